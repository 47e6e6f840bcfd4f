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

Columns are created on first use; a column that appears later is back-filled with NaN
(or ``""``), so components can add metrics without a schema migration. As in
``trajectories.zarr`` the group attribute ``n_committed`` is raised after each append and
readers slice to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr

from storage.schema import COMMIT_ATTR, STRING
from storage.trajectories import store_path

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


def _column(name: str, values: list[Any]) -> np.ndarray:
    strings = [isinstance(v, str) for v in values]
    if all(strings):
        return np.array(values, dtype=STRING)
    if any(strings):
        raise ValueError(f"metrics column {name!r} mixes strings and numbers")
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


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

    def __init__(self, path: str | Path) -> None:
        self.path = store_path(path, STORE_NAME)
        self.root = zarr.open_group(str(self.path), mode="a", zarr_format=3)

    def _table(self, table: str) -> zarr.Group:
        if table not in TABLES:
            raise ValueError(f"unknown metrics table {table!r}; tables are {sorted(TABLES)}")
        if table not in self.root:
            group = self.root.create_group(table)
            group.attrs[COMMIT_ATTR] = 0
        return self.root[table]

    def append(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        group = self._table(table)
        dim = TABLES[table]
        n = int(group.attrs[COMMIT_ATTR])
        names = list(dict.fromkeys(k for r in rows for k in r))
        columns = {name: _column(f"{table}.{name}", [r.get(name) for r in rows]) for name in names}
        for name, values in columns.items():
            if name not in group:
                arr = group.create_array(
                    name,
                    shape=(n,),
                    dtype=str if values.dtype.kind == "T" else values.dtype,
                    chunks=(_CHUNK,),
                    dimension_names=[dim],
                    fill_value="" if values.dtype.kind == "T" else np.nan,
                )
            arr = group[name]
            if arr.shape[0] != n:  # left by an interrupted append: drop it
                arr.resize((n,))
            arr.append(values.astype(arr.dtype) if values.dtype.kind != "T" else values)
        for name, arr in group.arrays():  # columns absent from these rows
            if name not in names:
                if arr.shape[0] != n:
                    arr.resize((n,))
                arr.resize((n + len(rows),))
        group.attrs[COMMIT_ATTR] = n + len(rows)


def open_metrics(path: str | Path, table: str) -> xr.Dataset:
    """One metrics table of a run as an :class:`xarray.Dataset` (committed rows only).

    ``rollouts`` comes back pivoted to dimensions ``time × rollout``; ``cluster`` has a
    ``time`` coordinate (seconds since the run started) so ``.sel``/``.interp`` work, and
    a ``wall_time`` datetime coordinate for ``resample``.
    """
    store = store_path(path, STORE_NAME)
    if not (store / "zarr.json").exists():
        raise FileNotFoundError(f"no metrics store at {str(store)!r}")
    root = zarr.open_group(str(store), mode="r", zarr_format=3)
    if table not in root:
        raise KeyError(f"metrics store {str(store)!r} has no table {table!r} yet")
    group = root[table]
    n = int(group.attrs[COMMIT_ATTR])
    dim = TABLES[table]
    data = {}
    for name, arr in group.arrays():
        values = arr[:n]
        if values.dtype.kind == "T":
            values = np.array(values.tolist(), dtype=str)
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
