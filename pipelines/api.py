"""The run API that notebooks and the CLI share.

>>> from distributed import Client                                  # doctest: +SKIP
>>> import pipelines
>>> client = Client("tcp://scheduler:8786")                          # doctest: +SKIP
>>> run = pipelines.submit("configs/tiny.yaml", client,
...                        overrides=["trainer.steps=20"])           # doctest: +SKIP
>>> run.progress()          # latest progress dict, never blocks     # doctest: +SKIP
>>> summary = run.wait()    # or run.stop() to end early, store intact  # doctest: +SKIP
>>> run = pipelines.resume(run.run_dir, client,
...                        overrides=["trainer.steps=40"])           # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from laminar.config import (
    RunConfig,
    config_from_dict,
    load_config,
    override_list,
    parse_overrides,
    with_overrides,
)
from laminar.errors import ConfigError, LaminarError, RunFailed, RunStopped
from storage.live import LIVE_FILE, LIVE_STALE_S, Claim, RunGoing, check_free, claim

logger = logging.getLogger("laminar")


class RunInterrupted(KeyboardInterrupt):
    """An interrupt (the kernel's stop button, Ctrl-C) during :meth:`RunHandle.wait`,
    raised once the run has stopped in order: ``summary`` is what it did (as in
    ``RUN_DIR/summary.json``). A ``KeyboardInterrupt``, so that what waits on runs one
    after another (a notebook's loop over a grid, a bench) ends there, rather than
    taking the truncated run for a finished one and submitting the next."""

    def __init__(self, message: str, summary: dict | None) -> None:
        super().__init__(message)
        self.summary = summary


def resolve_config(
    config: RunConfig | dict | str | Path,
    overrides: list[str] | tuple[str, ...] | str | None = (),
) -> RunConfig:
    """A config object from a YAML file's path, a :class:`RunConfig`, or a dict of
    sections as the file holds them (``{"trainer": {"steps": 20}}``, checked as the file
    is), with ``a.b=value`` overrides applied (None: none). Anything else is a
    :class:`ConfigError` saying what it takes."""
    overrides = override_list(overrides)
    if isinstance(config, dict):
        config = config_from_dict(config)
    if isinstance(config, RunConfig):
        return with_overrides(config, overrides) if overrides else config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            "config must be a YAML file's path (e.g. 'configs/tiny.yaml'), a "
            f"laminar.config.RunConfig or a dict of sections, not {type(config).__name__}"
        )
    return load_config(config, overrides)


# How long preflight waits for the reward's module to import (one that blocks as it is
# imported would hang the driver, with nothing said, and every worker later)
REWARD_IMPORT_TIMEOUT_S = 60.0


def _check_reward_imports(name: str, resolve, timeout_s: float = REWARD_IMPORT_TIMEOUT_S) -> None:
    """``resolve(name)`` (:func:`laminar.rewards.resolve_reward`), on a thread: a module
    that blocks as it is imported (a server started, ``input()``, a network call at its
    top) is a :class:`~laminar.errors.RewardError` after ``timeout_s``, naming it; the
    thread is left behind (a daemon: it ends with the process)."""
    from laminar.errors import RewardError

    out: list[BaseException | None] = []

    def run() -> None:
        try:
            resolve(name)
            out.append(None)
        except BaseException as e:  # noqa: BLE001 — raised in the caller's thread below
            out.append(e)

    thread = threading.Thread(target=run, name="laminar-reward-import", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not out:
        module = name.partition(":")[0]
        raise RewardError(
            f"task.reward {name!r}: importing {module!r} did not finish in {timeout_s:g} s: "
            "it blocks as it is imported (a server started, input(), a network call at its "
            "top), which would hang every worker too, or it is that slow to import (a cold "
            "network filesystem); move such work into the function, or under "
            "`if __name__ == '__main__':`"
        )
    if out[0] is not None and "only works in main thread" in str(out[0]):
        resolve(name)  # (signal.signal at its top: it imports in the main thread alone)
    elif out[0] is not None:
        raise out[0]


def preflight(cfg: RunConfig) -> None:
    """Check what can be checked before any cluster work: the model folder and its
    context (``rollout.max_seq_len`` within its positions); the prompts
    (each fits the rollout's sequence and the model's vocabulary); that the reward
    function imports (it is not called here: a reward may need what only the workers
    have, a judge service or a GPU); the TensorBoard writer when asked for; the
    checkpoint to resume from (against the model and optimizer settings); the
    warm-start cache folder. Each failure names the field and the fix."""
    from laminar.config_sections import ignored_by_correction_message
    from laminar.learner import check_checkpoint
    from laminar.model import check_policy_dir
    from laminar.prompt_pool import (
        check_answers,
        encode_prompts,
        load_prompts,
        unreachable_answers,
    )
    from laminar.prompts import check_reward_answers
    from laminar.rewards import resolve_reward
    from laminar.sft import base_model_config, base_tokenizer, check_cache_dir

    check_cache_dir(cfg)
    cfg.metrics.check_writer()
    _check_engine(cfg)
    if cfg.model.path:
        check_policy_dir(cfg.model.path)
    model_config = base_model_config(cfg)
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and cfg.rollout.max_seq_len > context:
        where = f"model.path {cfg.model.path!r}" if cfg.model.path else "the built-in tiny model"
        raise ConfigError(
            f"rollout.max_seq_len ({cfg.rollout.max_seq_len}) exceeds the context of "
            f"{where} ({context} positions, its max_position_embeddings): no sequence may "
            "run past the positions the policy was built for; lower rollout.max_seq_len "
            "(and rollout.max_new_tokens), or use a model with a longer context"
        )
    _check_torch_engine(cfg, model_config)
    _check_engine_memory(cfg, model_config)
    prompts = load_prompts(cfg)
    check_reward_answers(prompts, cfg)
    tok = base_tokenizer(cfg)
    encoded = encode_prompts(tok, prompts, cfg)
    answers = check_answers(tok, prompts, cfg)
    _check_vocab(cfg, tok, model_config, encoded, answers)
    if warning := unreachable_answers(tok, prompts, cfg):
        logger.warning(warning)
    for field in cfg.trainer.ignored_by_correction():
        logger.warning(ignored_by_correction_message(cfg.trainer, field))
    if cfg.trainer.correction == "decoupled" and cfg.trainer.mini_batches == 1:
        logger.warning(
            "trainer.correction=decoupled with trainer.mini_batches=1 trains exactly as "
            "tis: with one optimizer step the proximal policy is the step's own, so its "
            "clip never binds (and clip_frac, approx_kl stay 0). Set trainer.mini_batches "
            "to 2 or more for its trust region (docs/losses.md)"
        )
    if doomed := cfg.doomed_dispatch():
        logger.warning(doomed)
    _check_reward_imports(cfg.task.reward, resolve_reward)
    if cfg.trainer.resume_from:
        check_checkpoint(cfg.trainer.resume_from, model_config, cfg)


def _check_vocab(cfg: RunConfig, tok, model_config, encoded, answers: dict) -> None:
    """Refuse token ids the model has no embedding for (``config.vocab_size``): a
    tokenizer with tokens added after the model was saved (``add_tokens`` without
    ``resize_token_embeddings``). Its special tokens (bos, eos, pad), each prompt's ids
    and, when the warm start trains on them, the answers' (``answers``: demonstration ->
    ids; encoded here where :func:`check_answers` had no unknown token to check for). An
    id past the table failed on the cluster: an IndexError in the warm start or a
    rollout (a device-side assert on a GPU)."""
    from laminar.prompts import _where
    from laminar.tasks import longest_demonstration

    size = getattr(model_config, "vocab_size", None)
    if not isinstance(size, int):
        return
    where = f"model.path {cfg.model.path!r}" if cfg.model.path else "the built-in tiny model"
    fix = (
        "the tokenizer and the weights must be of one model (tokens added to a tokenizer "
        "need model.resize_token_embeddings before save_pretrained)"
    )
    for name in ("bos", "eos", "pad"):
        token = getattr(tok, f"{name}_token_id", None)
        if token is not None and not 0 <= token < size:
            raise ConfigError(
                f"the {name} token of {where}'s tokenizer has id {token}, past its "
                f"model's vocabulary (config.json's vocab_size {size}): {fix}"
            )
    named = _where(cfg)
    for p, ids in encoded:
        if ids and max(ids) >= size:
            raise ConfigError(
                f"{named(p)}: the prompt {p.text!r} encodes to id {max(ids)}, past the "
                f"vocabulary of {where} (config.json's vocab_size {size}): {fix}"
            )
    if not (cfg.sft.enabled and cfg.sft.steps) or not encoded:
        return
    task = None if cfg.task.prompt_file else cfg.task.name
    demos = [longest_demonstration(task, p) for p, _ in encoded]
    if missing := [d for d in dict.fromkeys(demos) if d not in answers]:  # (one batched call)
        ids = tok(missing, add_special_tokens=False)["input_ids"]
        answers = {**answers, **dict(zip(missing, ids, strict=True))}
    for (p, _), demo in zip(encoded, demos, strict=True):
        ids = answers[demo]
        if ids and max(ids) >= size:
            raise ConfigError(
                f"{named(p)}: the answer {p.answer!r} encodes to id {max(ids)}, past the "
                f"vocabulary of {where} (config.json's vocab_size {size}), and the warm "
                f"start trains on answers: {fix}"
            )


def _check_torch_engine(cfg: RunConfig, model_config) -> None:
    """Refuse, with ``rollout.engine: torch``, a model whose forward the torch engine
    does not compute (RoPE scaling, another MLP activation, sliding-window attention):
    it passed every check, trained the whole warm start, then failed scoring it (or its
    rollouts would have sampled from other logits than the trainer's)."""
    from laminar.model import torch_engine_refusal

    if cfg.rollout.engine != "torch" or not (refusal := torch_engine_refusal(model_config)):
        return
    reason, vllm_ok = refusal
    fix = (
        "set rollout.engine=vllm (vLLM generates from it; docs/engines.md), or use another model"
        if vllm_ok
        else "use another model (vLLM's engine does not support it either)"
    )
    raise ConfigError(
        f"model.path {cfg.model.path!r} cannot be generated from by rollout.engine=torch: "
        f"{reason}. Its rollouts would sample from other logits than the trainer "
        f"computes; {fix}"
    )


# The share of a local worker's memory_limit the torch engine's KV cache may take: the
# worker holds the policy and Python besides, and Dask's nanny restarts it at 95%.
KV_MEMORY_SHARE = 0.8


def _check_engine_memory(cfg: RunConfig, model_config) -> None:
    """Refuse, on a local cluster with the torch engine, a KV cache larger than a
    rollout worker may hold: the engine allocates it whole (``rollout.max_batch`` rows of
    ``rollout.max_seq_len`` tokens, float32), and a worker past its limit was restarted
    by Dask as it created the engine, the run failing with "the worker … was lost while
    it created a RolloutReplica actor", naming no setting."""
    from laminar.config_cluster import _memory_limit_bytes
    from laminar.model import cache_bytes

    if cfg.cluster.kind != "local" or cfg.rollout.engine != "torch":
        return
    limit = _memory_limit_bytes(cfg.cluster.memory_limit)
    if limit is None:  # (no limit: auto, or 0)
        return
    r = cfg.rollout
    kv = cache_bytes(model_config, r.max_batch, r.max_seq_len)
    if kv > KV_MEMORY_SHARE * limit:
        batch = (
            f"rollout.max_concurrency={r.max_concurrency}"
            if r.max_concurrency
            else f"rollout.groups_per_batch × group_size = {r.max_batch}"
        )
        raise ConfigError(
            f"the torch engine's KV cache would take {kv / 2**30:.2f} GiB on each rollout "
            f"worker ({batch} requests of rollout.max_seq_len={r.max_seq_len} tokens, "
            f"{model_config.num_hidden_layers} layers), over {KV_MEMORY_SHARE:.0%} of "
            f"cluster.memory_limit={cfg.cluster.memory_limit} (the worker also holds the "
            "policy, and Dask restarts it at 95%); lower the requests or "
            "rollout.max_seq_len, or raise cluster.memory_limit"
        )


def _check_engine(cfg: RunConfig) -> None:
    """Refuse ``rollout.engine: vllm`` where vLLM is not installed, for a local cluster
    (its workers are this environment's processes). It failed after the warm start, in a
    worker, with a ModuleNotFoundError and Dask's dumps. A remote cluster's workers may
    have what this machine lacks: not checked here."""
    import importlib.util

    if (
        cfg.rollout.engine == "vllm"
        and cfg.cluster.kind == "local"
        and importlib.util.find_spec("vllm") is None
    ):
        raise ConfigError(
            "rollout.engine=vllm but vLLM is not installed in this environment (a local "
            "cluster's workers run in it): run from the vLLM environment (.ci/vllm-env "
            'makes .venv-vllm; docs/engines.md, "The vLLM engine"), or set '
            "rollout.engine=torch"
        )


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


class RunAborted(LaminarError):
    """A run abandoned without an orderly stop (:meth:`RunHandle.abort`)."""


class RunHandle:
    """A run in progress on a Dask cluster; every method returns at once except ``wait``
    (and ``abort``, which writes ``summary.json``)."""

    _aborted: str | None = None  # (abort()'s reason)

    def __init__(self, cfg: RunConfig, client, run_dir: Path, resume=None) -> None:
        from pipelines.driver import schedule_class

        self.config = cfg
        self.client = client
        self.run_dir = run_dir = Path(run_dir)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        # Its setup done, the run began: a failure from then on is a failed run (with a
        # summary.json, unless that could not be written), not a failed start.
        self.training_began = False
        self._progress: dict = {"phase": "submitted"}
        self._stop = threading.Event()
        # (one summary.json at a time: the driver's, or an abort's)
        self._summary_lock = threading.Lock()
        self._done = threading.Event()
        # The directory's claim (prepare_run_dir's or prepare_resume's, or made here):
        # held, renewed, while the run goes; released when it ends.
        self._claim = _claim(run_dir, "start a run in")
        try:
            self._schedule = schedule_class(cfg.pipeline.schedule)(cfg, client, run_dir, resume)
        except BaseException:
            self._claim.release()
            raise
        self._claim.driving = True
        self._thread = threading.Thread(target=self._drive, name="laminar-driver", daemon=True)
        self._thread.start()

    def _set_progress(self, p: dict) -> None:
        self._progress = {**self._progress, **p}

    def _drive(self) -> None:
        from laminar.cluster import actors_made, release_actors
        from pipelines.data_module import resume_hint
        from pipelines.summary import summarize

        running = False  # set up: a failure from here on leaves a summary.json
        try:
            # Every actor the run starts (at the setup, and restarts or replacements in
            # the run) is released when it ends: none stays on the user's cluster, for
            # as long as the notebook keeps this handle.
            with actors_made() as made:
                try:
                    self._schedule.setup(self._set_progress, self._stop.is_set)
                except BaseException:  # (closed first: what holds files or threads)
                    release_actors(self.client, made)
                    made.clear()
                    raise
                running = self.training_began = True
                try:
                    raw = self._schedule.run(self._set_progress, self._stop.is_set)
                finally:  # (stopped and closed by the run's own shutdown)
                    release_actors(self.client, made, close=False)
            self.summary = summarize(self.run_dir, raw, self._schedule.sft_info, self.config)
            reason = str(self.summary["reason"])
            if reason.startswith("failed"):  # (stopped in order: wait() says so)
                self.error = RunFailed(
                    f"run {str(self.run_dir)!r} {reason}; it stopped in order and its "
                    "stores are intact (summary.json); fix the cause, then "
                    + resume_hint(self.run_dir, python=True),
                    self.summary,
                )
                self._set_progress({"phase": "failed", "error": reason})
            else:  # (the last figures, which the polling may have missed)
                done = {
                    "version": self.summary["versions"],
                    "updates": self.summary["updates"],
                    "trajectories": self.summary["trajectories"],
                    "reason": reason,
                }
                # (stopped early, by stop(), an interrupt or the walltime: not "done")
                phase = "stopped" if reason.startswith("stopped") else "done"
                self._set_progress({"phase": phase, **done})
        except BaseException as e:  # surfaced by wait(); never lost in a thread
            self.error = e
            if running and self.summary is None and not isinstance(e, RunStopped):
                self._summarize_failed(e)
            why = "".join(traceback.format_exception_only(e)).strip()
            phase = "stopped" if isinstance(e, RunStopped) else "failed"
            self._set_progress({"phase": phase, "error": why})
            logger.debug("run failed", exc_info=True)
        finally:
            try:
                self._claim.release()
            except OSError as e:  # (stale after LIVE_STALE_S all the same)
                logger.warning("cannot remove %s: %s", self.run_dir / LIVE_FILE, e)
            finally:
                self._done.set()

    def _summarize_failed(self, error: BaseException) -> None:
        """``summary.json`` from the stores, for a run whose driver failed: the reason
        stays on record, and tools that read it (``laminar bench --from-runs``, the
        audit) see a failed run, not one that may still be going."""
        from pipelines.summary import summarize_failed, write_summary

        with self._summary_lock:
            if self.summary is not None:  # (an abort's, written first)
                return
            try:
                start = self._schedule.start_records()
                summary = summarize_failed(self.run_dir, error, self.config, start)
                if self._aborted is not None:  # (its driver failed as the cluster closed)
                    summary["reason"] = self._aborted
                    write_summary(self.run_dir, summary)
                self.summary = summary
            except Exception as e:  # noqa: BLE001 — the error that failed the run stands
                why = f"{type(e).__name__}: {e}"
                logger.warning("%s: no summary.json written (%s)", self.run_dir, why)

    def abort(self, reason: str) -> None:
        """Record that the run is abandoned without an orderly stop (``laminar run``'s
        second Ctrl-C; the cluster is closed under it next): its ``summary.json`` says
        ``reason`` (``"aborted: …"``, with what continues the run) over what the stores
        hold, as a failed driver's does (``driver_failed``: no actor's figures), rather
        than an earlier start's summary standing for this one, or "failed: the Dask
        client is closed" once its driver trips on the closed cluster. Returns once it is
        written; during the setup (no run yet) it only stops the run."""
        self._aborted = reason
        self._stop.set()
        if self.training_began:
            self._summarize_failed(RunAborted(reason))

    def __fspath__(self) -> str:
        """The run directory: ``open_run(handle)``, ``open_metrics(handle, "cluster")``."""
        return str(self.run_dir)

    def progress(self) -> dict:
        """The latest progress: ``phase``; while training, ``updates`` (made, of
        ``steps``: ``trainer.steps``, the updates asked for), ``version`` (the weights'
        version number: a trainer restarted within the run skips the lost one's numbers,
        so it can pass ``steps``; the run ends at ``last_version``), ``reward``,
        ``gen_tok_s``, ``buffer_depth``, ``s_train_mean``, ``trajectories``. Once it has
        ended: ``phase`` ``"done"`` (completed), ``"stopped"`` (stopped early, in order:
        ``reason`` says how) or ``"failed"`` (``error``), with the summary's ``version``,
        ``updates`` and ``trajectories``; the other figures are the last ones polled."""
        return dict(self._progress)

    def done(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        """Ask the run to end: rollouts stop, the trainer checkpoints, the store is flushed.
        During its setup (the warm start included), it ends at once: ``wait`` raises
        :class:`~laminar.errors.RunStopped`, nothing having been stored."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends; returns the summary (also in ``RUN_DIR/summary.json``).
        A run that failed raises: :class:`~laminar.errors.RunFailed` (with its
        ``summary``) when it stopped in order on an error, else the error that ended it.

        An interrupt (a notebook's, or Ctrl-C) stops the run, as ``laminar run``'s first
        Ctrl-C does, and waits on for it to end in order, then raises
        :class:`RunInterrupted` (a ``KeyboardInterrupt``) with its ``summary``: a loop
        that waits on one run after another ends there. (One stopped during its setup
        raises :class:`~laminar.errors.RunStopped`, one that failed its error, as
        above.) A second interrupt returns at once, the run still stopping."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted: KeyboardInterrupt | None = None
        try:
            finished = self._done.wait(timeout)
        except KeyboardInterrupt as e:
            # (else the run would go on generating on the cluster, with nothing waiting
            # for it, beside whatever the notebook submits next)
            interrupted = e
            self.stop()
            logger.warning(
                "stopping the run in %s: finishing the current update and flushing the "
                "store (interrupt again to stop waiting; it still stops)",
                self.run_dir,
            )
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            finished = self._done.wait(left)
        if not finished:
            if interrupted is not None:
                raise RunInterrupted(
                    f"run {str(self.run_dir)!r} interrupted, still stopping after {timeout} s",
                    None,
                ) from interrupted
            raise TimeoutError(f"run {str(self.run_dir)!r} still going after {timeout} s")
        if self.error is not None:
            if isinstance(self.error, LaminarError):
                raise self.error
            raise LaminarError(f"run {str(self.run_dir)!r} failed: {self.error!r}") from self.error
        assert self.summary is not None
        if interrupted is not None:
            from pipelines.data_module import resume_hint

            raise RunInterrupted(
                f"run {str(self.run_dir)!r} interrupted: it stopped in order "
                f"({self.summary['reason']}, version {self.summary['versions']}); "
                + resume_hint(self.run_dir, python=True),
                self.summary,
            ) from interrupted
        return self.summary


def submit(
    config: RunConfig | dict | str | Path,
    client,
    *,
    overrides: list[str] | tuple[str, ...] | None = (),
    run_dir: str | Path | None = None,
) -> RunHandle:
    """Start a run on ``client``'s cluster and return its handle without blocking.

    The cluster's workers must advertise the role resources (``data``, ``trainer``,
    ``rollout``; ``relay`` when ``relay.relays`` is set);
    :func:`laminar.deploy.open_cluster` starts or finds such a cluster. Workers still
    joining (queued Slurm jobs) are waited for up to ``cluster.placement_timeout_s``.
    """
    from laminar.deploy import role_needs, wait_for_roles

    cfg = absolute_paths(resolve_config(config, overrides))
    preflight(cfg)
    check_run_dir(cfg, run_dir)  # (before the wait below: a taken one is told at once)
    # Placement errors (a cluster without role resources) surface here, not in wait().
    wait_for_roles(client, role_needs(cfg), cfg.cluster.placement_timeout_s)
    warn_if_shared(client)
    path = prepare_run_dir(cfg, run_dir)
    return RunHandle(cfg, client, path)


class SharedClusterWarning(UserWarning):
    """The cluster a run is submitted to already holds another run."""


def warn_if_shared(client) -> list[str]:
    """Warn when ``client``'s cluster already holds another run's trainer (a run still
    going, from this notebook or another): the two share the role workers, and the new
    one's tasks on the trainer's worker (its warm start, its trainer) wait for the
    first, while its progress says only "warm-start". Returns the trainers' keys."""
    import warnings

    def trainers(dask_scheduler) -> list[str]:
        return [
            str(ts.key)
            for ts in dask_scheduler.tasks.values()
            if ts.actor and ts.state == "memory" and str(ts.key).startswith("Trainer-")
        ]

    try:
        found = client.run_on_scheduler(trainers)
    except Exception:  # noqa: BLE001 — a scheduler that refuses it: nothing to say
        return []
    if found:
        warnings.warn(
            f"this cluster already holds another run (its trainer actor {found[0]}): "
            "runs on one cluster share its role workers, and this one waits for the "
            "other where they meet (its progress shows 'warm-start' meanwhile); give "
            "each run its own cluster (laminar.deploy.open_cluster), or wait for the "
            "other to end",
            SharedClusterWarning,
            stacklevel=3,
        )
    return found


def prepare_resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """The config, resume plan and run directory to continue ``run_dir`` in place: its
    own ``config.yaml`` with ``overrides``, from its newest checkpoint. Refuses, naming
    the fix, when there is nothing to continue from."""
    from laminar.learner import (
        checkpoint_skipped_versions,
        checkpoint_version,
        newest_checkpoint,
    )
    from storage.metrics import check_metrics_store

    path = Path(run_dir).expanduser().resolve()
    config = path / "config.yaml"
    if not path.is_dir():
        raise ConfigError(
            f"cannot resume {str(path)!r}: "
            + ("it is a file" if path.exists() else "it does not exist")
            + "; give a run directory (the one `laminar run` printed as 'run dir')"
        )
    _refuse_if_running(path, "resume")
    if not config.exists():
        held = [n for n in ("checkpoints", "trajectories.zarr") if (path / n).exists()]
        if held:  # (a run's, its config.yaml deleted or lost in a copy)
            newest = newest_checkpoint(path)
            raise ConfigError(
                f"cannot resume {str(path)!r}: it holds a run ({', '.join(held)}) but its "
                "config.yaml is gone; restore config.yaml from a copy of the run directory "
                "(the run wrote it as it started, with every setting), then resume"
                + (
                    "; or start a new run from its newest checkpoint: laminar run "
                    f"CONFIG --run-dir NEW_DIR {_setting(f'trainer.resume_from={newest}')}"
                    if newest is not None
                    else ""
                )
            )
        raise ConfigError(
            f"cannot resume {str(path)!r}: it has no config.yaml, so it is not a run "
            "directory written by `laminar run`"
        )
    ckpt = newest_checkpoint(path)
    if ckpt is None:
        from pipelines.data_module import resume_hint

        # (its own directory refuses a new run once the run stored anything: the new
        # run goes in another)
        raise ConfigError(f"cannot resume {str(path)!r}; {resume_hint(path)}")
    for key, value in parse_overrides(overrides):
        if key == "run_dir" and (value is None or Path(str(value)).expanduser().resolve() != path):
            raise ConfigError(
                f"cannot resume {str(path)!r} with run_dir={value}: a resume continues "
                "the run in its own directory (as --resume refuses --run-dir); drop that "
                "override, or start a new run in another directory from its checkpoint: "
                f"laminar run {str(config)!r} --run-dir NEW_DIR "
                + _setting(f"trainer.resume_from={ckpt}")
            )
    ran = load_config(config)
    # (the run's relative paths, of a run from before laminar recorded them absolute,
    # found where it read them; task.prompt_file's below, with its bytes checked)
    asked = load_config(config, overrides)
    if any(key == "trainer.resume_from" for key, _ in parse_overrides(overrides)):
        _refuse_resume_from(path, ran, asked, ckpt)
    cfg = _paths_found(path, ran, asked)
    # (null, unless it began from another run: recorded as found, with no --set of it)
    own = ran.trainer.resume_from
    if asked.trainer.resume_from == own:
        own = cfg.trainer.resume_from
    # (set, not --set: a path is not YAML; "runs/exp #2" would lose its " #2")
    trainer = cfg.trainer.model_copy(update={"resume_from": str(ckpt)})
    cfg = cfg.model_copy(update={"trainer": trainer, "run_dir": str(path)})
    if cfg.pipeline.schedule != "laminar":
        asked = (
            f" and --set pipeline.schedule={cfg.pipeline.schedule!r} was given"
            if cfg.pipeline.schedule != ran.pipeline.schedule
            else ""
        )
        raise ConfigError(
            f"cannot resume {str(path)!r} in place: it ran pipeline.schedule="
            f"{ran.pipeline.schedule!r}{asked}, and resuming in place is built for the "
            "laminar schedule; "
            + ("drop that --set, or " if asked and ran.pipeline.schedule == "laminar" else "")
            + "start a new run from its checkpoint: "
            + _new_run(path, ckpt, [f"pipeline.schedule={cfg.pipeline.schedule}"] if asked else [])
        )
    fingerprint = path / PROMPT_FINGERPRINT
    moved = fingerprint.exists()
    # A prompt file moved, or named from elsewhere: its bytes are checked below, where
    # the run recorded them (a run from before it did takes the file on trust). The
    # synthetic task's fields mean nothing beside a file.
    both_files = bool(ran.task.prompt_file and cfg.task.prompt_file)
    unused = {"task.prompt_file", *SYNTHETIC_FIELDS} if both_files else set()
    changed = [
        key for key in PROMPT_FIELDS if _field(cfg, key) != _field(ran, key) and key not in unused
    ]
    if changed:
        raise ConfigError(
            _cannot_resume_with(path, changed, cfg, ran)
            + ", and its stores hold groups of the prompts those made (a resume completes "
            "them by prompt key); drop that --set (override), or train on other data in a "
            "new run from its checkpoint: "
            + _new_run(path, ckpt, [_assignment(cfg, key) for key in changed])
        )
    _refuse_logprob_change(path, ran, cfg, ckpt)
    recorded = _recorded_digest(fingerprint) if moved else None
    cfg, digest = _prompt_file_found(path, ran, cfg, recorded, ckpt)
    now = None if digest is None else f"{digest}  {cfg.task.prompt_file}\n"
    version = checkpoint_version(ckpt)
    # (updates made: a trainer restarted within the run skips version numbers)
    made = version - (checkpoint_skipped_versions(ckpt) or 0)
    if cfg.trainer.steps <= made:
        raise ConfigError(
            f"cannot resume {str(path)!r}: its checkpoint is at version {version}, "
            f"{made} updates made, and trainer.steps={cfg.trainer.steps}; ask for more, "
            f"e.g. {_setting(f'trainer.steps={made + cfg.trainer.steps}')}"
        )
    preflight(cfg)
    check_metrics_store(path)  # (damaged: refused now, not by the writer on the cluster)
    plan = _plan(path, version, ckpt)
    # config.yaml takes the overrides but not this resume's checkpoint: it still repeats
    # the whole run (each resume finds its newest checkpoint itself).
    trainer = cfg.trainer.model_copy(update={"resume_from": own})
    text = cfg.model_copy(update={"trainer": trainer}).to_yaml()
    # (a run from before fingerprints gets one now: later resumes are checked against it)
    files = {config: text, **({fingerprint: now} if now is not None and not moved else {})}
    _write_claimed(path, "resume", files)
    return cfg, plan, path


def _cannot_resume_with(path: Path, changed: list[str], cfg: RunConfig, ran: RunConfig) -> str:
    """The start of a refused resume's message: the ``changed`` settings, as asked
    (``cfg``) and as the run ran them (``ran``)."""
    asked = ", ".join(f"{k}={_field(cfg, k)!r}" for k in changed)
    before = ", ".join(f"{k}={_field(ran, k)!r}" for k in changed)
    return f"cannot resume {str(path)!r} with {asked}: it ran {before}"


def _new_run(path: Path, ckpt: Path | str, sets: Sequence[str] = ()) -> str:
    """The command (and the Python API's overrides) that continues the run in ``path``
    in a new run from its checkpoint ``ckpt``, with the settings ``sets``
    (``key=value``): what a refused resume in place offers instead (``--resume`` takes
    no ``trainer.resume_from``)."""
    import shlex

    fields = [f"trainer.resume_from={ckpt}", *sets]
    config = shlex.quote(str(path / "config.yaml"))
    cli = " ".join(f"--set {shlex.quote(f)}" for f in fields)
    python = ", ".join(map(repr, fields))
    return f"`laminar run {config} --run-dir NEW_DIR {cli}` (from Python: overrides=[{python}])"


def _assignment(cfg: RunConfig, key: str) -> str:
    """``key=value`` of ``cfg``'s ``key``, as ``--set`` takes it back (None: ``null``)."""
    value = _field(cfg, key)
    return f"{key}={'null' if value is None else value}"


def _refuse_resume_from(path: Path, ran: RunConfig, asked: RunConfig, ckpt: Path) -> None:
    """Refuse a resume in place with ``trainer.resume_from`` set to another checkpoint
    than the run began from: the resume takes the run's newest checkpoint, and the
    setting was silently ignored (recorded as the run's own)."""
    given, own = asked.trainer.resume_from, ran.trainer.resume_from
    if given == own or (
        given is not None and own is not None and Path(given).resolve() == Path(own).resolve()
    ):
        return
    raise ConfigError(
        f"cannot resume {str(path)!r} with trainer.resume_from={given}: a resume in place "
        f"continues from the run's newest checkpoint ({ckpt.name}) and takes no "
        "trainer.resume_from; drop that --set (override); to roll back to an earlier "
        "checkpoint of the run, move the later checkpoints/version-* folders aside first, "
        "renaming them (e.g. to version-000014.aside: the resume takes the newest "
        "version-<digits> folder), or start a new run from that checkpoint, which reads "
        f"nothing of this store: {_new_run(path, given)}"
    )


def _refuse_logprob_change(path: Path, ran: RunConfig, cfg: RunConfig, ckpt: Path) -> None:
    """Refuse a resume in place with another :data:`LOGPROB_FIELDS` value: the behavior
    logprobs of the groups its store holds untrained (held again by the buffer) and of
    the partial responses it finishes are of the old temperature's distribution, and the
    trainer would take its own at the new one: every such token's ratio off, silently.
    A new run from the checkpoint reads nothing of this store: every trajectory it
    trains is sampled at the new value."""
    changed = [key for key in LOGPROB_FIELDS if _field(cfg, key) != _field(ran, key)]
    if not changed:
        return
    raise ConfigError(
        _cannot_resume_with(path, changed, cfg, ran)
        + ", and the behavior logprobs its stores hold for the groups not yet trained (held "
        "again by a resume) and for the partial responses it finishes are of that "
        "distribution, while the trainer would take its own at the new value: their "
        "importance ratios would be wrong; drop that --set (override), or change it in a "
        "new run from its checkpoint, which restores the weights, optimizer and prompt "
        "order and reads nothing of this store (what it holds untrained is left out): "
        + _new_run(path, ckpt, [f"{k}={_field(cfg, k)}" for k in changed])
    )


def _plan(path: Path, version: int, ckpt: Path):
    """The resume plan of the run in ``path`` from its checkpoint ``ckpt`` at
    ``version``, once what the resume reads of its store is known to read
    (:func:`storage.trajectories.check_resumable`): damage is refused here, naming the
    array and its chunk, not by the buffer after the cluster has started."""
    import shlex

    from storage.resume import plan_resume
    from storage.trajectories import StoreError, check_resumable

    try:
        try:
            plan = plan_resume(path, version)
        except StoreError:
            check_resumable(path)  # (names the array and its chunk, where that is it)
            raise
        check_resumable(path, plan.readmit)
    except StoreError as e:
        setting = shlex.quote(f"trainer.resume_from={ckpt}")
        config = shlex.quote(str(path / "config.yaml"))
        raise StoreError(
            f"cannot resume {str(path)!r}: {e}; or, with no copy, continue in a new run "
            "from its checkpoint, which reads nothing of this store (what it holds "
            f"untrained is left out): `laminar run {config} --run-dir NEW_DIR --set "
            f"{setting}`"
        ) from e
    return plan


def _recorded_digest(fingerprint: Path) -> str:
    """The sha256 that ``fingerprint`` (``PROMPT_FINGERPRINT``) records."""
    try:
        digest = fingerprint.read_text().split()[0]
    except (OSError, ValueError, IndexError):  # (ValueError: not UTF-8 text)
        digest = ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError(
            f"cannot resume {str(fingerprint.parent)!r}: its {PROMPT_FINGERPRINT} does not "
            "read as the sha256 of task.prompt_file (sha256sum's format: the digest, two "
            "spaces, the path); it is damaged: restore it from a copy, or delete it to take "
            "the prompt file on trust (the resume records it again)"
        )
    return digest


def _started_in(path: Path, ran: RunConfig) -> str | None:
    """The working directory the run in ``path`` was started from, when its
    ``config.yaml`` records ``run_dir`` relative to it (a run started before laminar
    recorded absolute paths, and not resumed since); None: unknown."""
    given = ran.run_dir
    if not given or os.path.isabs(given):
        return None
    parts = Path(os.path.normpath(given)).parts
    if not parts or ".." in parts:
        return None
    if path.parts[-len(parts) :] != parts:  # (moved since, or renamed)
        return None
    return str(Path(*path.parts[: -len(parts)]))


def _tried(path: Path, ran: RunConfig, key: str, given: str) -> list[tuple[str, str]]:
    """Where a resume of the run in ``path`` looks for ``given``, path field ``key``'s
    value, each with why there: a relative one of the run's ``config.yaml`` (a run
    started before laminar recorded absolute paths) where the run started
    (:func:`_started_in`), then in this working directory; one given now (an
    override), in this working directory; an absolute one, as it is."""
    from_config = given == _field(ran, key)
    if given.startswith("~"):  # (as given: read where it is read, ~ that machine's home)
        return [(given, "~ as this user's home")]
    if os.path.isabs(given):
        return [(given, "as config.yaml records it" if from_config else "as given")]
    tried: list[tuple[str, str]] = []
    start = _started_in(path, ran) if from_config else None
    if start is not None:
        tried.append((os.path.join(start, given), "where the run was started"))
    tried.append((os.path.abspath(given), "from this working directory"))
    return list(dict(tried).items())


def _not_found(
    path: Path, ran: RunConfig, key: str, given: str, tried: list[tuple[str, str]], what=""
) -> ConfigError:
    """A resume of the run in ``path`` refused: path field ``key``'s ``given`` is in none
    of the places ``tried``; ``what`` says more of what it must hold."""
    kind = "file" if key == "task.prompt_file" else "folder"
    named = ", ".join(f"{p!r} ({why})" for p, why in tried)
    return ConfigError(
        f"cannot resume {str(path)!r}: {key} {given!r} is not a {kind}: tried {named}; "
        f"give the path of the {kind} the run read{what}, e.g. "
        + _setting(f"{key}=/path/to/{Path(given).name}")
        + (
            ", or resume from the directory the run was started in"
            if given == _field(ran, key) and not os.path.isabs(given)
            else ""
        )
    )


def _paths_found(path: Path, ran: RunConfig, cfg: RunConfig) -> RunConfig:
    """``cfg`` with its path fields but ``task.prompt_file`` (:func:`_prompt_file_found`)
    found as the run read them (:func:`_tried`) and made absolute. ``model.path`` found
    nowhere is refused, naming the places tried; ``trainer.resume_from`` found nowhere
    is kept as given (a record: a resume reads its own checkpoint); another path found
    nowhere is taken where it was looked for first (a folder the run makes,
    ``sft.cache_dir``; a file that is checked where it is read, and named there)."""
    for key in PATH_FIELDS:
        given = _field(cfg, key)
        if key == "task.prompt_file" or not _is_path(key, given):
            continue
        tried = _tried(path, ran, key, given)
        found = [p for p, _ in tried if os.path.exists(p)]
        if not found and key == "model.path":
            raise _not_found(path, ran, key, given, tried, " (a local HF folder)")
        if found or key != "trainer.resume_from":
            cfg = _with(cfg, key, os.path.abspath((found or [tried[0][0]])[0]))
    return cfg


def _prompt_file_found(
    path: Path, ran: RunConfig, cfg: RunConfig, recorded: str | None, ckpt: Path
) -> tuple[RunConfig, str | None]:
    """``cfg`` with its ``task.prompt_file`` found and made absolute, and the file's
    sha256 (None: no prompt file). A relative path is looked for as the run read it: one
    of the run's ``config.yaml`` (a run started before laminar recorded absolute paths)
    where the run started (:func:`_started_in`), then in this working directory; one
    given now (an override), in this working directory. Of the files found, the first
    whose bytes are those the run began with (``recorded``; None: not recorded, the
    first found). Refuses, naming the field, every path tried and the fix, when none is
    there or none holds those bytes."""
    given = cfg.task.prompt_file
    if not given:
        return cfg, None
    tried = _tried(path, ran, "task.prompt_file", given)
    bytes_ = f"sha256 {recorded}, as {PROMPT_FINGERPRINT} in the run directory records"
    found = [p for p, _ in tried if os.path.isfile(p)]
    if not found:
        raise _not_found(
            path,
            ran,
            "task.prompt_file",
            given,
            tried,
            (f" (its bytes: {bytes_})" if recorded else ""),
        )
    digests = {p: _sha256(p) for p in found}
    match = next((p for p in found if recorded is None or digests[p] == recorded), None)
    if match is None:
        read = "; ".join(
            f"{p!r} ({why}) has sha256 {digests[p]}" for p, why in tried if p in digests
        )
        raise ConfigError(
            f"cannot resume {str(path)!r}: task.prompt_file {given!r} is not what the run "
            f"began with (its bytes changed since: {read}; it began with {bytes_}), "
            "and the stores hold groups of its prompts by key; put the run's file back (or "
            "give its copy's path: "
            + _setting(f"task.prompt_file=/path/to/{Path(given).name}")
            + "), or train on the new one in a new run from its checkpoint: "
            + _setting(f"trainer.resume_from={ckpt}")
        )
    task = cfg.task.model_copy(update={"prompt_file": os.path.abspath(match)})
    return cfg.model_copy(update={"task": task}), digests[match]


def _setting(field: str) -> str:
    """How to set ``field`` (``key=value``) from either door: the CLI's ``--set`` and
    the Python API's ``overrides``."""
    return f"--set {field} (from Python: overrides=[{field!r}])"


def resume(
    run_dir: str | Path, client, *, overrides: list[str] | tuple[str, ...] | None = ()
) -> RunHandle:
    """Continue a stopped or lost run in its own directory, from its newest checkpoint.

    The trainer restarts from the checkpoint (weights, optimizer, RNG, version); the
    buffer holds again the whole groups the store has that the checkpoint did not train
    (:mod:`storage.resume`); the prompt order goes on; every store is appended to.
    ``overrides`` change its ``config.yaml`` (e.g. ``trainer.steps``).
    """
    from laminar.deploy import role_needs, wait_for_roles

    cfg, plan, path = prepare_resume(run_dir, overrides)
    try:
        wait_for_roles(client, role_needs(cfg), cfg.cluster.placement_timeout_s)
        warn_if_shared(client)
    except BaseException:  # (the directory is free again for a resume from elsewhere)
        claim(path).release()
        raise
    return RunHandle(cfg, client, path, resume=plan)
