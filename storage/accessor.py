"""``Dataset.laminar``: analysis helpers that work in a notebook with no cluster.

>>> ds = open_run("runs/my-run")                                   # doctest: +SKIP
>>> ds.laminar.staleness()                                         # doctest: +SKIP
>>> ds.laminar.tokens("response_tokens", 0)                        # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from storage.schema import RAGGED, RAGGED_FIELDS


@xr.register_dataset_accessor("laminar")
class LaminarAccessor:
    """Views of a trajectory dataset returned by :func:`storage.open_run`."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    def tokens(self, field: str, i: int) -> np.ndarray:
        """The ragged ``field`` (e.g. ``"response_tokens"``) of trajectory ``i``."""
        if field not in RAGGED_FIELDS:
            raise KeyError(f"{field!r} is not a ragged field; choose from {sorted(RAGGED_FIELDS)}")
        group = RAGGED_FIELDS[field]
        start = int(self._ds[f"{group}_start"][i])
        length = int(self._ds[f"{group}_len"][i])
        return self._ds[field][start : start + length].values

    def staleness(self) -> xr.Dataset:
        """Per consumed trajectory: ``s_gen``, ``residence`` and ``s_train`` (versions)."""
        ds = self._ds
        consumed = ds.isel({"trajectory": np.flatnonzero(ds["status"].values == "consumed")})
        return consumed[["behavior_version", "s_gen", "residence", "s_train"]]

    def summary(self) -> dict[str, float]:
        """Counts by status and mean staleness of consumed trajectories."""
        ds = self._ds
        status = ds["status"].values
        out: dict[str, float] = {f"n_{s}": int((status == s).sum()) for s in np.unique(status)}
        st = self.staleness()
        for name in ("s_gen", "residence", "s_train"):
            out[f"{name}_mean"] = float(st[name].mean()) if st.sizes.get("trajectory") else 0.0
        return out


__all__ = ["LaminarAccessor", "RAGGED"]
