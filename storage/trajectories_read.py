"""Readers of ``trajectories.zarr``: :func:`open_run` (an xarray Dataset), :func:`open_runs`
(several runs side by side), :func:`open_trajectories` (numpy arrays), the tokens of a few
rows (:func:`tokens_at`, :func:`records_at`); each sliced to the commit markers, with the
leave events applied and the time a trajectory held again was out of the buffer taken out.

Apart from the writer (:mod:`storage.trajectories`, where the store's protocol is
described, and from where each name here is imported as well): reading a store needs no
writer, and a notebook reads stores no process writes.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xarray as xr
import zarr

from storage.schema import (
    COMMIT_ATTR,
    EVENT_COMMIT_ATTR,
    EVENT_DIM,
    EVENT_FIELDS,
    LEAVE_FIELDS,
    LEAVE_SCHEMA,
    RAGGED,
    RAGGED_FIELDS,
    READABLE_SCHEMA_VERSIONS,
    SCALARS,
    TRAJECTORY_DIM,
    left_as_sampled,
)
from storage.stores import (
    _NEVER_ALL_FILL,
    CHUNKS_ATTR,
    StoreError,
    _check_markers,
    _holds,
    committed_array,
    fill_value,
    fixed_width,
    group_arrays,
    reading,
    store_path,
)

logger = logging.getLogger(__name__)


def committed(path: str | Path) -> int:
    """How many trajectories a run's store has committed (:class:`StoreError` without
    one)."""
    _, group = _open_group(path)
    return int(group.attrs[COMMIT_ATTR])


def _open_group(path: str | Path) -> tuple[Path, zarr.Group]:
    # (absolute: open_run's token arrays are read later, and a notebook that changes
    # directory in between would read a relative path elsewhere, or nothing: zeros)
    store = store_path(Path(os.path.abspath(path)))
    if not (store / "zarr.json").exists():
        if (store.parent / "config.yaml").exists():  # (a run's directory: nothing yet)
            raise StoreError(_nothing_stored_yet(store))
        raise StoreError(
            f"no trajectory store at {str(store)!r}; pass a run directory written by "
            "`laminar run` (it holds trajectories.zarr)"
        )
    with reading(store):
        group = zarr.open_group(str(store), mode="r", zarr_format=3)
    if group.attrs.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise StoreError(
            f"{str(store)!r} has schema_version {group.attrs.get('schema_version')!r}; "
            f"this laminar reads {READABLE_SCHEMA_VERSIONS}"
        )
    _check_markers(store, group)
    return store, group


def has_leave_fields(group: zarr.Group) -> bool:
    """Whether a store holds ``t_leave`` and ``leave_version`` (schema 3 on): an older
    one's are read as :func:`storage.schema.left_as_sampled` says (any arrays of them
    there, a writer's taking it on cut short, left alone)."""
    return int(group.attrs.get("schema_version", 0)) >= LEAVE_SCHEMA


# Arrays of the leave fields (per trajectory and per leave event): absent before schema 3
_LEAVE_ARRAYS = (
    *LEAVE_FIELDS,
    *(name for name, field in EVENT_FIELDS.items() if field in LEAVE_FIELDS),
)


def _event_arrays(group: zarr.Group) -> tuple[str, ...]:
    """The leave-event arrays the store holds (:data:`EVENT_FIELDS`)."""
    if has_leave_fields(group):
        return tuple(EVENT_FIELDS)
    return tuple(name for name in EVENT_FIELDS if name not in _LEAVE_ARRAYS)


def _nothing_stored_yet(store: Path) -> str:
    """Why a run directory (it has its ``config.yaml``) has no trajectory store yet: its
    driver is still setting it up, or ``summary.json`` says how it ended."""
    import json
    import time

    from storage.live import running_driver

    run_dir = store.parent
    why = "its start may have failed or been stopped before its first batch"
    live = running_driver(run_dir)
    if live is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(live.get("since", 0))))
        why = f"it is running (driver pid {live.get('pid')} on {live.get('host')}, since {since})"
    else:
        try:
            reason = json.loads((run_dir / "summary.json").read_text()).get("reason")
        except (OSError, ValueError, AttributeError):
            reason = None
        if reason:
            why = f"its summary.json says: {reason}"
    return (
        f"run {str(run_dir)!r} has stored no trajectory yet (no {store.name}): {why}; "
        "rerun this once it has stored trajectories"
    )


def _apply_events(
    store: Path, group: zarr.Group, scalars: dict[str, np.ndarray]
) -> tuple[int, str, _Stays, np.ndarray]:
    """Apply the committed leave events, in order, to the per-trajectory ``scalars``.
    An event naming a trajectory the store does not hold (its batch failed to write, or
    two processes wrote the store) is skipped and counted, not fatal: the trajectories
    stay readable and the audit reports it. Returns how many were skipped, the first
    one's uid, the earlier stays in the buffer of the trajectories held again
    (:func:`_stays`; with ``t_insert`` among the ``scalars``, which then gain
    ``t_held``), and every event's time (``event_t_sample``, NaN where unknown: signs
    the run was going that the applied ``scalars`` no longer hold, such as the sampling
    times of a lost start's updates whose trajectories were held again)."""
    n_events = int(group.attrs.get(EVENT_COMMIT_ATTR, 0))
    if "t_insert" in scalars:
        scalars["t_held"] = scalars["t_insert"].astype(np.float64)
    out = (0, "", _NO_STAYS, np.zeros(0))
    if n_events:
        out = _apply_committed_events(store, group, scalars, n_events)
    if not has_leave_fields(group) and "status" in scalars:  # (an older store's)
        left = left_as_sampled(scalars["status"], scalars["t_sample"], scalars["sample_version"])
        scalars.update(zip(LEAVE_FIELDS, left, strict=True))
    return out


def _apply_committed_events(
    store: Path, group: zarr.Group, scalars: dict[str, np.ndarray], n_events: int
) -> tuple[int, str, _Stays, np.ndarray]:
    events = {
        name: committed_array(store, group, name, n_events)[:n_events]
        for name in _event_arrays(group)
    }
    rows = {uid: i for i, uid in enumerate(scalars["uid"].tolist())}
    index = np.array([rows.get(u, -1) for u in events["event_uid"].tolist()], dtype=np.int64)
    known = index >= 0
    unknown, first = int((~known).sum()), ""
    if unknown:
        first = str(events["event_uid"][np.flatnonzero(~known)[0]])
        logger.warning(
            "%s: %d leave events name trajectories the store does not hold (e.g. %r); "
            "they are skipped",
            store,
            unknown,
            first,
        )
    status = events["event_status"]
    when = events["event_t_sample"]
    held_again = status == HELD_AGAIN
    stored = scalars["status"], scalars["t_sample"]  # (as the records hold them)
    # (a held-again event's time is when it was held again, not a sample time)
    events["event_t_sample"] = np.where(held_again, np.nan, when)
    # Each row's last event, chosen here: NumPy does not promise which of repeated
    # indices an advanced assignment keeps
    rows_known = index[known]
    target, from_end = np.unique(rows_known[::-1], return_index=True)
    last = np.flatnonzero(known)[rows_known.size - 1 - from_end]
    for name, field in EVENT_FIELDS.items():
        if field != "uid" and name in events:
            scalars[field] = scalars[field].copy()
            scalars[field][target] = events[name][last]
    stays = _NO_STAYS
    if "t_held" in scalars and (held_again & known).any():
        stays = _stays(index[known], held_again[known], when[known], scalars["t_held"], *stored)
    left = events.get("event_t_leave", np.zeros(0))  # (when evicted, filtered, ...)
    return unknown, first, stays, np.concatenate([when, left]).astype(np.float64)


# A ``buffered`` event holds a stored trajectory again after it left (a resume, a data
# module rebuilt within the run, or a restarted trainer took back the consumption of an
# update that was lost); its ``event_t_sample`` is when (NaN in stores written before
# laminar recorded it), never a sample time: readers set ``t_sample`` NaN.
HELD_AGAIN = "buffered"

# Earlier stays in the buffer (row, from, to: epoch seconds), of trajectories held again.
_Stays = tuple[np.ndarray, np.ndarray, np.ndarray]
_NO_STAYS: _Stays = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0))


def _stays(
    index: np.ndarray,
    held_again: np.ndarray,
    when: np.ndarray,
    t_held: np.ndarray,
    status: np.ndarray,
    t_sample: np.ndarray,
) -> _Stays:
    """The stays in the buffer, before their last one, of the trajectories the events
    (in order: the row each names, whether it holds it again, its time) held again;
    ``t_held`` (each row's ``t_insert`` on entry) becomes when each last one began.
    ``status``, ``t_sample``: as the records hold them (a trajectory that left before
    its record was written is stored as it left, its leave in the record).

    A stay runs from ``t_insert`` or a holding again to the next leave (the consumption
    that a lost update, or a lost data module's reply, took back). A trajectory held
    again without a time (a store written before laminar recorded it) keeps
    ``t_held = t_insert`` and no earlier stays: its age is counted as before, from
    ``t_insert``, the time it was out of the buffer included."""
    rows, starts, ends = [], [], []
    again = np.unique(index[held_again])
    mine = np.flatnonzero(np.isin(index, again))
    mine = mine[np.argsort(index[mine], kind="stable")]  # by row, each in event order
    for row_events in np.split(mine, np.flatnonzero(np.diff(index[mine])) + 1):
        row = int(index[row_events[0]])
        begun: float | None = float(t_held[row])  # (None: out of the buffer)
        last, closed, earlier = begun, [], []
        if status[row] != HELD_AGAIN:  # (stored as it left)
            if math.isfinite(left := float(t_sample[row])):
                closed.append((begun, left))
            begun = None
        for e in row_events.tolist():
            t = float(when[e])
            if not held_again[e]:  # a leave: the stay ends (if it has a time)
                if begun is not None and math.isfinite(t):
                    closed.append((begun, t))
                begun = None
            elif not math.isfinite(t):  # (an older store's: no time, counted as before)
                break
            elif begun is None:  # held again: a new stay begins
                earlier += closed
                closed, begun, last = [], t, t
        else:
            t_held[row] = last
            rows += [row] * len(earlier)
            starts += [a for a, _ in earlier]
            ends += [b for _, b in earlier]
    return (
        np.asarray(rows, dtype=np.int64),
        np.asarray(starts, dtype=np.float64),
        np.asarray(ends, dtype=np.float64),
    )


def _held_seconds(n: int, stays: _Stays, pauses: Sequence[tuple[float, float]]) -> np.ndarray:
    """Per trajectory (of ``n``), seconds in the buffer in its earlier ``stays``, less
    the time the run was stopped in them (``pauses``: from, to)."""
    rows, a, b = stays
    held = np.zeros(n, dtype=np.float64)
    np.add.at(held, rows, b - a - _stopped(a, b, pauses))
    return held


def _stopped(a: np.ndarray, b: np.ndarray, pauses: Sequence[tuple[float, float]]) -> np.ndarray:
    """Seconds of each stretch ``a`` .. ``b`` (epoch seconds) the run was stopped."""
    out = np.zeros(np.broadcast(a, b).shape, dtype=np.float64)
    for start, end in pauses:
        out += np.clip(np.minimum(b, end) - np.maximum(a, start), 0.0, None)
    return out


def time_in_buffer(
    t_held: np.ndarray,
    held_s: np.ndarray,
    until: np.ndarray,
    pauses: Sequence[tuple[float, float]] = (),
) -> np.ndarray:
    """Seconds each trajectory spent in the buffer while the run went, up to ``until``
    (epoch seconds: a consumed one's ``t_sample``): ``held_s`` (its earlier stays) plus
    its last stay, from ``t_held`` on, less the time the run was stopped in it
    (``pauses``: from, to, as ``open_run``'s attribute ``pauses_s``).

    A trajectory consumed by an update that was lost, then held again, was out of the
    buffer in between (with the trainer, or the lost data module's reply): that time is
    not its age.

    >>> time_in_buffer(np.array([10.0, 50.0]), np.array([0.0, 3.0]), np.array([14.0, 52.0]),
    ...                [(20.0, 40.0)]).tolist()
    [4.0, 5.0]
    """
    t_held, until = np.asarray(t_held, np.float64), np.asarray(until, np.float64)
    return np.asarray(held_s, np.float64) + (until - t_held) - _stopped(t_held, until, pauses)


def _starts_from_lengths(store: Path, arrays: dict[str, np.ndarray]) -> None:
    """Set each ragged group's ``<group>_start`` from its lengths. The writer lays every
    batch's tokens end to end in record order, so a start is the sum of the lengths
    before it; stores written before an events-only batch stopped appending a stray start
    have every later start shifted on disk (their tokens and lengths are right)."""
    for g in RAGGED:
        lens = arrays[f"{g}_len"].astype(np.int64)
        starts = np.cumsum(lens) - lens
        if not np.array_equal(arrays[f"{g}_start"], starts):
            logger.warning(
                "%s: %s_start disagrees with %s_len on disk (a store written before events-"
                "only batches stopped shifting it); the starts are taken from the lengths",
                store,
                g,
                g,
            )
        arrays[f"{g}_start"] = starts


def open_trajectories(
    path: str | Path, fields: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """Every committed array of a store as numpy, sliced to the commit marker, with the
    leave events applied; with ``fields``, only those per-trajectory fields (and those
    the events set), no token-level arrays."""
    store, group = _open_group(path)
    with reading(store):
        if fields is not None:  # (the rest is checked too: a resume reads its tokens later)
            _check_all(store, group)
        return _read_trajectories(store, group, fields)


def _check_all(store: Path, group: zarr.Group) -> None:
    """Every array of the store holds its committed values, each chunk of them there."""
    lengths = {
        TRAJECTORY_DIM: int(group.attrs[COMMIT_ATTR]),
        EVENT_DIM: int(group.attrs.get(EVENT_COMMIT_ATTR, 0)),
        **group.attrs["n_committed_tokens"],
    }
    older = not has_leave_fields(group)
    for name, arr in group_arrays(group):
        (dim,) = arr.metadata.dimension_names
        if dim in lengths and not (older and name in _LEAVE_ARRAYS):
            _holds(store, group, name, arr, lengths[dim])


def _read_trajectories(store: Path, group: zarr.Group, fields) -> dict[str, np.ndarray]:
    n = int(group.attrs[COMMIT_ATTR])
    tokens = group.attrs["n_committed_tokens"]
    out: dict[str, np.ndarray] = {}
    wanted = SCALARS if fields is None else {*fields, *EVENT_FIELDS.values()}
    unknown = set(wanted) - set(SCALARS)
    if unknown:
        raise StoreError(f"open_trajectories: no per-trajectory fields {sorted(unknown)}")
    older = not has_leave_fields(group)  # (its leave fields: set by _apply_events)
    for name in SCALARS:
        if name in wanted and not (older and name in LEAVE_FIELDS):
            out[name] = committed_array(store, group, name, n)[:n]
    _, _, stays, times = _apply_events(store, group, out)
    if "t_held" in out:
        pauses = ()
        if stays[0].size:  # (only then: the stops are in the metrics)
            starts = _starts(store.parent, _activity(out, times), _resumes(group))
            pauses = pairs(starts["pauses_s"])
        out["held_s"] = _held_seconds(n, stays, pauses)
    if fields is not None:
        return out
    for g, (dim, fields) in RAGGED.items():
        for name in (f"{g}_start", f"{g}_len"):
            out[name] = committed_array(store, group, name, n)[:n]
        for name in fields:
            out[name] = committed_array(store, group, name, tokens[dim])[: tokens[dim]]
    _starts_from_lengths(store, out)
    return out


def records_at(
    arrays: Mapping[str, np.ndarray], rows: Sequence[int], path: str | Path | None = None
) -> list[dict[str, Any]]:
    """The records (field -> value, as :meth:`TrajectoryWriter.append` takes them) at
    ``rows`` of :func:`open_trajectories`' arrays. Arrays read with ``fields`` (every
    per-trajectory one: :data:`storage.schema.SCALARS`) hold no tokens: those of these
    rows alone are read from the store at ``path`` (:func:`tokens_at`)."""
    rows = [int(i) for i in rows]
    index = np.asarray(rows, dtype=np.int64)
    values = {name: arrays[name][index].tolist() for name in SCALARS}  # (str for strings)
    if all(name in arrays for name in RAGGED_FIELDS):
        tokens = {name: [] for name in RAGGED_FIELDS}
        for g, (_, fields) in RAGGED.items():
            for i in rows:
                start, n = int(arrays[f"{g}_start"][i]), int(arrays[f"{g}_len"][i])
                for name in fields:
                    tokens[name].append(np.array(arrays[name][start : start + n]))
    elif path is None:
        raise ValueError("records_at: arrays without tokens need the store's path")
    else:
        tokens = tokens_at(path, rows, n=len(arrays["uid"]))
    return [
        {name: column[k] for name, column in (*values.items(), *tokens.items())}
        for k in range(len(rows))
    ]


def tokens_at(
    path: str | Path, rows: Sequence[int], n: int | None = None
) -> dict[str, list[np.ndarray]]:
    """The token-level fields (:data:`storage.schema.RAGGED_FIELDS`) of the trajectories
    at ``rows`` (of :func:`open_trajectories`' arrays; ``n``: how many those hold), one
    array per row, read for those rows alone: a buffer that holds a few thousand
    trajectories again reads their tokens, not the run's (9.6 bytes a response token).

    A trajectory's tokens start where those of the rows before it end (the starts come
    from the lengths, as :func:`open_trajectories` takes them). The rows' token ranges
    are read in runs, one per stretch of chunks they touch, so each chunk is read once."""
    store, group = _open_group(path)
    with reading(store):
        committed_n = int(group.attrs[COMMIT_ATTR])
        tokens = group.attrs["n_committed_tokens"]
        n = committed_n if n is None else n
        index = np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= min(n, committed_n)):
            raise StoreError(
                f"{str(store)!r}: rows {int(index.min())}..{int(index.max())} asked of "
                f"{min(n, committed_n)} trajectories committed"
            )
        end = int(index.max()) + 1 if index.size else 0
        out: dict[str, list[np.ndarray]] = {}
        for g, (dim, fields) in RAGGED.items():
            lens = committed_array(store, group, f"{g}_len", committed_n)[:end]
            lens = lens.astype(np.int64)
            starts = np.cumsum(lens) - lens
            a = starts[index]
            b = a + lens[index]
            if b.size and int(b.max()) > tokens[dim]:
                raise StoreError(
                    f"{str(store)!r}: {g}_len adds up to {int(b.max())} {dim}s but "
                    f"{tokens[dim]} are committed; it is damaged: restore the run "
                    "directory from a copy"
                )
            for name in fields:
                arr = committed_array(store, group, name, tokens[dim])
                out[name] = _slices(arr, a, b)
    return out


def _slices(arr: zarr.Array, a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    """``arr[a[k]:b[k]]`` for each k, as copies; ranges less than a chunk apart are read
    together (zarr reads whole chunks, ~0.5 ms each besides its bytes), every chunk
    touched once."""
    out: list[np.ndarray] = [np.zeros(0, arr.dtype) for _ in range(len(a))]
    gap = int(arr.chunks[0])
    order = [k for k in np.argsort(a, kind="stable").tolist() if b[k] > a[k]]
    k0 = 0
    while k0 < len(order):
        lo, hi, k1 = int(a[order[k0]]), int(b[order[k0]]), k0 + 1
        while k1 < len(order) and int(a[order[k1]]) <= hi + gap:
            hi = max(hi, int(b[order[k1]]))
            k1 += 1
        span = arr[lo:hi]
        for k in order[k0:k1]:
            out[k] = span[int(a[k]) - lo : int(b[k]) - lo].copy()
        k0 = k1
    return out


def open_run(path: str | Path) -> xr.Dataset:
    """The trajectories of a run as an :class:`xarray.Dataset` on a ``trajectory`` dimension.

    Ragged fields sit on their own token dimensions (see :mod:`storage.schema`); the
    ``.laminar`` accessor gives staleness and per-trajectory token views. Only committed
    records are visible, with their leave events applied (``status``, ``sample_version``,
    ``t_sample`` are where each trajectory stands now). Derived staleness columns are added:
    ``s_gen``, ``residence``, ``s_train`` (NaN where a trajectory was never sampled).
    """
    store, group = _open_group(path)
    with reading(store):
        return _read_run(store, group)


def _read_run(store: Path, group: zarr.Group) -> xr.Dataset:
    import dask.array as da

    n = int(group.attrs[COMMIT_ATTR])
    lengths = {TRAJECTORY_DIM: n, **group.attrs["n_committed_tokens"]}
    # Built array by array rather than with xr.open_zarr: during (or after a crash in) an
    # append, arrays on one dimension have different lengths, which open_zarr refuses.
    variables = {}
    scalars = {}
    older = not has_leave_fields(group)
    for name, arr in group_arrays(group):
        if older and name in _LEAVE_ARRAYS:  # (a writer's taking it on, cut short)
            continue
        (dim,) = arr.metadata.dimension_names
        if dim in lengths:
            _holds(store, group, name, arr, lengths[dim])
        if dim == TRAJECTORY_DIM:
            scalars[name] = arr[:n]
        elif dim != EVENT_DIM:  # token-level: lazy
            lazy = da.from_array(
                _OnDisk(store, group, name, arr),
                chunks=arr.chunks,
                name=False,  # (each open its own: a live store grows between them)
                meta=np.empty(0, arr.dtype),
            )
            variables[name] = (dim, lazy[: lengths[dim]])
    unknown, first, stays, times = _apply_events(store, group, scalars)
    if all(f"{g}_len" in scalars for g in RAGGED):
        _starts_from_lengths(store, scalars)
    for name, values in scalars.items():
        if values.dtype.kind == "T":  # numpy's StringDType is still new to pandas/xarray
            values = fixed_width(values)
        variables[name] = (TRAJECTORY_DIM, values)
    ds = xr.Dataset(variables, coords={TRAJECTORY_DIM: np.arange(n)})
    sampled = ds["sample_version"] >= 0
    ds["s_gen"] = ds["finish_version"] - ds["behavior_version"]
    ds["residence"] = (ds["sample_version"] - ds["finish_version"]).where(sampled)
    ds["s_train"] = (ds["sample_version"] - ds["behavior_version"]).where(sampled)
    ds.attrs["run_dir"] = str(store.parent)
    # (the audit reports them; the uid of the first, only where there is one)
    ds.attrs["unknown_events"] = int(unknown)
    if unknown:
        ds.attrs["unknown_event_uid"] = first
    ds.attrs["schedule"] = group.attrs.get("schedule", "laminar")  # older stores: laminar
    # (3 and on: every trajectory that left has its t_leave and leave_version)
    ds.attrs["schema_version"] = int(group.attrs.get("schema_version", 0))
    # The first row written knowing when it left (a store taken on from schema 2: the
    # rows it held then are known for the consumed alone; of an older one: none)
    known = 0 if ds.attrs["schema_version"] >= LEAVE_SCHEMA else ds.sizes[TRAJECTORY_DIM]
    ds.attrs["leave_known_from"] = int(group.attrs.get("leave_known_from", known))
    # (each resume in place: when, from which checkpoint version; TrajectoryWriter.record_resume)
    resumes = recorded_resumes(group)
    ds.attrs["resumed_at_s"] = [t for t, _ in resumes]
    ds.attrs["resumed_from_version"] = [v for _, v in resumes]
    ds.attrs.update(_starts(store.parent, _activity(scalars, times), ds.attrs["resumed_at_s"]))
    if "t_held" in ds:
        held = _held_seconds(n, stays, pairs(ds.attrs["pauses_s"]))
        ds["held_s"] = (TRAJECTORY_DIM, held)
    return ds


class _OnDisk:
    """A token array of :func:`open_run`'s Dataset, read when a value is asked for: its
    chunks are checked first, as at the open (zarr reads a missing chunk as the fill
    value: a store moved or deleted since, or a chunk lost, would read as zeros)."""

    def __init__(self, store: Path, group: zarr.Group, name: str, arr: zarr.Array) -> None:
        self.store, self.name, self.arr = store, name, arr
        self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, 1
        self.every = bool(group.attrs.get(CHUNKS_ATTR)) or name in _NEVER_ALL_FILL

    def __getitem__(self, key):
        (index,) = key if isinstance(key, tuple) else (key,)
        start, stop, _ = index.indices(self.shape[0])
        size = int(self.arr.chunks[0])
        folder = self.store / self.name
        for i in range(start // size, -(-stop // size) if stop > start else 0):
            chunk = folder / self.arr.metadata.encode_chunk_key((i,))
            if chunk.exists():
                continue
            if not (self.store / "zarr.json").exists():
                raise StoreError(
                    f"{str(self.store)!r} is not there any more (moved or deleted since "
                    f"it was opened): open_run it again where it is now"
                )
            if self.every or not (folder / "zarr.json").exists():
                raise StoreError(
                    f"{str(self.store)!r}: array {self.name!r} lacks chunk {str(chunk)!r} "
                    f"(zarr would read it as {fill_value(self.arr.dtype)!r}s): the data is "
                    "not there; restore the run directory from a copy"
                )
        with reading(self.store):
            return self.arr[key]


def recorded_resumes(group: zarr.Group) -> list[tuple[float, int]]:
    """Each resume in place the trajectory store records, in order: when it began
    (epoch seconds) and the checkpoint version it resumed from (the attribute
    ``resumes``, :meth:`TrajectoryWriter.record_resume`; the one reader of it)."""
    return [(float(t), int(v)) for t, v in group.attrs.get("resumes", [])]


def _resumes(group: zarr.Group) -> list[float]:
    """When each resume in place began (epoch seconds, in order)."""
    return [t for t, _ in recorded_resumes(group)]


def run_stops(path: str | Path, arrays: Mapping[str, np.ndarray]) -> tuple[list, float]:
    """A run's stops so far (``open_run``'s ``pauses_s``, as pairs: the one each
    recorded resume ends included) and the last moment it was seen going before its
    latest recorded resume (NaN: never): its last ``cluster`` row or trajectory time
    (``arrays``, from :func:`open_trajectories`) before it, or the resume before (a
    start that did nothing else). For a run resumed now, its stop began then, and ends
    at the resume the store recorded (:func:`resume_stops`)."""
    store = store_path(path)
    _, group = _open_group(path)
    resumes = _resumes(group)
    with reading(store):
        n_events = int(group.attrs.get(EVENT_COMMIT_ATTR, 0))
        times = [np.zeros(0)]
        for name in ("event_t_sample", "event_t_leave"):  # (the lost start's: _activity)
            if n_events and name in _event_arrays(group):
                times.append(committed_array(store, group, name, n_events)[:n_events])
        times = np.concatenate(times).astype(np.float64)
    activity = _activity(arrays, times)
    metrics = _metrics(store.parent)  # (read once, for both)
    starts = _starts(store.parent, activity, resumes, metrics)
    signs = np.zeros(0) if activity is None else activity[np.isfinite(activity)]
    signs = np.concatenate([signs, metrics.times])
    if metrics.cluster is not None:
        signs = np.concatenate([signs, metrics.origin + metrics.cluster["time"].values])
    previous = resumes[-2] if len(resumes) > 1 else -math.inf
    last = _stop_before(signs, previous, resumes[-1] if resumes else math.inf)
    return pairs(starts["pauses_s"]), last if math.isfinite(last) else math.nan


def leave_events(path: str | Path, fields=tuple(EVENT_FIELDS)) -> dict[str, np.ndarray]:
    """The store's committed leave events, in the order they were written: ``fields`` of
    :data:`~storage.schema.EVENT_FIELDS` by name (``open_run`` shows where each
    trajectory stands now; these, every step it took: a consumption an update lost and a
    restarted trainer took back is a ``consumed`` event followed by a ``buffered`` one)."""
    store = store_path(path)
    _, group = _open_group(path)
    with reading(store):
        n_events = int(group.attrs.get(EVENT_COMMIT_ATTR, 0))
        if not n_events:
            return {f: np.zeros(0, SCALARS[EVENT_FIELDS[f]]) for f in fields}
        held = _event_arrays(group)
        out = {
            f: committed_array(store, group, f, n_events)[:n_events] for f in fields if f in held
        }
        if len(out) < len(fields):  # (an older store's leave fields: left_as_sampled)
            state = (
                committed_array(store, group, f, n_events)[:n_events]
                for f in ("event_status", "event_t_sample", "event_sample_version")
            )
            left = dict(zip(LEAVE_FIELDS, left_as_sampled(*state), strict=True))
            out |= {f: left[EVENT_FIELDS[f]] for f in fields if f not in out}
        return {f: out[f] for f in fields}


def resume_stops(path: str | Path, now: float) -> list[tuple[float, float]]:
    """Every stop of a run that is being resumed now (epoch seconds, from to), the one
    before this start included: from the last sign of the start before to the resume
    the store recorded (this start's ``record_resume``, before it generated anything).
    What ``open_run``'s ``pauses_s`` will say of them, so that the driver's
    ``oldest_buffered_age_s`` leaves out the same stretches as
    :meth:`~storage.accessor.LaminarAccessor.buffer_age`. With no resume recorded since
    the start before was last seen going (a stand-in buffer's), the stop ends ``now``."""
    store, group = _open_group(path)
    with reading(store):
        arrays = _read_trajectories(store, group, [f for f in _TIMES if f != "t_held"])
    pauses, last = run_stops(path, arrays)
    resumes = _resumes(group)
    if math.isfinite(last) and not (resumes and resumes[-1] > last):
        pauses.append((last, now))
    return pauses


# Each a moment the run was going: its trajectories' times (``t_held``: when the buffer
# held one again; ``t_leave``: when one left, evicted, filtered, ... as well).
_TIMES = ("t_submit", "t_start", "t_finish", "t_insert", "t_sample", "t_held", "t_leave")


def _activity(
    arrays: Mapping[str, np.ndarray], events: np.ndarray | None = None
) -> np.ndarray | None:
    """The moments the run was going that ``arrays`` (per trajectory) and the store's
    leave ``events`` (their ``event_t_sample``) hold. The events' times are needed as
    well: ``arrays`` hold where each trajectory stands now, so one consumed by an update
    that was lost, then held again, no longer holds when it was sampled (the last thing
    a lost start may have done)."""
    times = [np.asarray(arrays[f], np.float64) for f in _TIMES if f in arrays]
    if events is not None:
        times.append(np.asarray(events, np.float64))
    return np.concatenate(times) if times else None


def pairs(flat: Sequence[float]) -> list[tuple[float, float]]:
    """``open_run``'s flat attribute ``pauses_s`` (from, to, from, to, ...) as pairs."""
    flat = np.asarray(flat, dtype=np.float64)
    return [(float(a), float(b)) for a, b in flat.reshape(-1, 2)]


class _Metrics(NamedTuple):
    """What a run's metrics say of its starts: its ``cluster`` rows (``None``: none)
    and their clock's origin (epoch seconds), and the times (epoch seconds) and versions
    of its ``updates`` and ``publications`` rows (:func:`storage.metrics.version_rows`)."""

    cluster: xr.Dataset | None
    origin: float
    times: np.ndarray
    versions: np.ndarray


def _metrics(run_dir: Path) -> _Metrics:
    from storage.metrics import version_rows

    return _Metrics(*_cluster(run_dir), *version_rows(run_dir))


def _starts(
    run_dir: Path,
    activity: np.ndarray | None = None,
    resumes: Sequence[float] = (),
    metrics: _Metrics | None = None,
) -> dict:
    """What the run's starts say of it, as attributes (numbers and flat lists of them, so
    ``to_netcdf`` takes them; ``pauses_s`` always, the rest once metrics are written):

    * ``pauses_s``: when a resumed run was stopped, between its starts (epoch seconds,
      flat: from, to, from, to, ...; a run started once: ``[]``). Every resume the store
      recorded (``resumes``, epoch seconds, in order) ends a stop, whatever the metrics
      hold (none, one start's rows only, an aborted start's none): the resume records
      itself before the resumed start generates anything, and its buffer holds the
      trajectories held across the stop from then on (a stop ended at the resumed
      start's first trajectory time left its first seconds out of their age, and
      divided the tokens of a throughput window by a sliver of it). The stop begins at
      the last sign of the start before (:func:`_stop_before`): its latest ``activity``
      (epoch seconds the run was going: its trajectories' times and its leave events'),
      ``cluster`` row, update or publication (a stop finishes the update under way:
      its row and its publication come after the last ``cluster`` row; before
      2026-12-07 the stop began before them, and the trajectories held across it lost
      that time of their age) since the resume before, or that resume itself (a start
      that recorded its resume and did nothing else). A boundary between the metrics' starts
      with no resume recorded in it (a laminar from before the record) is the longest
      stretch between the rows with no activity, as :func:`storage.metrics.gaps` says: a
      crash loses the last seconds of rows, not of the trajectory store;
    * ``metrics_end_s``: its last ``cluster`` row (epoch seconds);
    * ``segment_start_s``, ``segment_first_version``: per start in the metrics
      (:func:`storage.metrics.segments`), when it began (epoch seconds: its first row;
      a later start's, the end of the stop before it) and the trainer's version in its
      first row (a resumed start's: the checkpoint's it resumed from, or a later one if
      the trainer had published an update by then).

    ``metrics``: the run's metrics (:func:`_metrics`), where the caller has read them
    already.
    """
    from storage.metrics import gaps, segments

    act = np.asarray([] if activity is None else activity, dtype=np.float64)
    cluster, origin, times, versions = metrics if metrics is not None else _metrics(run_dir)
    act = np.concatenate([act[np.isfinite(act)], times])  # (its updates, publications)
    at = np.asarray(resumes, dtype=np.float64)
    rows = np.zeros(0) if cluster is None else origin + cluster["time"].values
    stops = _resume_stops(at, np.concatenate([act, rows]))
    if cluster is None:
        return {"pauses_s": [t for stop in sorted(stops) for t in stop]}
    starts = segments(cluster, (times - origin, versions))
    between = gaps(cluster, act - origin, starts)
    begun = [origin + starts[0]["start_s"]]
    for a, b, (lo, hi) in zip(starts[:-1], starts[1:], between, strict=True):
        recorded = at[(at > origin + a["end_s"]) & (at <= origin + b["start_s"])]
        if recorded.size:  # (the resume that started b: the last between the rows)
            begun.append(float(recorded[-1]))
        else:  # (a resume by a laminar from before the record)
            stops.append((origin + lo, origin + hi))
            begun.append(origin + hi)
    return {
        "pauses_s": [t for stop in sorted(stops) for t in stop],
        "metrics_end_s": float(rows[-1]),
        "segment_start_s": begun,
        "segment_first_version": [s["first_version"] for s in starts],
    }


def _cluster(run_dir: Path) -> tuple[xr.Dataset | None, float]:
    """The run's ``cluster`` metrics and their clock's origin (epoch seconds); ``None``
    without rows (none written, or metrics that cannot be read: said at WARNING)."""
    from storage.metrics import open_metrics, time_origin

    try:
        cluster = open_metrics(run_dir, "cluster")
    except (FileNotFoundError, KeyError):
        return None, math.nan
    except (StoreError, ValueError, OSError) as e:  # (the trajectories stay readable)
        logger.warning(
            "%s: its metrics cannot be read (%s); its stops are the resumes the "
            "trajectory store recorded",
            run_dir,
            e,
        )
        return None, math.nan
    origin = time_origin(cluster)
    return (None, math.nan) if origin is None else (cluster, origin)


def _resume_stops(resumes: np.ndarray, signs: np.ndarray) -> list[tuple[float, float]]:
    """The stop each resume (epoch seconds, in order) ends: from the last sign of the
    start before it (:func:`_stop_before`); none before a first resume with no sign of a
    start before it."""
    out, previous = [], -math.inf
    for r in resumes.tolist():
        begun = _stop_before(signs, previous, r)
        if begun < r:
            out.append((begun, r))
        previous = r
    return out


def _stop_before(signs: np.ndarray, previous: float, resume: float) -> float:
    """When the start before ``resume`` was last seen going: its latest sign (``signs``:
    epoch seconds the run was going) after the ``previous`` resume, else that resume
    (it began the start; -inf: none)."""
    before = signs[(signs > previous) & (signs < resume)]
    return float(before.max()) if before.size else previous


def open_runs(paths, names: list[str] | None = None) -> xr.Dataset:
    """Several runs' trajectory records in one Dataset, on dimensions ``(run, trajectory)``.

    Every per-trajectory field (staleness, versions, rewards, times, status, lengths) of
    each run; runs with fewer trajectories are padded (NaN; ``""`` for strings; integer
    fields become floats). Token-level arrays stay with :func:`open_run`. ``names`` label
    the ``run`` coordinate (default: the run directories' names); ``n_trajectories``
    holds each run's own count.
    """
    if isinstance(paths, str | os.PathLike):  # (one run: not its path's characters)
        paths = [paths]
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths] if names is None else list(names)
    if len(names) != len(paths) or len(set(names)) != len(names):
        raise StoreError(f"open_runs: need one distinct name per run, got {names!r}")
    records = []
    for p in paths:
        ds = open_run(p)
        records.append(ds[[v for v in ds.data_vars if ds[v].dims == (TRAJECTORY_DIM,)]])
    fill = {v: "" if r[v].dtype.kind == "U" else np.nan for r in records for v in r.data_vars}
    out = xr.concat(records, dim="run", join="outer", fill_value=fill)
    out = out.assign_coords(run=names)
    out["n_trajectories"] = ("run", [r.sizes[TRAJECTORY_DIM] for r in records])
    out.attrs = {"run_dirs": [os.path.abspath(p) for p in paths]}
    return out
