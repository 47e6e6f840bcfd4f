"""``laminar report RUN_DIR [RUN_DIR ...] [--out DIR]``: plots and a one-page summary.

Reads only the run directories (no cluster). Writes PNG figures and ``report.md`` into
``DIR`` (default ``<first run>/report``); several runs are drawn on the same axes, one
colour each. Per run, ``rollouts-N.png`` marks repack moves and lost rollouts on the
rollouts' KV use, and ``events-N.png`` draws the events behind them: weight publications
(stall and chain broadcast), repack moves, fault recoveries and a trainer or data module
restarted within the run (from ``summary.json``: unknown, and said so, without it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from laminar.errors import ConfigError
from pipelines.summary import ran_s, reward_first_last
from storage import open_run
from storage.audit import (
    require_fields,
    rollout_losses,
    train_lags,
    train_staleness_bound,
)
from storage.metrics import TABLES, open_metrics, segments, time_origin
from storage.trajectories import StoreError, reading

logger = logging.getLogger("laminar")


def _load(run_dir: Path) -> dict:
    """A run's stores. A damaged metrics table or ``summary.json`` is left out, as if
    absent, and named in ``damaged`` (the report says so): the figures that do not read
    it are still drawn (it refused the whole report, as a damaged trajectory store
    still does: every figure reads that)."""
    run = {"name": run_dir.name, "dir": run_dir, "ds": open_run(run_dir), "damaged": []}
    run["absent"] = (
        []
        if (run_dir / "metrics.zarr").exists()
        else [
            "no metrics.zarr (moved, lost in a copy, or a run that failed before its first "
            "rows): its tables' figures and columns (throughput, buffer, rollouts, events, "
            "versions and RL wall time) are left out"
        ]
    )
    require_fields(run["ds"], run_dir)  # (every figure reads the trajectories)
    for table in TABLES:
        try:
            run[table] = open_metrics(run_dir, table)
        except (FileNotFoundError, KeyError):
            run[table] = None
        except StoreError as e:
            run[table] = None
            run["damaged"].append(f"metrics table {table!r} left out: {e}")
    summary = run_dir / "summary.json"
    # (absent: a killed driver's, or a live run's; the report says so, never "none")
    run["summary_state"] = "ok" if summary.exists() else "absent"
    if not summary.exists():
        run["absent"].append(
            "no summary.json (its driver was killed, or the run still goes): what only it "
            "records is unknown, and said so (trainer and data-module restarts, relays "
            "lost, hangs); its replacements column counts only those earlier starts carried"
        )
    try:
        with reading(summary):
            run["summary"] = json.loads(summary.read_text()) if summary.exists() else {}
        if not isinstance(run["summary"], dict):
            raise StoreError(f"{str(summary)!r} is not a JSON object; restore it from a copy")
    except StoreError as e:
        run["summary"], run["summary_state"] = {}, "damaged"
        run["damaged"].append(f"summary.json left out: {e}")
    for damaged in run["damaged"] + run["absent"]:
        logger.warning("%s: %s", run_dir, damaged)
    # Event tables hold epoch seconds; the time series hold seconds since the run began.
    run["t0"] = None if run["cluster"] is None else time_origin(run["cluster"])
    run["starts"] = [] if run["cluster"] is None else segments(run["cluster"])
    # A resumed run's starts: the time series have a gap between each and the next, as
    # open_run bounds it (narrowed by the trajectories' times: a crash loses the last
    # seconds of metrics rows, not of the store).
    pauses = [float(t) for t in run["ds"].attrs.get("pauses_s", [])]
    t0 = run["t0"]
    stops = zip(pauses[::2], pauses[1::2], strict=True)
    run["gaps"] = [] if t0 is None else [(a - t0, b - t0) for a, b in stops]
    return run


def _gaps_on(run: dict, axis_t0: float) -> list[tuple[float, float]]:
    """The run's gaps (on the metrics' time axis) on one that starts at epoch
    ``axis_t0``."""
    if run["t0"] is None:  # (no metrics: no gaps)
        return run["gaps"]
    shift = run["t0"] - axis_t0
    return [(a + shift, b + shift) for a, b in run["gaps"]]


def _broken(x, y, gaps: list[tuple[float, float]]):
    """``x, y`` with a NaN point in each gap, so that a line is not drawn across it."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    for a, b in gaps:
        i = int(np.searchsorted(x, (a + b) / 2))
        if 0 < i < len(x):
            x, y = np.insert(x, i, (a + b) / 2), np.insert(y, i, np.nan)
    return x, y


def _broken_steps(x, y, gaps: list[tuple[float, float]]):
    """``x, y`` for a step plot (``where="post"``) with a NaN point at the start of each
    gap: each value is drawn until the stop, not across it (:func:`_broken`'s point in
    the gap's middle drew its step on to there)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    for a, _ in sorted(gaps, reverse=True):
        i = int(np.searchsorted(x, a, side="right"))
        if 0 < i < len(x):
            x, y = np.insert(x, i, a), np.insert(y, i, np.nan)
    return x, y


NOT_RUNNING = "not running (resumed)"


def _shade(ax, gaps: list[tuple[float, float]]) -> None:
    """Grey where the run was not running (stopped, then resumed); labelled once an
    axis, whatever the runs drawn on it (a legend entry each run's first gap drew)."""
    labelled = any(p.get_label() == NOT_RUNNING for p in ax.patches)
    for a, b in gaps:
        ax.axvspan(a, b, color="0.9", zorder=0, label=None if labelled else NOT_RUNNING)
        labelled = True


def _since_start(run: dict, epoch) -> np.ndarray:
    return np.asarray(epoch, dtype=float) - run["t0"]


def _lost(run: dict) -> list[tuple[str, float]]:
    """Each lost rollout, over every start of the run, and when its loss was detected (s
    since the run began): from summary.json (its start's, and the earlier starts' it
    carries) and the ``faults`` table (every start's), as the audit counts them."""
    if run["t0"] is None:
        return []
    losses = rollout_losses(run["summary"], run["faults"])
    return sorted((rid, e["time"] - run["t0"]) for (_, rid), e in losses.items())


def _replacements(summary: dict) -> int:
    """Lost rollouts replaced over every start (summary.json and what it carries)."""
    f = summary.get("faults") or {}
    # (a failed driver's summary carries them as faults_earlier, as the audit reads them)
    carried = f.get("earlier") or summary.get("faults_earlier") or []
    earlier = [e.get("replacements") or {} for e in carried]
    return sum(len(r) for r in [f.get("replacements") or {}, *earlier])


# What summary.json records of a trainer or data module lost and restarted within the
# run (its own start's, docs/faults.md), by the name the report gives each.
RESTARTS = {
    "trainer_restarts": "trainer",
    "data_restarts": "data module",
    "core_restarts": "trainer + data",
}


def _unknown(run: dict, key: str) -> str | None:
    """Why summary.json does not say ``faults.<key>`` of the run's last start (``None``:
    it does). The report then says so, never "none": a run whose driver was killed (or
    that still goes) has no summary.json, or only an earlier start's; a failed driver's
    records its restarts, not its rollouts' replacements or relays."""
    s = run["summary"]
    if run["summary_state"] != "ok":
        return f"summary.json {run['summary_state']}"
    if s.get("segments", 1) < len(run["starts"]):
        return "summary.json is an earlier start's"
    if key not in (s.get("faults") or {}):
        return "the driver failed" if s.get("driver_failed") else "summary.json lacks it"
    return None


def _restarts(run: dict) -> list[dict]:
    """Each restart of a lost trainer or data module summary.json records (its start's):
    ``what`` (:data:`RESTARTS`), ``t`` (when the loss was found, s since the run began,
    ``None`` without metrics), ``label`` (a few words for the figure) and ``cost``
    (versions ``V→M``, the updates redone, the downtime: detection to running again)."""
    f = run["summary"].get("faults") or {}
    out = []
    for key, what in RESTARTS.items():
        for r in f.get(key) or []:
            t = None if run["t0"] is None or "time" not in r else r["time"] - run["t0"]
            down = f"{r['restart_s']:.1f} s down" if "restart_s" in r else "downtime unknown"
            if key == "data_restarts":
                label, cost = "data module rebuilt", f"rebuilt, {down}"
            elif r.get("finished"):  # (lost after its final checkpoint: none started)
                label = f"{what} lost after v{r.get('checkpoint_version')}"
                cost = f"after its final checkpoint (v{r.get('checkpoint_version')}), none redone"
            else:
                v, m = r.get("checkpoint_version", "?"), r.get("after_version", "?")
                label = f"{what} restarted v{v}→{m}"
                n = r.get("lost_updates", "?")
                cost = f"v{v}→{m}, {n} update{'' if n == 1 else 's'} redone, {down}"
            down_s = r.get("restart_s")
            out.append({"what": what, "t": t, "label": label, "cost": cost, "down_s": down_s})
    return sorted(out, key=lambda e: (e["t"] is None, e["t"] or 0.0))


def _restarts_cell(run: dict) -> str:
    """The events table's "trainer / data restarts": each restart and its cost."""
    unknown = _unknown(run, "trainer_restarts")
    if unknown is not None:
        return f"unknown ({unknown})"
    each = [f"{e['what']}: {e['cost']}" for e in _restarts(run)]
    starts = run["summary"].get("segments", 1)
    # (summary.json carries no earlier start's restarts: faults.earlier keeps losses)
    mark = " (last start's)" if starts > 1 else ""
    return f"{len(each)}{mark}" + (": " + "; ".join(each) if each else "")


def _relays_hung_cell(run: dict) -> str:
    """The events table's "relays lost / hung": summary.json's ``faults.relays_lost``
    and ``faults.hung`` (rollouts and relays declared hung, then fenced)."""
    unknown = _unknown(run, "relays_lost")
    if unknown is not None:
        return f"unknown ({unknown})"
    f = run["summary"].get("faults") or {}
    relays, hung = sorted(f.get("relays_lost") or {}), sorted(f.get("hung") or {})
    return (
        f"{len(relays)}"
        + (f" ({', '.join(relays)})" if relays else "")
        + f" / {len(hung)}"
        + (f" ({', '.join(hung)})" if hung else "")
    )


def _figure(title: str, ncols: int = 1):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 3.6), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


# A reward window of fewer trajectories than this share of the median window's is left
# out of the report's reward by time: a run's last windows hold only the slow tail of its
# final batches (a few long responses, mostly low-reward), which drew a plunge at its end.
FEW_SHARE = 0.25


def few_left_out(by_time):
    """``reward_curve(by="time")`` without the windows of fewer than :data:`FEW_SHARE` of
    the median window's trajectories."""
    n = by_time["trajectories"]
    if not n.size:
        return by_time
    return by_time.isel(time=np.flatnonzero(n.values >= FEW_SHARE * float(np.median(n))))


def plot_reward(runs: list[dict], out: Path) -> str:
    fig, (ax_t, ax_v) = _figure("Reward (mean over trajectories)", 2)
    for r in runs:
        by_time = few_left_out(r["ds"].laminar.reward_curve(by="time", window=5.0))
        gaps = _gaps_on(r, r["ds"].laminar.t0)
        # (markers: a start with a single bin is a point, not a line)
        ax_t.plot(*_broken(by_time["time"], by_time, gaps), ".-", ms=3, label=r["name"])
        _shade(ax_t, gaps)
        by_version = r["ds"].laminar.reward_curve(by="version")
        ax_v.plot(by_version["behavior_version"], by_version, label=r["name"])
    ax_t.set(xlabel="finish time (s since start)", ylabel="reward", title="vs wall time (5 s bins)")
    ax_v.set(xlabel="behavior version", ylabel="reward", title="vs weight version")
    ax_v.legend(fontsize=7)
    return _save(fig, out, "reward.png")


def plot_throughput(runs: list[dict], out: Path) -> str:
    fig, (ax_g, ax_u) = _figure("Throughput", 2)
    for i, r in enumerate(runs):
        color = f"C{i % 10}"  # (one a run, in both panels: "trained" dashed)
        tp = r["ds"].laminar.throughput(window=5.0)
        gaps = _gaps_on(r, r["ds"].laminar.t0)
        _shade(ax_g, gaps)
        # (a window the run was stopped throughout has no rate, NaN: no line, not a zero)
        for name, style in (("generated", "-"), ("trained", "--")):
            label = f"{r['name']} {name}"
            ax_g.plot(tp["time"].values, tp[name].values, style, color=color, label=label)
        versions, rate = update_throughput(r)
        if versions.size:
            ax_u.plot(versions, rate, ".-", ms=3, color=color, label=r["name"])
    ax_g.set(
        xlabel="time (s since start)", ylabel="tokens/s", title="generated vs trained (5 s bins)"
    )
    ax_u.set(xlabel="version", ylabel="tokens/s", title="actor-update throughput")
    ax_g.legend(fontsize=7)
    if ax_u.lines:
        ax_u.legend(fontsize=7)
    return _save(fig, out, "throughput.png")


# An update's interval this much shorter than the time since the row before it: a new
# trainer's first (restarted within the run, or a start's), timed from when it started.
NEW_TRAINER_S = 1e-3


def update_throughput(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """The paper's measure per version: tokens of a global batch over the time since the
    previous actor update, after warm-up. Each trainer's first update is left out (its
    interval is from the trainer's start, not from an update: the first batch, which
    after a start waits for the buffer to fill, and after a trainer restarted within the
    run finds it full): each start's, and each restarted trainer's, whose interval began
    after the update before it; of a version trained twice (a lost run resumed from an
    older checkpoint redoes the lost updates) the later row, whose weights stand."""
    u = run["updates"]
    if u is None or not u.sizes["update"] or "interval_s" not in u:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    version = u["version"].values
    # (updates are appended in order: the last row of a version is the redone one)
    _, from_end = np.unique(version[::-1], return_index=True)
    kept = np.zeros(len(version), dtype=bool)
    kept[len(version) - 1 - from_end] = True
    first = np.zeros(len(version), dtype=bool)
    first[0] = True
    if run["t0"] is not None and "time" in u:
        for _, start in run["gaps"]:  # a later start's first update: the first after it
            if (after := np.flatnonzero(u["time"].values >= run["t0"] + start)).size:
                first[after[0]] = True
    if "time" in u and len(version) > 1:
        # A trainer's updates each time the interval since its previous one (both read
        # from one clock: equal to the rows' time difference); a new trainer's first, from
        # when it started, after the row before it (a skipped update's makes the next
        # interval longer, not shorter).
        since_row = np.diff(u["time"].values.astype(float))
        first[1:] |= u["interval_s"].values[1:] < since_row - NEW_TRAINER_S
    keep = kept & ~first
    rate = u["tokens"].values[keep] / u["interval_s"].values[keep]
    return version[keep].astype(np.int64), rate


def plot_staleness(runs: list[dict], out: Path) -> str:
    fig, axes = _figure("Staleness of consumed trajectories (versions)", 3)
    width = 0.8 / len(runs)
    top = 0
    for i, r in enumerate(runs):
        hist = r["ds"].laminar.staleness_histogram()
        x = hist["staleness"].values + i * width
        for ax, name in zip(axes, ("s_gen", "residence", "s_train"), strict=True):
            ax.bar(x, hist[name].values, width=width, label=r["name"])
        top = max(top, int(hist["staleness"].max()))
    centre = np.arange(top + 1) + (len(runs) - 1) * width / 2
    for ax, title in zip(
        axes, ("s_gen = M_f − K", "residence = M_t − M_f", "s_train = M_t − K"), strict=True
    ):
        ax.set(xlabel="versions", ylabel="trajectories", title=title)
        ax.set_xticks(centre, [str(v) for v in range(top + 1)])
    axes[-1].legend(fontsize=7)
    return _save(fig, out, "staleness.png")


def plot_buffer(runs: list[dict], out: Path) -> str | None:
    have = [r for r in runs if r["cluster"] is not None]
    if not have:
        return None
    fig, (ax_d, ax_a) = _figure("Experience buffer", 2)
    for r in have:
        c, gaps = r["cluster"], r["gaps"]
        ax_d.plot(*_broken(c["time"], c["buffer_depth"], gaps), label=r["name"])
        ax_a.plot(*_broken(c["time"], c["oldest_buffered_age_s"], gaps), label=r["name"])
        _shade(ax_d, gaps)
        _shade(ax_a, gaps)
    ax_d.set(xlabel="time (s)", ylabel="trajectories", title="depth")
    ax_a.set(xlabel="time (s)", ylabel="seconds", title="age of the oldest buffered trajectory")
    ax_d.legend(fontsize=7)
    return _save(fig, out, "buffer.png")


def plot_rollouts(run: dict, out: Path) -> str | None:
    ro = run["rollouts"]
    if ro is None:
        return None
    fig, (ax_kv, ax_v) = _figure(f"Rollouts of {run['name']}", 2)
    colour = {}
    gaps = run["gaps"]
    for rid in ro["rollout"].values:
        one = ro.sel(rollout=rid)
        kv = 100 * one["kv_used"] / one["kv_capacity"]
        (line,) = ax_kv.plot(*_broken(one["time"], kv, gaps), label=str(rid))
        colour[str(rid)] = line.get_color()
        ax_v.step(*_broken_steps(one["time"], one["version"], gaps), where="post", label=str(rid))
    if run["cluster"] is not None:
        c = run["cluster"]
        steps = _broken_steps(c["time"], c["version"], gaps)
        ax_v.step(*steps, "k--", where="post", label="trainer")
    moves = run["repacks"]
    if moves is not None and run["t0"] is not None and moves.sizes["move"]:
        # Each move: a drop on its source, a rise on its destination, at the move's time.
        ok = moves["ok"].values.astype(bool)
        t = _since_start(run, moves["time"].values)
        top = ax_kv.get_xaxis_transform()  # x in data, y in axes fraction
        for end, marker, y in (("source", "v", 0.97), ("destination", "^", 0.91)):
            # (one line of markers per rollout: one per move took ~1 ms each to draw)
            rids = moves[end].values[ok].astype(str)
            for rid in dict.fromkeys(rids):
                at = t[ok][rids == rid]
                ax_kv.plot(
                    at, np.full(at.size, y), marker, color=colour.get(rid, "k"), ms=5, transform=top
                )
        ax_kv.plot([], [], "kv", ms=5, label=f"repack move out ({ok.sum()})")
        ax_kv.plot([], [], "k^", ms=5, label="repack move in")
    _shade(ax_kv, gaps)
    _shade(ax_v, gaps)
    for rid, t in _lost(run):
        ax_v.axvline(t, color=colour.get(rid, "r"), ls=":", lw=1.5)
        _mark_loss(ax_kv, rid, t, colour.get(rid, "r"), y=0.85)
    ax_kv.set(xlabel="time (s)", ylabel="% of KV slots", title="KV-cache use")
    # Below the axes: the move markers sit along the top.
    ax_kv.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    ax_v.set(xlabel="time (s)", ylabel="version", title="weight version live per rollout")
    ax_v.yaxis.get_major_locator().set_params(integer=True)
    ax_v.legend(fontsize=7)
    return _save(fig, out, f"rollouts-{run['index']}.png")


def _mark_loss(
    ax, rid: str, t: float, colour: str, y: float, ls: str = ":", lost: str = " lost"
) -> None:
    """A dotted line at a rollout's loss, labelled along it (``ls``, ``lost``: another
    line and words, for a restart's)."""
    ax.axvline(t, color=colour, ls=ls, lw=1.5)
    ax.annotate(
        f"{rid}{lost}",
        (t, y),
        xycoords=("data", "axes fraction"),
        fontsize=7,
        rotation=90,
        ha="right",
        va="top",
    )


def plot_events(run: dict, out: Path) -> str | None:
    """Weight publications, repack moves, fault recoveries and restarts of a trainer or
    data module (summary.json's) of one run, on one time axis."""
    pubs, moves, faults = run["publications"], run["repacks"], run["faults"]
    if run["t0"] is None:
        return None
    if all(x is None for x in (pubs, moves, faults)) and not _restarts(run):
        return None
    fig, (ax_w, ax_m, ax_f) = _figure(f"Events of {run['name']}", 3)
    gaps = run["gaps"]
    if pubs is not None and pubs.sizes["publication"]:
        t = _since_start(run, pubs["t_publish"].values)
        stall = _broken(t, 1e3 * pubs["stall_s"].values, gaps)
        ax_w.plot(*stall, "o-", ms=3, label="trainer stall")
        if "broadcast_s" in pubs:
            broadcast = _broken(t, 1e3 * pubs["broadcast_s"].values, gaps)
            ax_w.plot(*broadcast, "s-", ms=3, label="to every relay")
        ax_w.set_yscale("log")
        ax_w.legend(fontsize=7)
    ax_w.set(xlabel="publish time (s)", ylabel="ms", title="weight publications")
    if moves is not None and moves.sizes["move"]:
        t = _since_start(run, moves["time"].values)
        ok = moves["ok"].values.astype(bool)
        ax_m.bar(t[ok], moves["requests"].values[ok], width=0.6, label="moved")
        if (~ok).any():
            ax_m.bar(t[~ok], moves["requests"].values[~ok], width=0.6, label="rolled back")
        pause = float(np.nansum(moves["pause_s"].values))
        ax_m.set_title(f"repack: {ok.sum()} moves, {pause:.2f} s paused", fontsize=10)
        ax_m.legend(fontsize=7)
    else:
        ax_m.set_title("repack: no moves (off, or none planned)", fontsize=10)
    ax_m.set(xlabel="time (s)", ylabel="requests per move")
    lost = _lost(run)
    for rid, t in lost:
        _mark_loss(ax_f, rid, t, "r", y=0.98)
    said = [f"{len(lost)} lost"] if lost else []
    restarts = [e for e in _restarts(run) if e["t"] is not None]
    for e in restarts:  # (a dashed line at its loss; shaded until it ran again)
        _mark_loss(ax_f, e["label"], e["t"], "k", y=0.98, ls="--", lost="")
        if e["down_s"] is not None:
            ax_f.axvspan(e["t"], e["t"] + e["down_s"], color="k", alpha=0.08, zorder=0)
    for what in RESTARTS.values():
        n = sum(e["what"] == what for e in restarts)
        said += [f"{n} {what} restart{'' if n == 1 else 's'}"] if n else []
    unknown = _unknown(run, "trainer_restarts")
    if faults is not None and faults.sizes["recovery"]:
        t = _since_start(run, faults["time"].values)
        how, n_req = faults["how"].values, faults["requests"].values
        bottom = np.zeros_like(t)  # one bar per recovery, stacked by how
        for kind in dict.fromkeys(how):
            sel = how == kind
            ax_f.bar(t[sel], n_req[sel], width=0.6, bottom=bottom[sel], label=kind)
            for ti, n in zip(t[sel], n_req[sel], strict=True):
                bottom[t == ti] += n
        n = int(np.nansum(faults["requests"].values))
        said.insert(1 if lost else 0, f"{n} trajectories recovered")
        ax_f.legend(fontsize=7, title="how")
    if unknown is not None:  # (a killed driver's run: what only summary.json says)
        said.append(f"restarts unknown ({unknown})")
    ax_f.set_title(f"faults: {', '.join(said) or 'none'}", fontsize=10)
    ax_f.set(xlabel="time (s)", ylabel="trajectories recovered")
    for ax in (ax_w, ax_m, ax_f):  # one time axis for the three
        _shade(ax, gaps)
        ax.set_xlim(0, float(run["cluster"]["time"].values[-1]))
    return _save(fig, out, f"events-{run['index']}.png")


def _moves(r: dict) -> int:
    """Repack moves over every start, as ``events-N.png`` counts them: the ``repacks``
    table's ok rows (written as the run goes, by every start); summary.json's
    ``repack.moves`` only without the table (it counts its own start's, and a live,
    killed or failed start has not written it)."""
    moves = r["repacks"]
    if moves is not None:
        return int(moves["ok"].values.astype(bool).sum()) if moves.sizes["move"] else 0
    return int((r["summary"].get("repack") or {}).get("moves", 0))


def _publications(r: dict):
    """The ``publications`` rows the events table counts: each start's first left out
    (version 0's, or a resumed start's publication again of its checkpoint's version:
    made as the start sets up, not by an update). A start's first is the first row of
    the run, and the first after each stop began."""
    pubs = r["publications"]
    if pubs is None or not pubs.sizes["publication"]:
        return pubs
    first = np.zeros(pubs.sizes["publication"], dtype=bool)
    first[0] = True
    if r["t0"] is not None:
        t = _since_start(r, pubs["t_publish"].values)
        for a, _ in r["gaps"]:
            if (after := np.flatnonzero(t > a)).size:
                first[after[0]] = True
    return pubs.isel(publication=np.flatnonzero(~first))


def _events_row(r: dict) -> str:
    s = r["summary"]
    pubs = _publications(r)
    stall = (
        f"{1e3 * float(np.nanmedian(pubs['stall_s'].values)):.1f}"
        if pubs is not None and pubs.sizes["publication"]
        else "-"
    )
    broadcast = (
        f"{1e3 * float(np.nanmedian(pubs['broadcast_s'].values)):.1f}"
        if pubs is not None and "broadcast_s" in pubs and pubs.sizes["publication"]
        else "-"
    )
    how = (
        ", ".join(
            f"{k} {int(np.nansum(r['faults']['requests'].values[r['faults']['how'].values == k]))}"
            for k in dict.fromkeys(r["faults"]["how"].values)
        )
        if r["faults"] is not None
        else "-"
    )
    return (
        f"| {r['name']} | {0 if pubs is None else pubs.sizes['publication']} | {stall} | "
        f"{broadcast} | {_moves(r)} | {len(rollout_losses(s, r['faults']))} | {how} | "
        f"{_replacements(s)} | {_restarts_cell(r)} | {_relays_hung_cell(r)} |"
    )


def _row(r: dict) -> str:
    st = r["ds"].laminar.summary()
    # (from the store, as summary.json has it: a run with no summary.json yet, or only
    # its earlier start's, has its figures all the same)
    first, last = reward_first_last(r["ds"])
    versions, wall, n_starts = _versions_and_wall(r)
    flat = st["flat_group_share"]  # (NaN: no group trained on)
    n = r["ds"].sizes["trajectory"]
    return (
        f"| {r['name']} | {'-' if versions is None else versions} | "
        f"{n} | {first:.3f} → {last:.3f}"
        f"{'' if first != first or last != last else f' ({last - first:+.3f})'} | "
        f"{st['s_gen_mean']:.2f} / {st['residence_mean']:.2f} / {st['s_train_mean']:.2f} | "
        f"{st.get('n_discarded', 0)} | "
        f"{_share(st.get('n_evicted', 0), n)} | {_share(st.get('n_filtered', 0), n)} | "
        f"{_s_train_max(r)} | "
        f"{'-' if flat != flat else f'{flat:.0%}'} | "
        + " / ".join(f"{round(v, 1):g}" for v in percentile_lengths(r["ds"]).values())
        + f" | {wall:.0f}"
        + (f" ({n_starts} starts)" if n_starts > 1 else "")
        + " |"
    )


def _share(count: int, of: int) -> str:
    """A count of the trajectories generated, with its share of them.

    >>> _share(1920, 6016), _share(0, 6016), _share(0, 0)
    ('1920 (32%)', '0', '0')
    """
    return f"{count} ({count / of:.0%})" if count else str(count)


def _s_train_max(r: dict) -> str:
    """The most versions behind any trajectory was trained, counted along the weights'
    lineage as ``buffer.max_train_staleness`` counts it (a restarted trainer's first
    batch is not read as late by the numbers it skipped), with that bound where the
    run's ``config.yaml`` sets it: ``1 (bound 1)``. ``-`` where none was trained."""
    ds = r["ds"]
    lags = train_lags(r["dir"], ds)[ds["status"].values == "consumed"]
    lags = lags[np.isfinite(lags)]
    most = "-" if not lags.size else str(int(lags.max()))
    try:
        bound = train_staleness_bound(r["dir"])
    except StoreError as e:  # (said with the damaged stores; the bound left out)
        r["damaged"].append(f"buffer.max_train_staleness left out of s_train max: {e}")
        logger.warning("%s: %s", r["dir"], r["damaged"][-1])
        bound = None
    return most if bound is None else f"{most} (bound {bound})"


def _versions_and_wall(r: dict) -> tuple[int | None, float, int]:
    """The run's last version, RL wall seconds (every start's) and starts: from
    summary.json when it is of the run's last start, else from the ``cluster`` table
    (a run whose driver was killed, or still going, has no summary.json; a resumed one,
    its earlier start's until the resume ends)."""
    s, starts = r["summary"], r["starts"]
    current = bool(s) and s.get("segments", 1) >= len(starts)
    versions = s.get("versions") if current else None
    if versions is None and starts:
        versions = max(x["last_version"] for x in starts)
    wall = s.get("rl_wall_s_total", s.get("rl_wall_s")) if current else None
    if wall is not None:
        return versions, float(wall), int(s.get("segments", 1))
    if not starts:
        return versions, float("nan"), 1
    return versions, sum(ran_s(x) for x in starts), len(starts)


def _check_out(out: Path, given: str) -> None:
    """The report's folder ``out`` (named by ``given``: ``--out ``) is a folder, or can
    be made one: neither it nor a folder above it is a file."""
    for path in (out, *out.parents):
        if not path.exists():
            continue
        if path.is_dir():
            return
        if path == out:
            raise ConfigError(
                f"{given}{str(out)!r} is a file; the report is a folder: name a new one"
            )
        raise ConfigError(
            f"{given}{str(out)!r} cannot be made: {str(path)!r} is a file, not a folder; "
            "name a folder whose parents are folders"
        )


def build_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the figures and ``report.md``; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    given = "--out " if out else "the report's folder "
    if out is not None:  # (before any store is read)
        _check_out(Path(out), given)
    runs = [_load(Path(d)) | {"index": i} for i, d in enumerate(run_dirs)]
    if out is None:
        out = runs[0]["dir"] / "report"
        _check_out(out, given)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (a read-only folder, a full disk)
        raise ConfigError(
            f"{given}{str(out)!r} cannot be made ({type(e).__name__}: {e}); name a folder "
            "that can be written with --out"
        ) from e
    figures = [plot_reward(runs, out), plot_throughput(runs, out), plot_staleness(runs, out)]
    figures += [plot_buffer(runs, out)]
    figures += [f(r, out) for r in runs for f in (plot_rollouts, plot_events)]
    lines = [
        "# laminar report",
        "",
        "| run | versions | trajectories | reward first → last 20% | s_gen / residence / "
        "s_train (mean) | discarded | evicted | filtered | s_train max | flat groups | "
        "response length p50 / p90 / p99 | RL wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in runs),
        "",
        "| run | publications | stall ms (median) | to every relay ms (median) | "
        "repack moves | rollouts lost | trajectories recovered, by how | replacements | "
        "trainer / data restarts | relays lost / hung |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_events_row(r) for r in runs),
        "",
    ]
    damaged = [f"- {r['name']}: {d}" for r in runs for d in r["damaged"]]
    if damaged:
        lines += ["## Damaged stores (their figures and columns are left out)", "", *damaged, ""]
    absent = [f"- {r['name']}: {d}" for r in runs for d in r["absent"]]
    if absent:
        lines += ["## Missing stores", "", *absent, ""]
    lines += [f"![{name}]({name})" for name in figures if name]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def percentile_lengths(ds, q=(50, 90, 99)) -> dict[str, float]:
    """Response-length percentiles (tokens): the long tail the schedule must absorb."""
    lengths = ds["response_len"].values
    return {f"p{p}": float(np.percentile(lengths, p)) if lengths.size else np.nan for p in q}
