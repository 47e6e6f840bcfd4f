"""Dynamic repack (paper §5, Algorithm 1): consolidate long-tail requests of one weight
version onto fewer rollouts, so the freed rollouts pull the newest weights and take new
prompts instead of decoding a handful of stragglers at a fraction of their batch.

This module is the pure planner: no Dask, no engines. :func:`plan` takes each rollout's
load and returns whole-rollout moves.

>>> loads = [
...     RolloutLoad("R1", 3, kv_used=0.12, kv_prev=0.20, n_requests=3),
...     RolloutLoad("R2", 3, kv_used=0.18, kv_prev=0.30, n_requests=4),
...     RolloutLoad("R3", 3, kv_used=0.25, kv_prev=0.40, n_requests=5),
... ]
>>> plan(loads, c_max=0.9, max_batch=16)
[Move(source='R1', destination='R3'), Move(source='R2', destination='R3')]

Rules (each is a property test in ``tests/test_repack.py``):

* only rollouts of the same version are merged: a trajectory keeps one behavior version;
* candidates are non-empty rollouts whose KV use is below ``c_max`` and falling
  (``kv_used < min(c_max, kv_prev)``) with fewer than ``max_batch`` requests — their
  batch is draining, no new work is arriving;
* sources are taken in ascending ``kv_used``; each moves *wholly* to the candidate that
  is fullest after the merge while staying within ``c_max`` and ``max_batch``;
* a rollout that received work is not also a source, and a rollout that moved away is no
  destination (the freed rollout takes new prompts at the newest version instead);
* O(|S|²) for |S| candidates, with projected loads cached as moves are planned.

Planning again on the loads after the moves (:func:`apply`) yields no moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

# The manager's waits on one move, in actor timeouts (laminar.manager_repack): for the
# export, for the import, and for its question to a destination whose import went
# unanswered (served behind that import: twice as long).
EXPORT_WAIT_TIMEOUTS, IMPORT_WAIT_TIMEOUTS, QUESTION_WAIT_TIMEOUTS = 1, 1, 2
# A source held by a move for this many actor timeouts without being released takes its
# requests back: the manager that held it was lost or gave up (a copy it had imported
# elsewhere then decodes twice, and the buffer keeps the first to arrive; losing them would
# leave their groups incomplete). It outlasts every wait of the move and one more timeout
# for the release (sent again until acknowledged within the hold): a shorter hold ran out
# under a slow but answered round, and its requests decoded in two engines.
HOLD_LIMIT_TIMEOUTS = EXPORT_WAIT_TIMEOUTS + IMPORT_WAIT_TIMEOUTS + QUESTION_WAIT_TIMEOUTS + 1


@dataclass(frozen=True)
class RolloutLoad:
    """One rollout at one planning instant. ``kv_*`` are fractions of its KV capacity;
    ``kv_prev`` is the value at the previous check."""

    rollout_id: str
    version: int
    kv_used: float
    kv_prev: float
    n_requests: int


@dataclass(frozen=True)
class Move:
    """Every unfinished request of ``source`` goes to ``destination``."""

    source: str
    destination: str


def is_candidate(load: RolloutLoad, c_max: float, max_batch: int) -> bool:
    """A draining rollout: KV use below ``c_max`` and falling, fewer than ``max_batch``
    requests, and some requests at all."""
    return (
        load.n_requests > 0
        and load.kv_used < min(c_max, load.kv_prev)
        and load.n_requests < max_batch
    )


def plan(loads: Sequence[RolloutLoad], *, c_max: float, max_batch: int) -> list[Move]:
    """Best-fit consolidation moves for ``loads`` (see the module docstring)."""
    ids = [load.rollout_id for load in loads]
    if len(set(ids)) != len(ids):
        raise ValueError(f"rollout ids must be unique, got {ids}")
    by_version: dict[int, list[RolloutLoad]] = {}
    for load in loads:
        if is_candidate(load, c_max, max_batch):
            by_version.setdefault(load.version, []).append(load)
    moves: list[Move] = []
    for version in sorted(by_version):
        group = sorted(by_version[version], key=lambda r: (r.kv_used, r.rollout_id))
        kv = {r.rollout_id: r.kv_used for r in group}  # projected after planned moves
        n = {r.rollout_id: r.n_requests for r in group}
        received: set[str] = set()
        moved: set[str] = set()
        for src in group:
            s = src.rollout_id
            if s in received:
                continue
            best, best_kv = None, -1.0
            for dst in group:
                d = dst.rollout_id
                if d == s or d in moved:
                    continue
                after_kv, after_n = kv[d] + kv[s], n[d] + n[s]
                if after_kv <= c_max and after_n <= max_batch and after_kv > best_kv:
                    best, best_kv = d, after_kv
            if best is None:
                continue
            moves.append(Move(s, best))
            kv[best], n[best] = kv[best] + kv[s], n[best] + n[s]
            kv[s], n[s] = 0.0, 0
            moved.add(s)
            received.add(best)
    return moves


def apply(loads: Sequence[RolloutLoad], moves: Sequence[Move]) -> list[RolloutLoad]:
    """The loads right after ``moves``: each source empty, each destination holding its
    own plus its sources' KV and requests (its KV just rose: ``kv_prev = kv_used``);
    every other rollout unchanged, still draining if it was."""
    by_id = {load.rollout_id: load for load in loads}
    kv = {i: load.kv_used for i, load in by_id.items()}
    n = {i: load.n_requests for i, load in by_id.items()}
    for m in moves:
        kv[m.destination] += kv[m.source]
        n[m.destination] += n[m.source]
        kv[m.source], n[m.source] = 0.0, 0
    dests = {m.destination for m in moves}
    out = []
    for i, load in by_id.items():
        prev = kv[i] if i in dests else load.kv_prev
        out.append(replace(load, kv_used=kv[i], n_requests=n[i], kv_prev=prev))
    return out
