"""The data contract's invariants checked on a trajectory Dataset
(:meth:`storage.accessor.LaminarAccessor.audit`): versions in order, one behavior
version per trajectory (or one per response token, rising, where the schedule mixes
them), unique uids, sampling fields set exactly for consumed trajectories, consumed
groups whole and sampled at one version."""

from __future__ import annotations

import numpy as np

from storage.schema import ALL_FIELDS, LEAVE_SCHEMA, MIXED_VERSION_SCHEDULES, STATUSES


def contract_problems(acc) -> list[str]:
    """The data contract's violations in ``acc``'s Dataset (:meth:`LaminarAccessor.audit`,
    which lists the invariants); empty when sound."""
    acc._needs_tokens("audit")
    ds = acc._ds
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
            f"e.g. {str(uid[bad[0]])!r}"
        )
    if (bad := np.flatnonzero(consumed & (m_f > m_t))).size:
        problems.append(
            f"{bad.size} consumed trajectories sampled before they finished, "
            f"e.g. {str(uid[bad[0]])!r}"
        )
    if (bad := np.flatnonzero(consumed != (m_t >= 0))).size:
        problems.append(f"{bad.size} trajectories have sample_version inconsistent with status")
    if (bad := np.flatnonzero(consumed == np.isnan(ds["t_sample"].values))).size:
        problems.append(f"{bad.size} trajectories have t_sample inconsistent with status")
    if "t_leave" in ds and "leave_version" in ds:  # (when and at which version it left)
        t_leave, left_at = ds["t_leave"].values, ds["leave_version"].values
        t_sample = ds["t_sample"].values
        # (a consumed one without t_sample is reported above: NaN != NaN is no second)
        off = consumed & np.isfinite(t_sample) & ((t_leave != t_sample) | (left_at != m_t))
        if (bad := np.flatnonzero(off)).size:
            problems.append(
                f"{bad.size} consumed trajectories left the buffer at another time or version "
                f"than they were sampled (t_leave, leave_version), e.g. {str(uid[bad[0]])!r}"
            )
        still = status == "buffered"
        if (bad := np.flatnonzero(still & (np.isfinite(t_leave) | (left_at != -1)))).size:
            problems.append(
                f"{bad.size} buffered trajectories have a t_leave or leave_version, "
                f"e.g. {str(uid[bad[0]])!r}"
            )
        if int(acc._attrs.get("schema_version", 0)) >= LEAVE_SCHEMA:  # (before: consumed alone)
            # (of the rows written knowing it: a store taken on from schema 2 has older)
            known = ds["trajectory"].values >= int(acc._attrs.get("leave_known_from", 0))
            gone = known & ~still & ~consumed & np.isin(status, STATUSES)
            if (bad := np.flatnonzero(gone & (~np.isfinite(t_leave) | (left_at < 0)))).size:
                problems.append(
                    f"{bad.size} trajectories that left the buffer unconsumed have no "
                    f"t_leave or leave_version, e.g. {str(uid[bad[0]])!r}"
                )
    unknown = set(np.unique(status)) - set(STATUSES)
    if unknown:
        problems.append(f"unknown statuses {sorted(str(s) for s in unknown)}")
    # A reward is NaN only where scoring failed (finish_reason "error"); elsewhere NaN
    # is a missing or damaged chunk of the store, which zarr reads as its fill value.
    unscored = ~np.isfinite(ds["reward"].values) & (ds["finish_reason"].values != "error")
    if (bad := np.flatnonzero(unscored)).size:
        problems.append(
            f"{bad.size} trajectories ({int((unscored & consumed).sum())} consumed) have "
            f"no reward and no reward error, e.g. {str(uid[bad[0]])!r}: a chunk of the store's "
            "reward array is missing or damaged"
        )
    values, counts = np.unique(uid, return_counts=True)
    if (counts > 1).any():
        problems.append(
            f"{int((counts > 1).sum())} uids stored more than once, "
            f"e.g. {str(values[counts > 1][0])!r}"
        )
    if (problem := _token_versions_problem(acc, k, m_f, uid)) is not None:
        problems.append(problem)
    if consumed.any():
        pu = ds["prompt_uid"].values[consumed]
        groups, inverse, sizes = np.unique(pu, return_inverse=True, return_counts=True)
        want = np.zeros(len(groups), dtype=np.int64)
        want[inverse] = ds["group_size"].values[consumed]
        if (bad := np.flatnonzero(sizes != want)).size:
            problems.append(
                f"{bad.size} consumed groups incomplete, e.g. {str(groups[bad[0]])!r} "
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


def _token_versions_problem(acc, k: np.ndarray, m_f: np.ndarray, uid) -> str | None:
    """The first trajectory (in store order) whose ``token_versions`` break the
    schedule's rule (:meth:`LaminarAccessor.audit`), as a problem; None when all keep it.

    Vectorised, over blocks of about :data:`AUDIT_BLOCK_TOKENS` values read one at a
    time: a partial rollout run holds one version per response token (a loop per
    trajectory took ~2 s for 200k of them, and reading them all at once held them all
    in memory)."""
    ds = acc._ds
    n_versions = ds["versions_len"].values
    mixing = acc._attrs.get("schedule") in MIXED_VERSION_SCHEDULES
    n_resp = ds["response_len"].values
    for block, seg, first in acc._token_version_blocks(np.flatnonzero(n_versions)):
        n = n_versions[block]
        if not mixing:
            bad = np.minimum.reduceat(seg, first) != k[block]
            bad |= np.maximum.reduceat(seg, first) != k[block]
        else:
            bad = (n != n_resp[block]) | (seg[first] != k[block])
            bad |= seg[first + n - 1] > m_f[block]
            falls = np.diff(seg) < 0
            falls[first[1:] - 1] = False  # (from one trajectory's last to the next's first)
            bad[np.searchsorted(first, np.flatnonzero(falls), side="right") - 1] = True
        if not bad.any():
            continue
        j = int(np.argmax(bad))
        i = block[j]
        versions = sorted(set(seg[first[j] : first[j] + n[j]].tolist()))
        if not mixing:
            return f"trajectory {str(uid[i])!r} mixes weight versions {versions}"
        return (
            f"trajectory {str(uid[i])!r}: token versions {versions} are not one "
            f"per response token, rising from its behavior version {k[i]} to at "
            f"most its finish version {m_f[i]}"
        )
    return None
