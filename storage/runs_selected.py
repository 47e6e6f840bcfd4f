"""A run selected from :func:`storage.open_runs` (``.sel(run=name)``, ``.isel(run=i)``)
as :func:`storage.open_run` has it: its own rows, its integer fields, and the record
(end, stops, resumes) read from its directory (:class:`storage.accessor.LaminarAccessor`
uses these)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from storage.schema import SCALARS, TRAJECTORY_DIM


def run_name(ds: xr.Dataset) -> str:
    return str(ds["run"].values.item())


def selected_run(ds: xr.Dataset) -> bool:
    """``ds`` is one run of :func:`storage.open_runs`' (``.sel(run=name)``,
    ``.isel(run=i)``): a scalar ``run`` coordinate beside its count or the runs'
    directories."""
    return (
        "run" in ds.coords
        and ds["run"].ndim == 0
        and ("n_trajectories" in ds or "run_dirs" in ds.attrs)
    )


def own_rows(ds: xr.Dataset) -> xr.Dataset:
    """A run selected from ``open_runs`` as ``open_run`` has it, less its token-level
    fields: its ``n_trajectories`` rows (the rest pad it to the longest run: status
    ``""``, NaN), its integer fields integers again (the padding made them floats)."""
    if "n_trajectories" in ds:
        own = ds["trajectory"].values < int(ds["n_trajectories"].values)
        ds = ds.drop_vars("n_trajectories")
    else:
        own = ds["status"].values != ""
    ds = ds.isel({TRAJECTORY_DIM: np.flatnonzero(own)})
    ints = {**SCALARS, "s_gen": SCALARS["finish_version"]}
    restored = {
        name: ds[name].astype(dtype)
        for name, dtype in ints.items()
        if name in ds and dtype.kind in "iu" and ds[name].dtype.kind == "f"
    }
    return ds.assign(restored)


def attrs_of_run(ds: xr.Dataset, run_dirs: Sequence[str]) -> dict:
    """``open_run``'s attributes of the run ``ds`` was selected from, among ``run_dirs``
    (``open_runs``' ``run_dirs``): the directory named as the run first, then those
    holding as many trajectories or more (a run still going), opened in turn; the one
    whose trajectories are ``ds``'s (their ``uid`` and ``t_finish``)."""
    from storage.trajectories_read import committed, open_run

    name = run_name(ds)
    labels = ds[TRAJECTORY_DIM].values
    n = int(labels.max(initial=-1)) + 1

    def count(path: str) -> int:
        try:
            return committed(path)
        except (OSError, ValueError, KeyError):  # (moved, deleted: not this one)
            return -1

    counts = {p: count(p) for p in run_dirs}
    order = sorted(
        (p for p in run_dirs if counts[p] >= n),
        key=lambda p: (Path(p).name != name, counts[p] != n),
    )
    for path in order:
        opened = open_run(path)
        same = all(
            np.array_equal(opened[f].values[labels], ds[f].values, equal_nan=f != "uid")
            for f in ("uid", "t_finish")
        )
        if same:
            return dict(opened.attrs)
    raise ValueError(
        f"run {name!r} of open_runs: none of its runs' directories {list(run_dirs)} holds "
        "its trajectories now (moved, or rewritten?), and its record (when it ended, its "
        "stops and resumes) is read from there: use open_run(path).laminar"
    )
