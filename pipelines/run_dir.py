"""A run's directory: claimed by one process at a time (:mod:`storage.live`), refused
when it holds another run or foreign files, prepared (config, prompt fingerprint) as a
run starts; the config's paths made absolute, so that workers and resumes elsewhere
find the same files."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from laminar.config import RunConfig
from laminar.errors import ConfigError
from storage.live import LIVE_FILE, LIVE_STALE_S, Claim, RunGoing, check_free, claim

logger = logging.getLogger("laminar")


def _going(path: Path, doing: str, live: dict, here: bool = False) -> ConfigError:
    if here:
        return ConfigError(
            f"cannot {doing} {str(path)!r}: this process drives a run there already; "
            "wait for it or stop it first (RunHandle.stop())"
        )
    ago = time.time() - float(live.get("seen", 0))
    stalled = (
        " (it has not renewed its claim since: stopped with Ctrl-Z, or stalled; on its "
        "own host a driver holds the directory for as long as its process lives: "
        "continue it, or end it)"
        if ago > LIVE_STALE_S
        else ""
    )
    return ConfigError(
        f"cannot {doing} {str(path)!r}: a run is going there (its driver, pid "
        f"{live.get('pid')} on {live.get('host')!r}, said so {ago:.0f} s ago{stalled}); "
        f"stop it first (Ctrl-C, or RunHandle.stop()). If that process is gone, its "
        f"{LIVE_FILE} goes stale within {LIVE_STALE_S:.0f} s (at once on its own host)"
    )


def _refuse_if_running(path: Path, doing: str) -> None:
    """Refuse early (before any check or write) when a live driver holds ``path``."""
    try:
        check_free(path)
    except RunGoing as e:
        raise _going(path, doing, e.live, e.here) from None


def _claim(path: Path, doing: str) -> Claim:
    """Claim ``path`` for this process (:func:`storage.live.claim`: of two starts or
    resumes at once, one goes on), or refuse naming the driver that holds it."""
    try:
        return claim(path)
    except RunGoing as e:
        raise _going(path, doing, e.live, e.here) from None


def _write_claimed(path: Path, doing: str, files: dict[Path, str | None], before=None) -> None:
    """Claim ``path``, then write its ``config.yaml`` and the like (``files``: each
    one's text; None: removed); the claim is given back if a write fails, and kept (for
    the RunHandle to take over) if none does. ``before``: called once claimed, before
    the writes (what must not race another start)."""
    held = _claim(path, doing)  # (an idle claim: _claim refuses one a run drives)
    try:
        if before is not None:
            before()
        for file, text in files.items():
            if text is None:
                file.unlink(missing_ok=True)
            else:
                file.write_text(text)
    except BaseException:
        held.release()
        raise


# The sha256 of task.prompt_file's bytes as the run began (sha256sum's format): a resume
# refuses a file whose content changed (the stores' groups are of its prompts, by key).
PROMPT_FINGERPRINT = "prompt_file.sha256"
# The settings that make the prompts (and their order: seed): what a resume cannot change.
# What makes the synthetic task's prompts (unused beside task.prompt_file)
SYNTHETIC_FIELDS = (
    "task.name",
    "task.num_prompts",
    "task.median_len",
    "task.tail_ratio",
    "task.max_len",
    "task.length_share",
)
PROMPT_FIELDS = ("task.prompt_file", *SYNTHETIC_FIELDS, "seed")
# The settings the behavior logprobs depend on, and the trainer's too: the stores'
# untrained groups and the partial responses a resume finishes were sampled with them.
# (Not top_p/top_k: a behavior logprob is the unfiltered distribution's, laminar.sampling,
# as the trainer's is; the filters change what is drawn, not what the ratio compares.)
LOGPROB_FIELDS = ("rollout.temperature",)


def _fingerprint(cfg: RunConfig) -> str | None:
    """``PROMPT_FINGERPRINT``'s text for ``cfg``'s prompt file; None: no prompt file."""
    if not cfg.task.prompt_file:
        return None
    return f"{_sha256(Path(cfg.task.prompt_file).expanduser())}  {cfg.task.prompt_file}\n"


def _sha256(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# The config's paths read relative to a working directory: the driver's at the start,
# but a resume's may be another (a notebook's, a job script's), and so may a worker's.
# A run records them absolute (:func:`absolute_paths`). Not ``run_dir``: the run's own
# folder, which the driver resolves and hands to every worker.
PATH_FIELDS = (
    "task.prompt_file",
    "model.path",
    "sft.cache_dir",
    "trainer.resume_from",
    "cluster.scheduler_file",
    "cluster.security.ca_file",
    "cluster.security.cert",
    "cluster.security.key",
    "cluster.slurm.log_directory",
    "cluster.slurm.python",
)


def _is_path(key: str, given) -> bool:
    """Whether ``given``, the value of path field ``key``, is a path relative to the
    working directory. Not: unset, absolute, ``~/...`` (expanded where it is read, to
    that machine's home), nor a ``cluster.slurm.python`` with no ``/`` (a command,
    found on the compute node's PATH)."""
    if not isinstance(given, str) or not given or os.path.isabs(given):
        return False
    if given.startswith("~"):
        return False
    return key != "cluster.slurm.python" or "/" in given


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its relative paths (:data:`PATH_FIELDS`, as :func:`_is_path`
    tells) made absolute, as this process's working directory resolves them: the run's
    ``config.yaml`` records where they are, so a resume from another directory (a
    notebook's, a job script's) reads the same files and folders, and so does a worker
    whose working directory is not this one."""
    for key in PATH_FIELDS:
        given = _field(cfg, key)
        # (a model.path naming nothing here stays as given, for preflight to name:
        # laminar reads only local folders, but it may be meant as a hub id)
        if _is_path(key, given) and (key != "model.path" or os.path.exists(given)):
            cfg = _with(cfg, key, os.path.abspath(given))
    # sft.cache_dir unset defaults to $LAMINAR_CACHE: a relative one is recorded as this
    # directory resolves it (a worker, or a resume, elsewhere would find another cache)
    env = os.environ.get("LAMINAR_CACHE")
    if cfg.sft.cache_dir is None and env and _is_path("sft.cache_dir", env):
        cfg = _with(cfg, "sft.cache_dir", os.path.abspath(env))
    return cfg


def _with(model, key: str, value):
    """``model`` (a config, or a section of one) with its field ``key`` (dotted) set to
    ``value``."""
    head, _, rest = key.partition(".")
    inner = value if not rest else _with(getattr(model, head), rest, value)
    return model.model_copy(update={head: inner})


def _field(cfg: RunConfig, key: str):
    """The value of field ``key`` (dotted); None where a section on the way is unset
    (``cluster.security``)."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part) if value is not None else None
    return value


def _laminar_config(path: Path) -> bool:
    """Whether ``path/config.yaml`` is one laminar wrote (it always has ``run_dir``: a
    run directory's, moved or named relative to another working directory)."""
    import yaml

    try:
        data = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):  # (ValueError: not UTF-8 text)
        return False
    return isinstance(data, dict) and bool(data.get("run_dir"))


def _nothing_stored(path: Path) -> bool:
    """Whether the run directory's store has committed nothing (a start that stopped or
    failed in its setup: a new run may take it over)."""
    from storage.trajectories import committed

    try:
        return committed(path) == 0
    except Exception:  # noqa: BLE001 — unreadable: not taken over
        return False


# What a run writes in its directory, besides config.yaml (and driver.json, its live
# claim, checked apart): in a directory that is not a run's, a new run would overwrite
# these or mix its own into them. (tls/ and slurm/ are not here: open_cluster makes them
# in the run directory it is given, before pipelines.submit prepares it.)
RUN_FILES = (
    "trajectories.zarr",
    "metrics.zarr",
    "partial.zarr",
    "checkpoints",
    "summary.json",
    "tensorboard",
    PROMPT_FINGERPRINT,
    "dispatch_lease.json",
)


def _set_aside_failed_start(path: Path) -> dict[str, str]:
    """Move what an earlier start that stored nothing left in ``path`` (its
    :data:`START_OUTPUTS`) aside, as ``<name>.failed-<UTC time>``, and log it: a new run
    appended to its metrics.zarr and tensorboard/ (its clock from 0 again: ``cluster.time``
    going backwards, one segment of two starts, TensorBoard steps repeated), and its
    summary.json stood for the new run's until that one wrote its own. Nothing is
    deleted. Returns ``{name: new name}``."""
    found = [name for name in START_OUTPUTS if os.path.lexists(path / name)]
    if not found:
        return {}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix, n = f".failed-{stamp}", 1
    while any(os.path.lexists(path / f"{name}{suffix}") for name in found):
        n += 1  # (two takeovers in one second)
        suffix = f".failed-{stamp}-{n}"
    moved = {}
    for name in found:
        os.replace(path / name, path / f"{name}{suffix}")
        moved[name] = f"{name}{suffix}"
    logger.warning(
        "%s: an earlier start here stored no trajectory and recorded no update; its %s "
        "moved aside (renamed with the suffix %s), so this run's records start afresh",
        path,
        ", ".join(found),
        suffix,
    )
    return moved


# What a start writes in its run directory besides config.yaml and its prompt
# fingerprint (both rewritten by the next start): a new run taking over a failed start's
# directory moves these aside (:func:`_set_aside_failed_start`) rather than append to them.
START_OUTPUTS = tuple(name for name in RUN_FILES if name != PROMPT_FINGERPRINT)


def _trained(path: Path) -> bool:
    """Whether the run directory's ``metrics.zarr`` records an update (its store and
    checkpoints moved aside or lost: a new run would add its rows to that run's)."""
    store = path / "metrics.zarr"
    if not (store / "zarr.json").exists():
        return False
    import zarr

    from storage.schema import COMMIT_ATTR

    try:
        root = zarr.open_group(str(store), mode="r", zarr_format=3)
        return "updates" in root and int(root["updates"].attrs.get(COMMIT_ATTR, 0)) > 0
    except Exception:  # noqa: BLE001 — unreadable: not taken over
        return True


def _refuse_foreign_run_files(path: Path) -> None:
    """Refuse a directory that holds what a run writes but is not a run's own (no
    ``config.yaml`` laminar wrote): a run would overwrite those files or mix with them."""
    found = [name for name in RUN_FILES if (path / name).exists()]
    if found and not _laminar_config(path):
        raise ConfigError(
            f"run directory {str(path)!r} is not a laminar run's (it has no config.yaml "
            f"laminar wrote) but holds {', '.join(found)}, which a run would overwrite or "
            "mix its own into; pass a new --run-dir (a folder that does not exist yet, or "
            "an empty one)"
        )


def _file_in_the_way(path: Path) -> Path | None:
    """The file (not folder) at ``path`` or above it, which keeps a folder from being made."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def _run_dir_problem(run_dir: str | None, e: OSError) -> str:
    """Why the run directory cannot be made, naming what stands in its way."""
    path = Path(str(e.filename or run_dir or "runs"))
    blocker = _file_in_the_way(path)
    if blocker is not None:
        return (
            f"cannot make the run directory {str(path)!r}: {str(blocker)!r} is a file, not a "
            "folder; pass --run-dir (or run_dir in the config) a new folder's path, or move "
            "the file aside"
        )
    return (
        f"cannot make the run directory {str(path)!r} ({e.strerror or e}); pass --run-dir "
        "(or run_dir in the config) a folder this user can create and write"
    )


def prepare_run_dir(cfg: RunConfig, run_dir: str | Path | None) -> Path:
    """Create the run directory and store the exact resolved config in it. A folder
    that cannot be made or written is a :class:`ConfigError` naming it and the fix."""
    try:
        return _prepare_run_dir(cfg, run_dir)
    except OSError as e:  # (a file where the folder must be, no permission, ...)
        raise ConfigError(_run_dir_problem(str(run_dir or cfg.run_dir or ""), e)) from None


def check_run_dir(cfg: RunConfig, run_dir: str | Path | None) -> None:
    """Refuse, as :func:`prepare_run_dir` would, a run directory a new run cannot start
    in (one that holds a run, is a file, is another tool's), without making it: checked
    before a wait for the cluster's workers (queued Slurm jobs), so that a taken
    directory is not told only after it."""
    if run_dir is None and cfg.run_dir is None:
        return  # (a new runs/<time> folder)
    try:
        _check_run_dir(Path(run_dir or cfg.run_dir).expanduser())
    except OSError as e:
        raise ConfigError(_run_dir_problem(str(run_dir or cfg.run_dir or ""), e)) from None


def _prepare_run_dir(cfg: RunConfig, run_dir: str | Path | None) -> Path:
    path = Path(run_dir or cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    path = path.expanduser()  # (--set run_dir=~/runs/x made a folder named ~ here)
    _check_run_dir(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = absolute_paths(cfg)  # (submit's and `laminar run`'s already are)
    text = cfg.model_copy(update={"run_dir": str(path)}).to_yaml()
    files = {path / "config.yaml": text, path / PROMPT_FINGERPRINT: _fingerprint(cfg)}
    # (a failed start's records, kept: a directory taken over is this run's alone)
    _write_claimed(path, "start a run in", files, before=lambda: _set_aside_failed_start(path))
    return path.resolve()


def _check_run_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run directory {str(path)!r} is a file; pass a directory as --run-dir")
    _refuse_if_running(path, "start a run in")
    _refuse_foreign_run_files(path)
    from laminar.learner import newest_checkpoint

    if newest_checkpoint(path) is not None:  # (with its store, or with it moved or lost)
        from pipelines.data_module import resume_hint

        raise ConfigError(
            f"run directory {str(path)!r} already holds a run; pass a new --run-dir, "
            f"or {resume_hint(path)}"
        )
    if ((path / "trajectories.zarr").exists() and not _nothing_stored(path)) or _trained(path):
        raise ConfigError(
            f"run directory {str(path)!r} already holds a run with no checkpoint to "
            "continue from; pass a new --run-dir, or delete it to start over"
        )
    if (path / "config.yaml").exists() and not _laminar_config(path):
        raise ConfigError(
            f"{str(path / 'config.yaml')!r} was not written by laminar, and a run would "
            "overwrite it; pass another --run-dir"
        )
