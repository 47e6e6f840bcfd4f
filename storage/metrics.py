"""``metrics.zarr``: the run's time series, as data rather than log lines.

One group per table, one row-dimension per table, one writer (the driver):

============  ==========  ======================================================
table         dimension   one row per
============  ==========  ======================================================
``cluster``   ``time``    driver poll: buffer depth, arrivals, consumption, ages
``rollouts``  ``sample``  rollout per poll (long format; :func:`open_metrics`
                          pivots it to ``time × rollout``)
``updates``   ``update``  trainer update (published version)
============  ==========  ======================================================

With ``metrics.tensorboard: true`` every appended row is also written as TensorBoard
scalars under ``RUN_DIR/tensorboard`` (:class:`TensorBoardMirror`), for watching a run
live; ``metrics.zarr`` stays the record the analysis reads.

Columns are created on first use; a column that appears later is back-filled with NaN
(or ``""``), so components can add metrics without a schema migration. As in
``trajectories.zarr`` the group attribute ``n_committed`` is raised after each append and
readers slice to it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr

from storage.schema import COMMIT_ATTR, STRING
from storage.stores import CHECKED_ZSTD, CHUNKS_ATTR, WRITE_EVERY_CHUNK, check_chunks
from storage.trajectories import (
    StoreError,
    fill_value,
    fixed_width,
    group_arrays,
    reading,
    store_path,
)

logger = logging.getLogger(__name__)

STORE_NAME = "metrics.zarr"
TABLES = {
    "cluster": "time",
    "rollouts": "sample",
    "updates": "update",
    "publications": "publication",  # one row per version the trainer published
    "repacks": "move",  # one row per repack move (docs/repack.md)
    "faults": "recovery",  # one row per recovered batch of a lost rollout (docs/faults.md)
}
_CHUNK = 4096
# Columns that count since the run began: a resumed run's go on from where its earlier
# starts left them (:func:`counters_at_end`), so a rate is a ``diff`` across the whole
# run. The others are gauges (a value at the row's time).
ROLLOUT_COUNTERS = (
    "batches",
    "trajectories",
    "response_tokens",
    "decode_steps",
    "weight_loads",
    "weight_bytes",
    "moves_out",
    "moves_in",
    "moves_taken_back",
    "holds_timed_out",
    "requests_in",
    "reprefill_tokens",
    "reprefill_s",
    "idle_s",
    "weight_wait_s",
    "decode_s",
    "reward_errors",
    "logprob_errors",  # responses with a non-finite behavior logprob (their group discarded)
    "engine_preemptions",
    "engine_prefill_tokens",
    "engine_decode_tokens",
    "engine_admitted",
    "engine_steps",
    "pulls_unreachable",  # batch boundaries whose relay was lost (went on without)
    "pulls_failed",  # ... whose pull failed otherwise: a chunk's checksum (went on without)
    "engine_modelled_s",  # paced engines only
    "engine_compute_s",
    "interrupts",  # partial rollout: global updates that paused it ...
    "interrupted_requests",  # ... the unfinished requests they held (0 when idle)
    "sync_wait_s",  # ... the time it waited for their weights
    "recomputed_tokens",  # ... and the KV it recomputed after them ...
    "recompute_s",  # ... in the steps that did
    "dropped_requests",  # a lost rollout's requests whose version was gone (their
    "dropped_groups",  # groups discarded, made up by the pool: docs/faults.md)
    "topped_up_groups",  # rollout.top_up: groups taken into draining batches ...
    "top_up_asks",  # ... the pool calls that asked for them
    "top_up_s",  # ... and the wall time between decode steps those calls took
)
ROLLOUT_GAUGES = (
    "version",
    "kv_used",
    "kv_capacity",
    "running",
    "waiting",
    "read_at",  # the wall time (epoch s) the rollout read its counters
    "parity_max_abs",
    "parity_mean_abs",
)
# A table's group attribute where the writer keeps each counter's last value, as JSON
# text: ``{"n": rows committed, "counters": ...}`` (:func:`counters_at_end`).
LAST_ATTR = "last_counters"
CUMULATIVE = {
    "cluster": (
        "inserted",
        "consumed",
        "discarded",
        "evicted",
        "filtered",
        "response_tokens",
        "trainer_wait_s",
    ),
    "rollouts": ROLLOUT_COUNTERS,
}


def _column(name: str, values: list[Any]) -> np.ndarray:
    """A column's values as an array: strings (``None`` as ``""``) or float64 (``None``
    as NaN)."""
    present = [v for v in values if v is not None]
    strings = [isinstance(v, str) for v in present]
    if present and all(strings):
        return np.array(["" if v is None else v for v in values], dtype=STRING)
    if any(strings):
        raise ValueError(f"metrics column {name!r} mixes strings and numbers")
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


@contextmanager
def _damage(store: Path) -> Iterator[None]:
    """What a damaged metrics store raises where it is opened (a truncated or replaced
    ``zarr.json``: a JSON, zarr metadata or type error) becomes a :class:`StoreError`
    naming it and the fix. A permission error (``OSError``) is not damage: not caught."""
    try:
        yield
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # (zarr's errors: ValueError)
        raise StoreError(
            f"metrics store {str(store)!r} is damaged ({type(e).__name__}: {e}); restore "
            "it from a copy, or move it aside (rename it, e.g. to "
            f"{store.name}.damaged, to keep its rows): the run then records its metrics "
            "in a new one"
        ) from e


def _check_tables(root: zarr.Group) -> None:
    """Read the metadata an append reads (each table's group, its commit count and its
    columns' array metadata), no chunk."""
    for table in TABLES:
        if table not in root:
            continue
        group = root[table]
        if not isinstance(group, zarr.Group):
            raise TypeError(f"{table!r} is a {type(group).__name__}, not a table's group")
        if COMMIT_ATTR in group.attrs and not int(group.attrs[COMMIT_ATTR]) >= 0:
            raise ValueError(f"{table}'s {COMMIT_ATTR} is {group.attrs[COMMIT_ATTR]!r}")
        if group_arrays(group) and COMMIT_ATTR not in group.attrs:
            # (an empty one lacks it when a kill lands as it is created: read as 0 rows)
            raise ValueError(f"{table} has columns but no {COMMIT_ATTR}")


def check_metrics_store(run_dir: str | Path) -> None:
    """Refuse a run directory whose ``metrics.zarr`` a resumed run could not append to,
    before the cluster starts: reads its metadata (read-only), as
    :class:`MetricsWriter` does when it opens, and the last chunk of each column (the one
    its next append rewrites: a damaged one failed the resumed run at its stop, its
    rows lost); a :class:`StoreError` names the store and the fix. No store yet (or no
    ``zarr.json``: the writer makes one) passes."""
    store = store_path(run_dir, STORE_NAME)
    if not (store / "zarr.json").exists():
        return
    with _damage(store):
        root = zarr.open_group(str(store), mode="r", zarr_format=3)
        _check_tables(root)
        for table in TABLES:
            if table not in root:
                continue
            group = root[table]
            n = int(group.attrs.get(COMMIT_ATTR, 0))
            for _, arr in group_arrays(group):
                end = min(n, arr.shape[0])
                if end > 0:
                    arr[(end - 1) // arr.chunks[0] * arr.chunks[0] : end]


class MetricsWriter:
    """Append rows (mappings of column -> number or string) to the tables of a run.

    >>> import tempfile
    >>> w = MetricsWriter(tempfile.mkdtemp())
    >>> w.append("updates", [{"version": 1, "loss": 0.5}])
    >>> w.append("updates", [{"version": 2, "loss": 0.4, "grad_norm": 1.0}])
    >>> ds = open_metrics(w.path.parent, "updates")
    >>> ds["loss"].values.tolist(), ds["grad_norm"].values.tolist()
    ([0.5, 0.4], [nan, 1.0])
    """

    def __init__(
        self, path: str | Path, tensorboard: bool = False, resumed_from: int | None = None
    ) -> None:
        self.path = store_path(path, STORE_NAME)
        with _damage(self.path):  # (what append reads first, read now: a clear error)
            self.root = zarr.open_group(str(self.path), mode="a", zarr_format=3)
            _check_tables(self.root)
        # (resumed_from: the checkpoint version a resumed start went on from, for the
        # mirror's version-stepped curves: TensorBoardMirror)
        self.tensorboard = (
            TensorBoardMirror(self.path.parent, resumed_from=resumed_from) if tensorboard else None
        )
        # table -> where its cumulative counters stand (:data:`LAST_ATTR`), as appended
        self._last: dict[str, dict] = {}

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _table(self, table: str) -> zarr.Group:
        if table not in TABLES:
            raise ValueError(f"unknown metrics table {table!r}; tables are {sorted(TABLES)}")
        if table not in self.root:
            # (with its marker, in one write: a kill between the two left a table every
            # later append failed on). Every chunk written, that holding only fill
            # values too: a chunk missing from its committed rows is then lost data
            # (a copy cut short), refused where it is read, not NaN in a plot.
            # Its columns committed with its rows (COLUMNS_ATTR): one made by an append
            # killed before its commit (its earlier rows' chunks not yet back-filled)
            # is no column of the table's, not a lost chunk.
            return self.root.create_group(
                table, attributes={COMMIT_ATTR: 0, CHUNKS_ATTR: True, COLUMNS_ATTR: []}
            )
        return self.root[table]

    def append(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        group = self._table(table)
        dim = TABLES[table]
        # (no marker: created by a writer killed before it wrote one, without columns:
        # _check_tables refuses one with columns)
        n = int(group.attrs.get(COMMIT_ATTR, 0))
        names = list(dict.fromkeys(k for r in rows for k in r))
        columns = {name: _column(f"{table}.{name}", [r.get(name) for r in rows]) for name in names}
        # One listing of the table's arrays: a lookup by name reads that array's metadata
        # from disk each time (~1 ms a column, twice for each: half an append's time).
        arrays = dict(group.arrays())
        committed = group.attrs.get(COLUMNS_ATTR)  # (None: a table written before)
        for name in [a for a in arrays if committed is not None and a not in committed]:
            del group[name]  # (made by an append killed before its commit: made again)
            del arrays[name]
        for name, values in columns.items():
            old = arrays.get(name)
            if old is not None and old.dtype.kind != "T" and values.dtype.kind == "T":
                # strings in a column created from rows of only None (float): it holds
                # nothing but NaN, so it becomes a string column
                if not np.isnan(old[:n]).all():
                    raise ValueError(f"metrics column {table}.{name!r} mixes strings and numbers")
                del group[name]
                old = None
            if old is None:
                arrays[name] = group.create_array(
                    name,
                    shape=(n,),
                    dtype=str if values.dtype.kind == "T" else values.dtype,
                    chunks=(_CHUNK,),
                    dimension_names=[dim],
                    fill_value=fill_value(values.dtype),
                    compressors=CHECKED_ZSTD,  # (a changed chunk is refused, not misread)
                )
                if n and group.attrs.get(CHUNKS_ATTR):  # (a column new to earlier rows)
                    fill = np.full(n, fill_value(arrays[name].dtype), dtype=arrays[name].dtype)
                    arrays[name].with_config(WRITE_EVERY_CHUNK)[:] = fill
            elif values.dtype.kind != old.dtype.kind and all(r.get(name) is None for r in rows):
                values = np.full(len(rows), fill_value(old.dtype))  # only None: the fill
            elif old.dtype.kind == "T" and values.dtype.kind != "T":
                # (cast, numbers would be stored as their text: "3.5")
                raise ValueError(f"metrics column {table}.{name!r} mixes strings and numbers")
            columns[name] = values.astype(arrays[name].dtype)
        for name, arr in arrays.items():
            if arr.shape[0] != n:  # left by an interrupted append: drop it
                arr.resize((n,))
            # Written, not grown: growing would show what the interrupted append left
            # in the chunk instead of the fill of a column absent from these rows.
            values = columns.get(name)
            if values is None:
                values = np.full(len(rows), fill_value(arr.dtype), dtype=arr.dtype)
            arr.with_config(WRITE_EVERY_CHUNK).append(values)
        attrs: dict[str, Any] = {COMMIT_ATTR: n + len(rows)}
        if committed is not None:
            attrs[COLUMNS_ATTR] = sorted(arrays)
        if table in CUMULATIVE:
            # Where each counter stands, committed with the rows (one write of the
            # group's metadata): a resume reads it, not the whole table.
            if table not in self._last:
                self._last[table] = _group_counters(group, table, n)
            _merge(self._last[table], _latest(table, columns.get), table)
            # (as JSON text: zarr encodes a nested attribute ~6x slower, 40 ms at R = 256)
            attrs[LAST_ATTR] = json.dumps({"n": n + len(rows), "counters": self._last[table]})
        # (one write of the group's metadata: attrs.update writes it once per key, and a
        # failure between them left the rows committed while append raised, so the
        # driver appended them again)
        group.update_attributes(attrs)
        if self.tensorboard is not None:  # after the commit: the record comes first
            try:
                self.tensorboard.add(table, rows, first=n)
            except Exception as e:  # noqa: BLE001 — a mirror must not stop the run
                logger.warning("TensorBoard mirror: %s rows not written: %r", table, e)


# Columns that place a row rather than measure something: not drawn as scalars.
_PLACING = {"elapsed_s", "wall_time", "time", "t_publish", "rollout"}
_WALL = ("wall_time", "time", "t_publish")  # epoch seconds, in the tables that have one


# The tables whose TensorBoard step is the weight version, written in a folder of their own
VERSIONED = ("updates", "publications")
VERSIONS_DIR = "versions"


class TensorBoardMirror:
    """Each metrics row as TensorBoard scalars, tagged ``<table>/<column>`` (``rollouts``:
    ``rollouts/<column>/<rollout>``). The step is the weight version in ``updates`` and
    ``publications``, milliseconds since the run began in ``cluster`` and ``rollouts`` (so
    their curves line up, and a resumed run continues them), and the event's number in
    ``repacks`` and ``faults``; every point carries its row's wall time, for TensorBoard's
    "relative" axis. Strings, and columns that only place a row, are not drawn.

    The version-stepped tables are written under ``tensorboard/versions`` (a TensorBoard
    run of their own): a start resumed from its checkpoint of version ``resumed_from``
    redoes the versions after it, so it opens that folder's writer with ``purge_step =
    resumed_from + 1`` (TensorBoard drops the earlier start's points from that step on:
    the curves go on from the checkpoint, not back and forth), and leaves out its
    re-publication of the checkpoint's version (drawn once, by the start that made it).
    """

    def __init__(self, run_dir: str | Path, resumed_from: int | None = None) -> None:
        try:  # tensorboardX: TensorBoard's event files without TensorFlow (or torch)
            from tensorboardX import SummaryWriter
        except ImportError as e:  # preflight says so first; this is the backstop
            raise ImportError(
                "metrics.tensorboard needs tensorboardX (its writer): "
                "pip install tensorboardX (in a checkout: pip install -e '.[tensorboard]'), or "
                "set metrics.tensorboard=false"
            ) from e
        self.log_dir = Path(run_dir) / "tensorboard"
        # A file of its own, even for a writer opened in the same second (a resume).
        suffix = f".{os.getpid()}.{time.time_ns()}"
        self.writer = SummaryWriter(logdir=str(self.log_dir), filename_suffix=suffix)
        self.resumed_from = resumed_from
        purge = None if resumed_from is None else int(resumed_from) + 1
        self.versions = SummaryWriter(
            logdir=str(self.log_dir / VERSIONS_DIR), filename_suffix=suffix, purge_step=purge
        )
        self._origin: float | None = None  # wall_time - elapsed_s, from the cluster rows

    def add(self, table: str, rows: Sequence[Mapping[str, Any]], first: int) -> None:
        writer = self.versions if table in VERSIONED else self.writer
        for i, row in enumerate(rows):
            wall = next((float(row[k]) for k in _WALL if row.get(k) is not None), None)
            skip, tag = _PLACING, f"{table}/{{}}"
            if "elapsed_s" in row:  # cluster, rollouts
                step = round(1000 * float(row["elapsed_s"]))
                if wall is not None:
                    self._origin = wall - float(row["elapsed_s"])
                elif self._origin is not None:  # rollouts rows: the poll's wall time
                    wall = self._origin + float(row["elapsed_s"])
                if table == "rollouts":
                    tag = f"{table}/{{}}/{row['rollout']}"
            elif row.get("version") is not None and table in VERSIONED:
                step, skip = int(row["version"]), _PLACING | {"version"}
                if self.resumed_from is not None and step <= self.resumed_from:
                    continue  # (the checkpoint's version published again by its resume)
            else:
                step = first + i
            for name, value in row.items():
                if name in skip or isinstance(value, str) or value is None:
                    continue
                value = float(value)
                if not np.isnan(value):
                    writer.add_scalar(tag.format(name), value, global_step=step, walltime=wall)
        writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.versions.close()


def open_metrics(path: str | Path, table: str) -> xr.Dataset:
    """One metrics table of a run as an :class:`xarray.Dataset` (committed rows only).

    ``rollouts`` comes back pivoted to dimensions ``time × rollout``; ``cluster`` has a
    ``time`` coordinate (seconds since the run started) so ``.sel``/``.interp`` work, and
    a ``wall_time`` datetime coordinate for ``resample``.
    """
    if table not in TABLES:
        raise KeyError(f"no metrics table {table!r}; the tables are {list(TABLES)}")
    store = store_path(path, STORE_NAME)
    if not (store / "zarr.json").exists():
        raise FileNotFoundError(
            f"no metrics store at {str(store)!r}; pass a run directory written by "
            "`laminar run` (it holds metrics.zarr once the run has recorded its first rows)"
        )
    with reading(store):
        root = zarr.open_group(str(store), mode="r", zarr_format=3)
        group = root[table] if table in root else None
        if group is None or COMMIT_ATTR not in group.attrs:  # (created, not yet committed)
            raise KeyError(
                f"metrics store {str(store)!r} has no table {table!r}: the run has written "
                "no row of it (yet: it is written with its first rows; repacks and faults "
                "only by runs that moved or recovered something)"
            )
        ds = _read_table(group, table, store / table)
    # (where it was read: segments() reads the updates and publications beside it)
    ds.attrs["run_dir"] = str(store.parent.absolute())
    return ds


def _read_table(group: zarr.Group, table: str, folder: Path | None = None) -> xr.Dataset:
    n = int(group.attrs[COMMIT_ATTR])
    dim = TABLES[table]
    data = {}
    committed = group.attrs.get(COLUMNS_ATTR)  # (None: a table written before)
    for name, arr in group_arrays(group):  # (a store being written: no temp-file warning)
        if committed is not None and name not in committed:
            continue  # (being made by an append not yet committed, or killed before it)
        if folder is not None and group.attrs.get(CHUNKS_ATTR):
            check_chunks(folder, group, name, arr, n)  # (written since 2026-12-07)
        values = arr[:n]
        if values.dtype.kind == "T":
            values = fixed_width(values)
        data[name] = (dim, values)
    ds = xr.Dataset(data)
    if table == "rollouts" and n:
        ds = ds.set_index({dim: ["elapsed_s", "rollout"]}).unstack(dim)
        ds = ds.rename({"elapsed_s": "time"})
    elif table == "cluster" and n:
        ds = ds.set_coords("elapsed_s").swap_dims({dim: "elapsed_s"}).rename({"elapsed_s": dim})
        # A datetime coordinate beside the seconds, for resample():
        # ds.swap_dims(time="wall_time").resample(wall_time="10s").mean()
        if "wall_time" in ds:
            seconds = ds["wall_time"].values
            ds = ds.assign_coords(wall_time=(dim, (seconds * 1e9).astype("datetime64[ns]")))
    return ds


# A table's columns, committed with its rows (tables made since 2026-12-07)
COLUMNS_ATTR = "committed_columns"


# Rows written before starts were marked (2026-12-04): a stretch this long between two of
# them, and this many times their median spacing, is a stop between two starts (a resume
# takes a cluster's start and the model's load; rows come every metrics.poll_s).
UNMARKED_STOP_S = 60.0
UNMARKED_STOP_FACTOR = 20.0


def _unmarked_stops(t: np.ndarray) -> float:
    """The seconds between rows ``t`` (of one segment, unmarked) that look like stops."""
    if len(t) < 3:
        return 0.0
    dt = np.diff(t)
    long = dt > max(UNMARKED_STOP_S, UNMARKED_STOP_FACTOR * float(np.median(dt)))
    return float(dt[long].sum())


# The tables whose rows name a version made at a time (epoch seconds): a start's last
# update and its publication come after its last ``cluster`` row, a poll or more (a stop
# finishes the update under way, its row written at the end), and a resumed start
# publishes its checkpoint's version before its first row.
VERSION_TABLES = {"updates": "time", "publications": "t_publish"}


def version_rows(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The times (epoch seconds) and versions of the run's :data:`VERSION_TABLES` rows
    (``updates``, ``publications``), in time order: moments the run was going, and at
    which version. A table not written yet is left out; one that cannot be read too,
    said at WARNING (what reads them, a run's starts, stays readable)."""
    times, versions = [np.zeros(0)], [np.zeros(0)]
    for table, column in VERSION_TABLES.items():
        try:
            rows = open_metrics(run_dir, table)
        except (FileNotFoundError, KeyError):
            continue
        except (StoreError, ValueError, OSError) as e:
            logger.warning("%s: its %s table cannot be read (%s)", run_dir, table, e)
            continue
        if column in rows and "version" in rows:
            times.append(rows[column].values.astype(np.float64))
            versions.append(rows["version"].values.astype(np.float64))
    t, v = np.concatenate(times), np.concatenate(versions)
    ok = np.isfinite(t) & np.isfinite(v)
    order = np.argsort(t[ok], kind="stable")
    return t[ok][order], v[ok][order]


def segments(
    cluster: xr.Dataset, versions: tuple[np.ndarray, np.ndarray] | None = None
) -> list[dict]:
    """The stretches of time a run ran, one per start (``laminar run --resume`` adds
    one), from its ``cluster`` rows: ``segment`` (0, 1, ...), ``start_s`` and ``end_s``
    (its first and last row, seconds on the run's clock: rows come every
    ``metrics.poll_s``), ``stopped_s`` and the trainer's ``first_version`` and
    ``last_version``. Rows recorded before segments were marked are the first; as they
    may hold several starts, ``stopped_s`` is the time between them that looks like a
    stop (:data:`UNMARKED_STOP_S`: it ran ``end_s - start_s - stopped_s``), 0 for
    marked rows.

    The versions are those of the start's first and last moment among its ``cluster``
    rows and its ``updates`` and ``publications`` rows (``versions``: their times on
    the run's clock and versions; by default :func:`version_rows` of the run directory
    ``cluster`` was read from): a start stopped ends with the update under way, after
    its last row (before 2026-12-07 ``last_version`` was its last row's, one short of
    what its stop and ``summary.json`` said), and a resumed start publishes the
    checkpoint's version it resumed from before its first row. Such a row between two
    starts is the earlier's if it lies before the longest stretch between them with no
    row (the stop, as :func:`gaps` finds it), else the later's.

    >>> import tempfile
    >>> w = MetricsWriter(tempfile.mkdtemp())
    >>> rows = [(0, 1.0, 0), (0, 2.0, 3), (1, 60.0, 3), (1, 61.0, 5)]
    >>> w.append("cluster", [{"segment": s, "elapsed_s": t, "wall_time": 1e9 + t,
    ...                       "version": v} for s, t, v in rows])
    >>> [(s["start_s"], s["end_s"], s["last_version"]) for s in segments(
    ...     open_metrics(w.path.parent, "cluster"))]
    [(1.0, 2.0, 3), (60.0, 61.0, 5)]
    >>> w.append("updates", [{"version": 4, "time": 1e9 + 2.5}])  # after its last row
    >>> [s["last_version"] for s in segments(open_metrics(w.path.parent, "cluster"))]
    [4, 5]
    """
    n = cluster.sizes.get("time", 0)
    if not n:
        return []
    seg = cluster["segment"].values if "segment" in cluster else np.full(n, np.nan)
    unmarked = np.isnan(seg.astype(np.float64))
    seg = np.nan_to_num(seg, nan=0.0).astype(np.int64)  # (rows from before: the first)
    t, v = cluster["time"].values, cluster["version"].values
    out = []
    for s in dict.fromkeys(seg.tolist()):
        i = np.flatnonzero(seg == s)
        out.append(
            {
                "segment": int(s),
                "start_s": float(t[i[0]]),
                "end_s": float(t[i[-1]]),
                "stopped_s": _unmarked_stops(t[i[unmarked[i]]]),
                "first_version": int(v[i[0]]),
                "last_version": int(v[i[-1]]),
            }
        )
    if versions is None:
        versions = _version_rows_of(cluster)
    _add_versions(out, *versions)
    return out


def _version_rows_of(cluster: xr.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """:func:`version_rows` of the run ``cluster`` was read from (:func:`open_metrics`
    records it), on the run's clock; none for rows made otherwise."""
    origin = time_origin(cluster)
    run_dir = cluster.attrs.get("run_dir")
    if run_dir is None or origin is None:
        return np.zeros(0), np.zeros(0)
    times, versions = version_rows(run_dir)
    return times - origin, versions


def _add_versions(starts: list[dict], times: np.ndarray, versions: np.ndarray) -> None:
    """Widen each start's ``first_version``/``last_version`` (in place) to the rows at
    ``times`` (the run's clock) with ``versions`` that are its (:func:`segments`)."""
    times, versions = np.asarray(times, np.float64), np.asarray(versions, np.float64)
    if not times.size:
        return
    # Where each start after the first begins for these rows: the end of the longest
    # stretch with none of them between the start before's last row and its first
    cuts = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        inside = np.sort(times[(times > a["end_s"]) & (times < b["start_s"])])
        points = np.concatenate([[a["end_s"]], inside, [b["start_s"]]])
        cuts.append(float(points[int(np.argmax(np.diff(points))) + 1]))
    which = np.searchsorted(np.asarray(cuts), times, side="right")
    for k, s in enumerate(starts):
        mine = which == k
        if not mine.any():
            continue
        t, v = times[mine], versions[mine]
        first, last = int(np.argmin(t)), len(t) - 1 - int(np.argmax(t[::-1]))
        if t[first] < s["start_s"]:
            s["first_version"] = int(v[first])
        if t[last] >= s["end_s"]:
            s["last_version"] = int(v[last])


def gaps(
    cluster: xr.Dataset,
    activity: np.ndarray | None = None,
    starts: list[dict] | None = None,
) -> list[tuple[float, float]]:
    """The stretches a resumed run was stopped, between its starts (:func:`segments`):
    ``(from, to)`` on the run's clock, from one start's last row to the next's first.

    Rows are written every few seconds, so a crash loses the last ones, and a resumed
    start is going a moment before its first row. ``activity``: other times (the run's
    clock) it was going, e.g. its trajectories' times (NaN ignored); then each stop is
    the longest stretch between the two rows with no activity in it: it begins at the
    last sign of the earlier start, and ends at the first of the next.

    >>> import tempfile
    >>> w = MetricsWriter(tempfile.mkdtemp())
    >>> w.append("cluster", [{"segment": s, "elapsed_s": t, "version": 0}
    ...                      for s, t in [(0, 0.0), (0, 5.0), (1, 60.0)]])
    >>> cluster = open_metrics(w.path.parent, "cluster")
    >>> gaps(cluster), gaps(cluster, np.array([7.0, 59.0]))
    ([(5.0, 60.0)], [(7.0, 59.0)])

    ``starts``: :func:`segments` of ``cluster``, where the caller has them.
    """
    seg = segments(cluster) if starts is None else starts
    out = []
    if len(seg) < 2:  # (a run started once has no stop: its activity need not be sorted)
        return out
    act = np.asarray([] if activity is None else activity, dtype=np.float64)
    act = np.sort(act[np.isfinite(act)])
    for a, b in zip(seg[:-1], seg[1:], strict=True):
        lo, hi = a["end_s"], b["start_s"]
        inside = act[(act > lo) & (act < hi)]
        points = np.concatenate([[lo], inside, [hi]])
        i = int(np.argmax(np.diff(points)))  # (the first, of equally long stretches)
        out.append((float(points[i]), float(points[i + 1])))
    return out


def counters_at_end(run_dir: str | Path) -> dict[str, dict]:
    """Where a run's :data:`CUMULATIVE` counters stood when it stopped (what a resumed
    run adds its own to): ``{"cluster": {column: value}, "rollouts": {rollout: {column:
    value}}}``, each the column's last recorded value (NaN-free; a rollout's last row
    that has it). Tables or columns not written yet are left out.

    Read from where :class:`MetricsWriter` keeps them as it appends (the table's
    :data:`LAST_ATTR`), and from the rows appended after that (none, unless a writer
    older than it appended); a table written before it was kept is read whole (a
    resume used to read and pivot the whole ``rollouts`` table: 7 s and 0.9 GB at a
    million rows, a few hours at R = 256).

    >>> import tempfile
    >>> run = tempfile.mkdtemp()
    >>> w = MetricsWriter(run)
    >>> w.append("cluster", [{"elapsed_s": 1.0, "inserted": 4}, {"elapsed_s": 2.0, "inserted": 9}])
    >>> w.append("rollouts", [{"elapsed_s": 1.0, "rollout": "r0", "batches": 1},
    ...                       {"elapsed_s": 1.0, "rollout": "r1", "batches": 2},
    ...                       {"elapsed_s": 2.0, "rollout": "r0", "batches": 3}])
    >>> counters_at_end(run)
    {'cluster': {'inserted': 9.0}, 'rollouts': {'r0': {'batches': 3.0}, 'r1': {'batches': 2.0}}}
    """
    out: dict[str, dict] = {"cluster": {}, "rollouts": {}}
    store = store_path(run_dir, STORE_NAME)
    if not (store / "zarr.json").exists():
        return out
    with reading(store):
        root = zarr.open_group(str(store), mode="r", zarr_format=3)
        for table in out:
            group = root[table] if table in root else None
            if group is None or COMMIT_ATTR not in group.attrs:
                continue
            out[table] = _group_counters(group, table, int(group.attrs[COMMIT_ATTR]))
    return out


def _group_counters(group: zarr.Group, table: str, n: int) -> dict:
    """Where a table's :data:`CUMULATIVE` counters stand after its first ``n`` rows:
    its :data:`LAST_ATTR`, with the rows after the one it was kept at (all of them when
    it has none, or one kept past ``n``)."""
    kept = group.attrs.get(LAST_ATTR)
    try:
        kept = json.loads(kept) if isinstance(kept, str) else kept
    except ValueError:  # (damaged: the table is read instead)
        kept = None
    counters: dict = {}
    start = 0
    if isinstance(kept, dict) and 0 <= int(kept.get("n", -1)) <= n:
        counters = {k: dict(v) if isinstance(v, dict) else v for k, v in kept["counters"].items()}
        start = int(kept["n"])
    if start < n:
        arrays = dict(group_arrays(group))

        def column(name: str) -> np.ndarray | None:
            arr = arrays.get(name)
            return None if arr is None else np.asarray(arr[start:n])

        _merge(counters, _latest(table, column), table)
    return counters


def _latest(table: str, column) -> dict:
    """The last non-NaN value of each of a table's :data:`CUMULATIVE` counters among
    some rows (``column(name)``: their values, or ``None`` where the column is absent):
    ``{column: value}``, and for ``rollouts`` ``{rollout: {column: value}}``."""
    out: dict = {}
    rid = column("rollout") if table == "rollouts" else None
    if table == "rollouts":
        if rid is None:
            return out
        rid = np.asarray(rid)
        rid = fixed_width(rid) if rid.dtype.kind == "T" else rid.astype(str)
    for col in CUMULATIVE[table]:
        values = column(col)
        if values is None or np.asarray(values).dtype.kind not in "fiu":
            continue
        values = np.asarray(values, dtype=np.float64)
        ok = np.flatnonzero(~np.isnan(values))
        if not ok.size:
            continue
        if rid is None:
            out[col] = float(values[ok[-1]])
            continue
        last = ok[::-1]  # (each rollout's first here is its last row with the column)
        rids, first = np.unique(rid[last], return_index=True)
        for r, i in zip(rids.tolist(), last[first].tolist(), strict=True):
            out.setdefault(r, {})[col] = float(values[i])
    return out


def _merge(counters: dict, newer: dict, table: str) -> None:
    """``newer`` counter values over ``counters`` (in place)."""
    if table != "rollouts":
        counters.update(newer)
        return
    for rid, values in newer.items():
        counters.setdefault(rid, {}).update(values)


def time_origin(cluster: xr.Dataset) -> float | None:
    """When the run's clock began, in epoch seconds (``cluster.time`` counts from it,
    across resumes; the event tables hold epoch seconds): ``None`` with no rows yet."""
    if "wall_time" not in cluster.coords or not cluster.sizes.get("time"):
        return None
    wall = cluster["wall_time"].values[-1].astype("datetime64[ns]").astype(np.int64) / 1e9
    return float(wall - cluster["time"].values[-1])
