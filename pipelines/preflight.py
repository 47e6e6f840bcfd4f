"""Checks a run's config can start before any cluster is asked for anything: the
reward's module imports, the model and tokenizer load and cover the prompts, the engine
and its memory fit (:func:`preflight`; :func:`pipelines.submit` and ``laminar run`` call it)."""

from __future__ import annotations

import logging
import threading

from laminar.config import RunConfig
from laminar.errors import ConfigError

logger = logging.getLogger("laminar")


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
