"""Version lags counted along the weights' lineage, not the version numbers.

A trainer restarted within the run (docs/faults.md, "Trainer loss") goes on from its
checkpoint of version ``V`` and numbers its updates after ``M``, the newest version the
lost trainer published: the restart ``(V, M)``. The weights then form a tree: the numbers
after ``M`` branch off ``V``, and ``V+1 .. M`` are a lost branch. :func:`lineage_lag` is
the path between two weights in that tree; the buffer's ``max_train_staleness``
(:meth:`laminar.buffer_core.BufferCore.lag`) and the analysis
(``ds.laminar.staleness(restarts=...)``) both count with it.

Pure: no laminar import (``laminar`` imports ``storage``, not the other way round):
:func:`run_restarts` reads a checkpoint's ``trainer_state.json`` as
:func:`laminar.learner.checkpoint_restarts` does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Restarts = Sequence[tuple[int, int]]

logger = logging.getLogger(__name__)


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
    a, b = va[ok].astype(np.int64), vb[ok].astype(np.int64)
    if not a.size:
        return out
    # Once per distinct (version, behavior) pair, as one integer each (a loop per
    # trajectory took 0.9 s for 1M of them): a table of the pairs in their range where it
    # is not much larger than the pairs (no sort: 9 ms for 1M, np.unique's 70), else
    # np.unique's
    a0, b0 = int(a.min()), int(b.min())
    span = int(b.max()) - b0 + 1
    key = (a - a0) * span + (b - b0)
    size = int(key.max()) + 1
    if size <= 4 * key.size + (1 << 16):
        keys = np.flatnonzero(np.bincount(key, minlength=size))
        inverse = np.zeros(size, dtype=np.int64)
        inverse[keys] = np.arange(keys.size)
        inverse = inverse[key]
    else:
        keys, inverse = np.unique(key, return_inverse=True)
    lags = [
        lineage_lag(k // span + a0, k % span + b0, restarts, trainer=trainer) for k in keys.tolist()
    ]
    out[ok] = np.asarray(lags, dtype=np.float64)[inverse.reshape(-1)]
    return out


def run_restarts(
    run_dir: str | Path, *, shortfalls: list[str] | None = None
) -> list[tuple[int, int]]:
    """The trainer restarts ``(V, M)`` along the lineage of a run's weights, in the order
    they happened, from every start of the run: what the buffer counted
    ``max_train_staleness`` with and ``ds.laminar.staleness(restarts="run")`` counts with.

    A start's own restarts are in ``summary.json``, which each start rewrites
    (``faults.trainer_restarts`` and ``faults.core_restarts``: each record's
    ``checkpoint_version``, ``after_version`` and ``time``; one with ``M == V``, or one
    that did not get that far, no ``after_version``, branches nothing and is left out).
    The restarts before a resume (``laminar run --resume``) are those the checkpoint it
    resumed from records (``checkpoints/version-N/trainer_state.json``, ``restarts``,
    with ``N`` the last resume's version: the store's ``resumes``, else the summary's
    ``resumed.version``). So the list is the checkpoint's, then the summary's by time:

    * **In order, once each.** The checkpoint's writer was handed every restart before
      it started, its own last (:class:`storage.resume.ResumePlan`), and each resumed
      trainer is handed its checkpoint's, so the checkpoint's list holds those of every
      earlier start, and of earlier resumes, that its weights descend from. Each of them
      has ``M <= N``; the resumed start restarts from the newest checkpoint, ``N`` or
      one it wrote since, so each of its restarts has ``M > N``, after them all.
    * **A restart a resume superseded is left out.** A resume redoes the versions after
      ``N`` under the same numbers (``ds.laminar.superseded()``), so a restart of a lost
      start with ``M > N`` (after the checkpoint was written, or in a start resumed from
      an older checkpoint, one damaged and moved aside) branched weights that are gone;
      counted, it would put the resumed start's own ``N+1 ..`` on a lost branch. No
      trajectory the analysis counts is of them: the lost start's trajectories consumed at
      ``N`` or later were held again, and those finished after ``N`` dropped
      (:func:`storage.resume.plan_resume`). The checkpoint's list does not name them.
    * **Multiple resumes**: the last one's checkpoint holds those of the ones before.

    When it cannot tell, it says so at WARNING (logger ``storage.lineage``), naming the
    path, and returns what it knows; nothing is written or moved:

    * The checkpoint of version ``N`` gone, or its ``trainer_state.json`` damaged (not
      JSON, its ``restarts`` not pairs, another ``version``): the restarts with
      ``M <= N`` recorded by the oldest readable checkpoint after it, which the resumed
      start wrote with the same list before its own (said at INFO); with none, those
      restarts are unknown (WARNING), and a lag across one of them counts by the numbers.
      One written before laminar recorded the list reads as none (WARNING), as the
      resumed buffer read it (it counted by the numbers too).
    * ``summary.json`` not of the run's last start (none there: a run still going, or
      one whose driver was killed; a failed driver's that records no restarts, which
      one made before laminar recorded them there is; one
      that does not read; one of an earlier start, the store recording a later resume):
      that start's restarts are those its newest checkpoint records (its trainer was
      handed them), and one after that trainer started is unknown (WARNING).

    A run started once reads no checkpoint while its ``summary.json`` is its start's:
    the restarts are the summary's alone.

    ``shortfalls``: a list these WARNINGs are appended to instead (the audit says them
    as notes), each as its message.

    >>> run_restarts("no/such/run")  # (no summary, no checkpoint: none, said at WARNING)
    []
    >>> said = []
    >>> run_restarts("no/such/run", shortfalls=said), len(said)
    ([], 1)
    """
    run_dir = Path(run_dir)
    warn = logger.warning if shortfalls is None else _keeper(shortfalls)
    summary, problem = _read_summary(run_dir)
    resumes = _store_resumes(run_dir, warn)
    stated = (summary.get("resumed") or {}).get("version")
    stated = None if stated is None else int(stated)
    last = resumes[-1] if resumes else stated
    if problem is None and resumes and stated != last:
        problem = (
            f"{str(run_dir / 'summary.json')!r} is of an earlier start: the store records a "
            f"later resume, from version {last} (a start still going, or whose driver was "
            "killed)"
        )
    earlier = [] if last is None else _restarts_before(run_dir, last, warn)
    if problem is None:
        faults = summary.get("faults") or {}
        records = [*faults.get("trainer_restarts", []), *faults.get("core_restarts", [])]
        return [*earlier, *ordered_restarts(records)]
    floor = -1 if last is None else last
    ckpt, recorded = _newest_recorded(run_dir, floor, warn)
    if ckpt is None:
        warn(
            "%s; no checkpoint of it records its restarts: %s",
            problem,
            "none counted" if not earlier else f"counted only those before version {last}",
        )
        return earlier
    warn(
        "%s; counted the restarts %r records (its trainer was handed them): one after that "
        "trainer started is unknown, a lag across it counts by the numbers",
        problem,
        str(ckpt / "trainer_state.json"),
    )
    return [*earlier, *(r for r in recorded if r[1] > floor)]


def _keeper(shortfalls: list[str]):
    """A ``warn(msg, *args)`` that appends the message to ``shortfalls`` instead of logging."""

    def keep(msg: str, *args) -> None:
        shortfalls.append(msg % args)

    return keep


class _Unreadable(Exception):
    """A checkpoint's ``trainer_state.json`` that does not say its restarts (the why)."""


def _read_summary(run_dir: Path) -> tuple[dict, str | None]:
    """``summary.json`` and, where it does not record its start's restarts, why."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, f"{str(path)!r} is not there (a run still going, or whose driver was killed)"
    except (OSError, ValueError) as e:
        return {}, f"{str(path)!r} does not read ({type(e).__name__}: {e})"
    if not isinstance(summary, dict):
        return {}, f"{str(path)!r} does not read (not a JSON object)"
    if summary.get("driver_failed") and "trainer_restarts" not in (summary.get("faults") or {}):
        # (pipelines.summary.summarize_failed records them where the driver still knew them)
        return summary, f"{str(path)!r} is a failed driver's that records no restarts"
    return summary, None


def _store_resumes(run_dir: Path, warn=logger.warning) -> list[int] | None:
    """The checkpoint versions the run's starts resumed from, in order, as the trajectory
    store records them (``resumes``; ``None``: no store, or one that does not read)."""
    import zarr

    from storage.stores import reading, store_path
    from storage.trajectories_read import recorded_resumes

    store = store_path(run_dir)
    if not (store / "zarr.json").exists():
        return None
    try:
        with reading(store):
            group = zarr.open_group(str(store), mode="r", zarr_format=3)
            return [v for _, v in recorded_resumes(group)]
    except Exception as e:  # noqa: BLE001 — the summary still says the last resume
        warn("%r: its resumes do not read (%s: %s)", str(store), type(e).__name__, e)
        return None


def run_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's ``checkpoints/version-<digits>`` folders by version (one moved aside,
    ``version-000014.damaged``, is not one: as :func:`laminar.learner.newest_checkpoint`)."""
    folder = run_dir / "checkpoints"
    return {
        int(p.name.removeprefix("version-")): p
        for p in sorted(folder.glob("version-*"))
        if p.name.removeprefix("version-").isdigit()
    }


def _recorded(ckpt: Path, version: int) -> list[tuple[int, int]] | None:
    """The restarts ``ckpt`` (of ``version``) records, as
    :func:`laminar.learner.checkpoint_restarts` reads them; ``None``: it was written
    before laminar recorded them. A :class:`_Unreadable` says why it does not read."""
    path = ckpt / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
        if int(state["version"]) != version:
            raise _Unreadable(f"{str(path)!r} holds version {state['version']}, not {version}")
        if "restarts" not in state:
            return None
        return [(int(v), int(m)) for v, m in state["restarts"]]
    except FileNotFoundError:
        raise _Unreadable(f"{str(path)!r} is not there") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Unreadable(f"{str(path)!r} does not read ({type(e).__name__}: {e})") from None


def _restarts_before(run_dir: Path, version: int, warn=logger.warning) -> list[tuple[int, int]]:
    """The restarts before the resume from the checkpoint of ``version`` (its own list;
    else those with ``M <= version`` of the oldest readable checkpoint after it)."""
    saved = run_checkpoints(run_dir)
    ckpt = saved.get(version, run_dir / "checkpoints" / f"version-{version:06d}")
    try:
        if not ckpt.is_dir():
            raise _Unreadable(f"{str(ckpt)!r} is not there")
        recorded = _recorded(ckpt, version)
    except _Unreadable as e:
        why = str(e)
    else:
        if recorded is None:
            warn(
                "%r records no trainer restarts (written before laminar did): the "
                "restarts before the resume from it are unknown, read as none (as its "
                "resumed buffer read them); a lag across one counts by the numbers",
                str(ckpt / "trainer_state.json"),
            )
            return []
        return recorded
    for v in sorted(x for x in saved if x > version):
        try:
            later = _recorded(saved[v], v)
        except _Unreadable:
            continue
        if later is not None:
            logger.info(
                "%s: the restarts before the resume from version %d are read from %r",
                why,
                version,
                str(saved[v] / "trainer_state.json"),
            )
            return [r for r in later if r[1] <= version]
    warn(
        "%s, and no later checkpoint records the restarts before the resume from version "
        "%d: they are unknown, none counted; a lag across one counts by the numbers (pass "
        "restarts=[(V, M), ...] to count them)",
        why,
        version,
    )
    return []


def _newest_recorded(
    run_dir: Path, floor: int, warn=logger.warning
) -> tuple[Path | None, list[tuple[int, int]]]:
    """The newest readable checkpoint above version ``floor`` that records restarts, and
    them (``None, []``: none)."""
    saved = run_checkpoints(run_dir)
    for v in sorted((x for x in saved if x > floor), reverse=True):
        try:
            recorded = _recorded(saved[v], v)
        except _Unreadable as e:
            warn("%s: passed over", e)
            continue
        if recorded is not None:
            return saved[v], recorded
    return None, []


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
