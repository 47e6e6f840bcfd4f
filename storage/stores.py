"""What a run's Zarr stores share: where each is, the error that names one, reads that
turn damage into that error, empty arrays made and committed lengths checked, listings
without zarr's warning about its own temporary files.

Apart from :mod:`storage.trajectories` because the metrics (:mod:`storage.metrics`) and
the recovery log (:mod:`storage.partial_log`) use them as the trajectory store does.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zarr

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


def new_array(group: zarr.Group, name: str, dtype: np.dtype, dim: str, chunk: int, **kwargs):
    """An empty 1-d array of a run store, on dimension ``dim`` (``kwargs``: zarr's)."""
    return group.create_array(
        name,
        shape=(0,),
        dtype=dtype,
        chunks=(chunk,),
        dimension_names=[dim],
        fill_value=fill_value(dtype),
        **kwargs,
    )


@contextmanager
def reading(store: Path) -> Iterator[None]:
    """Reads of ``store``: what a damaged file raises there (a truncated ``zarr.json`` or
    ``summary.json``: a JSON error; a chunk that fails to decompress: the codec's
    ``RuntimeError``) becomes a :class:`StoreError` naming it. Nothing else is caught:
    a permission error or a bug must not read as damage."""
    try:
        yield
    except (json.JSONDecodeError, RuntimeError) as e:
        raise StoreError(
            f"cannot read {str(store)!r} ({type(e).__name__}: {e}); it looks damaged (a "
            "truncated file?): restore the run directory from a copy"
        ) from e


def _check_markers(store: Path, group: zarr.Group, *extra: str) -> None:
    """The commit markers are there (a store laminar did not write lacks them)."""
    for attr in (COMMIT_ATTR, "n_committed_tokens", *extra):
        if attr not in group.attrs:
            raise StoreError(
                f"{str(store)!r} has no commit marker {attr!r}: it is not a trajectory "
                "store laminar wrote, or its zarr.json was replaced; pass a run directory "
                "written by `laminar run`, or restore this one from a copy"
            )


def committed_array(store: Path, group: zarr.Group, name: str, n: int) -> zarr.Array:
    """Array ``name`` of a store, which must hold the ``n`` values committed to it."""
    try:
        arr = group[name]
    except (KeyError, FileNotFoundError):
        raise StoreError(
            f"{str(store)!r} has no array {name!r}; it is damaged or not a trajectory "
            "store: restore the run directory from a copy"
        ) from None
    return _holds(store, name, arr, n)


def _holds(store: Path, name: str, arr: zarr.Array, n: int) -> zarr.Array:
    if arr.shape[0] < n:
        raise StoreError(
            f"{str(store)!r}: {name!r} holds {arr.shape[0]} values but the store committed "
            f"{n}; it was copied while its run wrote it (copy it again once the run has "
            "stopped), or it is damaged (restore it from a copy)"
        )
    return arr


# zarr writes each metadata file through a temporary ``<name>.<32 hex>.partial`` beside
# it (its atomic write): a reader listing the group while the writer commits sees it.
_TEMPORARY_FILE_WARNING = r"Object at \S+\.[0-9a-f]{32}\.partial is not recognized"


def group_arrays(group: zarr.Group) -> list[tuple[str, zarr.Array]]:
    """The group's arrays, without zarr's warning about its own temporary files (a
    reader of a store being written lists them beside ``zarr.json``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TEMPORARY_FILE_WARNING)
        return list(group.arrays())


def fixed_width(values: np.ndarray) -> np.ndarray:
    """Variable-width strings (numpy's StringDType) as fixed-width ones, as wide as the
    longest (a direct cast: 3x faster than through a list of Python strings).

    >>> fixed_width(np.array(["a", "bcd"], dtype=np.dtypes.StringDType()))
    array(['a', 'bcd'], dtype='<U3')
    """
    width = int(np.strings.str_len(values).max()) if values.size else 0
    return values.astype(f"<U{max(width, 1)}")
