"""The supervised warm start, cached by a content hash of everything that shapes it.

GRPO from a chance-level policy has nothing to reinforce (``shared/notes/rl-tiny.md``),
so a run starts from a policy fine-tuned on task demonstrations. The demonstrations are
deliberately imperfect (``sft.demo_error_rate``): the policy learns the task's structure
but samples a mistake now and then, which leaves a middling reward for RL to raise.

The result is an HF folder under ``<cache>/sft-<hash>``; the hash covers the base model's
bytes, the prompts, the task (not its reward, nor a prompt file's path: its prompts are
hashed) and SFT config and the seed, so any change retrains and a rerun reuses it. The
warm start's reward is scored once per reward and sampling setting and kept beside the
weights (``sft_info.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from laminar.config import RunConfig
from laminar.errors import ConfigError, ModelError, RunStopped
from laminar.files import (
    ManifestMismatch,
    check_manifest,
    replace_text,
    sync_dir,
    sync_tree,
    write_manifest,
)
from laminar.model import (
    build_tiny_policy,
    build_tokenizer,
    check_policy_dir,
    encode_prompt,
    load_policy,
    load_tokenizer,
    tiny_config,
    weight_files,
)
from laminar.prompt_pool import check_answers, encode_prompts
from laminar.prompts import prompts_digest
from laminar.rewards import (
    OVERWHELMED_SHARE,
    OVERWHELMED_WINDOW_S,
    REWARD_FAILURE_WINDOW_S,
    REWARD_FAILURES_TO_STOP,
    REWARD_SHARE_WINDOW_S,
    fails_too_often,
    never_scores,
    past_share,
    timed_out,
)
from laminar.tasks import Prompt, demonstration, length_sigmas, longest_demonstration
from laminar.update import micro_batches, pack, response_logprobs

logger = logging.getLogger(__name__)

SFT_INFO = "sft_info.json"  # a cache entry's record: how it was trained, its scorings

# Bump when the SFT procedure changes, so cached results of the old one are not reused.
SFT_VERSION = 2
# In the key, a prompt file's path (its prompts are hashed, not where the file is).
PROMPT_FILE_KEY = "(a prompt file: its prompts)"
EVAL_PROMPTS = 256  # the warm-started policy's reward is measured on this many prompts
STOP_CHECK_STEPS = 5  # a stopped run's warm start ends within this many steps
SCORE_CHUNK = 16  # the warm start's responses scored at a time (checked between)
# A warm start's scoring still going after this long says how far it has got, at most
# once every SCORING_SAID_EVERY_S: a reward of 2 s a call kept it silent for 8.5 min
# (256 calls, one after another; said as warnings, the level the console is sent).
SCORING_SLOW_S = 20.0
SCORING_SAID_EVERY_S = 30.0
# The warm start's scoring gives up on a reward after this many calls cut at
# task.reward_timeout_s with no response scored (evaluate).
TIMEOUTS_TO_GIVE_UP = 3
SCORING = "scoring the warm start"  # (its reward's failures: laminar.rewards.never_scores)
# What the run does after a warm start whose reward failed so (a reward given up on here
# may be a service not up yet; the run's own rule stops it if it stays so).
GOES_ON = (
    f"; the run goes on, and its rollouts' reward failures stop it: on every response for "
    f"{REWARD_FAILURE_WINDOW_S:.0f} s (time for a reward service that starts late to come "
    f"up), on {OVERWHELMED_SHARE:.0%} or more of them over {OVERWHELMED_WINDOW_S:.0f} s once "
    "some have scored, or on more than task.reward_max_failure_share of them over "
    f"{REWARD_SHARE_WINDOW_S:.0f} s from the first score"
)


def cache_root(cfg: RunConfig) -> Path:
    root = cfg.sft.cache_dir or os.environ.get("LAMINAR_CACHE") or "~/.cache/laminar"
    return Path(root).expanduser()


def _cache_error(cfg: RunConfig, root: Path, e: OSError) -> ConfigError:
    """What to say when the cache folder cannot be made: which setting named it."""
    named = (
        "sft.cache_dir"
        if cfg.sft.cache_dir
        else "LAMINAR_CACHE (sft.cache_dir is unset)"
        if os.environ.get("LAMINAR_CACHE")
        else "the default (sft.cache_dir and LAMINAR_CACHE are unset)"
    )
    return ConfigError(
        f"the warm-start cache {str(root)!r}, from {named}, is not a folder this user can "
        f"make or write ({e.strerror or e}: {str(e.filename or root)!r}); set "
        "sft.cache_dir to one, on a file system every trainer worker sees"
    )


def check_cache_dir(cfg: RunConfig) -> None:
    """Before any cluster work: that the warm-start cache folder exists or can be made,
    when the run uses it (the built-in model is kept there, and so is a warm start), on
    a local cluster (elsewhere it may be on a file system only the workers mount). A
    cache that exists is not written to here: a read-only one holding the run's entries
    serves (:func:`warm_start`)."""
    if cfg.model.path and not (cfg.sft.enabled and cfg.sft.steps):
        return
    if cfg.cluster.kind != "local":  # (a file system the workers mount may not be here:
        return  # the warm start, on a worker, names the folder if it cannot be made)
    root = cache_root(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (a file where a folder must be, /proc, no permission)
        raise _cache_error(cfg, root, e) from None


def base_policy(cfg: RunConfig) -> Path:
    """The starting checkpoint: ``model.path``, or the built-in tiny Llama (cached)."""
    if cfg.model.path:
        return check_policy_dir(cfg.model.path)
    out = cache_root(cfg) / f"tiny-{cfg.fingerprint('model')}-seed{cfg.seed}"
    if (out / "config.json").exists():
        try:
            return check_policy_dir(out)
        except ModelError as e:  # (its message would say to point model.path elsewhere:
            _set_aside(out, cfg, e)  # the user never set it; it is built again)
    with _staged(out, cfg) as tmp:
        build_tiny_policy(tmp, **_tiny_shape(cfg), seed=cfg.seed)
    return out


def _tiny_shape(cfg: RunConfig) -> dict[str, int]:
    """The tiny Llama's shape from the ``model`` section."""
    m = cfg.model
    return dict(
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        intermediate_size=m.intermediate_size,
    )


def base_model_config(cfg: RunConfig):
    """The HF config of the model a run trains (``model.path``'s, or the tiny Llama's),
    without building it: what a checkpoint to resume from must match."""
    if cfg.model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(check_policy_dir(cfg.model.path), local_files_only=True)
    return tiny_config(**_tiny_shape(cfg))


def base_tokenizer(cfg: RunConfig):
    """The tokenizer of the model a run trains (``model.path``'s, or the tiny Llama's)."""
    if cfg.model.path:  # (as every user of the folder loads it: its eos, say)
        return load_tokenizer(cfg.model.path)
    return build_tokenizer()


def folder_hash(path: Path) -> str:
    """sha256 over the names and bytes of the files of an HF folder."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def warm_start(
    cfg: RunConfig, prompts: list[Prompt], should_stop: Callable[[], bool] | None = None
) -> tuple[Path, dict]:
    """Return the policy folder RL starts from, training it first unless cached.

    Runs where it is called (the pipeline submits it as a Dask task on the trainer worker).
    Returns the folder and ``{"cached": bool, "seconds": float, "final_loss": float,
    "eval_reward": float, ...}``; ``eval_reward`` is the warm start's mean reward under
    this run's reward and sampling (scored once per such :func:`_scoring`, then cached).
    ``should_stop`` is asked every :data:`STOP_CHECK_STEPS` steps of training: a stopped
    run's warm start raises :class:`~laminar.errors.RunStopped` and caches nothing.
    """
    base = base_policy(cfg)
    if not cfg.sft.enabled or cfg.sft.steps == 0:  # ("off": no warm start, none scored)
        return base, {"cached": True, "off": True, "seconds": 0.0, "final_loss": float("nan")}
    inputs = {
        "base": folder_hash(base),
        "sft": cfg.sft.model_dump(
            mode="json", exclude={"cache_dir", "torch_threads", "micro_batch_tokens"}
        ),
        # (not the reward: it scores the weights, :func:`_scoring`, and shapes nothing)
        "task": cfg.task.model_dump(
            mode="json",
            exclude={
                "reward",
                "truncated_reward",
                "reward_timeout_s",
                "reward_max_failure_share",
            },
        ),
        "prompts": prompts_digest(prompts),
        "seed": cfg.seed,
        "version": SFT_VERSION,
    }
    # A prompt file's path is not hashed, its prompts are ("prompts"): the same file at
    # another path, or named relative then absolute (a resume of a run from before
    # laminar recorded it absolute), warms the same entry.
    given = cfg.task.prompt_file
    if given:
        inputs["task"]["prompt_file"] = PROMPT_FILE_KEY
    out = cache_root(cfg) / _entry(inputs)
    if given and not out.exists():
        out = _adopt(out, inputs, given)
    scoring = _scoring(cfg)
    info = _cached_info(out, cfg)
    if info is not None:
        rewards = info.get("eval_rewards", {})
        if scoring not in rewards:  # the same weights, scored another way: score them
            model, tok = load_policy(out)
            rewards = {**rewards, scoring: evaluate(cfg, model, tok, prompts[-EVAL_PROMPTS:])}
            info["eval_rewards"] = rewards
            if not math.isfinite(rewards[scoring]):  # (nothing scored: not kept)
                return out, {**_public(info), "eval_reward": rewards[scoring], "cached": True}
            try:
                replace_text(out / SFT_INFO, json.dumps(info, indent=2))
            except OSError as e:  # a read-only cache: the score is not kept, the run goes on
                logger.warning("warm start: could not keep this scoring in %s (%s)", out, e)
        return out, {**_public(info), "eval_reward": rewards[scoring], "cached": True}
    torch.set_num_threads(cfg.sft.torch_threads)
    t0 = time.time()
    model, tok = load_policy(base)
    loss = _train(cfg, model, tok, prompts, should_stop)
    seconds = time.time() - t0
    info = {
        "cached": False,
        "seconds": seconds,
        "final_loss": loss,
        "base": str(base),
        "eval_prompts": min(EVAL_PROMPTS, len(prompts)),
        # the warm start's reward for each way of scoring it (reward and sampling)
        "eval_rewards": {},
    }
    with _staged(out, cfg) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # (each file's size and digest, but the info file: scorings are added to it)
        write_manifest(tmp, leave_out=(SFT_INFO,))
        (tmp / SFT_INFO).write_text(json.dumps(info, indent=2))
    # (the weights kept before they are scored: a run stopped meanwhile, or whose reward
    # failed on everything, is followed by one that scores them without training again;
    # a nan score is not kept, so that one scores them. Merged into the entry's file:
    # another run's copy may have been renamed in first.)
    reward = evaluate(cfg, model, tok, prompts[-EVAL_PROMPTS:])
    info["eval_rewards"] = {scoring: reward}
    if math.isfinite(reward):
        kept = _cached_info(out, cfg) or dict(info)
        kept["eval_rewards"] = {**kept.get("eval_rewards", {}), scoring: reward}
        replace_text(out / SFT_INFO, json.dumps(kept, indent=2))
    return out, {**_public(info), "eval_reward": info["eval_rewards"][scoring]}


def _entry(inputs: dict) -> str:
    """The cache entry's folder name for the warm start's ``inputs``."""
    key = json.dumps(inputs, sort_keys=True)
    return f"sft-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _adopt(out: Path, inputs: dict, given: str) -> Path:
    """The cache entry of a prompt file's warm start: ``out``, or one written before its
    path was left out of the key (:data:`PROMPT_FILE_KEY`) renamed to ``out``: the one
    keyed by the path as given (``task.prompt_file``, absolute since runs record it so),
    else by that path relative to this working directory (a run that named it relative,
    resumed from the directory it started in). In a cache this user cannot write, the
    old entry serves where it is."""
    names = {given, os.path.relpath(given)} if os.path.isabs(given) else {given}
    for name in sorted(names):
        old = out.parent / _entry({**inputs, "task": {**inputs["task"], "prompt_file": name}})
        if not (old / SFT_INFO).exists():
            continue
        try:
            os.rename(old, out)
        except OSError:  # (another run adopted it first; or read-only: served as it is)
            return out if out.exists() else old
        logger.info("warm start: cache entry %s renamed %s (keyed by prompts)", old, out)
        return out
    return out


def _cached_info(out: Path, cfg: RunConfig) -> dict | None:
    """The cache entry's ``sft_info.json``, or None when there is no entry. An entry that
    cannot be read (its info file truncated or missing: a crash, a full disk, someone's
    hand), or whose files differ from its manifest (a flipped bit in the weights, a file
    cut short: every run would start from weights no warm start made), is moved aside,
    not deleted, and trained again. An entry written before entries had a manifest is
    used unchecked."""
    if not out.exists():
        return None
    try:
        info = json.loads((out / SFT_INFO).read_text())
        if not isinstance(info, dict):
            raise ValueError(f"a JSON object expected, got {type(info).__name__}")
        # (the weights: model.safetensors, or saved sharded, the index and its shards)
        check_manifest(out, leave_out=(SFT_INFO,), require=weight_files(out))
        return info
    # (json.JSONDecodeError and UnicodeDecodeError too)
    except (OSError, ValueError, ManifestMismatch) as e:
        _set_aside(out, cfg, e)
        return None


def _set_aside(out: Path, cfg: RunConfig, e: Exception) -> None:
    """Move a cache entry that cannot be read as written aside (not deleted: kept for
    a look), for it to be made again. In a cache this user cannot write, a
    :class:`ConfigError` naming the entry and the setting, not a bare PermissionError."""
    try:
        # (a fresh empty folder, renamed over: two set aside in one second stay apart)
        aside = Path(tempfile.mkdtemp(prefix=f"{out.name}.unreadable-", dir=out.parent))
        with contextlib.suppress(FileNotFoundError):  # (another run moved it first)
            os.rename(out, aside)
    except OSError as moving:  # (a read-only cache: no permission, a read-only mount)
        raise ConfigError(
            f"the warm-start cache entry {str(out)!r} cannot be read as written ({e}), "
            f"and it cannot be moved aside to be made again: "
            f"{_cache_error(cfg, out.parent, moving)}; or delete the entry"
        ) from None
    logger.warning(
        "warm start: the cache entry %s cannot be read as written (%s); moved to %s, "
        "making it again (delete it once you no longer need it)",
        out,
        e,
        aside,
    )


def _public(info: dict) -> dict:
    """``sft_info.json`` as a run reports it: without the other scorings' rewards."""
    return {k: v for k, v in info.items() if k != "eval_rewards"}


def _scoring(cfg: RunConfig) -> str:
    """What :func:`evaluate` depends on beside the weights and prompts: the reward and
    how the rollouts sample. A run that changes only these reuses the cached weights."""
    r = cfg.rollout
    return json.dumps(
        {
            "reward": cfg.task.reward,
            "truncated_reward": cfg.task.truncated_reward,
            "sampling": dataclasses.asdict(r.sampling_params()),
            "max_seq_len": r.max_seq_len,
        },
        sort_keys=True,
    )


def evaluate(cfg: RunConfig, model, tok, prompts: list[Prompt]) -> float:
    """Mean reward of one sampled response per prompt, as the rollouts will sample them.

    Sampled by the torch engine, on this (the trainer's) worker: a model it does not
    compute (:func:`laminar.model.torch_engine_refusal`; ``rollout.engine=vllm`` runs
    it, and preflight refuses it for ``torch``) is not scored: nan, not kept."""
    from laminar.engine import GenerationRequest
    from laminar.rewards import score_batch
    from laminar.torch_engine import TorchEngine

    r = cfg.rollout
    try:
        engine = TorchEngine(
            model.config,
            model.state_dict(),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_batch=64,
            max_seq_len=r.max_seq_len,
            seed=cfg.seed,
        )
    except ModelError as e:
        if r.engine == "torch":  # (its rollouts could not run either: preflight says so)
            raise
        logger.warning(
            "warm start: its reward is nan (not kept in the cache): it is scored with "
            "the torch engine, which cannot generate from this model (%s); the run's "
            "rollouts (rollout.engine=%s) are not affected",
            e,
            r.engine,
        )
        return float("nan")
    params = r.sampling_params()
    for i, p in enumerate(prompts):
        engine.add_request(
            GenerationRequest(str(i), tuple(encode_prompt(tok, p.text)), params, {"p": p})
        )
    items = []
    while engine.has_work():
        for out in engine.step():
            items.append((out.text(tok), out.request.meta["p"].answer, out.ended))
    t = cfg.task
    rewards: list[float] = []
    scored, errors, timeouts, latest, t0 = 0, 0, 0, "", time.time()
    said = t0  # (when its progress was last said)

    def too_many() -> bool:  # (failed on every response, or on more than the share)
        never = errors >= REWARD_FAILURES_TO_STOP and not scored
        return never or past_share(errors, scored, t.reward_max_failure_share)

    # In chunks: a reward that fails on every response (hanging till its timeout, say)
    # is given up on by the run's rule (REWARD_FAILURES_TO_STOP, none scored), not after
    # every response. The score is then nan and the run goes on: its rollouts' failures
    # stop it by the same rule over REWARD_FAILURE_WINDOW_S, which lets a reward service
    # that starts late catch up (pipelines.driver_polls). So is one that fails on as many
    # and on more than task.reward_max_failure_share of the responses given to it: the
    # mean of those that scored is of a biased few (the run's rule over its window).
    # One at a time until a response has scored: a reward that hangs is given up on
    # after TIMEOUTS_TO_GIVE_UP calls cut at task.reward_timeout_s (each costs that
    # long: the rule above would wait 64 of them, 5 h 20 min at the default 300 s).
    i = 0
    while i < len(items):
        chunk = items[i : i + (SCORE_CHUNK if scored else 1)]
        i += len(chunk)
        scores = score_batch(t.reward, chunk, t.truncated_reward, t.reward_timeout_s)
        rewards += [s.reward for s in scores if s.error is None]
        scored += sum(
            1 for (_, _, ended), s in zip(chunk, scores, strict=True) if ended and not s.error
        )
        failed = [s.said for s in scores if s.error]
        errors, latest = errors + len(failed), failed[-1] if failed else latest
        cut = sum(1 for e in failed if timed_out(e))
        if cut and not timeouts:
            logger.warning(
                "warm start: task.reward %r did not return within task.reward_timeout_s=%g s "
                "(the call was cut; each such call costs that long); %s gives up on it after "
                "%d such calls with none scored",
                t.reward,
                t.reward_timeout_s,
                SCORING,
                TIMEOUTS_TO_GIVE_UP,
            )
        timeouts += cut
        if too_many() or (timeouts >= TIMEOUTS_TO_GIVE_UP and not scored):
            break
        now = time.time()
        if i < len(items) and now - t0 >= SCORING_SLOW_S and now - said >= SCORING_SAID_EVERY_S:
            said = now
            logger.warning(
                "warm start: scoring its policy with task.reward %r, %d of %d responses "
                "done in %.0f s (%.2f s a response, one after another; about %.0f s "
                "left); each run scores it once per reward and sampling (then kept in "
                "the cache); sft.enabled=false skips the warm start and this",
                t.reward,
                i,
                len(items),
                now - t0,
                (now - t0) / i,
                (now - t0) / i * (len(items) - i),
            )
    if timeouts >= TIMEOUTS_TO_GIVE_UP and not scored:
        logger.warning(
            "warm start: its reward is nan (not kept in the cache): task.reward %r did not "
            "return within task.reward_timeout_s=%g s on %d of the %d responses it was "
            "given and scored none, %s; given up on rather than wait for each of the %d "
            "responses (latest: %s); fix the function, or the service it calls, or raise "
            "task.reward_timeout_s if it is this slow%s",
            t.reward,
            t.reward_timeout_s,
            timeouts,
            errors,
            SCORING,
            len(items),
            latest,
            GOES_ON,
        )
        return float("nan")
    if errors and not scored:  # (the responses not cut off all failed: no score)
        logger.warning(
            "warm start: its reward is nan (not kept in the cache): %s%s",
            never_scores(t.reward, errors, time.time() - t0, latest, SCORING),
            GOES_ON,
        )
        return float("nan")
    if too_many():
        where = f"in {time.time() - t0:.0f} s, {SCORING}"
        logger.warning(
            "warm start: its reward is nan (not kept in the cache): %s%s",
            fails_too_often(t.reward, errors, scored, t.reward_max_failure_share, where, latest),
            GOES_ON,
        )
        return float("nan")
    return float(np.mean(rewards))


def _train(cfg: RunConfig, model, tok, prompts: list[Prompt], should_stop=None) -> float:
    s = cfg.sft
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    task = None if cfg.task.prompt_file else cfg.task.name
    own = length_sigmas(cfg.task.tail_ratio, cfg.task.length_share)[1]
    # demonstration text -> token ids (the pre-start check, again where the warm start
    # runs: answers in the model's vocabulary, named by file and line; prompts below)
    ids: dict[str, list[int]] = check_answers(tok, prompts, cfg)

    def encode(text: str) -> list[int]:
        if text not in ids:
            ids[text] = tok(text, add_special_tokens=False)["input_ids"]
        return ids[text]

    # Each draw's demonstration (count_range: a length drawn anew each time); for the
    # vocabulary check and the mistakes' alphabet, the longest one each prompt allows.
    def demo(p: Prompt) -> list[int]:
        return encode(demonstration(task, p, rng, own))

    examples = [
        (list(q), encode(longest_demonstration(task, p)))
        for p, q in encode_prompts(tok, prompts, cfg)
    ]
    # Mistakes are drawn from the symbols that answers use, so they look plausible.
    alphabet = np.unique(np.concatenate([np.asarray(a, dtype=np.int64) for _, a in examples]))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(s.steps):
        if should_stop is not None and step % STOP_CHECK_STEPS == 0 and should_stop():
            raise RunStopped(f"warm start stopped at step {step} of {s.steps} (sft.steps)")
        prompts_, answers = [], []
        for i in rng.integers(0, len(examples), s.batch_size):
            q = examples[i][0]
            a = np.asarray(demo(prompts[i]), dtype=np.int64)
            flip = rng.random(len(a)) < s.demo_error_rate
            a = np.where(flip, rng.choice(alphabet, size=len(a)), a)
            prompts_.append(np.asarray(q))
            answers.append(np.append(a, tok.eos_token_id))
        # Token-mean NLL of the answers over the whole batch, computed in length-sorted
        # micro-batches (long-tailed lengths would make one padded batch mostly padding).
        n_tokens = sum(len(a) for a in answers)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        lengths = [len(q) + len(a) for q, a in zip(prompts_, answers, strict=True)]
        for idx in micro_batches(lengths, s.micro_batch_tokens):
            ones = [np.ones(len(answers[i])) for i in idx]
            batch = pack(
                [prompts_[i] for i in idx], [answers[i] for i in idx], ones, ones, tok.pad_token_id
            )
            nll = -(response_logprobs(model, batch) * batch.response_mask).sum() / n_tokens
            nll.backward()
            total += float(nll.detach())
        opt.step()
        loss = total
    model.eval()
    return loss


@contextlib.contextmanager
def _staged(final: Path, cfg: RunConfig) -> Iterator[Path]:
    """Write a cache entry under a temporary name, then rename it into place (atomic on
    POSIX).

    Two runs warming the same cache entry at once both succeed; the later rename loses
    and its copy is dropped. A failure leaves nothing behind.
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    except OSError as e:  # (on a worker: say which setting, not only errno)
        raise _cache_error(cfg, final.parent, e) from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        sync_tree(tmp)
    except OSError as e:  # (the disk refused it: EIO, a quota; not another writer)
        shutil.rmtree(tmp, ignore_errors=True)
        raise _cache_error(cfg, final.parent, e) from None
    try:
        os.rename(tmp, final)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        sync_dir(final.parent)
    except OSError as e:
        raise _cache_error(cfg, final.parent, e) from None
