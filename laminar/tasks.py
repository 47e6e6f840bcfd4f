"""Prompt sources: a synthetic task family with long-tailed lengths, or a JSONL file.

The synthetic tasks turn a list of ``n`` random symbols into a verifiable answer. ``n`` is
lognormal, so response lengths are long-tailed like the paper's reasoning workloads:
``P99/median`` of ``n`` equals ``tail_ratio`` (default 10, as in the paper) before the cap.

===============  ===========================  =============================
task             prompt                       answer
===============  ===========================  =============================
``count``        ``n 3 >``                    ``1 2 3``
``copy``         ``c 3 1 4 >``                ``3 1 4``
``reverse``      ``r 3 1 4 >``                ``4 1 3``
``sort``         ``s 3 1 4 >``                ``1 3 4``
``count_range``  ``b 2 5 >``                  any of ``1 2``, …, ``1 2 3 4 5``
===============  ===========================  =============================

In all but ``count_range`` a prompt has one right answer, so the responses to a prompt
have one target length. ``count_range`` has many, of different lengths: count from 1 to
any ``k`` in the band the prompt shows. Its demonstrations stop at a ``k`` drawn anew for
each one (:func:`demonstration`), so a policy warm-started on them samples a length per
response, and the 16 responses of a GRPO group differ in length as reasoning traces do.
Only part of the length varies from prompt to prompt (``length_share`` of its
log-variance, the shared cluster model's half); the rest varies within the group.
``Prompt.answer`` holds the band, ``"lo hi"``, which :func:`laminar.rewards.count_in_range`
checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from laminar.errors import DataError

T = TypeVar("T")

# How many standard deviations P99 lies above the median of a normal distribution.
_Z99 = 2.3263478740408408


@dataclass(frozen=True)
class Prompt:
    """One dataset row: a prompt text and the answer its reward function checks."""

    key: int
    text: str
    answer: str
    # count_range: the median of the demonstrations' lengths, the band's unrounded centre
    centre: float | None = None
    line: int | None = None  # a prompt file's: the line it is on (1-based), for errors


def _copy(xs: list[str]) -> list[str]:
    return xs


def _reverse(xs: list[str]) -> list[str]:
    return xs[::-1]


def _sort(xs: list[str]) -> list[str]:
    return sorted(xs)


def _count(xs: list[str]) -> list[str]:
    return [str(i) for i in range(1, len(xs) + 1)]


TASKS: dict[str, tuple[str, Callable[[list[str]], list[str]] | None]] = {
    "count": ("n", _count),
    "copy": ("c", _copy),
    "reverse": ("r", _reverse),
    "sort": ("s", _sort),
    "count_range": ("b", None),  # many right answers: see the module docstring
}
# count_range: the band reaches this many within-group standard deviations either side
# of its centre (a wider band would admit lengths the demonstrations almost never show).
BAND_SIGMAS = 2.5
SYMBOLS = tuple("0123456789")


def lognormal_lengths(
    rng: np.random.Generator, size: int, *, median: float, tail_ratio: float, max_len: int
) -> np.ndarray:
    """Integer lengths, lognormal with the given median and ``P99/median``, in ``[1, max_len]``.

    >>> rng = np.random.default_rng(0)
    >>> n = lognormal_lengths(rng, 20000, median=6, tail_ratio=10, max_len=1000)
    >>> bool(5 <= np.median(n) <= 7), bool(8 <= np.percentile(n, 99) / np.median(n) <= 12)
    (True, True)
    """
    sigma = math.log(tail_ratio) / _Z99 if tail_ratio > 1 else 0.0
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=size)
    return np.clip(np.rint(raw), 1, max_len).astype(np.int64)


def synthetic_prompts(
    task: str,
    *,
    size: int,
    median_len: float,
    tail_ratio: float,
    max_len: int,
    seed: int,
    length_share: float = 0.5,
) -> list[Prompt]:
    """``size`` prompts of a synthetic ``task``; the same arguments give the same prompts.

    ``length_share`` is used by ``count_range`` alone: the fraction of the answer
    length's log-variance that the prompt fixes (1: one length per prompt, like ``count``).
    """
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    tag, fn = TASKS[task]
    rng = np.random.default_rng(seed)
    if fn is None:
        return _count_range_prompts(rng, size, median_len, tail_ratio, max_len, length_share)
    lengths = lognormal_lengths(
        rng, size, median=median_len, tail_ratio=tail_ratio, max_len=max_len
    )
    prompts = []
    for key, n in enumerate(lengths):
        xs = [SYMBOLS[i] for i in rng.integers(0, len(SYMBOLS), size=int(n))]
        shown = [str(n)] if task == "count" else xs
        prompts.append(Prompt(key=key, text=" ".join([tag, *shown, ">"]), answer=" ".join(fn(xs))))
    return prompts


def length_sigmas(tail_ratio: float, length_share: float) -> tuple[float, float]:
    """The log-length standard deviations a prompt fixes and leaves to each response.

    >>> [round(x, 3) for x in length_sigmas(10, 0.5)]
    [0.7, 0.7]
    """
    sigma = math.log(tail_ratio) / _Z99 if tail_ratio > 1 else 0.0
    return sigma * math.sqrt(length_share), sigma * math.sqrt(1.0 - length_share)


def _count_range_prompts(rng, size, median_len, tail_ratio, max_len, length_share):
    if not 0.0 <= length_share <= 1.0:
        raise DataError(f"task.length_share={length_share!r}; must be within [0, 1]")
    shared, own = length_sigmas(tail_ratio, length_share)
    centre = np.exp(rng.normal(math.log(median_len), shared, size))
    lo = np.clip(np.rint(centre * math.exp(-BAND_SIGMAS * own)), 1, max_len).astype(int)
    hi = np.clip(np.rint(centre * math.exp(BAND_SIGMAS * own)), lo, max_len).astype(int)
    return [
        Prompt(key=key, text=f"b {a} {b} >", answer=f"{a} {b}", centre=c)
        for key, (a, b, c) in enumerate(zip(lo.tolist(), hi.tolist(), centre.tolist(), strict=True))
    ]


def demonstration(
    task: str | None, prompt: Prompt, rng: np.random.Generator, own_sigma: float
) -> str:
    """A demonstration answer to ``prompt`` of ``task`` (``None``: a prompt file's), for
    the supervised warm start.

    The one right answer for every task but ``count_range``, whose demonstrations count
    to a ``k`` drawn lognormally about the band's centre (``own_sigma``: the log standard
    deviation left to each response; the centre: ``prompt.centre``, else the band's
    geometric mean), clipped to the band.

    >>> p = Prompt(0, "b 2 8 >", "2 8")
    >>> rng = np.random.default_rng(0)
    >>> sorted({len(demonstration("count_range", p, rng, 0.5).split()) for _ in range(200)})
    [2, 3, 4, 5, 6, 7, 8]
    >>> demonstration("count", Prompt(1, "n 2 >", "1 2"), rng, 0.5)
    '1 2'
    """
    if task != "count_range":
        return prompt.answer
    lo, hi = (int(x) for x in prompt.answer.split())
    centre = prompt.centre if prompt.centre is not None else math.sqrt(lo * hi)
    k = round(math.exp(rng.normal(math.log(centre), own_sigma)))
    return _count_to(min(max(k, lo), hi))


def longest_demonstration(task: str | None, prompt: Prompt) -> str:
    """The longest answer :func:`demonstration` can give ``prompt`` (``count_range``: the
    count to the band's top), for checks that must cover every one.

    >>> longest_demonstration("count_range", Prompt(0, "b 2 4 >", "2 4"))
    '1 2 3 4'
    """
    if task != "count_range":
        return prompt.answer
    return _count_to(int(prompt.answer.split()[1]))


def _count_to(k: int) -> str:
    return " ".join(_count([""] * k))


_ONE_LINE = (  # what a prompt file's line must be: the fix for a line that is not
    'task.prompt_file takes JSONL: one JSON object per line, {"prompt": "...", '
    '"answer": "..."} (not a JSON array, nor an object spread over lines)'
)


def _cut(text: str, limit: int = 200) -> str:
    """``text`` for an error message, cut at ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Read prompts from a JSONL file with ``prompt`` and ``answer`` fields on every line.

    Raises :class:`DataError` naming the file, the line and the missing field. ``~`` is
    this machine's home.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(
            f"prompt file {str(path)!r} is a directory; set task.prompt_file to a JSONL file"
        )
    if not path.is_file():
        raise DataError(f"prompt file {str(path)!r} does not exist; set task.prompt_file")
    try:
        raw = path.read_bytes()
    except OSError as e:  # (no permission, a special file that cannot be read, ...)
        raise DataError(
            f"prompt file {str(path)!r} cannot be read ({type(e).__name__}: "
            f"{e.strerror or e}); set task.prompt_file to a JSONL file this user can read"
        ) from None
    try:  # (utf-8-sig: a byte order mark, as Windows tools write, is not part of line 1)
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{lineno}: not UTF-8 text (byte {e.start}: {e.reason}); "
            "task.prompt_file takes JSONL in UTF-8, one JSON object per line (save it as "
            "UTF-8, or decompress it first)"
        ) from None
    # (universal newlines, as a text-mode read has them: \r\n and a lone \r end a line)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    prompts = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_Row)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); {_ONE_LINE}") from None
        except ValueError as e:  # (an integer over Python's 4300-digit limit, in any field)
            raise DataError(
                f"{path}:{lineno}: a number too long to read ({_cut(str(e), 80)}); write "
                'very long numbers as strings ("123...")'
            ) from None
        except RecursionError:  # (arrays or objects nested about 1000 deep, in any field)
            raise DataError(
                f"{path}:{lineno}: JSON nested too deeply to read (arrays or objects inside "
                "each other about a thousand deep); nest less deeply, or drop the field"
            ) from None
        if not isinstance(row, dict):
            kind = {list: "a JSON array"}.get(type(row), f"a JSON {type(row).__name__}")
            raise DataError(f"{path}:{lineno}: {kind}, not an object; {_ONE_LINE}")
        for field in ("prompt", "answer"):
            if field in row.twice:  # (json keeps the last: the first would be lost unsaid)
                raise DataError(
                    f"{path}:{lineno}: field {field!r} appears twice; keep one prompt and "
                    "one answer on each line"
                )
            if not isinstance(row.get(field), str):
                raise DataError(
                    f"{path}:{lineno}: field {field!r} is missing or not a string "
                    f"(got {_cut(repr(row.get(field)))}); every line needs "
                    '{"prompt": "...", "answer": "..."}'
                )
            if not row[field].strip():
                raise DataError(
                    f"{path}:{lineno}: field {field!r} is empty; every line needs a prompt "
                    "and the answer its reward checks (and the warm start trains on)"
                )
            try:
                row[field].encode("utf-8")
            except UnicodeEncodeError as e:  # (no tokenizer takes it: say where, not later)
                raise DataError(
                    f"{path}:{lineno}: field {field!r} holds {row[field][e.start : e.end]!r}, "
                    "half of a UTF-16 surrogate pair (an escape such as \\ud800 without its "
                    "partner), which no tokenizer can encode; write the character itself, or "
                    "escape both halves of its pair"
                ) from None
        prompts.append(
            Prompt(key=len(prompts), text=row["prompt"], answer=row["answer"], line=lineno)
        )
    if not prompts:
        raise DataError(f"prompt file {str(path)!r} holds no prompts")
    return prompts


class _Row(dict):
    """A JSON object as :func:`json.loads` builds it, with the keys it met more than once
    (``twice``), which a plain dict would keep the last of without a word."""

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        super().__init__(pairs)
        self.twice: set[str] = set()
        if len(self) < len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                (self.twice if k in seen else seen).add(k)


def iter_epochs(items: Sequence[T], seed: int) -> Iterator[tuple[int, T]]:
    """Yield ``(epoch, item)`` forever, reshuffling the items each epoch.

    >>> import itertools
    >>> [e for e, _ in itertools.islice(iter_epochs("ab", 0), 5)]
    [0, 0, 1, 1, 2]
    """
    rng = np.random.default_rng(seed)
    epoch = 0
    while True:
        for i in rng.permutation(len(items)):
            yield epoch, items[i]
        epoch += 1
