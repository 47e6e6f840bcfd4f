"""The run's prompts: loaded (a JSONL file, or the synthetic task), encoded and checked
against the rollout's lengths and the model's vocabulary; their answers checked for the
warm start (``sft``) and for a reward that compares whole answers.

Apart from :mod:`laminar.prompt_pool` (what is handed out, and when): these checks run
before any cluster work too (``preflight``), and the warm start encodes with them.
"""

from __future__ import annotations

import hashlib
import json

from laminar.config import RunConfig
from laminar.errors import DataError
from laminar.tasks import Prompt, jsonl_prompts, synthetic_prompts


def load_prompts(cfg: RunConfig) -> list[Prompt]:
    """The run's prompts: the JSONL file if one is named, else the synthetic task."""
    t = cfg.task
    if t.prompt_file:
        return jsonl_prompts(t.prompt_file)
    return synthetic_prompts(
        t.name,
        size=t.num_prompts,
        median_len=t.median_len,
        tail_ratio=t.tail_ratio,
        max_len=t.max_len,
        seed=cfg.seed + 1,
        length_share=t.length_share,
    )


def prompts_digest(prompts: list[Prompt]) -> str:
    """sha256 of the prompts and their answers, in order (as JSON: rows joined by
    separators a text may hold would hash alike); the warm start's cache key takes the
    same digest (:func:`laminar.sft.warm_start`)."""
    return hashlib.sha256(json.dumps([[p.text, p.answer] for p in prompts]).encode()).hexdigest()


def prompt_order(prompts: list[Prompt], seed: int) -> dict:
    """What a run's prompt order is made of (:class:`laminar.prompt_pool.PromptPoolCore`:
    the prompts, by their place in the file, shuffled by ``seed``): recorded beside the
    position in each checkpoint (``data_state.json``), so that a new run from it
    (``trainer.resume_from``) continues that order only on the same prompts. Not the
    prompt file's path: the same prompts at another path are the same order."""
    return {"prompts": len(prompts), "sha256": prompts_digest(prompts), "seed": seed}


def order_differs(recorded: dict, now: dict) -> str | None:
    """What differs between two :func:`prompt_order` records, in words (``None``: the
    same order).

    >>> old = {"prompts": 400, "sha256": "a", "seed": 0}
    >>> order_differs(old, {"prompts": 500, "sha256": "b", "seed": 1})
    'seed 0, now 1; 400 prompts, now 500'
    >>> order_differs(old, {"prompts": 400, "sha256": "b", "seed": 0})
    'the same number of prompts (400), but their text or answers differ'
    """
    if recorded == now:
        return None
    said = []
    if recorded.get("seed") != now.get("seed"):
        said.append(f"seed {recorded.get('seed')!r}, now {now.get('seed')!r}")
    if recorded.get("prompts") != now.get("prompts"):
        said.append(f"{recorded.get('prompts')!r} prompts, now {now.get('prompts')!r}")
    elif recorded.get("sha256") != now.get("sha256"):
        said.append(
            f"the same number of prompts ({now.get('prompts')}), but their text or answers differ"
        )
    return "; ".join(said) or f"recorded {recorded!r}, now {now!r}"


def _words(words: list[str]) -> str:
    """A vocabulary, short: its runs of integers as ranges, then the other words.

    >>> _words(["b", "2", "0", "1", "a", "7"])
    '0..2 7 a b'
    """
    ints = sorted(int(w) for w in words if w.isdigit() and str(int(w)) == w)
    runs: list[list[int]] = []
    for i in ints:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    numbers = [f"{a}..{b}" if b > a else str(a) for a, b in runs]
    others = sorted(w for w in words if not (w.isdigit() and str(int(w)) == w))
    return " ".join(numbers + others)


def _where(cfg: RunConfig):
    """How errors name a prompt: its file and line, or its task and number."""
    t = cfg.task
    if not t.prompt_file:
        return lambda p: f"task {t.name!r}, prompt {p.key}"
    return lambda p: (
        f"{t.prompt_file}:{p.line}"
        if p.line is not None
        else f"{t.prompt_file}, prompt {p.key + 1}"  # (its n-th prompt, 1-based)
    )


def _unknown_token(tok) -> int | None:
    """The token an unknown symbol shows as, unless the tokenizer has none or uses a
    token it also places itself (GPT-2's family: unk = bos = <|endoftext|>)."""
    unk = tok.unk_token_id
    return None if unk in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) else unk


def _outside(tok, unk: int, text: str) -> str:
    """The words of ``text`` outside the vocabulary, and the vocabulary when short."""
    from laminar.model import encode_prompt

    unknown = [w for w in text.split() if unk in encode_prompt(tok, w)]
    known = [w for w in tok.get_vocab() if w not in tok.all_special_tokens]
    vocab = (  # (the built-in model's words; a real model's are too many to list)
        f"; its vocabulary: {_words(known)}" if len(known) <= 512 else ""
    )
    # (a control character, shown as it is, would print as nothing: escaped)
    shown = [w if w.isprintable() else ascii(w) for w in dict.fromkeys(unknown)]
    return f"({' '.join(shown) or '?'}){vocab}"


def encode_prompts(tok, prompts: list[Prompt], cfg: RunConfig) -> list[tuple[Prompt, tuple]]:
    """Each prompt with its token ids, after checking that it fits the rollout's sequence
    and the model's vocabulary (run before any cluster work too: ``preflight``; the
    answers: :func:`check_answers`)."""
    from laminar.model import encode_prompt

    where = _where(cfg)
    max_prompt = cfg.rollout.max_seq_len - cfg.rollout.max_new_tokens
    unk = _unknown_token(tok)
    encoded = []
    for p in prompts:
        ids = tuple(encode_prompt(tok, p.text))
        if len(ids) > max_prompt:
            raise DataError(
                f"{where(p)}: the prompt has {len(ids)} tokens, more than "
                f"rollout.max_seq_len - rollout.max_new_tokens = {max_prompt}; raise "
                "rollout.max_seq_len"
            )
        if unk is not None and unk in ids:
            raise DataError(
                f"{where(p)}: the prompt {p.text!r} has symbols outside the model's "
                f"vocabulary {_outside(tok, unk, p.text)}. Write prompts in the model's "
                "symbols, or set model.path to a model whose tokenizer has them"
            )
        encoded.append((p, ids))
    return encoded


def check_answers(tok, prompts: list[Prompt], cfg: RunConfig) -> dict[str, list[int]]:
    """When the warm start trains (``sft``), that it can encode every demonstration it
    may train on (a prompt file's: its answers) in the model's vocabulary; returns their
    token ids (demonstration -> ids: the warm start encodes them once). Answers are
    encoded nowhere else: a reward compares them as text."""
    from laminar.tasks import longest_demonstration

    unk = _unknown_token(tok)
    if not (cfg.sft.enabled and cfg.sft.steps) or unk is None or not prompts:
        return {}
    task = None if cfg.task.prompt_file else cfg.task.name
    where = _where(cfg)
    demos = [longest_demonstration(task, p) for p in prompts]
    encoded = tok(demos, add_special_tokens=False)["input_ids"]  # (one batched call)
    for p, demo, ids in zip(prompts, demos, encoded, strict=True):
        if unk in ids:
            raise DataError(
                f"{where(p)}: the answer {p.answer!r} has "
                f"symbols outside the model's vocabulary {_outside(tok, unk, demo)}, and "
                "the warm start trains on answers. Write them in the model's symbols, set "
                "model.path to a model whose tokenizer has them, or set sft.enabled=false"
            )
    return dict(zip(demos, encoded, strict=True))


def check_reward_answers(prompts: list[Prompt], cfg: RunConfig) -> None:
    """Under a built-in reward that reads its answer in a form of its own
    (``count_in_range``: ``"lo hi"``), that a prompt file's answers have it: else every
    reward of the run fails (each group discarded) and the run stops after a minute of
    generating for nothing. A :class:`DataError` naming the first that does not."""
    from laminar.rewards import length_band

    if cfg.task.reward != "count_in_range" or not cfg.task.prompt_file:
        return
    where = _where(cfg)
    for p in prompts:
        if length_band(p.answer) is None:
            raise DataError(
                f"{where(p)}: the answer {p.answer!r} is not 'lo hi', two integers "
                "0 <= lo <= hi, which task.reward=count_in_range scores against; write "
                "the answers so, or pick a reward that reads them (task.reward)"
            )


def unreachable_answers(tok, prompts: list[Prompt], cfg: RunConfig) -> str | None:
    """Under a reward that compares whole answers (``exact_match``), what to warn of when
    a prompt file's answers are too long for ``rollout.max_new_tokens`` (with the end of
    sequence after them): every response to such a prompt is cut off and scores
    ``task.truncated_reward``, so its groups teach nothing. ``None``: none is."""
    if not cfg.task.prompt_file or cfg.task.reward != "exact_match" or not prompts:
        return None
    limit = cfg.rollout.max_new_tokens
    encoded = tok([p.answer for p in prompts], add_special_tokens=False)["input_ids"]
    long = [(p, len(ids)) for p, ids in zip(prompts, encoded, strict=True) if len(ids) >= limit]
    if not long:
        return None
    (first, n), where = long[0], _where(cfg)
    return (
        f"{len(long)} of {len(prompts)} answers in {cfg.task.prompt_file} cannot be "
        f"generated within rollout.max_new_tokens={limit} (the first: {where(first)}, "
        f"{n} tokens, and the end of sequence after them): every response to them is cut "
        "off and scores task.truncated_reward, so their groups teach nothing; raise "
        "rollout.max_new_tokens (and rollout.max_seq_len), or leave those prompts out"
    )
