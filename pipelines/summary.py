"""The run summary (``RUN_DIR/summary.json``): what the driver collected from every
actor at the stop, with the store's reward, token and staleness figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from laminar.config import RunConfig


def _strict(x):
    """``x`` as strict JSON holds it: NaN and infinities (a figure with nothing to
    compute it from, e.g. the rewards of a run stopped before any trajectory) as None,
    numpy scalars as Python ones."""
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def write_summary(run_dir: Path, summary: dict) -> None:
    """Write ``RUN_DIR/summary.json`` whole or not at all (a reader, `laminar report` or
    the audit of a run that is ending, never sees half of it), as strict JSON: what has
    no value is ``null``, not ``NaN`` (which strict readers refuse). The summary that
    the driver returns keeps its NaN."""
    from laminar.files import replace_text

    text = json.dumps(_strict(summary), indent=2, default=lambda o: _strict(float(o)))
    replace_text(Path(run_dir) / "summary.json", text)


def faults_summary(
    m_stats: dict | None,
    partial: dict | None,
    trainer_restarts: list[dict] = (),
    data_restarts: list[dict] = (),
    core_restarts: list[dict] = (),
    earlier: list[dict] = (),
    unrecovered: dict[str, dict] | None = None,
) -> dict:
    """Losses and recoveries over this start of the run, and the partial-response log's
    counters (``None`` with ``faults.recover`` off: there is no log); ``earlier``: a
    resumed run's earlier starts' (:func:`earlier_faults`); ``unrecovered``: the rollouts
    lost with ``faults.recover`` off (:func:`unrecovered_losses`).

    Always a dict: with recovery off it was ``null``, and a run that failed on a lost
    rollout (or went on through a lost relay) had nothing of it in summary.json."""
    m = m_stats or {}
    return {
        "lost": m.get("lost", {}),
        "recoveries": m.get("recoveries", 0),
        "recovered_requests": m.get("recovered_requests", 0),
        "unrecovered": dict(unrecovered or {}),
        "replacements": m.get("replacements", {}),
        "relays_lost": m.get("relays_lost", {}),
        "hung": m.get("hung", {}),
        "chain": m.get("chain"),
        "masters_replaced": m.get("masters_replaced", []),
        "trainer_restarts": list(trainer_restarts),
        "data_restarts": list(data_restarts),
        "core_restarts": list(core_restarts),  # trainer and data module lost together
        "partial": partial,
        "earlier": list(earlier),  # one entry per earlier start
    }


def unrecovered_losses(
    m_stats: dict | None, workers: dict[str, str], last_stats: dict[str, dict]
) -> dict[str, dict]:
    """Each rollout lost with ``faults.recover`` off (``m_stats``: the manager's stats,
    every loss of which is then unrecovered): ``time`` it was found lost (epoch s),
    ``how`` (``unrecovered``), its ``worker`` (``workers``: rollout -> address), whether
    it had ``hung`` (declared hung, then fenced), and what it held at its last report to
    the driver (``last_stats``: rollout -> its last stats): ``requests`` (unfinished in
    its engine: running and waiting), ``unscored`` (finished, their rewards still out),
    ``as_of`` (when it read them, epoch s; ``None`` with the counts when it never
    answered). All of them are lost with it: nothing resumes them.

    >>> unrecovered_losses(
    ...     {"lost": {"r1": 10.0}, "hung": {}},
    ...     {"r1": "tcp://w1"},
    ...     {"r1": {"running": 6, "waiting": 2, "pending_rewards": 1, "read_at": 9.6}},
    ... )["r1"]  # doctest: +NORMALIZE_WHITESPACE
    {'time': 10.0, 'how': 'unrecovered', 'worker': 'tcp://w1', 'hung': False,
     'requests': 8, 'unscored': 1, 'as_of': 9.6}
    """
    m = m_stats or {}
    out = {}
    for rid, t in (m.get("lost") or {}).items():
        s = last_stats.get(rid)
        out[rid] = {
            "time": t,
            "how": "unrecovered",
            "worker": workers.get(rid),
            "hung": rid in (m.get("hung") or {}),
            "requests": None if s is None else int(s["running"]) + int(s["waiting"]),
            "unscored": None if s is None else int(s["pending_rewards"]),
            "as_of": None if s is None else s["read_at"],
        }
    return out


# What ``faults.earlier`` keeps of each earlier start's faults.
EARLIER_FAULTS = ("lost", "replacements", "recoveries", "recovered_requests")
# a start's restarts within the run, by what was lost (faults_summary, summarize_failed)
RESTART_KINDS = ("trainer_restarts", "data_restarts", "core_restarts")


def earlier_faults(run_dir: Path, earlier_segments: list[dict], origin: float | None) -> list[dict]:
    """The losses of a resumed run's earlier starts (``earlier_segments``:
    :func:`storage.metrics.segments` of them), one entry per start: ``segment``,
    ``lost`` (rollout → when found lost, epoch seconds), ``replacements``,
    ``recoveries``, ``recovered_requests``. Each start rewrites summary.json, and a
    resumed run's rollouts are named ``r0``, ``r1``, ... again: the resumed start
    carries those before it under ``faults.earlier``, so that summary.json, and the
    report and audit that read it, count every start's losses.

    From the run's summary.json where a start that stopped in order wrote it (with the
    starts it carried itself); a start that failed or was killed wrote no faults, so
    its entry comes from the ``faults`` table of ``metrics.zarr`` (each row's
    ``segment``, or for older rows the start its time falls in: ``origin`` is the run's
    clock's epoch), where replacements are not recorded (``None``) and a rollout whose
    rows were lost with the data module is missing (``"from": "faults table"``)."""
    starts = [int(seg["segment"]) for seg in earlier_segments]
    out = _carried_faults(_read_summary(run_dir))
    missing = [s for s in starts if s not in out]
    if missing:
        for s in missing:
            out[s] = {
                "segment": s,
                "lost": {},
                "replacements": None,
                "recoveries": 0,
                "recovered_requests": 0,
                "from": "faults table",
            }
        for seg, rid, t, requests, how in _fault_rows(run_dir, earlier_segments, origin):
            e = out.get(seg)
            if e is None or e.get("from") != "faults table":
                continue
            e["lost"][rid] = min(t, e["lost"].get(rid, t))
            if how == "unrecovered":  # (faults.recover off: a loss, not a recovery)
                e.setdefault("unrecovered", {})[rid] = {"time": t, "how": how}
                continue
            e["recoveries"] += 1
            e["recovered_requests"] += requests
    return [out[s] for s in sorted(out) if s in starts]


def _read_summary(run_dir: Path) -> dict:
    try:
        prev = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return prev if isinstance(prev, dict) else {}


def _carried_faults(prev: dict) -> dict[int, dict]:
    """Start -> its faults entry, as a run's summary.json ``prev`` holds them: those it
    carries (``faults.earlier``; a failed driver's summary, ``faults_earlier``) and, when
    its start stopped in order, its own."""
    f = prev.get("faults")
    f = f if isinstance(f, dict) else {}
    out = {int(e["segment"]): dict(e) for e in f.get("earlier") or prev.get("faults_earlier") or []}
    if "lost" in f and not prev.get("driver_failed"):
        seg = int(prev.get("segments", 1)) - 1
        out[seg] = {"segment": seg, **{k: f.get(k) for k in EARLIER_FAULTS}}
        if f.get("unrecovered"):  # (lost with faults.recover off: what they held)
            out[seg]["unrecovered"] = f["unrecovered"]
    return out


def _fault_rows(run_dir: Path, earlier_segments: list[dict], origin: float | None):
    """``(segment, rollout, time, requests, how)`` of each row of the ``faults`` table (none
    when it has none, or cannot be read)."""
    from storage.metrics import open_metrics

    try:
        rows = open_metrics(run_dir, "faults")
    except Exception:  # noqa: BLE001 — none written, or unreadable: nothing to carry
        return []
    if not rows.sizes.get("recovery"):
        return []
    times = rows["time"].values.astype(float)
    if "segment" in rows:
        seg = rows["segment"].values.astype(float)
    else:
        seg = np.full(len(times), np.nan)
    if np.isnan(seg).any():  # (rows from before they named their start: by time)
        clock = times - (origin if origin is not None else 0.0)
        starts = np.array([s["start_s"] for s in earlier_segments] or [0.0])
        ids = np.array([s["segment"] for s in earlier_segments] or [0])
        by_time = ids[np.clip(np.searchsorted(starts, clock, side="right") - 1, 0, None)]
        seg = np.where(np.isnan(seg), by_time, seg)
    return zip(
        seg.astype(int).tolist(),
        rows["rollout"].values.astype(str).tolist(),
        times.tolist(),
        rows["requests"].values.astype(int).tolist(),
        rows["how"].values.astype(str).tolist(),
        strict=True,
    )


def updates_made(trainer: dict, steps: int) -> int:
    """The updates that made a run's final weights, from its last trainer's stats
    (``trainer``) and ``trainer.steps``: the run's steps less those that trainer still
    owed. Not its version: a trainer restarted within the run skips the lost one's
    numbers (docs/faults.md), and its ``steps`` counts the skipped numbers of the whole
    lineage on top of ``trainer.steps`` (its checkpoint's ``skipped_versions``, and its
    own).

    >>> updates_made({"version": 7, "steps": 7}, 5)  # 2 numbers skipped, run to its end
    5
    >>> updates_made({"version": 4, "steps": 7}, 5)  # stopped with 3 still owed
    2
    """
    return steps - (trainer["steps"] - trainer["version"])


def ran_s(segment: dict) -> float:
    """How long a start (:func:`storage.metrics.segments`) ran, from its first row to its
    last, less the stops its rows show where they were not marked by start (written
    before 2026-12-04, they may hold several: their stops counted as wall time).

    >>> ran_s({"start_s": 0.0, "end_s": 300.0, "stopped_s": 200.0})
    100.0
    """
    return segment["end_s"] - segment["start_s"] - segment.get("stopped_s", 0.0)


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(np.median(xs)) if xs else math.nan


def reward_first_last(ds) -> tuple[float, float]:
    """Mean reward of the first and of the last 20% of a run's trajectories by finish
    time (``ds``: :func:`storage.open_run`), failed rewards left out, and those of weights
    that no longer exist (a lost run's versions that its resume redid:
    ``ds.laminar.superseded()``) too, so that a resume does not count them as progress."""
    keep = (ds["finish_reason"].values != "error") & ~ds.laminar.superseded().values
    t = ds["t_finish"].values[keep]
    rewards = ds["reward"].values[keep][np.argsort(t, kind="stable")]
    if not len(rewards):
        return float("nan"), float("nan")
    k = max(1, len(rewards) // 5)
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))


def store_figures(ds) -> dict:
    """What the trajectory store says of a run (``ds``: :func:`storage.open_run`):
    trajectories, consumed, the first vs last 20% reward, mean staleness, the share of
    the groups trained on whose rewards were all equal, status counts."""
    first, last = reward_first_last(ds)
    st = ds.laminar.summary()
    return {
        "trajectories": int(ds.sizes["trajectory"]),
        "consumed": int((ds["status"].values == "consumed").sum()),
        "reward_first_20pct": first,
        "reward_last_20pct": last,
        "reward_gain": last - first,
        "staleness": {k: v for k, v in st.items() if k.endswith("_mean")},
        "flat_group_share": st["flat_group_share"],
        "status_counts": {k: v for k, v in st.items() if k.startswith("n_")},
    }


def summarize(run_dir: Path, raw: dict, sft_info: dict, cfg: RunConfig) -> dict:
    """The run summary: reward of the first vs last 20% of trajectories (by finish time),
    token counts, wall time, staleness; written to ``RUN_DIR/summary.json``."""
    from storage import open_run

    ds = open_run(run_dir)
    store = store_figures(ds)
    earlier = raw["earlier_segments"]  # (a resumed run's starts before this one)
    summary = {
        "run_dir": str(run_dir),
        "reason": raw["reason"],
        "seed": cfg.seed,
        # the last version number, skipped ones included; the updates made beside it
        "versions": raw["trainer"]["version"],
        "updates": updates_made(raw["trainer"], cfg.trainer.steps),
        "trajectories": store["trajectories"],
        "consumed": store["consumed"],
        "reward_first_20pct": store["reward_first_20pct"],
        "reward_last_20pct": store["reward_last_20pct"],
        "reward_gain": store["reward_gain"],
        "flat_group_share": store["flat_group_share"],
        "response_tokens": int(ds.sizes["response_token"]),
        "prompt_tokens": int(ds.sizes["prompt_token"]),
        "rl_wall_s": raw["wall_s"],  # this start's (a resumed run: since the resume)
        # every start's: the earlier ones' from their first to last metrics row
        "rl_wall_s_total": raw["wall_s"] + sum(ran_s(s) for s in earlier),
        "segments": len(earlier) + 1,
        "sft": sft_info,
        "staleness": store["staleness"],
        "status_counts": store["status_counts"],
        "schedule": cfg.pipeline.schedule,
        # every start's and every trainer's, as the cluster table's column (it was only
        # the last trainer's of the last start)
        "trainer_wait_s": raw.get("trainer_wait_s", raw["trainer"]["wait_s"]),
        # trainer.pacing: modelled vs real time of updates and weight movements
        "trainer_pacing": raw["trainer"]["paced"],
        "buffer": raw["buffer"],
        "pool": raw["pool"],
        "rollouts": raw["rollouts"],
        "reward_errors": reward_errors(raw.get("rollouts_seen", raw["rollouts"]), raw["buffer"]),
        "engine": _engine_summary(raw["rollouts"]),
        "trainer_ranks": cfg.trainer.ranks,
        "skipped_steps": raw["trainer"]["skipped_steps"],
        # (the versions of updates skipped, and the batch each consumed: storage.audit)
        "skipped_updates": raw["trainer"]["skipped_updates"],
        "groups_per_step": cfg.trainer.groups_per_step,
        "checkpoint": raw["trainer"]["checkpoint"],
        # Data-parallel ranks end with equal weights: one checksum per rank, rank 0 first.
        "weights_checksums": [raw["trainer"]["weights_checksum"]]
        + [r["weights_checksum"] for r in raw["trainer"]["ranks_stats"]],
        "relay": raw["relay"],
        "repack": raw["repack"],
        "faults": raw["faults"],
        "resumed": raw["resumed"],  # this segment's start, when resumed in place
        "metrics": str(run_dir / "metrics.zarr"),
    }
    write_summary(run_dir, summary)
    return summary


def rollouts_seen(last: dict[str, dict], answered: list[dict]) -> list[dict]:
    """Every rollout of a start, at its latest stats: those that ``answered`` the stop,
    and the others (lost during the run) at their ``last`` poll's answer.

    >>> [r["rollout_id"] for r in rollouts_seen(
    ...     {"r0": {"rollout_id": "r0", "n": 1}, "r1": {"rollout_id": "r1", "n": 1}},
    ...     [{"rollout_id": "r1", "n": 2}])]
    ['r0', 'r1']
    """
    return list({**last, **{s["rollout_id"]: s for s in answered}}.values())


def reward_errors(rollouts: list[dict], buffer: dict) -> dict:
    """The reward function's failures over this start's rollouts (their stats at the
    stop; a lost one's at its last answer, :class:`pipelines.driver.Schedule`'s
    ``rollouts_seen``; a resumed run's earlier starts are in their own summaries):
    ``failed`` and ``scored`` responses (not those cut at the length limit, which it is
    not given), ``groups_discarded`` by the buffer (every failure discards its group; a
    non-finite behavior logprob too), and the ``latest`` error one of them kept.

    >>> reward_errors(
    ...     [{"reward_errors": 3, "rewards_scored": 9, "last_reward_error": "reward f raised"},
    ...      {"reward_errors": 0, "rewards_scored": 4, "last_reward_error": None}],
    ...     {"groups_discarded": 2},
    ... )
    {'failed': 3, 'scored': 13, 'groups_discarded': 2, 'latest': 'reward f raised'}
    """
    latest = [r["last_reward_error"] for r in rollouts if r.get("last_reward_error")]
    return {
        "failed": sum(int(r.get("reward_errors") or 0) for r in rollouts),
        "scored": sum(int(r.get("rewards_scored") or 0) for r in rollouts),
        "groups_discarded": int(buffer.get("groups_discarded") or 0),
        "latest": latest[-1] if latest else None,
    }


def _engine_summary(rollouts: list[dict]) -> dict:
    """Behavior/trainer parity over the run, and modelled vs real time when paced."""
    out = {
        "parity_checks": sum(r.get("parity_checks", 0) for r in rollouts),
        "parity_moved_responses": sum(r.get("parity_moved_responses", 0) for r in rollouts),
        "parity_max_abs": max((r.get("parity_worst_abs", 0.0) for r in rollouts), default=0.0),
        "preemptions": sum(r.get("engine_preemptions", 0) for r in rollouts),
    }
    if any("engine_modelled_s" in r for r in rollouts):
        out["modelled_s"] = sum(r["engine_modelled_s"] for r in rollouts)
        out["compute_s"] = sum(r["engine_compute_s"] for r in rollouts)
        out["overruns"] = sum(r["engine_overruns"] for r in rollouts)
        # (seconds paced steps ended past their deadlines, uncaught by the next step)
        out["overrun_s"] = sum(r.get("engine_overrun_s", 0.0) for r in rollouts)
    return out


def summarize_failed(
    run_dir: Path, error: BaseException, cfg: RunConfig, start: dict | None = None
) -> dict:
    """``summary.json`` of a run whose driver failed before it could collect the actors'
    figures (a cluster lost under it, a store the driver could not write): the reason,
    and what the stores say — trajectories, rewards, staleness, the last published
    version. Whatever cannot be read is left out, never guessed.

    ``start``: what the failed driver itself still knew of its start
    (:meth:`pipelines.driver.Schedule.start_records`): its restarts within the run
    (``faults.trainer_restarts``, ``data_restarts``, ``core_restarts``, as an orderly
    stop records them) and the resume it began from (``resumed``). With them
    :func:`storage.lineage.run_restarts` counts this start's restarts; without (a
    driver that failed before it was made) they are unknown, and said so there."""
    why = " ".join(f"{type(error).__name__}: {error}".split())
    # (the earlier starts' losses the summary this one replaces carried: kept for the
    # resume, which takes this start's own from the faults table)
    carried = sorted(_carried_faults(_read_summary(run_dir)).values(), key=lambda e: e["segment"])
    summary: dict = {
        "run_dir": str(run_dir),
        "reason": f"failed: {why[:2000]}",
        "seed": cfg.seed,
        "schedule": cfg.pipeline.schedule,
        "driver_failed": True,  # (no actor's figures: the run did not stop in order)
        "metrics": str(run_dir / "metrics.zarr"),
    }
    if carried:
        summary["faults_earlier"] = carried
    if start is not None:
        summary["faults"] = {k: list(start[k]) for k in RESTART_KINDS}
        summary["resumed"] = start["resumed"]
    try:
        from storage import open_run

        ds = open_run(run_dir)
        summary |= store_figures(ds)
    except Exception as e:  # noqa: BLE001 — the store itself may be what failed
        summary["store_error"] = f"{type(e).__name__}: {e}"
    # The last published version the records show: the updates table (written with the
    # driver's periodic flush), the cluster table's polls, the store's consumed batches
    # (one trained at version v made v + 1); each may lag the run by a flush.
    seen = []
    if "consumed" in summary and summary["consumed"]:
        seen.append(
            int(np.nanmax(ds["sample_version"].values[ds["status"].values == "consumed"])) + 1
        )
    from storage.metrics import open_metrics, segments

    for table in ("updates", "cluster"):
        try:
            rows = open_metrics(run_dir, table)
            versions = rows["version"].values
        except Exception:  # noqa: BLE001 — not written yet, or unreadable
            continue
        if len(versions):
            seen.append(int(np.nanmax(versions)))
        if table == "cluster" and (starts := segments(rows)):
            # the wall time the rows show (they stop at the driver's last flush)
            walls = [ran_s(s) for s in starts]
            summary |= {"rl_wall_s": walls[-1], "rl_wall_s_total": sum(walls)}
            summary["segments"] = len(starts)
    if seen:
        summary["versions"] = max(seen)
    write_summary(run_dir, summary)
    return summary
