"""``partial.zarr``: the partial-response pool's recovery log on disk.

The pool (:class:`laminar.partial.PartialResponsePool`) keeps what every unfinished
trajectory has generated in memory; this log is the same on disk, so that it outlives the
pool's worker. It is a journal of the pool's changes, one row per change, in three tables:

=============  ============  =========================================================
table          dimension     one row per
=============  ============  =========================================================
``requests``   ``request``   request registered: who decodes it, its weight version,
                             seed, sampling parameters, ``meta`` (JSON), prompt tokens
``chunks``     ``chunk``     tokens logged: ``offset`` (tokens logged before) and the
                             new tokens, logprobs and token versions (flat arrays on
                             the ``token`` dimension, ``start``/``len`` per chunk)
``events``     ``event``     a change of state: ``finished`` (with ``finish_reason``),
                             ``owner`` (moved to another rollout), ``held`` (the buffer
                             has it), ``forgotten`` (the trajectory store has it);
                             or ``fenced``: no request (``request_id`` empty), the
                             rollout ``owner`` given up as lost, whose later flushes
                             the pool ignores
=============  ============  =========================================================

Every row has a ``seq`` number, global across tables: replaying the rows in ``seq``
order gives back the pool's entries (:func:`read_partial_log`). One writer appends; as
in ``trajectories.zarr`` the counts it has committed are raised last, in one update of
the root attributes, and readers slice to them, so a write half-done when the writer dies
is invisible. Arrays grow by doubling and are written by slice (no metadata write per
append).

The journal of a long run is mostly trajectories long forgotten: when it holds many
more tokens than the live entries, the writer **compacts** it, writing the live entries
as a new *generation* (a subgroup ``g<N>``), in as many batches as it takes, and then
pointing the root at it in the one update that commits them; the old generation is
removed after. A reader follows the root's pointer, so it sees one whole generation or
the other: a compaction cut short at any point (its writer dead, or failed: it stays on
the old generation) leaves the log as it was, or compacted. A writer removes the older
generations that a writer which died after its commit left.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from storage.schema import STRING
from storage.stores import CHECKED_RAW, CHUNKS_ATTR, WRITE_EVERY_CHUNK, missing_chunks
from storage.trajectories import StoreError, fill_value, new_array, reading, store_path

STORE_NAME = "partial.zarr"
SCHEMA_VERSION = 1
# what to do with a damaged log (the store holds everything finished; the log only what
# was in flight, which a resume without it generates again)
LOG_FIX = "move it aside (the run resumes without its recovery log) or restore it from a copy"

I64, I32, F64, F32 = (np.dtype(t) for t in ("int64", "int32", "float64", "float32"))
# table -> (dimension, {column: dtype}); ``seq`` orders rows across tables
TABLES: dict[str, tuple[str, dict[str, np.dtype]]] = {
    "requests": (
        "request",
        {
            "seq": I64,
            "request_id": STRING,
            "owner": STRING,
            "version": I64,
            "seed": I64,
            "t_start": F64,
            "n_moves": I64,
            "params": STRING,
            "meta": STRING,
            "prompt_start": I64,
            "prompt_len": I64,
        },
    ),
    "chunks": (
        "chunk",
        {
            "seq": I64,
            "request_id": STRING,
            "owner": STRING,
            "offset": I64,
            "start": I64,
            "len": I64,
            "t": F64,
        },
    ),
    "events": (
        "event",
        {
            "seq": I64,
            "request_id": STRING,
            "kind": STRING,
            "owner": STRING,
            "finish_reason": STRING,
            "t": F64,
        },
    ),
}
# flat arrays: name -> (dimension, dtype, the table whose rows point into it)
FLAT: dict[str, tuple[str, np.dtype, str]] = {
    "prompt_tokens": ("prompt_token", I32, "requests"),
    "tokens": ("token", I32, "chunks"),
    "logprobs": ("token", F32, "chunks"),
    "token_versions": ("token", I32, "chunks"),
}
DIMS = [dim for dim, _ in TABLES.values()] + sorted({d for d, _, _ in FLAT.values()})
_FIRST_CAPACITY = 1024


class PartialLogWriter:
    """Append the pool's changes to ``RUN_DIR/partial.zarr`` (one writer per store).

    Rows are mappings of a table's columns; a ``requests`` row also has
    ``prompt_tokens``, a ``chunks`` row ``tokens``, ``logprobs`` and ``token_versions``
    (the row's ``start``/``len`` into them are filled in here).

    >>> import tempfile
    >>> run = tempfile.mkdtemp()
    >>> w = PartialLogWriter(run)
    >>> w.append(requests=[{"seq": 0, "request_id": "p0-000", "owner": "r0", "version": 3,
    ...     "seed": 7, "t_start": 1.0, "params": "{}", "meta": "{}", "prompt_tokens": [1, 2]}],
    ...     chunks=[{"seq": 1, "request_id": "p0-000", "owner": "r0", "offset": 0, "t": 2.0,
    ...     "tokens": [5, 6], "logprobs": [-.5, -.25], "token_versions": [3, 3]}])
    >>> log = read_partial_log(run)
    >>> log["chunks"]["request_id"].tolist(), log["tokens"].tolist(), log["prompt_tokens"]
    (['p0-000'], [5, 6], array([1, 2], dtype=int32))
    """

    def __init__(self, path: str | Path) -> None:
        self.path = store_path(path, STORE_NAME)
        exists = (self.path / "zarr.json").exists()
        self.root = zarr.open_group(str(self.path), mode="a", zarr_format=3)
        if not exists:
            self.root.update_attributes({"schema_version": SCHEMA_VERSION})
            self._new_generation(0)
            self._commit()
            return
        _check(self.root, self.path)
        self.generation = int(self.root.attrs["generation"])
        self.committed = {d: int(n) for d, n in self.root.attrs["committed"].items()}
        group = self.root[f"g{self.generation}"]
        names = {(t, c): f"{t}/{c}" for t, (_, cols) in TABLES.items() for c in cols}
        names |= {(None, name): name for name in FLAT}
        self.arrays = {k: group[name].with_config(WRITE_EVERY_CHUNK) for k, name in names.items()}
        for sub in self.path.glob("g*"):  # (older ones: a writer died before it removed them)
            if sub.name[1:].isdigit() and int(sub.name[1:]) < self.generation:
                shutil.rmtree(sub, ignore_errors=True)

    def _new_generation(self, generation: int) -> None:
        """Create the empty arrays of ``g<generation>`` (the root still points at the old
        generation until :meth:`_commit` names this one)."""
        # (what a compaction cut short left of it: overwriting the group keeps its arrays)
        shutil.rmtree(self.path / f"g{generation}", ignore_errors=True)
        group = self.root.create_group(f"g{generation}", overwrite=True)
        # (its writer writes every chunk, one of only fill values too: a missing one is
        # lost data; _check_chunks)
        group.update_attributes({CHUNKS_ATTR: True})
        self.arrays = {}
        for table, (dim, cols) in TABLES.items():
            sub = group.create_group(table)
            for col, dtype in cols.items():
                self.arrays[table, col] = _create(sub, col, dtype, dim, 4096)
        for name, (dim, dtype, _) in FLAT.items():
            self.arrays[None, name] = _create(group, name, dtype, dim, 16384)
        self.generation = generation
        self.committed = dict.fromkeys(DIMS, 0)

    def _commit(self) -> None:
        # The one write that makes the rows (and a new generation) visible. (Not
        # attrs.update, which writes zarr.json once per key: a reader could see the new
        # generation with the old one's counts.)
        self.root.update_attributes({"generation": self.generation, "committed": self.committed})

    def append(
        self,
        requests: Sequence[Mapping[str, Any]] = (),
        chunks: Sequence[Mapping[str, Any]] = (),
        events: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Append rows to the three tables and commit them together."""
        if self._write_rows(requests, chunks, events):
            self._commit()

    def _write_rows(
        self,
        requests: Sequence[Mapping[str, Any]] = (),
        chunks: Sequence[Mapping[str, Any]] = (),
        events: Sequence[Mapping[str, Any]] = (),
    ) -> bool:
        """Write rows after the committed ones and count them as committed, but do not
        commit them (:meth:`_commit`); whether there were any."""
        rows = {"requests": list(requests), "chunks": list(chunks), "events": list(events)}
        if not any(rows.values()):
            return False
        counts = dict(self.committed)
        writes: list[tuple[tuple[str | None, str], int, np.ndarray]] = []
        for table, (dim, cols) in TABLES.items():
            if not rows[table]:
                continue
            made: dict[str, np.ndarray] = {}  # (columns made here, not in the rows)
            flats = [n for n, (_, _, t) in FLAT.items() if t == table]
            if flats:  # each row's slice of its flat arrays
                flat_dim = FLAT[flats[0]][0]
                lens = [len(r[flats[0]]) for r in rows[table]]
                for name in flats:
                    values = [r[name] for r in rows[table]]
                    if [len(v) for v in values] != lens:
                        raise StoreError(f"partial log: {name} and {flats[0]} differ in length")
                    flat = np.concatenate([np.asarray(v, FLAT[name][1]) for v in values])
                    writes.append(((None, name), counts[flat_dim], flat))
                head = "prompt_" if table == "requests" else ""
                n = made[f"{head}len"] = np.array(lens, dtype=np.int64)
                made[f"{head}start"] = counts[flat_dim] + np.cumsum(n) - n
                counts[flat_dim] += int(n.sum())
            for col, dtype in cols.items():
                if col in made:
                    values = made[col].astype(dtype)
                else:
                    fill = fill_value(dtype)
                    values = np.array([r.get(col, fill) for r in rows[table]], dtype)
                writes.append(((table, col), counts[dim], values))
            counts[dim] += len(rows[table])
        self._write_all(writes)
        self.committed = counts
        return True

    def _write_all(self, writes: list[tuple[tuple[str | None, str], int, np.ndarray]]) -> None:
        """Grow the arrays that need it (by doubling), then write every slice, each step
        for all arrays at once: a log write touches ~25 arrays, and one at a time each
        waits for its own file I/O."""
        import asyncio

        from zarr.core.sync import sync  # (runs coroutines on zarr's own event loop)

        grow, put = [], []
        for key, at, values in writes:
            arr = self.arrays[key].async_array
            need = at + len(values)
            if need > arr.shape[0]:
                grow.append(arr.resize((max(need, 2 * arr.shape[0], _FIRST_CAPACITY),)))
            if len(values):
                put.append((arr, slice(at, need), values))

        async def run() -> None:
            await asyncio.gather(*grow)
            await asyncio.gather(*(arr.setitem(sel, v) for arr, sel, v in put))

        sync(run())

    def compact(
        self,
        requests: Sequence[Mapping[str, Any]],
        chunks: Sequence[Mapping[str, Any]],
        events: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Replace the journal by these rows (the live entries as a fresh journal):
        :meth:`rewrite` in one batch."""
        self.rewrite([{"requests": requests, "chunks": chunks, "events": events}])

    def rewrite(self, batches: Iterable[Mapping[str, Sequence[Mapping[str, Any]]]]) -> None:
        """Replace the journal by the rows of ``batches`` (each ``{table: rows}``, as
        :meth:`append` takes them): written as a new generation, one batch at a time, the
        root pointed at it in the one update that commits them all, then the old
        generation removed. Until that update readers see the old generation, and if a
        batch cannot be written the writer stays on it (the error is raised)."""
        old = self.generation, self.arrays, self.committed
        try:
            self._new_generation(self.generation + 1)
            for rows in batches:
                self._write_rows(**rows)
            self._commit()  # (also when there were no rows)
        except BaseException:
            self.generation, self.arrays, self.committed = old
            raise
        shutil.rmtree(self.path / f"g{old[0]}", ignore_errors=True)

    def tokens(self) -> int:
        """Response tokens in the journal."""
        return self.committed["token"]

    def all_tokens(self) -> int:
        """Tokens in the journal, the requests' prompts too (what compaction weighs
        against the live entries')."""
        return self.committed["token"] + self.committed.get("prompt_token", 0)


def _create(group: zarr.Group, name: str, dtype: np.dtype, dim: str, chunk: int):
    # uncompressed (written by slice, often, and a compressed chunk is rewritten whole),
    # with a checksum: a chunk a crash left short of its bytes is refused, not replayed
    arr = new_array(group, name, dtype, dim, chunk, compressors=CHECKED_RAW)
    return arr.with_config(WRITE_EVERY_CHUNK)


def _check(root: zarr.Group, path: Path) -> None:
    version = root.attrs.get("schema_version")
    if version != SCHEMA_VERSION or "generation" not in root.attrs:
        raise StoreError(
            f"{str(path)!r} is not a recovery log this code reads (schema_version "
            f"{version!r}, expected {SCHEMA_VERSION}); move it aside or use a new run directory"
        )


def read_partial_log(path: str | Path, flat: Collection[str] = tuple(FLAT)) -> dict[str, Any]:
    """The committed journal: ``{table: {column: array}}`` for the three tables, and the
    ``flat`` arrays by name (default: all; the generated tokens, logprobs and token
    versions are most of a log, and a reader that needs only counts leaves them out);
    every array sliced to what the writer committed. A run without a log gives empty
    tables (a run with ``faults.recover: false`` writes none)."""
    path = store_path(path, STORE_NAME)
    out: dict[str, Any] = {}
    if not (path / "zarr.json").exists():
        for table, (_, cols) in TABLES.items():
            out[table] = {c: np.zeros(0, d) for c, d in cols.items()}
        out |= {name: np.zeros(0, d) for name, (_, d, _) in FLAT.items() if name in flat}
        return out
    with reading(path, LOG_FIX):
        # A compaction between reading the root's pointer and reading the generation it
        # names removes that generation under the reader (a missing array, or chunks that
        # read as fill): the root is read again after, and a moved pointer means again.
        for _ in range(_READ_TRIES):
            root = zarr.open_group(str(path), mode="r", zarr_format=3)
            _check(root, path)
            generation = int(root.attrs["generation"])
            lost: StoreError | None = None
            try:
                read = _read_generation(path, root, generation, out, flat)
            except (KeyError, FileNotFoundError):
                read = None
            except _LostChunk as e:
                read, lost = None, e
            now = zarr.open_group(str(path), mode="r", zarr_format=3)
            if int(now.attrs.get("generation", -1)) != generation:
                continue
            if lost is not None:  # (not a compaction's doing either)
                raise lost
            if read is None:  # (not a compaction's doing)
                raise StoreError(
                    f"{str(path)!r}: generation g{generation} lacks an array; it is "
                    f"damaged: {LOG_FIX}"
                )
            return read
    raise StoreError(
        f"{str(path)!r}: its writer compacted it {_READ_TRIES} times while it was read; "
        "read it again (or once its run has stopped)"
    )


_READ_TRIES = 5


def _read_generation(
    path: Path, root: zarr.Group, generation: int, out: dict[str, Any], flat: Collection[str]
) -> dict[str, Any]:
    committed = root.attrs["committed"]
    group = root[f"g{generation}"]
    every = bool(group.attrs.get(CHUNKS_ATTR))
    names = [(f"{t}/{c}", dim) for t, (dim, cols) in TABLES.items() for c in cols]
    names += [(name, dim) for name, (dim, _, _) in FLAT.items() if name in flat]
    values = {}
    for name, dim in names:
        n = int(committed[dim])
        arr = group[name]
        if every or name in _NEVER_ALL_FILL:
            _check_chunks(path / f"g{generation}", name, arr, n)
        with reading(path / f"g{generation}" / name, LOG_FIX):  # (a checksum: named)
            values[name] = arr[:n]
    for table, (_, cols) in TABLES.items():
        out[table] = {c: values[f"{table}/{c}"] for c in cols}
    return out | {name: values[name] for name in FLAT if name in flat}


# Arrays of a generation written before its writer wrote every chunk (no CHUNKS_ATTR:
# zarr left out a chunk of only fill values, and reads a missing chunk as them) where
# such a chunk cannot be, so that a missing one is lost: never 4,096 rows of one
# ``seq``, an empty request id or event kind, a NaN time or log-probability, or 16,384
# tokens all 0. (Not the token versions: 16,384 tokens of version 0 are a run's start.)
_NEVER_ALL_FILL = frozenset(
    {f"{t}/seq" for t in TABLES}
    | {"requests/request_id", "chunks/request_id", "events/kind"}
    | {"requests/t_start", "chunks/t", "events/t"}
    | {"prompt_tokens", "tokens", "logprobs"}
)


class _LostChunk(StoreError):
    """A chunk of a generation's committed rows is not on disk."""


def _check_chunks(group_path: Path, name: str, arr: zarr.Array, n: int) -> None:
    """Each chunk of the first ``n`` values of array ``name`` (of the generation at
    ``group_path``) is on disk: zarr reads a missing one as the fill value, and a
    restore would continue a response after tokens 0 as if generated (and train on
    them). One directory listing, as :func:`storage.stores.check_chunks`."""
    if missing := missing_chunks(group_path / name, arr, n):
        chunk = group_path / name / missing[0]
        raise _LostChunk(
            f"{str(group_path.parent)!r}: array {name!r} of generation {group_path.name} "
            f"lacks chunk {str(chunk)!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f" of its {n} committed values (zarr would read it as "
            f"{fill_value(arr.dtype)!r}s); it is damaged: {LOG_FIX}"
        )


def ordered_rows(log: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(table, row)`` of every row of :func:`read_partial_log`'s journal, in the order
    the pool made the changes (``seq``)."""
    keyed = [
        (int(seq), table, i) for table in TABLES for i, seq in enumerate(log[table]["seq"].tolist())
    ]
    return [(table, i) for _, table, i in sorted(keyed)]


def replay(path: str | Path, tokens: bool = True) -> dict[str, dict[str, Any]]:
    """The entries the log last recorded, by request id (= trajectory uid): the journal
    replayed in ``seq`` order. Each has ``version``, ``owner`` (``""``: taken from a lost
    rollout), ``seed``, ``t_start``, ``n_moves``, ``params`` and ``meta`` (decoded JSON;
    a take appends the rollout to ``meta["rollout_path"]``, and a repack move, counted in
    ``n_moves``, its source), ``prompt_tokens``, the
    ``tokens``, ``logprobs`` and ``token_versions`` logged, ``t_flush``, ``finished``
    (``(finish_reason, t_finish)`` or ``None``) and ``held`` (the buffer had it). An entry
    the store committed is forgotten.

    ``tokens=False``: each entry's ``tokens`` is how many were logged, and it has no
    ``logprobs`` or ``token_versions`` (the token arrays are not read: what the audit,
    a resume's plan and a rebuild's need).

    (:func:`laminar.partial.replay_log` makes them the pool's states again.)"""
    log = read_partial_log(path, FLAT if tokens else ("prompt_tokens",))
    generated = ("tokens", "logprobs", "token_versions") if tokens else ()
    out: dict[str, dict[str, Any]] = {}
    req, chunks, events = log["requests"], log["chunks"], log["events"]
    for table, i in ordered_rows(log):
        rid = str(log[table]["request_id"][i])
        if table == "requests":
            a, n = int(req["prompt_start"][i]), int(req["prompt_len"][i])
            out[rid] = {
                "version": int(req["version"][i]),
                "owner": str(req["owner"][i]),
                "seed": int(req["seed"][i]),
                "t_start": float(req["t_start"][i]),
                "n_moves": int(req["n_moves"][i]),
                "params": json.loads(str(req["params"][i])),
                "meta": json.loads(str(req["meta"][i])),
                "prompt_tokens": log["prompt_tokens"][a : a + n].tolist(),
                **{name: [] for name in generated},
                "t_flush": float(req["t_start"][i]),
                "finished": None,
                "held": False,
            }
            if not tokens:
                out[rid]["tokens"] = 0
            continue
        e = out.get(rid)
        if e is None:  # forgotten before (a late row), or a fence (no request: see
            continue  # fenced_rollouts)
        if table == "chunks":
            offset = int(chunks["offset"][i])
            logged = len(e["tokens"]) if tokens else e["tokens"]
            if offset > logged:  # a gap: the pool refused it too
                continue
            a, n = int(chunks["start"][i]), int(chunks["len"][i])
            for name in generated:
                e[name][offset:] = log[name][a : a + n].tolist()
            if not tokens:
                e["tokens"] = offset + n
            e["owner"], e["t_flush"] = str(chunks["owner"][i]), float(chunks["t"][i])
            continue
        kind, owner = str(events["kind"][i]), str(events["owner"][i])
        if kind == "finished":
            e["finished"] = (str(events["finish_reason"][i]), float(events["t"][i]))
        elif kind == "owner":
            if not owner and e["owner"]:  # taken from a lost rollout: on its path, a move
                path_ = e["meta"].setdefault("rollout_path", [])
                path_.append(e["owner"])
                e["n_moves"] += 1
            e["owner"] = owner
        elif kind == "moved":  # a repack move from ``owner``: as PartialCore.reassign
            e["meta"].setdefault("rollout_path", []).append(owner)
            e["n_moves"] += 1
        elif kind == "held":
            e["held"] = True
        elif kind == "forgotten":
            del out[rid]
    return out


def fenced_rollouts(path: str | Path) -> dict[str, float]:
    """The rollouts the pool had fenced (given up as lost, their later flushes ignored:
    :meth:`laminar.partial.PartialCore.fence`) -> when, from the log's ``fenced``
    events (read without the token arrays). :func:`replay` leaves them out: they name
    no request."""
    log = read_partial_log(path, ())
    ev = log["events"]
    out: dict[str, float] = {}
    for kind, owner, t in zip(
        ev["kind"].tolist(), ev["owner"].tolist(), ev["t"].tolist(), strict=True
    ):
        if str(kind) == "fenced":
            out.setdefault(str(owner), float(t))
    return out


def requests_of_groups(path: str | Path, prompt_uids: Collection[str]) -> list[dict[str, Any]]:
    """``requests`` rows (without ``seq``) of the entries the log holds of these prompt
    groups, ownerless and without their tokens: what a run resumed in place keeps in its
    own log of the groups it re-issues whole (:func:`storage.resume.plan_resume` found
    them here alone), until it registers them again, so that a run stopped again before
    then re-issues them too."""
    wanted = set(prompt_uids)
    out = []
    for rid, e in replay(path, tokens=False).items():
        if _prompt_group(e["meta"]).get("prompt_uid", "") not in wanted:
            continue
        out.append(
            {
                "request_id": rid,
                "owner": "",
                "version": e["version"],
                "seed": e["seed"],
                "t_start": e["t_start"],
                "n_moves": e["n_moves"],
                "params": json.dumps(e["params"]),
                # (re-issued whole, as new requests: the rollouts the lost ones passed
                # through are not theirs; a later start reuses their ids)
                "meta": json.dumps({k: v for k, v in e["meta"].items() if k != "rollout_path"}),
                "prompt_tokens": e["prompt_tokens"],
            }
        )
    return out


def _prompt_group(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A request's prompt group, as its meta encodes it (``{}``: none)."""
    return meta.get("group", {}).get("__prompt_group__", {})


def log_entries(path: str | Path) -> dict[str, dict[str, Any]]:
    """:func:`replay` without the tokens: per request id ``version``, ``owner``,
    ``tokens`` (how many logged), ``finished`` and ``held`` (booleans), and from its meta
    the ``prompt_uid``, ``prompt_key``, ``group_size``, ``sample_idx`` and
    ``rollout_path`` (the rollouts it left). What is here
    and not in ``trajectories.zarr`` was still in the pool — generating, or completed
    and not yet stored."""
    out = {}
    for rid, e in replay(path, tokens=False).items():
        group = _prompt_group(e["meta"])
        out[rid] = {
            "version": e["version"],
            "owner": e["owner"],
            "tokens": e["tokens"],
            "finished": e["finished"] is not None,
            "held": e["held"],
            "prompt_uid": group.get("prompt_uid", ""),
            "prompt_key": group.get("prompt_key", -1),
            "group_size": group.get("group_size", 0),
            "sample_idx": e["meta"].get("sample_idx", -1),
            # the rollouts it left (lost, or moved from by repack), oldest first
            "rollout_path": list(e["meta"].get("rollout_path", [])),
        }
    return out
