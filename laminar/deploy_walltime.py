"""The walltime of the Slurm jobs a run cannot lose: :class:`WalltimeWatch` reads, from
``squeue``, how long the jobs of the driver, the trainer's ranks and the data module have
left, so that the driver stops the run in order (its final checkpoint written, its
stores closed) ``cluster.stop_before_walltime_s`` before the first of them ends, where
Slurm's end would lose every update since the last checkpoint and fail the run.

Which jobs: the one each of those processes runs in, as its ``SLURM_JOB_ID`` says. That
covers the jobs laminar submitted (``cluster.kind: slurm``), workers you started with the
sbatch recipe, a local cluster inside an allocation (its workers inherit the driver's
job) and a driver run from a job script. A rollout's or relay's job ending is a lost
worker, which the run recovers from (docs/faults.md); it is not watched.

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

# How the reason of a run stopped by the watch begins (summary.json's ``reason``; the CLI
# exits with WALLTIME_EXIT for it, as timeout(1) does, so that a job script can tell it).
WALLTIME_REASON = "stopped before the walltime"
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


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in (run on a worker by :class:`WalltimeWatch`)."""
    return os.environ.get("SLURM_JOB_ID") or None


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
        driver = (os.environ if environ is None else environ).get("SLURM_JOB_ID") or None
        self._driver_job = driver
        self._jobs_of: dict[str, str | None] = {}  # worker address -> its job (or none)
        # job -> (the monotonic time its walltime ends, the roles it holds)
        self.ends: dict[str, tuple[float, list[str]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._no_squeue = False
        self._said: tuple[str, float] | None = None  # the end last logged: (job, end)

    def start(self) -> WalltimeWatch:
        if self.stop_before_s > 0:
            self._thread = threading.Thread(target=self._loop, name="laminar-walltime", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def due(self) -> str | None:
        """Why the run must stop in order now (the first core job's walltime is less
        than ``stop_before_s`` away), or None."""
        if self.stop_before_s <= 0:
            return None
        with self._lock:
            if not self.ends:
                return None
            job, (end, roles) = min(self.ends.items(), key=lambda kv: kv[1][0])
        left = end - time.monotonic()
        if left > self.stop_before_s:
            return None
        return (
            f"Slurm job {job} ({', '.join(roles)}) reaches its walltime in {max(left, 0):.0f} s"
            f" (cluster.stop_before_walltime_s={self.stop_before_s:g})"
        )

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
            self.ends = {j: (asked + s, roles[j]) for j, s in left.items() if j in roles}
            first = min(self.ends.items(), key=lambda kv: kv[1][0], default=None)
        if first is not None:
            job, (end, on) = first
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
        """``{role: its worker's Slurm job}`` for the core workers (asked once per
        worker: a worker's job never changes)."""
        workers = dict(self.core_workers())
        new = sorted({w for w in workers.values() if w and w not in self._jobs_of})
        if new:
            try:
                # (bounded: a hung worker never answers; Client.run hands callback_timeout
                # to Client.sync)
                answers = self.client.run(
                    slurm_job_id,
                    workers=new,
                    on_error="return",
                    callback_timeout=SQUEUE_TIMEOUT_S,
                )
            except Exception as e:  # noqa: BLE001 — a worker lost meanwhile: next time
                log.debug("cannot ask %s for their Slurm jobs: %r", new, e)
                answers = {}
            for w, job in answers.items():
                if not isinstance(job, BaseException):
                    self._jobs_of[w] = job
        return {role: self._jobs_of.get(w) for role, w in workers.items()}

    def _squeue(self, jobs: list[str]) -> dict[str, float] | None:
        """``{job: seconds left}`` of the jobs squeue lists with a limit (an ended one is
        not listed: its loss is the fault handling's), or None when squeue cannot say."""
        # (%A: the job's own id, what SLURM_JOB_ID says, also for an array's element,
        # where %i says ARRAY_INDEX)
        cmd = ["squeue", "-h", "-j", ",".join(jobs), "-o", "%A|%L"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
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
            log.warning("squeue did not answer (%r); asking again in %g s", e, self.refresh_s)
            return None
        if r.returncode != 0:
            if "Invalid job id" in r.stderr:  # every one of them ended (and purged)
                return {}
            log.warning("squeue failed: %s", r.stderr.strip() or r.returncode)
            return None
        out = {}
        for line in r.stdout.splitlines():
            job, _, left = line.partition("|")
            seconds = time_left_s(left)
            if seconds is not None:
                out[job.strip()] = seconds
        return out
