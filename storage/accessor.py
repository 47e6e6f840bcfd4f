"""``Dataset.laminar``: analysis helpers that work in a notebook with no cluster.

>>> ds = open_run("runs/my-run")                                   # doctest: +SKIP
>>> ds.laminar.staleness()                                         # doctest: +SKIP
>>> ds.laminar.tokens("response_tokens", 0)                        # doctest: +SKIP
>>> ds.laminar.audit()       # [] when every contract invariant holds  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from storage.schema import ALL_FIELDS, RAGGED_FIELDS, STATUSES


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

    def audit(self) -> list[str]:
        """Check the data contract's invariants; returns the violations (empty when sound).

        * every contract field is present;
        * ``behavior_version <= finish_version <= sample_version`` (for consumed ones);
        * one behavior version per trajectory (``token_versions`` empty or all equal to it);
        * uids unique, so nothing was stored — or consumed — twice;
        * ``sample_version``/``t_sample`` set exactly for consumed trajectories;
        * every consumed group complete: ``group_size`` consumed siblings per prompt_uid,
          all sampled at the same version.
        """
        ds = self._ds
        problems: list[str] = []
        missing = [f for f in ALL_FIELDS if f not in ds]
        if missing:
            return [f"missing contract fields: {missing}"]
        k = ds["behavior_version"].values
        m_f = ds["finish_version"].values
        m_t = ds["sample_version"].values
        status = ds["status"].values
        consumed = status == "consumed"
        uid = ds["uid"].values
        if (bad := np.flatnonzero(k > m_f)).size:
            problems.append(
                f"{bad.size} trajectories finish before their behavior version, "
                f"e.g. {uid[bad[0]]!r}"
            )
        if (bad := np.flatnonzero(consumed & (m_f > m_t))).size:
            problems.append(
                f"{bad.size} consumed trajectories sampled before they finished, "
                f"e.g. {uid[bad[0]]!r}"
            )
        if (bad := np.flatnonzero(consumed != (m_t >= 0))).size:
            problems.append(f"{bad.size} trajectories have sample_version inconsistent with status")
        if (bad := np.flatnonzero(consumed == np.isnan(ds["t_sample"].values))).size:
            problems.append(f"{bad.size} trajectories have t_sample inconsistent with status")
        unknown = set(np.unique(status)) - set(STATUSES)
        if unknown:
            problems.append(f"unknown statuses {sorted(unknown)}")
        values, counts = np.unique(uid, return_counts=True)
        if (counts > 1).any():
            problems.append(
                f"{int((counts > 1).sum())} uids stored more than once, "
                f"e.g. {values[counts > 1][0]!r}"
            )
        n_versions = ds["versions_len"].values
        if n_versions.any():
            tv = ds["token_versions"].values
            starts = ds["versions_start"].values
            for i in np.flatnonzero(n_versions):
                seg = tv[starts[i] : starts[i] + n_versions[i]]
                if (seg != k[i]).any():
                    problems.append(
                        f"trajectory {uid[i]!r} mixes weight versions {sorted(set(seg))}"
                    )
                    break
        if consumed.any():
            pu = ds["prompt_uid"].values[consumed]
            groups, inverse, sizes = np.unique(pu, return_inverse=True, return_counts=True)
            want = np.zeros(len(groups), dtype=np.int64)
            want[inverse] = ds["group_size"].values[consumed]
            if (bad := np.flatnonzero(sizes != want)).size:
                problems.append(
                    f"{bad.size} consumed groups incomplete, e.g. {groups[bad[0]]!r} "
                    f"({sizes[bad[0]]}/{want[bad[0]]})"
                )
            mt = m_t[consumed]
            lo = np.full(len(groups), np.iinfo(np.int64).max)
            hi = np.full(len(groups), np.iinfo(np.int64).min)
            np.minimum.at(lo, inverse, mt)
            np.maximum.at(hi, inverse, mt)
            if (bad := np.flatnonzero(lo != hi)).size:
                problems.append(f"{bad.size} groups consumed across several trainer versions")
        return problems
