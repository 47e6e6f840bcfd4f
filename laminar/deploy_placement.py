"""What a run needs of its cluster, and the wait until the cluster has it: one worker
per role instance (:func:`run_workers`), the workers per role resource
(:func:`role_needs`), :func:`wait_for_roles`, and :class:`SlurmJobs`, the wait's view of
the Slurm jobs laminar submitted (which ended before their worker joined, why the others
have not started).

Apart from :mod:`laminar.deploy` (which kind of cluster, opened how) because every kind
is waited for the same way, and the Slurm modules build on it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from laminar.cluster import ROLE_COUNTS, role_workers, workers_with
from laminar.config import RunConfig
from laminar.errors import ClusterError

# (laminar.deploy's logger, as before the split: docs/deploy.md quotes its lines)
log = logging.getLogger("laminar.deploy")

# How long a wait for the role workers is logged at INFO before it is a warning
QUIET_WAIT_S = 30.0


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
    start = time.monotonic()
    deadline = start + timeout_s
    logged, logged_quietly = None, False
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
                + (jobs.missing(role) if jobs is not None else _start_workers(role, short))
                for role, (got, n) in short.items()
            ]
            raise ClusterError(
                f"the cluster cannot place this run (waited {timeout_s:g} s, "
                "cluster.placement_timeout_s):\n" + "\n".join(lines)
            )
        # (said at once, a warning only past QUIET_WAIT_S: Slurm jobs just submitted, or
        # a local cluster's workers starting, are a wait, not a problem)
        late = time.monotonic() - start >= QUIET_WAIT_S
        if short != logged or (late and logged_quietly):
            level = logging.WARNING if late else logging.INFO
            log.log(
                level,
                "waiting for workers: %s",
                ", ".join(f"{r} {g}/{n}" for r, (g, n) in short.items()),
            )
            logged, logged_quietly = short, not late
        time.sleep(poll_s)


def _start_workers(role: str, short: dict[str, tuple[int, int]]) -> str:
    """The `dask worker` command that adds the workers ``role`` lacks (``short``: role ->
    (workers, needed)). The data module and trainer rank 0 share one worker
    (``data=1,trainer=1``, as docs/deploy.md starts them) unless ``cluster.data_apart``,
    which the wait does not know: with both short, both ways are given."""
    got, n = short[role]
    both = "data" in short and "trainer" in short
    if role == "data" and both:
        return (
            "start one `dask worker ADDRESS --resources data=1,trainer=1` for the data module "
            "and trainer rank 0 (with cluster.data_apart: true, a `--resources data=1` worker "
            "and a `--resources trainer=1` one)"
        )
    shared = role == "trainer" and both  # (rank 0's worker: the data line's)
    if shared and n - got == 1:
        return "the data=1,trainer=1 worker above is it"
    lower = f" (or lower {ROLE_COUNTS[role]})" if role in ROLE_COUNTS else ""
    return (
        f"start {n - got - shared} more with `dask worker ADDRESS --resources {role}=1`"
        + (" besides the data=1,trainer=1 one above" if shared else "")
        + lower
    )


# The scheduler plugin of SlurmReplacer that records every worker name that joined.
JOINED_PLUGIN = "laminar-joined"


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
            if name in self.joined or name in self._seen:
                continue
            never = _never_starts(state, why, f"cluster.slurm.{self.sections[name]}")
            if never:
                raise ClusterError(
                    f"Slurm job {job} of worker {name} (cluster.slurm.{self.sections[name]}) "
                    f"can never start: {_job_state(state, why)}, {never}; the run's jobs "
                    f"are cancelled. Change that and run again (`scontrol show job {job}` "
                    "before it is gone, or your site's limits, say more)"
                )
            if state in self.ACTIVE:
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


# squeue's reasons for a PENDING job that never clear by themselves (Slurm's "Job Reason
# Codes", slurm.schedmd.com/job_reason_codes.html; sbatch -t: "If the requested time
# limit exceeds the partition's time limit, the job will be left in a PENDING state
# (possibly indefinitely)"): the job asks for more than its partition, association or
# QOS allows any one job, or names what does not exist. Only a person changes that, so
# the placement wait fails at once instead of after placement_timeout_s. Left out, being
# ones that clear as other jobs end, nodes come back or a person releases the job:
# Resources, Priority, the aggregate (Grp*) and per-user limits, ReqNodeNotAvail,
# PartitionNodeLimit (down or drained nodes too), PartitionDown/Inactive, held jobs.
# {s}: the job's section of cluster.slurm.
_NEVER_STARTS = {
    "PartitionTimeLimit": "its walltime (cluster.slurm.walltime) is longer than its "
    "partition allows (or choose another: {s}.partition, else cluster.slurm.partition)",
    "AssocMaxWallDurationPerJobLimit": "its walltime (cluster.slurm.walltime) is longer "
    "than your association allows a job",
    "QOSMaxWallDurationPerJobLimit": "its walltime (cluster.slurm.walltime) is longer than "
    "its QOS allows a job",
    "AssocMaxCpuPerJobLimit": "its cores ({s}.cores) are more than your association allows a job",
    "QOSMaxCpuPerJobLimit": "its cores ({s}.cores) are more than its QOS allows a job",
    "AssocMaxCpuPerNode": "its cores ({s}.cores) are more than your association allows a node",
    "QOSMaxCpuPerNode": "its cores ({s}.cores) are more than its QOS allows a node",
    "AssocMaxMemPerJob": "its memory ({s}.memory) is more than your association allows a job",
    "QOSMaxMemoryPerJob": "its memory ({s}.memory) is more than its QOS allows a job",
    "AssocMaxMemPerNode": "its memory ({s}.memory) is more than your association allows a node",
    "QOSMaxMemoryPerNode": "its memory ({s}.memory) is more than its QOS allows a node",
    "MaxMemPerLimit": "its memory ({s}.memory) per CPU or per node is more than its "
    "partition allows",
    "AssocMaxGRESPerJob": "its GPUs ({s}.gpus) are more than your association allows a job",
    "QOSMaxGRESPerJob": "its GPUs ({s}.gpus) are more than its QOS allows a job",
    "AssocMaxGRESPerNode": "its GPUs ({s}.gpus) are more than your association allows a node",
    "QOSMaxGRESPerNode": "its GPUs ({s}.gpus) are more than its QOS allows a node",
    "AssocMaxNodePerJobLimit": "its nodes ({s}.job_directives or cluster.slurm.job_directives) are "
    "more than your association allows a job",
    "QOSMaxNodePerJobLimit": "its nodes ({s}.job_directives or cluster.slurm.job_directives) "
    "are more than its QOS allows a job",
    "InvalidAccount": "its account ({s}.account, else cluster.slurm.account, else your "
    "default) is not valid",
    "AccountNotAllowed": "its account ({s}.account, else cluster.slurm.account) may not use "
    "its partition ({s}.partition, else cluster.slurm.partition)",
    "InvalidQOS": "its QOS (a --qos of {s}.job_directives or cluster.slurm.job_directives, "
    "or your default) is not valid",
    "QOSNotAllowed": "its QOS (a --qos of {s}.job_directives or "
    "cluster.slurm.job_directives, or your default) is not allowed for your account or its "
    "partition",
    "BadConstraints": "what it asks for can never be met ({s}.job_directives or "
    "cluster.slurm.job_directives, such as --constraint, or {s}.cores, .memory, .gpus)",
    "DependencyNeverSatisfied": "it depends on a job that will never complete "
    "({s}.job_directives or cluster.slurm.job_directives)",
    "ReservationDeleted": "its reservation is gone ({s}.job_directives or "
    "cluster.slurm.job_directives)",
}


def _never_starts(state: str, reason: str, section: str) -> str | None:
    """Why a job in ``state`` for ``reason`` (squeue's ``%r``) can never start, naming
    the setting of ``section`` to change; None if it may."""
    if state != "PENDING":
        return None
    said = _NEVER_STARTS.get(reason.split(",", 1)[0].strip())
    return said.format(s=section) if said else None


def _job_state(state: str, reason: str) -> str:
    """``PENDING (Resources)``; ``RUNNING`` (squeue's reason ``None`` left out)."""
    return f"{state} ({reason})" if reason and reason != "None" else state


def _role_section(resources: dict) -> str:
    """The ``cluster.slurm`` section of a worker's job: the trainer's job holds the data
    module too (``data=1,trainer=1``), a lone data worker has ``data``."""
    return "trainer" if "trainer" in resources else next(iter(resources))
