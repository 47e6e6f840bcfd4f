"""Where a run's workers come from: a local cluster, a running scheduler, or Slurm jobs.

:func:`open_cluster` is what ``laminar run`` uses; notebooks use it too, or bring their
own :class:`distributed.Client`::

    with open_cluster(cfg, run_dir) as client:
        handle = pipelines.submit(cfg, client, run_dir=run_dir)

Every kind gives one worker per role instance (:func:`role_workers`), each advertising
its role as a Dask resource, so actors land where they belong. A cluster that cannot
hold the run is reported by :func:`wait_for_roles`, naming the role and the fix, instead
of leaving actors waiting forever for a worker that never comes.

Here: :func:`open_cluster` and the scheduler-file checks of ``cluster.kind: address``.
The parts, each importable from here too: what a run needs and the wait for it
(:mod:`laminar.deploy_placement`), TLS (:mod:`laminar.deploy_tls`), Slurm jobs submitted
(:mod:`laminar.deploy_slurm`), lost workers fenced and their Slurm jobs replaced
(:mod:`laminar.deploy_lost`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from laminar.cluster import role_cluster
from laminar.config import RunConfig
from laminar.config_cluster import address_problem, scheme_problem
from laminar.deploy_lost import (
    REPLACE_BACKOFF_S,
    REPLACE_STABLE_S,
    REPLACE_TRIES,
    Replacements,
    SlurmReplacer,
    fence_workers,
)
from laminar.deploy_placement import (
    JOINED_PLUGIN,
    SlurmJobs,
    role_needs,
    run_workers,
    wait_for_roles,
)
from laminar.deploy_slurm import slurm_cluster, slurm_log_dir
from laminar.deploy_tls import TLS_FILES, _protocol, generate_tls, security_for
from laminar.errors import ClusterError, ConfigError

__all__ = [
    "JOINED_PLUGIN",
    "REPLACE_BACKOFF_S",
    "REPLACE_STABLE_S",
    "REPLACE_TRIES",
    "TLS_FILES",
    "Replacements",
    "SlurmJobs",
    "SlurmReplacer",
    "fence_workers",
    "generate_tls",
    "open_cluster",
    "role_needs",
    "run_workers",
    "security_for",
    "slurm_cluster",
    "slurm_log_dir",
    "wait_for_roles",
]


def _scheduler_in_file(path: str, timeout_s: float) -> str:
    """The scheduler's address in its file (``dask scheduler --scheduler-file``), read
    once the file holds one, for up to ``timeout_s``.

    A scheduler started as a Slurm job writes its file once the job runs, and writes it
    in place, not atomically: on a shared file system (NFS, Lustre) another machine may
    see it empty or cut short for a while. Dask's client read it once and failed on a
    bare AssertionError.
    """
    file = Path(path).expanduser()
    deadline = time.monotonic() + timeout_s
    while True:
        address, held = _address_in(file)
        if address is not None:
            return address
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if held is None:
        raise ClusterError(
            f"no scheduler file at {path!r} after {timeout_s:g} s "
            "(cluster.placement_timeout_s); start the scheduler with "
            f"`dask scheduler --scheduler-file {path}` (or sbatch "
            "deploy/slurm/scheduler.sbatch), on a file system this machine shares"
        )
    raise ConfigError(
        f"cluster.scheduler_file: {path!r} holds {held} after {timeout_s:g} s "
        '(cluster.placement_timeout_s), not the JSON with the scheduler\'s "address" that '
        f"`dask scheduler --scheduler-file {path}` writes; give the file your scheduler "
        "wrote (--scheduler-file), or the scheduler's address (--scheduler)"
    )


def _address_in(file: Path) -> tuple[str | None, str | None]:
    """``(address, None)`` from a scheduler file that names one, ``(None, what it holds)``
    from one that does not (yet), ``(None, None)`` where there is no file."""
    import json

    try:
        text = file.read_text(errors="replace")
    except FileNotFoundError:
        return None, None
    except OSError as e:  # (a folder, no permission: not a file that is still being written)
        raise ConfigError(
            f"cluster.scheduler_file: cannot read {str(file)!r} ({e.strerror or e}); give "
            "the file `dask scheduler --scheduler-file FILE` wrote, readable by this user"
        ) from None
    if not text.strip():
        return None, "nothing (it is empty)"
    try:
        data = json.loads(text)
    except ValueError:
        cut = text if len(text) <= 80 else text[:80] + "..."
        return None, f"{cut!r}, which is not JSON (or not all of it yet)"
    if not isinstance(data, dict) or not isinstance(data.get("address"), str):
        if isinstance(data, dict):
            shown = f"the keys {sorted(data)}" if data else "no keys"
        else:
            shown = f"a JSON {type(data).__name__}"
        return None, f'JSON without an "address" ({shown})'
    return data["address"], None


def _check_file_address(path: str, address: str, secured: bool) -> None:
    """The address a scheduler file names, checked as ``cluster.address`` is."""
    problem = address_problem(address)
    problem = scheme_problem(address, secured) if problem is None else f"{address!r} {problem}"
    if problem is not None:
        raise ConfigError(f"cluster.scheduler_file: the scheduler address in {path!r}: {problem}")
    if address.startswith("ucx://"):
        ucx_is_installed("cluster.scheduler_file", f"{path} (a ucx:// scheduler)")


def ucx_is_installed(field: str, value: str, otherwise: str = "use cluster.protocol=tcp") -> None:
    """Dask's UCX comes from `distributed-ucxx`: without it, a scheduler over UCX failed
    to start with no word of why (``Scheduler failed to start.``)."""
    import importlib.util

    if importlib.util.find_spec("distributed_ucxx") is None:
        raise ConfigError(
            f"{field}={value}: UCX needs the distributed-ucxx package, which this Python "
            f"({sys.executable}) lacks; it pins its own dask release, so install it with "
            "laminar in an environment of its own and run laminar from there: python3 -m "
            "venv .venv-ucx && . .venv-ucx/bin/activate && pip install -e '.[cpu,ucx]' "
            f"(docs/deploy.md, UCX); or {otherwise}"
        )


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
    if kind != "address" and _protocol(c) == "ucx":
        ucx_is_installed("cluster.protocol", "ucx")
    if address and address.startswith("ucx://"):
        ucx_is_installed("cluster.address", address)
    security = security_for(c, run_dir)
    jobs = None
    with contextlib.ExitStack() as stack:
        if kind == "address":
            if scheduler_file:
                address = _scheduler_in_file(scheduler_file, c.placement_timeout_s)
                _check_file_address(scheduler_file, address, security is not None)
            where = f"{address} (from {scheduler_file})" if scheduler_file else address
            try:
                client = Client(address, security=security, timeout="30s")
            except (OSError, TimeoutError) as e:
                raise ClusterError(
                    f"cannot reach the scheduler at {where}: {e}; check that it runs and, "
                    "for a tls:// scheduler, that cluster.security gives its CA and a "
                    "certificate it trusts" + _stale_hint(scheduler_file)
                ) from e
            except (RuntimeError, ValueError, TypeError) as e:  # (what the checks missed)
                field = "cluster.scheduler_file" if scheduler_file else "cluster.address"
                raise ClusterError(
                    f"cannot connect to the scheduler at {where}: {type(e).__name__}: {e}; "
                    f"check {field} and cluster.security (set: {security is not None})"
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
