"""Workers lost for good: :func:`fence_workers` stops a hung or lost worker before its
work is redone elsewhere, and :class:`SlurmReplacer` (its decisions :class:`Replacements`'s,
a pure core) cancels the job of a Slurm worker the scheduler lost and submits a new one
from the same job spec: its role's resources, cores, memory, GPUs, threads, partition,
account and ``#SBATCH`` lines.

Apart from starting a cluster (:mod:`laminar.deploy`, :mod:`laminar.deploy_slurm`)
because it acts while the run goes: called by the driver's and the manager's fault
handling, or on the cluster's event loop.
"""

from __future__ import annotations

import contextlib
import logging
import time

from laminar.deploy_placement import JOINED_PLUGIN, SlurmJobs

# (laminar.deploy's logger, as before the split: docs/deploy.md quotes its lines)
log = logging.getLogger("laminar.deploy")


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
    from the lost job's spec, held meanwhile (the same resources and the role's job
    settings, partition and account included; :class:`Replacements` decides which and
    when). Stops with the cluster."""

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
                # Each decision awaits (scancel, sbatch): the run may end meanwhile, and a
                # closing cluster's spec is empty; a job submitted now would outlive it.
                if self.cluster.status != Status.running:
                    return
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
            await self._cancel(job)

    def _cancel(self, job):
        """Cancel ``job`` (out of the cluster's ``workers``): a future the cluster's close
        waits for, as for the jobs SpecCluster itself closes (its ``_futures``). The job is
        ``closing`` from now on: the close checks every job the cluster made (an
        AssertionError for one still ``running``, a scancel under way)."""
        import asyncio

        from distributed.core import Status

        async def cancel() -> None:
            try:
                await job.close()  # scancel (an ended job's error is ignored)
            except Exception:  # (the close gathers it: it must not fail the run's end)
                log.exception("cancelling Slurm job %s failed", getattr(job, "job_id", job))
            finally:
                job.status = Status.closed

        job.status = Status.closing
        future = asyncio.ensure_future(cancel())
        self.cluster._futures.add(future)
        future.add_done_callback(self.cluster._futures.discard)
        return future

    async def _submit(self, slot: _Slot, name: str, _job, _why) -> None:
        from distributed.core import Status

        if self.cluster.status != Status.running:  # (no await from here to the spec)
            return
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
        if self.cluster.status != Status.running:
            # The cluster began to close while sbatch ran. Its own close cancels the jobs
            # in its workers; this one is cancelled here all the same, lest it outlive it.
            job = self.cluster.workers.pop(name, None)
            if job is not None and job.status not in (Status.closing, Status.closed):
                await self._cancel(job)
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
