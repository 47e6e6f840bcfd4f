"""What a run's Zarr stores share: where each is, the error that names one, reads that
turn damage into that error, empty arrays made and committed lengths checked, listings
without zarr's warning about its own temporary files.

Apart from :mod:`storage.trajectories` because the metrics (:mod:`storage.metrics`) and
the recovery log (:mod:`storage.partial_log`) use them as the trajectory store does.
"""

from __future__ import annotations

import json
import os
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from storage.schema import COMMIT_ATTR

STORE_NAME = "trajectories.zarr"


class StoreError(ValueError):
    """A run store is missing or does not match the schema (names the path and the fix)."""


# The stores of a run directory: the trajectories, the metrics, the recovery log.
RUN_STORES = (STORE_NAME, "metrics.zarr", "partial.zarr")


def store_path(path: str | Path, name: str = STORE_NAME) -> Path:
    """``path`` itself if it names a ``.zarr`` store, else the store ``name`` inside it.
    Another of a run's stores (``metrics.zarr`` where ``name`` is wanted) is a
    :class:`StoreError` that names the run directory to pass instead.

    >>> store_path("runs/a"), store_path("runs/a/trajectories.zarr")
    (PosixPath('runs/a/trajectories.zarr'), PosixPath('runs/a/trajectories.zarr'))
    >>> try:
    ...     store_path("runs/a/metrics.zarr")
    ... except StoreError as e:
    ...     print(str(e).split("; ")[1])
    pass the run directory, 'runs/a'
    """
    path = Path(path)
    if not path.name.endswith(".zarr"):
        return path / name
    if path.name in RUN_STORES and path.name != name:
        raise StoreError(
            f"{str(path)!r} is the run's {path.name}, not its {name}; pass the run "
            f"directory, {str(path.parent)!r}"
        )
    return path


def fill_value(dtype: np.dtype) -> Any:
    """What a store's array of ``dtype`` holds where nothing was written."""
    if dtype.kind in "TU":
        return ""
    if dtype.kind == "f":
        return np.nan
    return 0


# The compression of a run store's arrays: zarr's default (zstd, level 0) with zstd's
# content checksum (xxh64 of the chunk's bytes, 4 bytes a chunk), which the decoder
# checks: a chunk whose bytes changed is refused where it is read ("Restored data doesn't
# match checksum"), not read as other values. (Without it, a flipped byte that zstd
# still decodes read back as wrong values, silently: 229 of 300 single-bit flips of a
# 100 KB chunk did.) Arrays written before keep what their zarr.json records.
CHECKED_ZSTD = (ZstdCodec(level=0, checksum=True),)
# ... and of an uncompressed one (the recovery log's, written by slice): a CRC32C of each
# chunk's bytes after them, checked at read. Without it, a chunk whose bytes did not all
# reach the disk before a crash (zeros) or changed since read back as tokens. Measured:
# 2,000 appends of 64 values took the same time with it as without (3.86 s, 3.88 s).
CHECKED_RAW = (Crc32cCodec(),)


def new_array(group: zarr.Group, name: str, dtype: np.dtype, dim: str, chunk: int, **kwargs):
    """An empty 1-d array of a run store, on dimension ``dim``, compressed with
    :data:`CHECKED_ZSTD` (``kwargs``: zarr's; ``compressors=CHECKED_RAW``: uncompressed,
    checksummed)."""
    return group.create_array(
        name,
        shape=(0,),
        dtype=dtype,
        chunks=(chunk,),
        dimension_names=[dim],
        fill_value=fill_value(dtype),
        **{"compressors": CHECKED_ZSTD, **kwargs},
    )


@contextmanager
def reading(store: Path, fix: str = "restore the run directory from a copy") -> Iterator[None]:
    """Reads of ``store``: what a damaged file raises there (a truncated ``zarr.json`` or
    ``summary.json``: a JSON error; a chunk that fails to decompress: the codec's
    ``RuntimeError``; a truncated chunk of an uncompressed array: zarr's codecs'
    ``ValueError``, "cannot reshape array" or "data seem truncated"; an array's
    ``zarr.json`` whose data type or fill value zarr cannot read: its ``TypeError`` or
    ``ValueError``) becomes a :class:`StoreError` naming it (and ``fix``, what to do).
    Nothing else is caught: a permission error or a bug must not read as damage."""
    try:
        yield
    except StoreError:
        raise
    except (json.JSONDecodeError, RuntimeError, ValueError, TypeError) as e:
        if not isinstance(e, json.JSONDecodeError | RuntimeError) and not _decoding(e):
            raise
        raise StoreError(
            f"cannot read {str(store)!r} ({type(e).__name__}: {e}); it looks damaged (a "
            f"truncated or changed file?): {fix}"
        ) from e


_CODECS = os.path.join("zarr", "codecs", "")
# zarr's reading of an array's metadata from its zarr.json (an edited one's int8 with a
# NaN fill is a TypeError there); not its making of metadata for an array being created,
# where the same error is a bug of the caller's
_METADATA_FROM_DISK = "from_dict"


def _decoding(e: BaseException) -> bool:
    """``e`` was raised decoding what is on disk: in zarr's codecs (a chunk), or as zarr
    read an array's metadata (``from_dict``)."""
    frames = [frame.f_code for frame, _ in traceback.walk_tb(e.__traceback__)]
    return any(_CODECS in c.co_filename for c in frames) or any(
        c.co_name == _METADATA_FROM_DISK and os.path.join("zarr", "") in c.co_filename
        for c in frames
    )


def _check_markers(store: Path, group: zarr.Group, *extra: str) -> None:
    """The commit markers are there (a store laminar did not write lacks them), each a
    count (``n_committed_tokens``: one per token dimension): an edited or garbled one
    ("x", -5) failed as a bare ValueError, or as xarray's "conflicting sizes"."""
    for attr in (COMMIT_ATTR, "n_committed_tokens", *extra):
        if attr not in group.attrs:
            raise StoreError(
                f"{str(store)!r} has no commit marker {attr!r}: it is not a trajectory "
                "store laminar wrote, or its zarr.json was replaced; pass a run directory "
                "written by `laminar run`, or restore this one from a copy"
            )
        value = group.attrs[attr]
        counts = value if attr == "n_committed_tokens" else {attr: value}
        if (
            not isinstance(counts, dict)
            or not counts
            or not all(_is_count(v) for v in counts.values())
        ):
            raise StoreError(
                f"{str(store)!r}: its commit marker {attr!r} in zarr.json is "
                f"{_shown(value)}, not "
                + ("a count per token dimension" if attr == "n_committed_tokens" else "a count")
                + "; the file was edited or is damaged: restore the run directory from a copy"
            )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# A group attribute: the store's writer writes every chunk, one that holds only the fill
# value too (zarr leaves those out by default, and reads a missing chunk as the fill
# value). In a store with it, a chunk of the committed range that is not there is lost
# data (a copy of the run directory cut short), not zeros.
CHUNKS_ATTR = "every_chunk_written"

# Without it (stores written before), a chunk of only fill values was left out, and a
# missing one is lost data only in arrays where such a chunk cannot be: never an empty
# uid or status, a NaN log-probability, a prompt of no tokens, or 65,536 tokens all 0.
_NEVER_ALL_FILL = frozenset(
    {"uid", "status", "prompt_len", "behavior_logprobs", "prompt_tokens", "response_tokens"}
)

# Write every chunk (an array opened to write to: ``arr.with_config(WRITE_EVERY_CHUNK)``).
WRITE_EVERY_CHUNK = {"write_empty_chunks": True}


def committed_array(store: Path, group: zarr.Group, name: str, n: int) -> zarr.Array:
    """Array ``name`` of a store, which must hold the ``n`` values committed to it, each
    chunk of them there (:func:`check_chunks`)."""
    try:
        arr = group[name]
    except (KeyError, FileNotFoundError):
        raise no_array(store, [name]) from None
    return _holds(store, group, name, arr, n)


def no_array(store: Path, names: list[str]) -> StoreError:
    """The error of a trajectory store that lacks the arrays ``names`` (a folder deleted
    or lost in a copy): damaged, whoever reads it (a resume's writer, the audit, the
    report).

    >>> print(no_array(Path("r/trajectories.zarr"), ["status"]))
    'r/trajectories.zarr' has no array 'status'; it is damaged or not a trajectory store: \
restore the run directory from a copy
    """
    which = f"array {names[0]!r}" if len(names) == 1 else f"arrays {', '.join(map(repr, names))}"
    return StoreError(
        f"{str(store)!r} has no {which}; it is damaged or not a trajectory store: restore "
        "the run directory from a copy"
    )


def _holds(store: Path, group: zarr.Group, name: str, arr: zarr.Array, n: int) -> zarr.Array:
    if arr.shape[0] < n:
        raise StoreError(
            f"{str(store)!r}: {name!r} holds {arr.shape[0]} values but the store committed "
            f"{n}; it was copied while its run wrote it (copy it again once the run has "
            "stopped), or it is damaged (restore it from a copy)"
        )
    check_chunks(store, group, name, arr, n)
    return arr


def missing_chunks(folder: Path, arr: zarr.Array, n: int) -> list[str]:
    """The chunk files (relative to the 1-d array's ``folder``, in order) of its first
    ``n`` values that are not on disk: one directory listing."""
    if n <= 0:
        return []
    count = -(-n // int(arr.chunks[0]))
    sub, first = os.path.split(arr.metadata.encode_chunk_key((0,)))  # ("c", "0")
    stem = first[:-1]  # (a 1-d array's keys differ in the number alone)
    try:
        there = set(os.listdir(folder / sub))
    except FileNotFoundError:
        there = set()
    return [os.path.join(sub, f"{stem}{i}") for i in range(count) if f"{stem}{i}" not in there]


def check_chunks(store: Path, group: zarr.Group, name: str, arr: zarr.Array, n: int) -> None:
    """Each chunk of the first ``n`` values of array ``name`` is on disk; zarr reads a
    missing one as the fill value (zeros: a resume would train on them, and its writer
    write them back for good). One directory listing, not a read of the chunks (0.2 ms
    for the 458 chunks of 3e7 tokens; 7 ms every array of a store of 1e5 trajectories).
    Checked in every array of a store whose writer wrote every chunk
    (:data:`CHUNKS_ATTR`), else in those where a chunk of fill values cannot be."""
    if n <= 0 or not (group.attrs.get(CHUNKS_ATTR) or name in _NEVER_ALL_FILL):
        return
    if missing := missing_chunks(store / name, arr, n):
        raise StoreError(
            f"{str(store)!r}: array {name!r} lacks chunk {str(store / name / missing[0])!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f" of its {n} committed values (zarr would read it as "
            f"{fill_value(arr.dtype)!r}s): the data is not there (a copy of the run "
            "directory cut short?); restore the run directory from the copy it came from"
        )


# zarr writes each metadata file through a temporary ``<name>.<32 hex>.partial`` beside
# it (its atomic write): a reader listing the group while the writer commits sees it.
_TEMPORARY_FILE_WARNING = r"Object at \S+\.[0-9a-f]{32}\.partial is not recognized"


def group_arrays(group: zarr.Group) -> list[tuple[str, zarr.Array]]:
    """The group's arrays, without zarr's warning about its own temporary files (a
    reader of a store being written lists them beside ``zarr.json``).

    A group on disk (every run store) is listed here and its arrays opened one by one
    (10 ms for a trajectory store's 33, as ``Group.arrays``): zarr opens them all at
    once, and where one's ``zarr.json`` is damaged it raises with the others' reads
    still pending, which asyncio then reports, a screen of "Task was destroyed but it
    is pending!" after the error that names the file."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TEMPORARY_FILE_WARNING)
        root = getattr(group.store, "root", None)
        if root is None:
            return list(group.arrays())
        arrays = []
        for entry in os.scandir(Path(root) / group.path):  # (zarr's order: its listing's)
            if entry.name in _GROUP_FILES:
                continue
            try:
                node = group[entry.name]
            except KeyError:  # (zarr's warning, as Group.arrays gives it)
                warnings.warn(
                    f"Object at {entry.name} is not recognized as a component of a Zarr hierarchy.",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            if isinstance(node, zarr.Array):
                arrays.append((entry.name, node))
        return arrays


# A group's own files, which Group.arrays passes over.
_GROUP_FILES = frozenset({"zarr.json", ".zgroup", ".zattrs", ".zmetadata"})


def fixed_width(values: np.ndarray) -> np.ndarray:
    """Variable-width strings (numpy's StringDType) as fixed-width ones, as wide as the
    longest (a direct cast: 3x faster than through a list of Python strings).

    >>> fixed_width(np.array(["a", "bcd"], dtype=np.dtypes.StringDType()))
    array(['a', 'bcd'], dtype='<U3')
    """
    width = int(np.strings.str_len(values).max()) if values.size else 0
    return values.astype(f"<U{max(width, 1)}")
