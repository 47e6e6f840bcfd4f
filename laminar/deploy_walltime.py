"""The walltime of the Slurm jobs a run cannot lose: :class:`WalltimeWatch` reads, from
``squeue``, how long the jobs of the driver, the trainer's ranks and the data module have
left, so that the driver stops the run in order (its final checkpoint written, its
stores closed) ``cluster.stop_before_walltime_s`` before the first of them ends, where
Slurm's end would lose every update since the last checkpoint and fail the run.

Which jobs: the one each of those processes runs in, as its ``SLURM_JOB_ID`` says on one
of the job's nodes (:func:`slurm_job_id`). That covers the jobs laminar submitted
(``cluster.kind: slurm``), workers you started with the sbatch recipe, a local cluster
inside a job (its workers inherit the driver's job), a driver run from a job script,
and the scheduler's (path B's `dask scheduler` job). A rollout's or relay's job ending
is a lost worker, which the run recovers from (docs/faults.md); it is not watched.
:meth:`WalltimeWatch.check_start` refuses a run whose jobs are already within the
margin.

Apart from :mod:`laminar.deploy_lost` (which replaces lost jobs) because it acts on
jobs that still run, and on a thread of the driver's, not the cluster's event loop.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable

log = logging.getLogger("laminar.deploy")

# How often squeue is asked (a job's limit can be changed while it runs: `scontrol
# update TimeLimit=`), and how long it may take to answer.
REFRESH_S = 60.0
SQUEUE_TIMEOUT_S = 30.0
ASK_TIMEOUT_S = 10.0  # a worker's answer: which job it runs in
# The states of a job that still runs, or will (squeue's -t; a job suspended still counts
# its time left): pending, running, suspended, completing, configuring.
LIVE_STATES = "PD,R,S,CG,CF"

# `laminar run`'s exit code for a run the watch stopped (its reason begins with
# storage.audit.WALLTIME_REASON), as timeout(1)'s, so that a job script can tell it.
WALLTIME_EXIT = 124


def time_left_s(text: str) -> float | None:
    """squeue's ``%L`` in seconds (``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``), or None when
    the job has no limit, or none yet (``UNLIMITED``, ``NOT_SET``, ``INVALID``).

    >>> time_left_s("4:59"), time_left_s("1:00:00"), time_left_s("2-00:00:01")
    (299.0, 3600.0, 172801.0)
    >>> time_left_s("UNLIMITED") is None and time_left_s("NOT_SET") is None
    True
    """
    text = text.strip()
    days, dash, rest = text.partition("-")
    if not dash:
        days, rest = "0", text
    parts = rest.split(":")
    if not (days.isdigit() and 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts)):
        return None
    h, m, s = ([0] * (3 - len(parts)) + [int(p) for p in parts])[:3]
    return float(int(days) * 86400 + h * 3600 + m * 60 + s)


def slurm_job_id(environ: dict | None = None) -> str | None:
    """The Slurm job this process runs in (run on each worker by :class:`WalltimeWatch`),
    or None. Only on one of the job's nodes (``SLURMD_NODENAME``: a batch script, an
    ``srun`` step, what they start): an ``salloc`` shell on a login node has the
    allocation's ``SLURM_JOB_ID`` too, but outlives it, and so does what it starts.

    >>> in_a_job = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}
    >>> slurm_job_id(in_a_job), slurm_job_id({"SLURM_JOB_ID": "7"})  # (an salloc shell)
    ('7', None)
    """
    env = os.environ if environ is None else environ
    if not env.get("SLURMD_NODENAME"):
        return None
    return env.get("SLURM_JOB_ID") or None


class WalltimeWatch:
    """Asks, every :data:`REFRESH_S` on a thread of its own (the driver's poll never
    waits on the Slurm controller), how long the run's core jobs have left; :meth:`due`
    says why the run must stop now, or None.

    ``core_workers()``: the driver's ``{role: worker address}`` of the trainer's ranks
    and the data module, read at each refresh (a restart within the run moves them);
    ``stop_before_s``: ``cluster.stop_before_walltime_s`` (0: never due).
    """

    def __init__(
        self,
        client,
        core_workers: Callable[[], dict[str, str]],
        stop_before_s: float,
        *,
        refresh_s: float = REFRESH_S,
        environ: dict | None = None,
    ) -> None:
        self.client = client
        self.core_workers = core_workers
        self.stop_before_s = stop_before_s
        self.refresh_s = refresh_s
        self._driver_job = slurm_job_id(environ)
        self._jobs_of: dict[str, str | None] = {}  # worker address -> its job (or none)
        # job -> (the monotonic time its walltime ends, the roles it holds)
        self.ends: dict[str, tuple[float, list[str]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._no_squeue = False
        self._failures = 0  # squeue's, in a row
        self._scheduler_job: str | None | bool = False  # (False: not asked yet)
        self._said: tuple[str, float] | None = None  # the end last logged: (job, end)

    def check_start(self) -> None:
        """Before a run starts: a :class:`~laminar.errors.ClusterError` when a job it
        cannot lose has no more than ``stop_before_s`` left. The run would stop at its
        first poll, and a job script that resumes it on exit code 124 from within that
        job would start it again and again."""
        from laminar.errors import ClusterError

        if self.stop_before_s <= 0:
            return
        self.refresh()
        if (why := self.due()) is not None:
            raise ClusterError(
                f"not starting the run: {why}, and it would stop in order at once; start it "
                "in new jobs (from a job script: submit the script again rather than "
                "resuming in the job that ends; path B: new worker jobs), or lower "
                "cluster.stop_before_walltime_s"
            )

    def start(self) -> WalltimeWatch:
        if self.stop_before_s > 0:
            self._thread = threading.Thread(target=self._loop, name="laminar-walltime", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _first(self) -> tuple[str, float, list[str]] | None:
        """The watched job whose walltime ends first: ``(job, end, roles)``, or None."""
        with self._lock:
            if not self.ends:
                return None
            job, (end, roles) = min(self.ends.items(), key=lambda kv: kv[1][0])
        return job, end, roles

    def due(self) -> str | None:
        """Why the run must stop in order now (the first core job's walltime is less
        than ``stop_before_s`` away), or None."""
        if self.stop_before_s <= 0 or (first := self._first()) is None:
            return None
        job, end, roles = first
        left = end - time.monotonic()
        if left > self.stop_before_s:
            return None
        return (
            f"Slurm job {job} ({', '.join(roles)}) reaches its walltime in {max(left, 0):.0f} s"
            f" (cluster.stop_before_walltime_s={self.stop_before_s:g})"
        )

    def stop_in(self) -> float | None:
        """Seconds until the run stops for the walltime (0: due), or None while no
        watched job has a limit (or the watch is off): what the progress shows."""
        if self.stop_before_s <= 0 or (first := self._first()) is None:
            return None
        return max(first[1] - self.stop_before_s - time.monotonic(), 0.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug must not end the watch silently, nor the run
                log.exception("reading the Slurm jobs' walltime failed")
            if self._no_squeue:
                return
            self._stop.wait(self.refresh_s)

    def refresh(self) -> None:
        """Read the core jobs' time left from squeue (once: called by the thread)."""
        roles: dict[str, list[str]] = {}
        if self._driver_job:
            roles[self._driver_job] = ["driver"]
        for role, job in self._worker_jobs().items():
            if job:
                roles.setdefault(job, []).append(role)
        if not roles:
            with self._lock:
                self.ends = {}
            return
        asked = time.monotonic()
        left = self._squeue(sorted(roles))
        if left is None:
            return  # (no answer: the last one stands)
        with self._lock:
            ends = {}
            for j, s in left.items():
                if j not in roles:
                    continue
                if s is not None:
                    ends[j] = (asked + s, roles[j])
                elif j in self.ends:  # (past its limit, in a site's OverTimeLimit: INVALID)
                    ends[j] = (self.ends[j][0], roles[j])
            self.ends = ends
        if (first := self._first()) is not None:
            job, end, on = first
            # (said once, and again when it moves: a limit changed, a core restart)
            if self._said is None or self._said[0] != job or abs(self._said[1] - end) > 60:
                self._said = (job, end)
                stop_in = end - self.stop_before_s - time.monotonic()
                log.info(
                    "the run stops in order in %.0f s (at %s), %g s before Slurm job %s "
                    "(%s) reaches its walltime (cluster.stop_before_walltime_s)",
                    max(stop_in, 0),
                    time.strftime("%H:%M:%S", time.localtime(time.time() + max(stop_in, 0))),
                    self.stop_before_s,
                    job,
                    ", ".join(on),
                )

    def _worker_jobs(self) -> dict[str, str | None]:
        """``{role: its process's Slurm job}`` for the core workers and the scheduler
        (each asked once: a process's job never changes)."""
        workers = dict(self.core_workers())
        for w in sorted({w for w in workers.values() if w and w not in self._jobs_of}):
            # (one at a time, bounded: a hung worker never answers, and must not keep the
            # others' jobs unknown; Client.run hands callback_timeout to Client.sync)
            try:
                self._jobs_of[w] = self.client.run(
                    slurm_job_id, workers=[w], callback_timeout=ASK_TIMEOUT_S
                )[w]
            except Exception as e:  # noqa: BLE001 — lost or hung meanwhile: next time
                log.debug("cannot ask %s for its Slurm job: %r", w, e)
        jobs = {role: self._jobs_of.get(w) for role, w in workers.items()}
        if self._scheduler_job is False and self.client is not None:
            # (path B's `dask scheduler` job; path A's scheduler is the driver's process)
            try:
                self._scheduler_job = self.client.run_on_scheduler(
                    slurm_job_id, callback_timeout=ASK_TIMEOUT_S
                )
            except Exception as e:  # noqa: BLE001 — next time
                log.debug("cannot ask the scheduler for its Slurm job: %r", e)
        # (path A's scheduler runs in the driver's process: its job, if any, is named once)
        if self._scheduler_job and self._scheduler_job != self._driver_job:
            jobs["scheduler"] = self._scheduler_job
        return jobs

    def _squeue(self, jobs: list[str]) -> dict[str, float | None] | None:
        """``{job: seconds left}`` of the jobs squeue lists (None: no limit, or past it;
        an ended job is not listed: its loss is the fault handling's), or None when
        squeue cannot say."""
        # (%A: the job's own id, what SLURM_JOB_ID says, also for an array's element,
        # which %i shows as ARRAYJOBID_INDEX)
        # (the states asked for, whatever SQUEUE_STATES says: an ended job listed would
        # read 0:00 left; and no SQUEUE_* filter of the user's may hide a job asked for)
        cmd = ["squeue", "-h", "-t", LIVE_STATES, "-j", ",".join(jobs), "-o", "%A|%L"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQUEUE_")}
        try:
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S, env=env
            )
        except FileNotFoundError:
            # (a driver on a machine without Slurm's commands, its workers in jobs)
            log.warning(
                "the run's core workers run in Slurm jobs %s, but squeue is not on this "
                "machine's PATH: the run cannot stop in order before their walltime "
                "(cluster.stop_before_walltime_s)",
                ", ".join(jobs),
            )
            self._no_squeue = True
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            self._failed(f"squeue did not answer ({e!r})")
            return None
        if r.returncode != 0:
            if "Invalid job id" in r.stderr:  # every one of them ended (and purged)
                return {}
            self._failed(f"squeue failed: {r.stderr.strip() or r.returncode}")
            return None
        self._failures = 0
        out = {}
        for line in r.stdout.splitlines():
            job, _, left = line.partition("|")
            if job.strip():
                out[job.strip()] = time_left_s(left)
        return out

    def _failed(self, why: str) -> None:
        """squeue could not say: warned of once, until it answers again (a driver's host
        without Slurm's configuration fails every minute of the run)."""
        self._failures += 1
        level = logging.WARNING if self._failures == 1 else logging.DEBUG
        log.log(
            level,
            "%s; the run cannot stop in order before its Slurm jobs' walltime until squeue "
            "answers (asked every %g s; cluster.stop_before_walltime_s)",
            why,
            self.refresh_s,
        )
