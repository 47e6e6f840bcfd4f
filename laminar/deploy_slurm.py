"""``cluster.kind: slurm``: :func:`slurm_cluster` submits one dask-jobqueue job per role
worker, each with its role's resources, cores, memory and GPUs from
``cluster.slurm.<role>``; a refused or interrupted submission cancels the jobs sbatch took.

Apart from :mod:`laminar.deploy` because it is dask-jobqueue's and sbatch's details
(private parts of dask-jobqueue among them); the wait for its jobs' workers is
:mod:`laminar.deploy_placement`'s, the replacement of lost ones :mod:`laminar.deploy_lost`'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path

from laminar.cluster import (
    MEMORY_PAUSE,
    TORCH_THREADS_VAR,
    _set_in_users_config,
    worker_environ,
)
from laminar.config import RunConfig, SlurmRole
from laminar.config_cluster import (
    gpu_directive,
    vllm_gpu_problem,
    walltime_minutes,
    walltime_problem,
)
from laminar.deploy_lost import SlurmReplacer
from laminar.deploy_placement import _role_section, run_workers
from laminar.deploy_tls import _protocol
from laminar.errors import ClusterError, ConfigError

# (laminar.deploy's logger, as before the split: docs/deploy.md quotes its lines)
log = logging.getLogger("laminar.deploy")


def _env_name(key: str) -> str:
    """The environment variable of Dask setting ``key``: DASK_A__B_C for a.b-c."""
    return "DASK_" + "__".join(part.upper().replace("-", "_") for part in key.split("."))


def slurm_cluster(cfg: RunConfig, run_dir: str | Path, security=None):
    """A ``dask_jobqueue.SLURMCluster`` with one job per worker of :func:`run_workers`.

    Each job carries its own role resources (``--resources rollout=1``), cores, memory
    and GPUs (``--gres=gpu:N``) from ``cluster.slurm.<role>``; the trainer's job also
    holds the data module. Workers run without a nanny: one process per job, with the
    job's environment (and glibc's adaptive malloc, see :func:`worker_environ`); Slurm
    enforces the job's memory.
    """
    problem = vllm_gpu_problem(cfg.cluster, cfg.rollout.engine)
    if problem is not None:  # (before anything starts: no job would run vLLM)
        raise ConfigError(problem)
    SLURMCluster, SLURMJob = _import_jobqueue()
    s = cfg.cluster.slurm
    if (problem := walltime_problem(cfg.cluster)) is not None:  # (a config built in code)
        raise ConfigError(problem)
    minutes = walltime_minutes(s.walltime)
    if minutes is not None and minutes < 10:
        log.warning(
            "cluster.slurm.walltime=%s is %s to sbatch: every job of the run, and its "
            "worker, ends then (sbatch reads 1:00 as one minute and 1:00:00 as one hour); "
            "give H:M:S, e.g. 02:00:00",
            s.walltime,
            f"{minutes:g} minute(s)",
        )
    # Absolute, for what the job scripts name (-e/-o, --tls-*): a job reads them from
    # its working directory, which a --chdir of job_directives or a prologue's cd moves.
    run_dir = _absolute(run_dir)
    log_dir = slurm_log_dir(cfg, run_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable by this user")
    except OSError as e:  # (a file in the way, no permission, a read-only file system)
        raise ConfigError(
            f"cannot make the Slurm jobs' log folder {str(log_dir)!r} "
            f"({e.strerror or e}); set cluster.slurm.log_directory to a folder this user "
            "can create and write, on a file system the compute nodes share"
        ) from None
    if '"' in str(log_dir):
        raise ConfigError(
            f"the Slurm job logs' folder {str(log_dir)!r} has a double quote, which an "
            "#SBATCH line cannot hold; set cluster.slurm.log_directory to a plainer path"
        )
    if cfg.cluster.security is None:
        # (Dask's scheduler without TLS accepts any client, which can run code as you:
        # `client.run_on_scheduler(os.system, ...)`, on every job of the run too.)
        log.warning(
            "cluster.kind=slurm without cluster.security: the run's scheduler listens in "
            "plaintext on %s, and anyone who can reach its port can run code as you, on "
            "this machine and in every job of the run; set cluster.security: {generate: "
            "true} (certificates made for the run, as configs/slurm.yaml does) or your own "
            "certificates (docs/deploy.md, Security)",
            f"interface {s.interface}" if s.interface else "every interface of this machine",
        )
    # Jobs from other runs must not be mistaken for ours in squeue. An #SBATCH line ends
    # at a blank: a run directory "my run" gave `-J laminar-my run`, which sbatch refused.
    job_name = ("laminar-" + re.sub(r"[^A-Za-z0-9._-]", "_", Path(run_dir).name))[:64]
    # The logs' lines quoted (dask-jobqueue's log_directory writes them bare), and a % of
    # the folder's name doubled: Slurm reads -o/-e as a pattern (a run dir "lr_5%" ...).
    where = str(log_dir).replace("%", "%%")
    logs = [f'-e "{where}/{job_name}-%J.err"', f'-o "{where}/{job_name}-%J.out"']
    pause_theirs = _set_in_users_config(MEMORY_PAUSE)

    def prologue(role: SlurmRole) -> list[str]:
        """The job script's lines before its worker: the environment, with the role's
        threads (its cores unless it says), then cluster.slurm.job_prologue's."""
        threads = role.torch_threads or role.cores
        env = worker_environ(threads)
        env[TORCH_THREADS_VAR] = str(threads)  # (its actors', laminar.cluster.actor_threads)
        if role.gpus == 0 and gpu_directive([*s.job_directives, *role.job_directives]) is None:
            # A job that asked for no GPU sees none: on a node that does not hide the
            # others (no cgroup device limits), CUDA would take GPU 0, another job's.
            env["CUDA_VISIBLE_DEVICES"] = ""
        if not pause_theirs:
            # Without a nanny a worker still pauses at Dask's memory.pause (80%) of its
            # --memory-limit, here the job's memory, and a paused worker starts no task and
            # the scheduler gives it none (distributed's WorkerState._ensure_computing): a
            # rollout whose engine holds most of its job's memory would run none of the
            # run's reward tasks. Slurm enforces the job's memory; a user's setting stands.
            env[_env_name(MEMORY_PAUSE)] = "False"
        lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
        return lines + [_checked(line) for line in s.job_prologue]

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
        # The role's partition and account where it has its own (GPUs in a partition,
        # or on an account, of their own), and its #SBATCH lines after everyone's.
        if role.partition is not None:
            options["queue"] = role.partition
        if role.account is not None:
            options["account"] = role.account
        gres = [f"--gres=gpu:{role.gpus}"] * (role.gpus > 0)
        directives = [*logs, *s.job_directives, *role.job_directives, *gres]
        res = ",".join(f"{k}={v}" for k, v in resources.items())
        options.update(
            cores=role.cores,
            memory=role.memory,
            job_script_prologue=prologue(role),
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
            f"({', '.join(sections) or 'cluster.slurm'}; cluster.slurm's walltime and "
            "job_directives apply to every job, its partition and account to those of a "
            "role without its own):\n  "
            + "\n  ".join(said)
            + (
                "\nthe jobs it had accepted are cancelled"
                if len(refused) < len(run_workers(cfg))
                else ""
            )
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
    real_signal = signal.signal

    def from_a_thread(signum, handler):
        # Python sets handlers from the main thread only: dask-jobqueue's, at import,
        # raised a bare ValueError when a cluster was opened from another thread (a
        # notebook's or an application's). Its handler is put back below anyway.
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller == "dask_jobqueue.runner" and threading.current_thread() is not (
            threading.main_thread()
        ):
            return signal.getsignal(signum)
        return real_signal(signum, handler)

    try:
        if threading.current_thread() is not threading.main_thread():
            signal.signal = from_a_thread
        from dask_jobqueue import SLURMCluster
        from dask_jobqueue.slurm import SLURMJob
    except ImportError as e:
        raise ConfigError(
            "cluster.kind=slurm needs dask-jobqueue: pip install 'laminar-rl[slurm]'"
        ) from e
    except ValueError as e:  # (a dask-jobqueue that sets its handler some other way)
        raise ConfigError(
            f"dask-jobqueue could not be imported outside the main thread ({e}): open the "
            "Slurm cluster (laminar.deploy.open_cluster) from the main thread"
        ) from None
    finally:
        signal.signal = real_signal
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


def _checked(line: str) -> str:
    """A ``cluster.slurm.job_prologue`` line that ends the job when it fails, saying which
    in the job's log (which the placement wait quotes): a job script runs on past a
    failed command, and its worker started in the wrong environment. Not ``set -e``,
    which would hold for the user's own lines' inner commands too. The line stands in a
    ``{ ...; }`` group of its own on its own line: a trailing comment stays one, and a
    ``source`` or ``export`` in it holds for the job."""
    if not line.strip() or line.lstrip().startswith("#"):
        return line
    said = shlex.quote(f"laminar: job_prologue line failed: {line}")
    return f"{{ {line}\n}} || {{ echo {said} >&2; exit 1; }}"


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
        for arg in ("--tls-" + key.replace("_", "-"), shlex.quote(_tls_path(str(value))))
    ]


def _tls_path(value: str) -> str:
    """A certificate's path made absolute (see :func:`slurm_cluster`); a PEM given as
    text (Security takes either) as it is."""
    return value if value.lstrip().startswith("-----BEGIN") else str(_absolute(value))


def slurm_log_dir(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Where the jobs of ``cluster.kind: slurm`` write their logs: RUN_DIR/slurm unless
    ``cluster.slurm.log_directory``."""
    return _absolute(cfg.cluster.slurm.log_directory or Path(run_dir) / "slurm")


def _absolute(path: str | Path) -> Path:
    """``path`` with ``~`` expanded, absolute (``..`` folded, symbolic links kept)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def _cancel_submitted(cluster) -> list[str]:
    """After a refused submission: cancel the jobs that were accepted and stop the
    scheduler now (not at the interpreter's exit: a notebook's kernel lives on). Returns
    the names of the workers whose job was refused."""
    import subprocess

    from distributed.core import Status

    # Every job sbatch answered for: cluster.workers holds them only once the whole
    # submission ended, and one still under way (a slow sbatch past _submit's settle_s)
    # was left out and ran on to its walltime. cluster._created holds each job object
    # from before its sbatch; job_id is set once sbatch answers (dask-jobqueue 0.9).
    jobs = [*cluster.workers.values(), *getattr(cluster, "_created", ())]
    accepted = {w.name: w.job_id for w in jobs if getattr(w, "job_id", None)}
    refused = [n for n in cluster.worker_spec if n not in accepted]  # (close() empties it)
    if accepted:
        ids = sorted(set(accepted.values()), key=lambda i: (len(i), i))
        try:
            r = subprocess.run(
                ["scancel", *ids], capture_output=True, text=True, timeout=60, check=False
            )
            failed = None if r.returncode == 0 else (r.stderr or r.stdout).strip()
        except (OSError, subprocess.SubprocessError) as e:
            failed = repr(e)
        if failed is not None:
            log.error(
                "scancel did not cancel the run's Slurm jobs %s (%s): they hold their "
                "nodes until their walltime; cancel them yourself: scancel %s",
                ", ".join(ids),
                failed or "no message",
                " ".join(ids),
            )
    for w in list(cluster._created):  # never submitted: nothing for close() to wait on
        if w.status == Status.created:
            w.status = Status.failed
    with contextlib.suppress(Exception):
        cluster.close(timeout=30)
    return refused
