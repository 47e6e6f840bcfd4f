"""Prompt sources: a synthetic task family with long-tailed lengths, or a JSONL file.

The synthetic tasks turn a list of ``n`` random symbols into a verifiable answer. ``n`` is
lognormal, so response lengths are long-tailed like the paper's reasoning workloads:
``P99/median`` of ``n`` equals ``tail_ratio`` (default 10, as in the paper) before the cap.

=============  ===========================  ===================
task           prompt                       answer
=============  ===========================  ===================
``copy``       ``c 3 1 4 >``                ``3 1 4``
``reverse``    ``r 3 1 4 >``                ``4 1 3``
``sort``       ``s 3 1 4 >``                ``1 3 4``
=============  ===========================  ===================
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


def _copy(xs: list[str]) -> list[str]:
    return xs


def _reverse(xs: list[str]) -> list[str]:
    return xs[::-1]


def _sort(xs: list[str]) -> list[str]:
    return sorted(xs)


def _count(xs: list[str]) -> list[str]:
    return [str(i) for i in range(1, len(xs) + 1)]


TASKS: dict[str, tuple[str, Callable[[list[str]], list[str]]]] = {
    "count": ("n", _count),
    "copy": ("c", _copy),
    "reverse": ("r", _reverse),
    "sort": ("s", _sort),
}
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
    task: str, *, size: int, median_len: float, tail_ratio: float, max_len: int, seed: int
) -> list[Prompt]:
    """``size`` prompts of a synthetic ``task``; the same arguments give the same prompts."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    tag, fn = TASKS[task]
    rng = np.random.default_rng(seed)
    lengths = lognormal_lengths(
        rng, size, median=median_len, tail_ratio=tail_ratio, max_len=max_len
    )
    prompts = []
    for key, n in enumerate(lengths):
        xs = [SYMBOLS[i] for i in rng.integers(0, len(SYMBOLS), size=int(n))]
        shown = [str(n)] if task == "count" else xs
        prompts.append(Prompt(key=key, text=" ".join([tag, *shown, ">"]), answer=" ".join(fn(xs))))
    return prompts


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Read prompts from a JSONL file with ``prompt`` and ``answer`` fields on every line.

    Raises :class:`DataError` naming the file, the line and the missing field.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {str(path)!r} does not exist; set task.prompt_file")
    prompts = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object with prompt/answer")
            for field in ("prompt", "answer"):
                if not isinstance(row.get(field), str):
                    raise DataError(
                        f"{path}:{lineno}: field {field!r} is missing or not a string "
                        f"(got {row.get(field)!r}); every line needs "
                        '{"prompt": "...", "answer": "..."}'
                    )
            prompts.append(Prompt(key=len(prompts), text=row["prompt"], answer=row["answer"]))
    if not prompts:
        raise DataError(f"prompt file {str(path)!r} holds no prompts")
    return prompts


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
