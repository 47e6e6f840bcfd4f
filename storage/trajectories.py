"""``trajectories.zarr``: a single writer appends record batches; readers never see a torn one.

The writer appends every token-level array first, then every per-trajectory array, then
the leave events, and only then raises the group attributes ``n_committed`` (with the
token and event counts beside it) in one update. Readers slice every array to the
committed lengths, so a batch half-written when a reader looks (or when the writer dies)
is invisible rather than corrupt.

A trajectory is stored once, when the buffer admits it (status ``buffered``); when it
leaves (consumed, evicted, …) a small *leave event* is appended, and readers apply the
events (:data:`storage.schema.EVENT_FIELDS`). So the store always holds every admitted
trajectory — a crash loses at most the batch not yet flushed — and what is still
unconsumed is what a reader sees as ``buffered``.

Only one process may write a store: several appenders to one Zarr array corrupt it
silently (see ``shared/notes/stack.md``).

This module is the writer. The readers (:func:`open_run`, :func:`open_runs`,
:func:`open_trajectories`, ...) are in :mod:`storage.trajectories_read`, and what every
store of a run shares (:class:`StoreError`, :func:`store_path`, ...) in
:mod:`storage.stores`; their public names are importable from here as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
    SCALARS,
    SCHEMA_VERSION,
    STATUSES,
    TRAJECTORY_DIM,
    left_as_sampled,
)
from storage.stores import CHUNKS_ATTR, WRITE_EVERY_CHUNK, _check_markers, _decoding
from storage.stores import RUN_STORES as RUN_STORES
from storage.stores import STORE_NAME as STORE_NAME
from storage.stores import StoreError as StoreError
from storage.stores import committed_array as committed_array
from storage.stores import fill_value as fill_value
from storage.stores import fixed_width as fixed_width
from storage.stores import group_arrays as group_arrays
from storage.stores import new_array as new_array
from storage.stores import reading as reading
from storage.stores import store_path as store_path
from storage.trajectories_read import HELD_AGAIN as HELD_AGAIN
from storage.trajectories_read import _open_group
from storage.trajectories_read import committed as committed
from storage.trajectories_read import has_leave_fields as has_leave_fields
from storage.trajectories_read import open_run as open_run
from storage.trajectories_read import open_runs as open_runs
from storage.trajectories_read import open_trajectories as open_trajectories
from storage.trajectories_read import pairs as pairs
from storage.trajectories_read import recorded_resumes as recorded_resumes
from storage.trajectories_read import records_at as records_at
from storage.trajectories_read import run_stops as run_stops
from storage.trajectories_read import time_in_buffer as time_in_buffer
from storage.trajectories_read import tokens_at as tokens_at

# A group attribute: raised by each writer as it opens the store, and checked before
# each of its commits (TrajectoryWriter._check_epoch).
EPOCH_ATTR = "writer_epoch"


class WriterReplaced(StoreError):
    """Another writer opened the store since this one did: this one writes no more."""


# Values per chunk. zarr reads a chunk for ~0.5 ms on top of its bytes, so reading a
# run's per-trajectory fields was mostly chunk count at 4096 (open_run of 1M trajectories:
# ~4 s of its ~10 in ~7,000 chunks); 16,384 reads a number field 4x faster, and costs an
# append (which rewrites the last chunk) about the same, +3 ms a string field.
_CHUNK_TRAJ = 16384
_CHUNK_TOK = 65536


class TrajectoryWriter:
    """Append trajectory records (mappings of field -> value) to a Zarr store.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from storage.schema import ALL_FIELDS
    >>> w = TrajectoryWriter(tempfile.mkdtemp())
    >>> rec = {f: 0 for f in ALL_FIELDS} | {
    ...     "uid": "t0", "prompt_uid": "p0", "finish_reason": "eos", "rollout_ids": "r0",
    ...     "status": "consumed", "prompt_tokens": np.array([1, 5]),
    ...     "response_tokens": np.array([7, 2]), "behavior_logprobs": np.array([-.1, -.2]),
    ...     "loss_mask": np.array([1, 1]), "token_versions": np.array([], int)}
    >>> w.append([rec])
    1
    >>> open_trajectories(w.path)["response_tokens"].tolist()
    [7, 2]
    """

    def __init__(self, path: str | Path, schedule: str = "laminar") -> None:
        """``schedule``: the ``pipeline.schedule`` that writes the run, recorded in the
        store's attributes (the audit knows from it whether responses may mix versions)."""
        self.path = store_path(path)
        exists = (self.path / "zarr.json").exists()
        with reading(self.path):
            self.group = zarr.open_group(str(self.path), mode="a", zarr_format=3)
            created = not exists or _never_created(self.path, self.group)
            schema = self.group.attrs.get("schema_version")
            if created:
                self._create(schedule)
            elif schema not in (LEAVE_SCHEMA - 1, SCHEMA_VERSION):
                raise StoreError(
                    f"{str(self.path)!r} has schema_version {schema!r}, this code writes "
                    f"{SCHEMA_VERSION}; use a new run directory"
                )
            _check_markers(self.path, self.group, EVENT_COMMIT_ATTR)
            # This writer's turn (created: the first, 1): a writer that opened the store
            # before it commits nothing more (_check_epoch). Before a schema-2 store is
            # taken on: a writer of it still going would otherwise commit rows without
            # the arrays the migration adds.
            self.epoch = 1 if created else int(self.group.attrs.get(EPOCH_ATTR, 0)) + 1
            if not created:
                self.group.update_attributes({EPOCH_ATTR: self.epoch})
            if not created and schema == LEAVE_SCHEMA - 1:
                self._add_leave_fields()
            self.n_committed = int(self.group.attrs[COMMIT_ATTR])
            self.tokens_committed = dict(self.group.attrs["n_committed_tokens"])
            self.events_committed = int(self.group.attrs[EVENT_COMMIT_ATTR])
            # (before anything is truncated: a store shorter than its markers is not
            # padded to them with empty trajectories)
            for name, n in self._lengths().items():
                committed_array(self.path, self.group, name, n)
            self._truncate_uncommitted()

    def _create(self, schedule: str) -> None:
        """The arrays, then every attribute in one write: until then the store is not
        created (:func:`_never_created`), and a writer opening it creates it again (a
        kill part-way used to leave a store every later open refused, and one killed
        before its ``schedule`` read as a ``laminar`` store)."""
        g = self.group
        for name, (dtype, dim, chunk) in _arrays().items():  # (over any a kill left)
            new_array(g, name, dtype, dim, chunk, overwrite=True)
        self.group.update_attributes(  # (one write: attrs.update writes key by key)
            {
                "schedule": schedule,
                "schema_version": SCHEMA_VERSION,
                EPOCH_ATTR: 1,
                COMMIT_ATTR: 0,
                "n_committed_tokens": {dim: 0 for dim, _ in RAGGED.values()},
                EVENT_COMMIT_ATTR: 0,
                CHUNKS_ATTR: True,  # (append writes every chunk: a missing one is lost)
            }
        )

    def _add_leave_fields(self) -> None:
        """Take on a store of schema 2 (before ``t_leave`` and ``leave_version``, a
        resume of a run an older laminar wrote): their arrays, per trajectory and per
        leave event, are added for what it committed, as such a store is read
        (:func:`storage.schema.left_as_sampled`: known for a consumed trajectory, its
        sampling; NaN, -1 for the rest), then ``schema_version`` is raised in one write
        of the group's attributes. A kill in between leaves a store of schema 2, whose
        readers leave the added arrays alone, and which the next writer takes on again.
        What is past the committed lengths is not read (the writer takes it back)."""
        g = self.group
        n, m = int(g.attrs[COMMIT_ATTR]), int(g.attrs[EVENT_COMMIT_ATTR])

        def read(name: str, k: int) -> np.ndarray:
            return committed_array(self.path, g, name, k)[:k]

        stored = (read(f, n) for f in ("status", "t_sample", "sample_version"))
        values = dict(zip(LEAVE_FIELDS, left_as_sampled(*stored), strict=True))
        events = (read(f, m) for f in ("event_status", "event_t_sample", "event_sample_version"))
        values |= dict(zip(_EVENT_LEAVE, left_as_sampled(*events), strict=True))
        specs = _arrays()
        for name, v in values.items():
            dtype, dim, chunk = specs[name]
            arr = new_array(g, name, dtype, dim, chunk, overwrite=True)
            arr.with_config(WRITE_EVERY_CHUNK).append(v.astype(dtype))
        # (the rows from n on were written knowing when they left: the audit checks them)
        self.group.update_attributes({"schema_version": SCHEMA_VERSION, "leave_known_from": n})

    def record_resume(self, from_version: int, t: float) -> None:
        """A start that resumed the run in place from its checkpoint of ``from_version``,
        at ``t`` (epoch seconds, before it generated anything): the attribute
        ``resumes`` (``[[t, version], ...]``). The lost start's trajectories of versions
        after ``from_version`` were generated by weights the resume redoes under the same
        numbers (:meth:`~storage.accessor.LaminarAccessor.superseded` reads this). Call it
        before this writer commits anything: it is one write of the group's attributes,
        as each commit is."""
        resumes = [[*r] for r in recorded_resumes(self.group)] + [[float(t), int(from_version)]]
        self._check_epoch()
        self.group.update_attributes({"resumes": resumes})

    def _check_epoch(self) -> None:
        """That no writer opened the store after this one (its ``zarr.json``, read from
        disk: ~0.1 ms): two appending to one store corrupt it silently, and what this
        one would commit now goes over what the newer one commits. Else a
        :class:`WriterReplaced` naming the store; nothing more is written."""
        try:
            doc = json.loads((self.path / "zarr.json").read_bytes())
            epoch = doc["attributes"].get(EPOCH_ATTR)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            epoch = f"unreadable ({type(e).__name__}: {e})"
        if epoch != self.epoch:
            raise WriterReplaced(
                f"{str(self.path)!r}: another writer took the store over (its "
                f"{EPOCH_ATTR} is {epoch!r}, this writer's {self.epoch}): this one commits "
                "nothing more (two writers of one store corrupt it); the data module that "
                "opened it last writes it"
            )

    def _lengths(self) -> dict[str, int]:
        """Every array's committed length."""
        out = dict.fromkeys(SCALARS, self.n_committed)
        for group, (dim, fields) in RAGGED.items():
            out |= dict.fromkeys((f"{group}_start", f"{group}_len"), self.n_committed)
            out |= dict.fromkeys(fields, self.tokens_committed[dim])
        return out | dict.fromkeys(EVENT_FIELDS, self.events_committed)

    def _truncate_uncommitted(self) -> None:
        """Drop a batch a previous writer left half-appended (reopening after a crash)."""
        arrays = dict(self.group.arrays())
        for name, n in self._lengths().items():
            if arrays[name].shape[0] != n:
                arrays[name].resize((n,))

    def append(
        self, records: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]] = ()
    ) -> int:
        """Append records, then leave events (mappings with ``uid``, ``status``,
        ``sample_version``, ``t_sample`` of trajectories stored before or in this call),
        and commit them together; returns the number of committed trajectories."""
        if not records and not events:
            return self.n_committed
        bad = [e for e in events if e["status"] not in STATUSES]
        if bad:
            raise StoreError(
                f"leave event for {bad[0]['uid']!r}: status {bad[0]['status']!r} is not one "
                f"of {STATUSES}"
            )
        bad = [r for r in records if r["status"] not in STATUSES]
        if bad:
            raise StoreError(
                f"record {bad[0]['uid']!r}: status {bad[0]['status']!r} is not one of {STATUSES}"
            )
        # Everything is checked and converted before anything is written ...
        tokens = dict(self.tokens_committed)
        flat: dict[str, np.ndarray] = {}
        per_traj: dict[str, np.ndarray] = {}
        for group, (dim, fields) in RAGGED.items():
            lead = next(iter(fields))
            lens = np.array([len(r[lead]) for r in records], dtype=np.int64)
            for name, dtype in fields.items():
                values = [np.asarray(r[name]) for r in records]
                bad = [i for i, v in enumerate(values) if len(v) != lens[i]]
                if bad:
                    raise StoreError(
                        f"record {records[bad[0]]['uid']!r}: {name} has {len(values[bad[0]])} "
                        f"values but {lead} has {lens[bad[0]]}"
                    )
                flat[name] = _exact(records, name, values, dtype)
            # (exclusive cumsum: one start per record, none for an events-only batch)
            per_traj[f"{group}_start"] = tokens[dim] + np.cumsum(lens) - lens
            per_traj[f"{group}_len"] = lens
            tokens[dim] += int(lens.sum())
        left = _left(records)
        for name, dtype in SCALARS.items():
            values = left[name] if name in left else [r[name] for r in records]
            per_traj[name] = _exact(records, name, values, dtype)
        # (checked as records are: numpy stored a sample_version of 1.7 as 1, and a NaN
        # raised a ValueError the buffer took for the store's refusal of the batch)
        left = _left(events)
        leave = {
            name: _exact(
                events,
                field,
                left[field] if field in left else [e[field] for e in events],
                SCALARS[field],
                "leave event",
            )
            for name, field in EVENT_FIELDS.items()
        }
        self._check_epoch()  # (before anything is written: a newer writer's to write)
        # (one listing: a lookup by name reads that array's metadata, ~1 ms an array)
        arrays = dict(self.group.arrays())
        # ... and what is past the committed lengths is taken back, so that the batch
        # starts there, not after the remains: of a batch cut short while writing (a
        # full disk), or one an older writer wrote after this one opened the store.
        for name, n in self._lengths().items():
            if arrays[name].shape[0] != n:
                arrays[name].resize((n,))
        for name, values in (*flat.items(), *per_traj.items(), *leave.items()):
            # (a chunk of fill values too: zarr would leave it out, and then a reader
            # could not tell it from one lost; storage.stores.check_chunks)
            arrays[name].with_config(WRITE_EVERY_CHUNK).append(values)
        n_committed = self.n_committed + len(records)
        n_events = self.events_committed + len(events)
        # The commit markers go last, in one write of the group's metadata: readers slice
        # to them. (Not attrs.update, which writes zarr.json once per key: a reader could
        # see n_committed raised and the token counts not yet.) Not over a newer
        # writer's markers: it may have opened the store while this batch was written.
        self._check_epoch()
        self.group.update_attributes(
            {COMMIT_ATTR: n_committed, "n_committed_tokens": tokens, EVENT_COMMIT_ATTR: n_events}
        )
        self.n_committed, self.tokens_committed, self.events_committed = (
            n_committed,
            tokens,
            n_events,
        )
        return self.n_committed


# The leave events' arrays of LEAVE_FIELDS
_EVENT_LEAVE = tuple(name for name, field in EVENT_FIELDS.items() if field in LEAVE_FIELDS)


def _left(items: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """``t_leave`` and ``leave_version`` of records or leave events, as the store holds
    them: as given; where not given (or NaN, -1), a consumed one's sampling's (the
    contract: they agree); one ``buffered`` (admitted, or held again) has neither."""
    times, versions = [], []
    for r in items:
        t, v = r.get("t_leave", math.nan), r.get("leave_version", -1)
        if r["status"] == "buffered":
            t, v = math.nan, -1
        elif r["status"] == "consumed":
            if isinstance(t, float) and math.isnan(t):
                t = r["t_sample"]
            if v == -1:
                v = r["sample_version"]
        times.append(t)
        versions.append(v)
    return {"t_leave": times, "leave_version": versions}


def _arrays() -> dict[str, tuple[np.dtype, str, int]]:
    """Every array of a trajectory store: name -> (dtype, dimension, chunk length)."""
    out = {name: (dtype, TRAJECTORY_DIM, _CHUNK_TRAJ) for name, dtype in SCALARS.items()}
    for group, (dim, fields) in RAGGED.items():
        for name in (f"{group}_start", f"{group}_len"):
            out[name] = (np.dtype("int64"), TRAJECTORY_DIM, _CHUNK_TRAJ)
        out |= {name: (dtype, dim, _CHUNK_TOK) for name, dtype in fields.items()}
    for name, field in EVENT_FIELDS.items():
        out[name] = (SCALARS[field], EVENT_DIM, _CHUNK_TRAJ)
    return out


def _never_created(store: Path, group: zarr.Group) -> bool:
    """A store a writer began to create and never finished (killed before the one write
    of its attributes, :meth:`TrajectoryWriter._create`): no attribute says what it is,
    and it holds nothing but (some of) the arrays a trajectory store has, each with no
    value written (a folder with its ``zarr.json`` alone, if that). Anything else (a
    store of another schema, or not laminar's) is left as it is."""
    if "schema_version" in group.attrs or COMMIT_ATTR in group.attrs:
        return False
    names = _arrays()
    for entry in store.iterdir():
        if entry.name == "zarr.json" or entry.name.endswith(".partial"):  # (zarr's temp)
            continue
        if entry.name not in names or not entry.is_dir():
            return False
        if any(f.name != "zarr.json" and not f.name.endswith(".partial") for f in entry.iterdir()):
            return False
    return True


def _exact(
    records: Sequence[Mapping[str, Any]],
    name: str,
    values: list,
    dtype: np.dtype,
    what: str = "record",
) -> np.ndarray:
    """``values`` of field ``name`` (one per record: arrays for a ragged field) as
    ``dtype``. A value it cannot hold (not a number; for an integer field, a fraction or
    out of range) is a :class:`StoreError` naming its record (``what``: a record, or a
    leave event), rather than cast: numpy would store 1.7 as 1, 2**31 as -2**31, and -1
    as 255 in a ``uint8`` mask."""
    ragged = name in RAGGED_FIELDS
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            if ragged:
                given = np.concatenate(values) if values else np.zeros(0, dtype)
                out = given.astype(dtype)
                exact = dtype.kind not in "iu" or np.array_equal(out, given)
            else:
                out = np.array(values, dtype=dtype)
                exact = dtype.kind not in "iu" or out.tolist() == list(values)
        if exact:
            return out
    except (TypeError, ValueError, OverflowError):
        pass
    for rec, v in zip(records, values, strict=True):  # (which record, which value)
        for x in np.asarray(v).ravel().tolist() if ragged else [v]:
            try:
                with np.errstate(invalid="ignore", over="ignore"):
                    held = np.array(x, dtype=dtype).item()
            except (TypeError, ValueError, OverflowError):
                held = None
            if held is None or (dtype.kind in "iu" and held != x):
                raise StoreError(
                    f"{what} {rec['uid']!r}: {name} value {x!r} is not a {dtype} (the "
                    "store would cast it); pass the values the schema holds "
                    "(storage/schema.py)"
                )
    return out


def check_resumable(path: str | Path, uids: Collection[str] = ()) -> None:
    """That a resume can read what it reads of the store at ``path``, before any
    cluster starts: every per-trajectory array and every leave-event array, whole (its
    plan and its buffer read them all), and the chunks of the token-level arrays that
    hold the tokens of the trajectories ``uids`` (those its buffer holds again). A chunk
    that does not decode (cut short, its bytes changed, another file in its place) is a
    :class:`StoreError` naming the store, the array and the chunk file; so is an array
    whose ``zarr.json`` does not read. Token chunks of other trajectories are not read
    (a resume never reads them)."""
    store, group = _open_group(path)
    n = int(group.attrs[COMMIT_ATTR])
    lengths = {
        **dict.fromkeys(SCALARS, n),
        **{f"{g}_{end}": n for g in RAGGED for end in ("start", "len")},
        **dict.fromkeys(EVENT_FIELDS, int(group.attrs.get(EVENT_COMMIT_ATTR, 0))),
    }
    if not has_leave_fields(group):  # (an older store: its writer adds them)
        lengths = {k: v for k, v in lengths.items() if k not in (*LEAVE_FIELDS, *_EVENT_LEAVE)}
    values = {name: _decoded(store, group, name, m) for name, m in lengths.items()}
    wanted = set(uids)
    if not wanted:
        return
    rows = np.array([i for i, u in enumerate(values["uid"].tolist()) if u in wanted], np.int64)
    tokens = group.attrs["n_committed_tokens"]
    for g, (dim, fields) in RAGGED.items():
        lens = values[f"{g}_len"].astype(np.int64)
        ends = np.cumsum(lens)  # (the starts come from the lengths, as readers take them)
        a, b = (ends - lens)[rows], ends[rows]
        spans = (a[b > a], b[b > a])
        for name in fields:
            _decoded(store, group, name, tokens[dim], spans)


def _decoded(
    store: Path,
    group: zarr.Group,
    name: str,
    n: int,
    spans: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray | None:
    """The ``n`` committed values of array ``name``; with ``spans`` (from, to), only the
    chunks those ranges touch are read, and None is returned. A chunk that does not
    decode is a :class:`StoreError` naming the array and the chunk."""
    with reading(store / name):  # (its zarr.json; a missing array or chunk: named)
        arr = committed_array(store, group, name, n)
    size = int(arr.chunks[0])
    if spans is None:
        try:
            return arr[:n]  # (at once; chunk by chunk only to find the damaged one)
        except (RuntimeError, ValueError) as e:
            if not _damage(e):
                raise
            whole = e
        chunks: Collection[int] = range(-(-n // size))
    else:
        first, last = spans[0] // size, (spans[1] - 1) // size
        chunks = sorted({c for lo, hi in zip(first, last, strict=True) for c in range(lo, hi + 1)})
    for c in chunks:
        lo, hi = c * size, min((c + 1) * size, n)
        try:
            arr[lo:hi]
        except (RuntimeError, ValueError) as e:
            if not _damage(e):
                raise
            chunk = store / name / arr.metadata.encode_chunk_key((c,))
            raise StoreError(
                f"{str(store)!r} is damaged: its array {name!r} does not read, chunk "
                f"{str(chunk)!r} (values {lo}..{hi - 1} of the {n} committed) does not "
                f"decode ({type(e).__name__}: {e}); restore the run directory from a copy"
            ) from e
    if spans is None:  # (each chunk read alone: the damage is in none of them)
        raise StoreError(
            f"{str(store)!r} is damaged: its array {name!r} does not read "
            f"({type(whole).__name__}: {whole}); restore the run directory from a copy"
        ) from whole
    return None


def _damage(e: BaseException) -> bool:
    """``e``, raised reading a chunk, says it is damaged (as :func:`reading` tells)."""
    return isinstance(e, RuntimeError) or _decoding(e)
