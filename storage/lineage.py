"""Version lags counted along the weights' lineage, not the version numbers.

A trainer restarted within the run (docs/faults.md, "Trainer loss") goes on from its
checkpoint of version ``V`` and numbers its updates after ``M``, the newest version the
lost trainer published: the restart ``(V, M)``. The weights then form a tree: the numbers
after ``M`` branch off ``V``, and ``V+1 .. M`` are a lost branch. :func:`lineage_lag` is
the path between two weights in that tree; the buffer's ``max_train_staleness``
(:meth:`laminar.buffer_core.BufferCore.lag`) and the analysis
(``ds.laminar.staleness(restarts=...)``) both count with it.

Pure: no laminar import (``laminar`` imports ``storage``, not the other way round).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Restarts = Sequence[tuple[int, int]]


def lineage_lag(version: int, behavior: int, restarts: Restarts, *, trainer: bool = True) -> int:
    """How many updates apart the weights numbered ``version`` and ``behavior`` are,
    along the tree of weights the trainer ``restarts`` (``(V, M)``, in the order they
    happened) make: ``version - behavior`` with none; else the path between the two,
    each restart ``(V, M)`` branching the numbers after ``M`` off ``V``.

    ``trainer`` (the default): ``version`` is a trainer's (one that sampled a batch);
    a restarted trainer at ``M`` (the newest restart with that ``M``), before its first
    update, holds ``V``'s weights. ``trainer=False``: both are published weights (a
    rollout's ``finish_version`` and ``behavior_version``), ``M`` the lost trainer's.

    So for the restart ``(V, M)`` and a trainer at ``t >= M`` on it: ``(t - M) + (V - b)``
    for ``b <= V``, ``(t - M) + (b - V)`` for ``b`` in ``(V, M]`` (the lost branch),
    ``t - b`` for ``b > M``.

    >>> r = [(10, 19)]
    >>> lineage_lag(19, 10, r), lineage_lag(19, 19, r), lineage_lag(21, 4, r)
    (0, 9, 8)
    >>> lineage_lag(21, 15, r), lineage_lag(21, 20, r)
    (7, 1)
    >>> lineage_lag(19, 10, r, trainer=False)   # the lost trainer's 19
    9
    >>> lineage_lag(7, 3, [])
    4
    """
    if not restarts:
        return version - behavior
    a, b, d = version, behavior, 0
    if trainer:
        for v, m in reversed(restarts):
            if m == version:  # (the restarted trainer's weights)
                a = v
                break
    while True:
        ia, ib = _branch(a, restarts), _branch(b, restarts)
        if ia == ib:  # (one descends from the other: b's after a's is off the lineage)
            return d + abs(a - b)
        # climb the one on the newer branch to where its branch leaves off
        v, m = restarts[max(ia, ib) - 1]
        if ia > ib:
            d, a = d + a - m, v
        else:
            d, b = d + b - m, v


def _branch(n: int, restarts: Restarts) -> int:
    """Of the weights numbered ``n``, the restart whose branch they are on (``i``:
    ``restarts[i - 1]``; 0: the first trainer's): the newest whose ``M`` is below ``n``."""
    i = len(restarts)
    while i and restarts[i - 1][1] >= n:
        i -= 1
    return i


def lineage_lags(
    versions: np.ndarray, behaviors: np.ndarray, restarts: Restarts, *, trainer: bool = True
) -> np.ndarray:
    """:func:`lineage_lag` of each pair (float64; NaN where either is NaN or negative: a
    trajectory never sampled has ``sample_version`` -1 or NaN).

    >>> lineage_lags(np.array([19, 21, -1]), np.array([10, 15, 3]), [(10, 19)])
    array([ 0.,  7., nan])
    """
    versions = np.asarray(versions, dtype=np.float64)
    behaviors = np.asarray(behaviors, dtype=np.float64)
    ok = np.isfinite(versions) & np.isfinite(behaviors) & (versions >= 0) & (behaviors >= 0)
    out = np.full(np.broadcast(versions, behaviors).shape, np.nan)
    if not restarts:
        out[ok] = (versions - behaviors)[ok]
        return out
    va, vb = np.broadcast_arrays(versions, behaviors)
    cache: dict[tuple[int, int], int] = {}  # (few distinct pairs: one per version pair)
    for i in np.flatnonzero(ok.ravel()):
        key = (int(va.flat[i]), int(vb.flat[i]))
        lag = cache.get(key)
        if lag is None:
            lag = cache[key] = lineage_lag(*key, restarts, trainer=trainer)
        out.flat[i] = lag
    return out


def run_restarts(run_dir: str | Path) -> list[tuple[int, int]]:
    """The trainer restarts ``(V, M)`` of a run, in the order they happened, from its
    ``summary.json`` (``faults.trainer_restarts`` and ``faults.core_restarts``: each
    record's ``checkpoint_version``, ``after_version`` and ``time``). A restart that
    branches nothing (``M == V``) and a record of a restart that did not get that far
    (no ``after_version``) are left out; none for a run without a summary.

    A resumed run's summary is its last start's: the restarts of its earlier starts are
    in its checkpoints' ``trainer_state.json`` (``restarts``), not here."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    faults = summary.get("faults") or {}
    return ordered_restarts([*faults.get("trainer_restarts", []), *faults.get("core_restarts", [])])


def ordered_restarts(
    records: Sequence[dict], more: Sequence[tuple[float, int, int]] = ()
) -> list[tuple[int, int]]:
    """The restarts ``(V, M)`` of restart ``records`` (``summary.json``'s, or the
    driver's own: each record's ``checkpoint_version``, ``after_version`` and ``time``)
    and of ``more`` (``(time, V, M)``: a restart whose record is not written yet), in the
    order they happened. A record of a restart that did not get that far (no
    ``after_version``) and a restart that branches nothing (``M == V``) are left out.

    >>> ordered_restarts(
    ...     [{"time": 5.0, "checkpoint_version": 4, "after_version": 6},
    ...      {"time": 2.0, "checkpoint_version": 2, "after_version": 2},
    ...      {"time": 1.0, "checkpoint_version": 0}],
    ...     more=[(3.0, 2, 3)])
    [(2, 3), (4, 6)]
    """
    done = [
        (float(r.get("time", 0.0)), int(r["checkpoint_version"]), int(r["after_version"]))
        for r in records
        if r.get("after_version") is not None and r.get("checkpoint_version") is not None
    ]
    done += [(float(t), int(v), int(m)) for t, v, m in more]
    done.sort(key=lambda r: r[0])
    return [(v, m) for _, v, m in done if m != v]
