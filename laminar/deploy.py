"""Where a run's workers come from: a local cluster, a running scheduler, or Slurm jobs.

:func:`open_cluster` is what ``laminar run`` uses; notebooks use it too, or bring their
own :class:`distributed.Client`::

    with open_cluster(cfg, run_dir) as client:
        handle = pipelines.submit(cfg, client, run_dir=run_dir)

Every kind gives one worker per role instance (:func:`role_workers`), each advertising
its role as a Dask resource, so actors land where they belong. A cluster that cannot
hold the run is reported by :func:`wait_for_roles`, naming the role and the fix, instead
of leaving actors waiting forever for a worker that never comes.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from laminar.cluster import (
    ROLE_COUNTS,
    role_cluster,
    role_workers,
    worker_environ,
    workers_with,
)
from laminar.config import ClusterConfig, RunConfig, SlurmRole
from laminar.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

# The file names of `cluster.security.generate` and of `laminar certs DIR`.
TLS_FILES = {"ca_file": "ca.pem", "cert": "cert.pem", "key": "key.pem"}


def run_workers(cfg: RunConfig) -> dict:
    """:func:`role_workers` for a run config."""
    return role_workers(
        cfg.rollout.replicas,
        trainer_ranks=cfg.trainer.ranks,
        relays=cfg.relay.relays or 0,
        data_apart=cfg.cluster.data_apart,
    )


def role_needs(cfg: RunConfig) -> dict[str, int]:
    """Workers per role resource the run needs: ``{"data": 1, "trainer": 1, ...}``."""
    needs: dict[str, int] = {}
    for resources in run_workers(cfg).values():
        for role in resources:
            needs[role] = needs.get(role, 0) + 1
    return needs


def wait_for_roles(
    client, needs: dict[str, int], timeout_s: float, poll_s: float = 0.5, jobs=None
) -> None:
    """Wait until the cluster has ``needs[role]`` workers with each role resource.

    Raises :class:`ClusterError` after ``timeout_s`` listing every role still short, with
    the command that adds such a worker. ``timeout_s=0`` checks once. With ``jobs`` (the
    :class:`SlurmJobs` of a cluster laminar submitted), a job that ended before its worker
    joined fails the wait at once, quoting its log, and the timeout's message gives the
    state of each job still missing instead of a `dask worker` command.
    """
    deadline = time.monotonic() + timeout_s
    logged = None
    while True:
        have = {role: len(workers_with(client, role)) for role in needs}
        short = {r: (have[r], n) for r, n in needs.items() if have[r] < n}
        if not short:
            return
        if jobs is not None:
            jobs.check(client)
        if time.monotonic() >= deadline:
            lines = [
                f"  {role}: {got} worker(s) with resource {role!r}, the run needs {n}; "
                + (
                    jobs.missing(role)
                    if jobs is not None
                    else f"start {n - got} more with `dask worker ADDRESS --resources "
                    f"{role}=1`"
                    + (f" (or lower {ROLE_COUNTS[role]})" if role in ROLE_COUNTS else "")
                )
                for role, (got, n) in short.items()
            ]
            raise ClusterError(
                f"the cluster cannot place this run (waited {timeout_s:g} s, "
                "cluster.placement_timeout_s):\n" + "\n".join(lines)
            )
        if short != logged:
            log.warning(
                "waiting for workers: %s",
                ", ".join(f"{r} {g}/{n}" for r, (g, n) in short.items()),
            )
            logged = short
        time.sleep(poll_s)


def _wait_for_file(path: str, timeout_s: float) -> None:
    """A scheduler started as a Slurm job writes its file once the job runs."""
    deadline = time.monotonic() + timeout_s
    while not Path(path).expanduser().is_file():
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"no scheduler file at {path!r} after {timeout_s:g} s "
                "(cluster.placement_timeout_s); start the scheduler with "
                f"`dask scheduler --scheduler-file {path}` (or sbatch "
                "deploy/slurm/scheduler.sbatch), on a file system this machine shares"
            )
        time.sleep(0.5)


# The scheduler plugin of SlurmReplacer that records every worker name that joined.
JOINED_PLUGIN = "laminar-joined"


def _stale_hint(path: str | None) -> str:
    """A scheduler file may be an ended scheduler's: `dask scheduler` leaves it behind."""
    if not path:
        return ""
    try:
        age = time.time() - Path(path).expanduser().stat().st_mtime
    except OSError:
        return ""
    return (
        f". The file was written {age:.0f} s ago, and a scheduler leaves its file behind "
        f"when it ends: if that one ended, `rm {path}` before starting the next "
        "(deploy/slurm/scheduler.sbatch removes it as it starts and ends)"
    )


class SlurmJobs:
    """The Slurm jobs laminar submitted for a run's workers, as the placement wait sees
    them: which ended before their worker joined (a wrong ``cluster.slurm.python``, a
    prologue that fails: laminar submits no second job, so the run cannot be placed), and
    why the others have not started (``PENDING (Resources)``). Asks ``squeue`` at most
    every ``every_s`` seconds."""

    # States of a job that may still start its worker; any other (or none: purged) ended.
    ACTIVE = frozenset(
        "PENDING CONFIGURING RUNNING SUSPENDED REQUEUED REQUEUE_HOLD REQUEUE_FED RESIZING "
        "SIGNALING STAGE_OUT STOPPED RESV_DEL_HOLD".split()
    )

    def __init__(self, cluster, workers: dict, log_dir: Path, every_s: float = 5.0) -> None:
        self.ids = {n: str(w.job_id) for n, w in cluster.workers.items() if w.job_id}
        # Every worker name that joined: this wait's own sightings, and those of the
        # scheduler plugin of SlurmReplacer (a worker that came and went between two
        # checks). A first job that ends after its worker joined is SlurmReplacer's.
        self.joined: set[str] = set()
        plugins = getattr(getattr(cluster, "scheduler", None), "plugins", {})
        self._seen: set[str] = getattr(plugins.get(JOINED_PLUGIN), "names", set())
        self.roles = {n: set(workers[n]) for n in self.ids}
        self.sections = {n: _role_section(workers[n]) for n in self.ids}
        self.log_dir = Path(log_dir)
        self.every_s = every_s
        self._asked = -float("inf")
        self._states: dict[str, tuple[str, str]] | None = None

    def states(self) -> dict[str, tuple[str, str]] | None:
        """Job id -> (state, reason), or None when squeue does not answer."""
        import subprocess

        if time.monotonic() - self._asked < self.every_s:
            return self._states
        self._asked = time.monotonic()
        cmd = ["squeue", "-h", "-t", "all", "-j", ",".join(self.ids.values()), "-o", "%i|%T|%r"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return self._states
        if r.returncode != 0:  # every id purged: "Invalid job id specified"
            self._states = {} if "Invalid job id" in r.stderr else self._states
            return self._states
        found = (line.split("|", 2) for line in r.stdout.splitlines() if line.count("|") == 2)
        self._states = {i: (s, why) for i, s, why in found}
        return self._states

    def check(self, client) -> None:
        """Raise :class:`ClusterError` if a job ended before its worker joined."""
        from laminar.cluster import scheduler_workers

        states = self.states()
        if states is None:
            return
        self.joined |= {w.get("name") for w in scheduler_workers(client).values()}
        for name, job in self.ids.items():
            state, why = states.get(job, ("gone from squeue", ""))
            if name in self.joined or name in self._seen or state in self.ACTIVE:
                continue
            raise ClusterError(
                f"Slurm job {job} of worker {name} (cluster.slurm.{self.sections[name]}) "
                f"ended, {_job_state(state, why)}, before its worker joined; the run's other "
                f"jobs are cancelled. {self._log_tail(job)}"
            )

    def missing(self, role: str) -> str:
        """What the jobs of ``role`` that have no worker yet are doing."""
        states = self.states() or {}
        names = [n for n in self.ids if role in self.roles[n]]
        jobs = [
            f"job {self.ids[n]} {_job_state(*states.get(self.ids[n], ('(no state)', '')))}"
            for n in names
        ]
        sections = ", ".join(sorted({f"cluster.slurm.{self.sections[n]}" for n in names}))
        return (
            f"its Slurm jobs: {', '.join(jobs) or 'none'} (squeue; logs in {self.log_dir}); "
            "raise cluster.placement_timeout_s where jobs queue, or ask for less "
            f"({sections or 'cluster.slurm'})"
        )

    def _log_tail(self, job: str) -> str:
        logs = sorted(self.log_dir.glob(f"*-{job}.err"))
        if not logs:
            return f"Its log would be in {self.log_dir}, which has none for it."
        lines = [ln for ln in logs[0].read_text(errors="replace").splitlines() if ln.strip()]
        tail = "\n    ".join(lines[-3:]) or "(empty)"
        return f"The end of its log, {logs[0]}:\n    {tail}"


# -- replacing lost Slurm workers --------------------------------------------------------

# A replacement counts as failed when its job ends (or sbatch refuses it) before its worker
# joins, or its worker is lost within STABLE_S of joining. After TRIES failures in a row
# the role's worker is given up; between them the next job waits BACKOFF_S, doubling.
REPLACE_TRIES = 3
REPLACE_BACKOFF_S = 5.0
REPLACE_STABLE_S = 60.0


class _Slot:
    """One role worker of the run and its current job."""

    def __init__(self, base: str, job: str | None) -> None:
        self.base = self.name = base  # name: the cluster's (and the worker's) name now
        self.job = job
        self.jobs = 1  # jobs submitted for it (a replacement is named BASE.N)
        self.joined_at: float | None = None
        self.failures = 0
        self.due: float | None = None  # lost: its next job is submitted then
        self.given_up = False


class Replacements:
    """Which role workers of a Slurm cluster lost their job and when to submit the next
    one: a pure core (events in, decisions out) for :class:`SlurmReplacer`.

    Only a worker that joined is replaced: a first job that ends before its worker joins
    is the placement wait's to report (:class:`SlurmJobs`). A worker that leaves the
    scheduler is lost whatever its job does: a worker without a nanny never comes back,
    and a fenced one may be stopped, holding its job.

    >>> r = Replacements({"rollout-0": "7"}, tries=2, backoff_s=5, stable_s=60)
    >>> r.step(0.0, connected={"rollout-0"}, ended=set())
    []
    >>> [(k, name) for k, _, name, *_ in r.step(1.0, connected=set(), ended=set())]
    [('lost', 'rollout-0'), ('submit', 'rollout-0.2')]
    >>> r.submitted(r.slots["rollout-0"], "9")
    >>> [(k, name) for k, _, name, *_ in r.step(2.0, connected=set(), ended={"9"})]
    [('lost', 'rollout-0.2')]
    >>> r.step(3.0, connected=set(), ended=set())  # backing off, 5 s
    []
    >>> [d[0] for d in r.step(7.0, connected=set(), ended=set())]
    ['submit']
    >>> r.refused(r.slots["rollout-0"], 7.5)
    True
    >>> r.step(60.0, connected=set(), ended=set())  # given up: nothing more
    []
    """

    def __init__(
        self,
        jobs: dict[str, str | None],
        *,
        tries: int = REPLACE_TRIES,
        backoff_s: float = REPLACE_BACKOFF_S,
        stable_s: float = REPLACE_STABLE_S,
    ) -> None:
        self.slots = {name: _Slot(name, job) for name, job in jobs.items()}
        self.tries, self.backoff_s, self.stable_s = tries, backoff_s, stable_s

    def waiting(self) -> list[_Slot]:
        """Replacement jobs whose worker has not joined yet (squeue says if they ended)."""
        return [
            s
            for s in self.slots.values()
            if s.jobs > 1 and s.due is None and s.joined_at is None and not s.given_up
        ]

    def step(
        self,
        now: float,
        connected: set[str],
        ended: set[str],
        specs: set[str] | None = None,
        joined: set[str] | None = None,
    ) -> list[tuple]:
        """``(kind, slot, name, job, why)`` decisions: ``lost`` (cancel job ``job`` of
        worker ``name``, keep its spec out of the cluster's), ``submit`` (a new job, for a
        worker named ``name``), ``give_up``.
        ``connected``: the names of the scheduler's workers; ``ended``: job ids that
        ended; ``specs``: the names the cluster's spec holds (a worker scaled away is not
        replaced; None: all); ``joined``: every name that ever joined (a worker that came
        and went between two steps was there)."""
        out: list[tuple] = []
        for s in self.slots.values():
            if s.given_up or (s.due is None and specs is not None and s.name not in specs):
                continue
            if s.due is None:
                if s.joined_at is None and (s.name in connected or s.name in (joined or ())):
                    s.joined_at = now
                if s.name in connected:
                    if s.failures and now - s.joined_at >= self.stable_s:
                        s.failures = 0
                    continue
                if s.joined_at is not None:
                    lived = now - s.joined_at
                    why = f"its worker left the cluster after {lived:.0f} s"
                    s.failures += s.jobs > 1 and lived < self.stable_s
                elif s.jobs > 1 and s.job in ended:
                    why = "the job ended before its worker joined"
                    s.failures += 1
                else:
                    continue  # queued or starting
                out.append(("lost", s, s.name, s.job, why))
                if self._failed(s, now):
                    out.append(("give_up", s, s.name, s.job, why))
                    continue
            if s.due is not None and now >= s.due:
                s.due = None
                s.jobs += 1
                s.name = f"{s.base}.{s.jobs}"
                s.job = s.joined_at = None
                out.append(("submit", s, s.name, None, ""))
        return out

    def submitted(self, slot: _Slot, job: str | None) -> None:
        slot.job = job

    def refused(self, slot: _Slot, now: float) -> bool:
        """sbatch refused ``slot``'s new job; True when that was its last try."""
        slot.failures += 1
        return self._failed(slot, now)

    def _failed(self, s: _Slot, now: float) -> bool:
        if s.failures >= self.tries:
            s.given_up = True
            return True
        s.due = now + (self.backoff_s * 2 ** (s.failures - 1) if s.failures else 0.0)
        return False


class SlurmReplacer:
    """Keeps a role worker in every job of a Slurm cluster laminar submitted: a periodic
    check on the cluster's event loop that cancels the job of a worker the scheduler lost
    (killed, its job ended, or fenced: `restart_workers` only removes a worker without a
    nanny, and a stopped process would keep its job and its node) and submits a new one
    with the same resources through the cluster's spec (:class:`Replacements` decides
    which and when). Stops with the cluster."""

    def __init__(self, cluster, workers: dict, every_s: float = 1.0, **limits) -> None:
        self.cluster = cluster
        self.roles = {n: ",".join(workers[n]) for n in workers}
        ids = {n: getattr(w, "job_id", None) for n, w in cluster.workers.items()}
        self.core = Replacements({n: ids.get(n) for n in workers}, **limits)
        self.held: dict[str, dict] = {}  # base name -> spec, while its job is not in it
        self.every_s = every_s
        self._asked = -float("inf")
        self.squeue_timeout_s = 30.0
        self.joined: set[str] = set()  # names of every worker that joined (a plugin's)

    def start(self) -> None:
        from distributed.diagnostics.plugin import SchedulerPlugin
        from tornado.ioloop import PeriodicCallback

        joined = self.joined

        class Joined(SchedulerPlugin):
            names = joined  # (SlurmJobs reads it too)

            def add_worker(self, scheduler, worker: str) -> None:
                joined.add(scheduler.workers[worker].name)

        async def start() -> None:
            self.cluster.scheduler.add_plugin(Joined(), name=JOINED_PLUGIN)
            pc = PeriodicCallback(self._tick, self.every_s * 1000)
            self.cluster.periodic_callbacks["laminar-replace-jobs"] = pc
            pc.start()

        self.cluster.sync(start)

    async def _tick(self) -> None:
        from distributed.core import Status

        if self.cluster.status != Status.running:
            return
        try:
            connected = {ws.name for ws in self.cluster.scheduler.workers.values()}
            self.joined |= connected
            ended = await self._ended_jobs()
            if self.cluster.status != Status.running:
                return
            specs = set(self.cluster.worker_spec)
            now = time.monotonic()
            for kind, slot, *what in self.core.step(now, connected, ended, specs, self.joined):
                await getattr(self, f"_{kind}")(slot, *what)
        except Exception:  # a bug must not end the check silently, nor the run
            log.exception("the check for lost Slurm workers failed")

    async def _ended_jobs(self) -> set[str]:
        """Of the replacement jobs whose worker has not joined, those squeue says ended
        (asked at most every 5 s)."""
        import asyncio

        jobs = [s.job for s in self.core.waiting() if s.job]
        if not jobs or time.monotonic() - self._asked < 5.0:
            return set()
        self._asked = time.monotonic()
        cmd = ["squeue", "-h", "-t", "all", "-j", ",".join(jobs), "-o", "%i|%T"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError:
            return set()
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.squeue_timeout_s)
        except TimeoutError:  # a controller that does not answer: no squeue left behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return set()
        if proc.returncode != 0:  # every id purged: "Invalid job id specified"
            return set(jobs) if b"Invalid job id" in err else set()
        states = dict(ln.split("|", 1) for ln in out.decode().splitlines() if "|" in ln)
        return {j for j in jobs if states.get(j, "gone") not in SlurmJobs.ACTIVE}

    async def _lost(self, slot: _Slot, name: str, job_id: str | None, why: str) -> None:
        from distributed.core import Status

        log.warning(
            "Slurm worker %s (%s) lost: %s; cancelling its job %s",
            name,
            self.roles[slot.base],
            why,
            job_id,
        )
        self.held[slot.base] = self.cluster.worker_spec.pop(name)
        job = self.cluster.workers.pop(name, None)
        if job is not None:
            await job.close()  # scancel (an ended job's error is ignored)
            job.status = Status.closed  # (the cluster's close checks every job it made)

    async def _submit(self, slot: _Slot, name: str, _job, _why) -> None:
        from distributed.core import Status

        self.cluster.worker_spec[name] = self.held.pop(slot.base)
        try:
            await self.cluster._correct_state()
        except Exception as e:  # noqa: BLE001 — sbatch refused it
            job = self.cluster.workers.pop(name, None)
            if job is not None:
                job.status = Status.failed
            self.held[slot.base] = self.cluster.worker_spec.pop(name)
            said = [ln for ln in str(e).splitlines() if ln.startswith("sbatch:")] or [str(e)]
            last = self.core.refused(slot, time.monotonic())
            log.warning(
                "Slurm refused a new job for worker %s (%s): %s",
                slot.base,
                self.roles[slot.base],
                " ".join(said),
            )
            if last:
                await self._give_up(slot, name, None, "Slurm refused its new job")
            return
        job = getattr(self.cluster.workers.get(name), "job_id", None)
        self.core.submitted(slot, job)
        log.warning(
            "submitted Slurm job %s for lost worker %s (%s), as worker %s (try %d of %d)",
            job,
            slot.base,
            self.roles[slot.base],
            name,
            slot.failures + 1,
            self.core.tries,
        )

    async def _give_up(self, slot: _Slot, name: str, job_id, why: str) -> None:
        log.error(
            "gave up replacing Slurm worker %s (%s): %d new jobs in a row failed, the last "
            "because %s; see its job logs, and submit a worker for it by hand "
            "(`dask worker ADDRESS --resources %s`) if the run still waits for it",
            slot.base,
            self.roles[slot.base],
            self.core.tries,
            why,
            self.roles[slot.base],
        )


def fence_workers(client, workers: list[str], timeout: float = 10) -> dict[str, str]:
    """Stop ``workers`` (addresses) for good before their work is redone elsewhere.

    A worker with a nanny is restarted (``Client.restart_workers``: the nanny kills a
    process that will not stop). One without (a Slurm worker) is removed from the
    scheduler, which tells it to close: ``restart_workers`` refuses such workers outright
    ("requires a nanny"), leaving a hung one in place. For ``cluster.kind: slurm``,
    :class:`SlurmReplacer` then cancels its job, a stopped process with it, and submits a
    new one. Returns address -> ``"OK"``, ``"removed"``, ``"gone"`` (no longer the
    scheduler's), or the error.

    >>> fence_workers(client, ["tcp://10.0.0.7:40123"])  # doctest: +SKIP
    {'tcp://10.0.0.7:40123': 'removed'}
    """
    from laminar.cluster import scheduler_workers

    info = scheduler_workers(client, timeout=timeout)
    bare = [w for w in workers if w in info and info[w].get("nanny") is None]
    out = {w: "gone" for w in workers if w not in info} | {w: "removed" for w in bare}
    if bare:
        client.run_on_scheduler(_remove_workers, bare)
    nannied = [w for w in workers if w in info and w not in bare]
    if nannied:
        out.update(client.restart_workers(nannied, timeout=timeout, raise_for_error=False))
    return out


async def _remove_workers(addresses: list[str], dask_scheduler=None) -> None:
    for address in addresses:
        await dask_scheduler.remove_worker(
            address=address, stimulus_id=f"laminar-fence-{time.time()}", close=True
        )


# -- TLS ---------------------------------------------------------------------------------


def generate_tls(directory: str | Path) -> dict[str, str]:
    """Write a new self-signed CA, certificate and key (one for every role) to
    ``directory`` (``ca.pem``, ``cert.pem``, ``key.pem``; the key readable by its owner
    only) and return their paths as ``cluster.security`` fields."""
    from distributed.security import Security

    try:
        made = Security.temporary()
    except ImportError as e:  # pragma: no cover - cryptography is a dependency
        raise ConfigError(
            "cluster.security.generate needs the `cryptography` package; pip install "
            "cryptography, or give certificate files"
        ) from e
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    contents = {
        "ca_file": made.tls_ca_file,
        "cert": made.tls_client_cert,
        "key": made.tls_client_key,
    }
    paths = {}
    for field, name in TLS_FILES.items():
        path = directory / name
        mode = 0o600 if field == "key" else 0o644
        path.touch(mode=mode)
        path.chmod(mode)  # (touch leaves an existing file's mode: a 0644 key.pem stayed so)
        path.write_text(contents[field])
        paths[field] = str(path)
    return paths


def security_for(cfg: ClusterConfig, run_dir: str | Path | None):
    """The run's :class:`distributed.Security`, or ``None`` without ``cluster.security``.

    ``generate: true`` writes new certificates to ``RUN_DIR/tls`` (so a second client, a
    notebook say, can join the run's cluster with them).
    """
    from distributed.security import Security

    tls = cfg.security
    if tls is None:
        return None
    if tls.generate:
        if run_dir is None:
            raise ConfigError("cluster.security.generate needs a run directory to hold them")
        paths = generate_tls(Path(run_dir) / "tls")
    else:
        paths = {"ca_file": tls.ca_file, "cert": tls.cert, "key": tls.key}
        for field, path in paths.items():
            if not Path(path).expanduser().is_file():
                raise ConfigError(
                    f"cluster.security.{field}: no file at {path!r}; give the path of a "
                    "PEM file, or generate: true (`laminar certs DIR` writes a set)"
                )
        paths = {k: str(Path(v).expanduser()) for k, v in paths.items()}
    ca, cert, key = paths["ca_file"], paths["cert"], paths["key"]
    return Security(
        tls_ca_file=ca,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


def _protocol(cfg: ClusterConfig) -> str:
    return "tls" if cfg.security is not None else cfg.protocol


# -- Slurm -------------------------------------------------------------------------------


def slurm_cluster(cfg: RunConfig, run_dir: str | Path, security=None):
    """A ``dask_jobqueue.SLURMCluster`` with one job per worker of :func:`run_workers`.

    Each job carries its own role resources (``--resources rollout=1``), cores, memory
    and GPUs (``--gres=gpu:N``) from ``cluster.slurm.<role>``; the trainer's job also
    holds the data module. Workers run without a nanny: one process per job, with the
    job's environment (and glibc's adaptive malloc, see :func:`worker_environ`); Slurm
    enforces the job's memory.
    """
    SLURMCluster, SLURMJob = _import_jobqueue()
    s = cfg.cluster.slurm
    log_dir = slurm_log_dir(cfg, run_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if '"' in str(log_dir):
        raise ConfigError(
            f"the Slurm job logs' folder {str(log_dir)!r} has a double quote, which an "
            "#SBATCH line cannot hold; set cluster.slurm.log_directory to a plainer path"
        )
    # Jobs from other runs must not be mistaken for ours in squeue. An #SBATCH line ends
    # at a blank: a run directory "my run" gave `-J laminar-my run`, which sbatch refused.
    job_name = ("laminar-" + re.sub(r"[^A-Za-z0-9._-]", "_", Path(run_dir).name))[:64]
    # The logs' lines quoted (dask-jobqueue's log_directory writes them bare), and a % of
    # the folder's name doubled: Slurm reads -o/-e as a pattern (a run dir "lr_5%" ...).
    where = str(log_dir).replace("%", "%%")
    logs = [f'-e "{where}/{job_name}-%J.err"', f'-o "{where}/{job_name}-%J.out"']
    env = worker_environ(cfg.cluster.torch_threads)
    prologue = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    prologue += list(s.job_prologue)
    protocol = _protocol(cfg.cluster)
    base = dict(
        queue=s.partition,
        account=s.account,
        walltime=s.walltime,
        processes=1,
        cores=1,
        memory="1GB",
        nanny=False,
        # dask-jobqueue joins the worker's command with blanks, unquoted: a python (or,
        # below, a certificate) whose path has a blank ended every job at once.
        python=shlex.quote(s.python or sys.executable),
        job_script_prologue=prologue,
        # (a jobqueue.slurm.log-directory in a Dask config file would add bare ones)
        job_directives_skip=["#SBATCH -e ", "#SBATCH -o "],
        interface=s.interface,
        protocol=f"{protocol}://",
        security=security,
        job_name=job_name,
        scheduler_options={"dashboard_address": ":0"},
    )
    try:
        cluster = SLURMCluster(**{k: v for k, v in base.items() if v is not None})
    except (RuntimeError, ValueError) as e:  # the in-process scheduler did not start
        cause = e.__cause__ or e
        if s.interface and "interface" in str(cause):
            raise ConfigError(
                f"cluster.slurm.interface={s.interface!r}: {cause}; give the interface the "
                "compute nodes reach this machine on, or null for the default route"
            ) from None
        raise ConfigError(f"the scheduler of the Slurm cluster did not start: {cause}") from None
    # A SLURMCluster has one job template; ours differ per role. It is a SpecCluster, so
    # each worker gets its own spec (the template's options with the role's resources,
    # cores, memory, GPUs) and _correct_state submits them, as scale() does for one
    # template. Both are private to dask-jobqueue (tested with 0.9).
    tls_args = _worker_tls_args(cluster._job_kwargs.get("security"))
    jobs = {}
    for name, resources in run_workers(cfg).items():
        role: SlurmRole = getattr(s, _role_section(resources))
        options = dict(cluster._job_kwargs)
        gres = [f"--gres=gpu:{role.gpus}"] * (role.gpus > 0)
        directives = [*logs, *s.job_directives, *gres]
        res = ",".join(f"{k}={v}" for k, v in resources.items())
        options.update(
            cores=role.cores,
            memory=role.memory,
            job_extra_directives=directives,
            security=None,  # its --tls-* arguments, quoted, are ours
            worker_extra_args=list(options.get("worker_extra_args") or [])
            + ["--resources", res]
            + tls_args,
        )
        jobs[name] = {"cls": SLURMJob, "options": options}
    cluster.worker_spec.update(jobs)
    try:
        _submit(cluster)
    except Exception as e:  # noqa: BLE001 — sbatch refused a job: undo the others, say why
        refused = _cancel_submitted(cluster)
        sections = sorted({f"cluster.slurm.{_role_section(run_workers(cfg)[n])}" for n in refused})
        said = [ln for ln in str(e).splitlines() if ln.startswith("sbatch:")] or [str(e)]
        raise ClusterError(
            f"Slurm refused the job(s) of {', '.join(sorted(refused)) or 'the run'} "
            f"({', '.join(sections) or 'cluster.slurm'}; partition, account, walltime and "
            "job_directives apply to every job):\n  " + "\n  ".join(said) + "\n"
            "the jobs it had accepted are cancelled"
        ) from None
    except BaseException:  # Ctrl-C: the jobs sbatch took must not outlive the run
        log.warning("interrupted: cancelling the Slurm jobs submitted so far")
        _cancel_submitted(cluster)
        raise
    try:
        SlurmReplacer(cluster, run_workers(cfg)).start()
    except BaseException:
        _cancel_submitted(cluster)
        raise
    return cluster


def _import_jobqueue() -> tuple[type, type]:
    """dask-jobqueue's ``SLURMCluster`` and ``SLURMJob``. Importing it makes Ctrl-C raise
    ``SystemExit`` (``dask_jobqueue.runner`` sets a SIGINT handler that calls
    ``sys.exit()``): in `laminar run` a Ctrl-C while jobs queued exited 0, not 130, with
    no "interrupted". The process's handler is put back (Python's, where dask-jobqueue
    was imported before)."""
    import signal
    import threading

    def jobqueue_s(handler) -> bool:
        return getattr(handler, "__module__", None) == "dask_jobqueue.runner"

    before = signal.getsignal(signal.SIGINT)
    try:
        from dask_jobqueue import SLURMCluster
        from dask_jobqueue.slurm import SLURMJob
    except ImportError as e:
        raise ConfigError(
            "cluster.kind=slurm needs dask-jobqueue: pip install 'laminar-rl[slurm]'"
        ) from e
    finally:
        if (
            jobqueue_s(signal.getsignal(signal.SIGINT))
            and threading.current_thread() is threading.main_thread()
        ):
            ours = before is not None and not jobqueue_s(before)
            signal.signal(signal.SIGINT, before if ours else signal.default_int_handler)
    return SLURMCluster, SLURMJob


def _submit(cluster, settle_s: float = 120.0) -> None:
    """Submit the jobs of ``cluster``'s spec. Ctrl-C meanwhile does not stop the sbatch
    calls under way (``cluster.sync`` would cancel the submission, leaving the jobs sbatch
    was taking out of ``cluster.workers``, where nothing cancels them): it waits for them,
    up to ``settle_s``, so that every job submitted is there to cancel, then re-raises."""
    import asyncio
    import concurrent.futures

    async def submit() -> None:
        await cluster._correct_state()

    done = asyncio.run_coroutine_threadsafe(submit(), cluster.loop.asyncio_loop)
    try:
        done.result()
    except BaseException:
        if not done.done():
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline:
                try:
                    done.result(timeout=max(0.0, deadline - time.monotonic()))
                    break
                except KeyboardInterrupt:  # a second Ctrl-C: the jobs are not all known yet
                    continue
                except (Exception, concurrent.futures.CancelledError):
                    break
        raise


def _worker_tls_args(security) -> list[str]:
    """The ``--tls-*`` arguments dask-jobqueue gives a job's worker for ``security``, each
    path quoted for the job's shell (dask-jobqueue writes them bare)."""
    if not security:
        return []
    tls = security.get_tls_config_for_role("worker")
    return [
        arg
        for key, value in tls.items()
        if key != "ciphers" and value  # (ciphers has no command-line option)
        for arg in ("--tls-" + key.replace("_", "-"), shlex.quote(str(value)))
    ]


def slurm_log_dir(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Where the jobs of ``cluster.kind: slurm`` write their logs: RUN_DIR/slurm unless
    ``cluster.slurm.log_directory``."""
    return Path(cfg.cluster.slurm.log_directory or Path(run_dir) / "slurm").expanduser()


def _job_state(state: str, reason: str) -> str:
    """``PENDING (Resources)``; ``RUNNING`` (squeue's reason ``None`` left out)."""
    return f"{state} ({reason})" if reason and reason != "None" else state


def _role_section(resources: dict) -> str:
    """The ``cluster.slurm`` section of a worker's job: the trainer's job holds the data
    module too (``data=1,trainer=1``), a lone data worker has ``data``."""
    return "trainer" if "trainer" in resources else next(iter(resources))


def _cancel_submitted(cluster) -> list[str]:
    """After a refused submission: cancel the jobs that were accepted and stop the
    scheduler now (not at the interpreter's exit: a notebook's kernel lives on). Returns
    the names of the workers whose job was refused."""
    import subprocess

    from distributed.core import Status

    accepted = {n: w.job_id for n, w in cluster.workers.items() if getattr(w, "job_id", None)}
    refused = [n for n in cluster.worker_spec if n not in accepted]  # (close() empties it)
    if accepted:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["scancel", *accepted.values()], capture_output=True, timeout=60, check=False
            )
    for w in list(cluster._created):  # never submitted: nothing for close() to wait on
        if w.status == Status.created:
            w.status = Status.failed
    with contextlib.suppress(Exception):
        cluster.close(timeout=30)
    return refused


# -- one entry point ---------------------------------------------------------------------


@contextlib.contextmanager
def open_cluster(cfg: RunConfig, run_dir: str | Path | None = None) -> Iterator:
    """A :class:`distributed.Client` to a cluster that can hold ``cfg``'s run.

    ``cluster.kind`` picks it: ``local`` starts worker processes on this machine,
    ``slurm`` submits one job per worker, ``address`` connects to a running scheduler
    (``cluster.address`` or ``cluster.scheduler_file``). Waits up to
    ``cluster.placement_timeout_s`` for every role's workers, then fails saying which role
    is missing. What this function started, it stops on exit (Slurm jobs are cancelled).
    """
    from distributed import Client

    c = cfg.cluster
    kind, address, scheduler_file = c.kind, c.address, c.scheduler_file
    security = security_for(c, run_dir)
    jobs = None
    with contextlib.ExitStack() as stack:
        if kind == "address":
            if scheduler_file:
                _wait_for_file(scheduler_file, c.placement_timeout_s)
            target = (
                {"scheduler_file": str(Path(scheduler_file).expanduser())}
                if scheduler_file
                else {"address": address}
            )
            try:
                client = Client(**target, security=security, timeout="30s")
            except (OSError, TimeoutError) as e:
                where = scheduler_file or address
                raise ClusterError(
                    f"cannot reach the scheduler at {where}: {e}; check that it runs and, "
                    "for a tls:// scheduler, that cluster.security gives its CA and a "
                    "certificate it trusts" + _stale_hint(scheduler_file)
                ) from e
            stack.enter_context(client)
        else:
            if kind == "local":
                cluster = role_cluster(
                    run_workers(cfg),
                    memory_limit=c.memory_limit,
                    torch_threads=c.torch_threads,
                    name="laminar-local",
                    protocol=_protocol(c),
                    security=security,
                )
            else:
                if run_dir is None:
                    raise ConfigError("cluster.kind=slurm needs a run directory (job logs)")
                cluster = slurm_cluster(cfg, run_dir, security)
            stack.enter_context(cluster)  # (at once: a Ctrl-C from here on cancels the jobs)
            if kind == "slurm":
                jobs = SlurmJobs(cluster, run_workers(cfg), slurm_log_dir(cfg, run_dir))
            client = stack.enter_context(Client(cluster, security=security))
        wait_for_roles(client, role_needs(cfg), c.placement_timeout_s, jobs=jobs)
        yield client
