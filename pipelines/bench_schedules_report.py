"""The result of ``laminar bench schedules``: the runs' figures as medians per schedule,
the ratios between schedules, the notes (:func:`_result`; :func:`_search_result` for a
bench that only searched the splits), and beside the JSON a markdown table and the plots
(:func:`write_extras`).

Apart from the bench because it only turns measured figures into a report: it runs
nothing and reads no store, so the bench and its re-analysis of kept runs
(:func:`pipelines.bench_schedules.reanalyse`) share it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipelines.bench_schedules_cluster import (
    ABLATION_OF,
    GPUS_PER_REPLICA,
    LENGTH_SCALE,
    REQUEST_SCALE,
    WORKLOAD,
    noise_band,
    spread_of,
)
from pipelines.bench_schedules_figures import (
    pair_times_to_reward,
    reward_thresholds,
    time_to_reward,
)

FIGURES = [
    "throughput",
    "gen_throughput",
    "ttr_s",
    "ttr_trained_s",
    "iteration_s",
    "rollout_idle",
    "trainer_idle",
    "decode_batch",
    "s_gen_mean",
    "s_gen_p99",
    "s_gen_max",
    "residence_mean",
    "residence_p99",
    "residence_max",
    "s_train_mean",
    "s_train_p99",
    "s_train_max",
    "buffer_depth",
    "buffer_age_s",
    "arrivals_per_s",
    "consumption_per_s",
    "evicted",
    "discarded",
    "filtered",
    "wasted_tokens",
    "recomputed_tokens",
    "reward_first",
    "reward_last",
    "compute_vs_modelled",
    "overrun_steps",
    "decode_unmodelled",
    "overrun_share",
    "top_up_share",
    "trainer_compute_vs_modelled",
    "trainer_overruns",
    "audit_ok",
    "moves",
    "len_p99_over_median",
    "len_cap_over_mean",
    "len_within_share",
    "response_len",
    "len_drift",
    "replicas",
    "trainer_gpus",
]
TABLE = [
    "replicas",
    "trainer_gpus",
    "throughput",
    "gen_throughput",
    "ttr_s",
    "rollout_idle",
    "trainer_idle",
    "decode_batch",
    "s_train_mean",
    "s_train_max",
    "buffer_depth",
    "wasted_tokens",
    "len_drift",
]


def _search_result(cluster, arms, splits, probes, root, failed=()):
    """``--seeds 0``: the splits alone, searched (or fixed), and every probe; nothing is
    measured beyond the probes, so there are no medians and no ratios."""
    from pipelines.bench import BenchResult, failed_notes

    figures: dict[str, float | None] = {}
    rows = []
    for arm in arms:
        seen = probes.get(arm, {})
        r = splits.get(arm)  # (None: its search failed, every probe)
        best = seen.get(r)
        figures[f"{arm}_replicas"] = None if r is None else float(r)
        figures[f"{arm}_probe_throughput"] = best
        probed = ", ".join(f"{r}: {v / 1e3:,.0f}k" for r, v in seen.items())
        if r is None:
            probed = f"search failed ({probed or 'no probe'})"
        elif not probed:
            base = ABLATION_OF.get(arm)
            probed = (
                "colocated"
                if arm == "sync"
                else f"at {base}'s split"
                if base in splits and splits[base] == splits[arm]
                else "fixed"
            )
        trainer = None if r is None else cluster.gpus - GPUS_PER_REPLICA * r
        rows.append([arm, r, cluster.gpus if arm == "sync" else trainer, best, probed])
    return BenchResult(
        name="schedules",
        figures=figures,
        ratios={},
        samples={},
        columns=["schedule", "replicas", "trainer_gpus", "probe_throughput", "probes (R: tok/s)"],
        rows=rows,
        options=_options(cluster, splits, probes, root, seeds=0),
        notes=[
            f"{cluster.gpus} emulated H800 GPUs: the split search alone (--seeds 0), probes "
            "of seed 0 in the probes' order; run with --splits ARM=R to measure at these; "
            "no table or plots beside the JSON (nothing was measured at the splits)",
            *band_notes(splits, probes),
            *failed_notes(list(failed)),
        ],
        failed=list(failed),
    )


def band_notes(splits, probes) -> list[str]:
    """A note per searched arm whose chosen split the probes did not tell apart from
    another (:func:`noise_band`): its probe ± standard error, and theirs.

    >>> from pipelines.bench_schedules_cluster import Probe
    >>> band_notes({"laminar": 9}, {"laminar": {8: Probe(203e3, [193e3, 213e3]),
    ...                                         9: Probe(210e3, [200e3, 220e3])}})
    ['laminar: split R=9 (probe 210k ± 10k) not told apart from R=8 (203k ± 10k), within noise']
    """

    def pm(v: float) -> str:
        return f"{v / 1e3:,.0f}k ± {spread_of(v) / 1e3:,.0f}k"

    notes = []
    for arm, seen in probes.items():
        r = splits.get(arm)
        band = [b for b in noise_band(r, seen) if b != r]
        if band:
            notes.append(
                f"{arm}: split R={r} (probe {pm(seen[r])}) not told apart from "
                + ", ".join(f"R={b} ({pm(seen[b])})" for b in band)
                + ", within noise"
            )
    return notes


def _options(cluster, splits, probes, root, **more) -> dict:
    """What a result records of how it was made: cluster shape, scales, splits, every probe."""
    return {
        "gpus": cluster.gpus,
        "dilation": cluster.dilation,
        "length_scale": LENGTH_SCALE,
        "request_scale": REQUEST_SCALE,
        "splits": splits,
        "probes": {arm: {str(r): v for r, v in seen.items()} for arm, seen in probes.items()},
        # each probe's measured intervals' throughputs and their standard error, and the
        # probed splits within that noise of the chosen one (noise_band)
        "probe_intervals": {
            arm: {str(r): list(getattr(v, "intervals", ())) for r, v in seen.items()}
            for arm, seen in probes.items()
        },
        "probe_spread": {
            arm: {str(r): spread_of(v) for r, v in seen.items()} for arm, seen in probes.items()
        },
        "split_band": {
            arm: noise_band(splits.get(arm), seen) for arm, seen in probes.items() if seen
        },
        "workload": WORKLOAD,
        "runs": str(root),
        **more,
    }


def _result(cluster, arms, results, splits, probes, reward_threshold, root, failed, locals_):
    from pipelines.bench import BenchResult, failed_notes

    if not any(results.values()):
        raise RuntimeError(
            "every measured run failed; nothing to report:\n" + "\n".join(failed_notes(failed))
        )
    thresholds = reward_thresholds(results, reward_threshold)
    for rs in results.values():
        for f in rs:
            f["ttr_threshold"] = thresholds[f.get("_seed")]
            f["ttr_s"] = time_to_reward(f["_policy"], f["ttr_threshold"])
            f["ttr_trained_s"] = time_to_reward(f["_trained"], f["ttr_threshold"])
    med = {  # (an arm whose every run failed: NaN throughout)
        arm: {
            k: _median_censored([f[k] for f in rs])
            if k in CENSORED
            else _median([f[k] for f in rs])
            for k in FIGURES
        }
        for arm, rs in results.items()
    }

    null: list[str] = []  # why each null ratio is null, naming the arm

    def ratio(name: str, a: str, b: str, key: str = "throughput") -> float | None:
        for arm in (a, b):
            why = _unmeasured(arm, results) or (
                f"has no {key} (NaN: never reached in its median run)"
                if key in CENSORED and math.isnan(med[arm][key])
                else f"has no {key} (NaN)"
                if math.isnan(med[arm][key])
                else None
            )
            if why:
                null.append(f"{name} null: {arm} {why}")
                return None
        if med[b][key] == 0:
            null.append(f"{name} null: {b}'s {key} is 0")
            return None
        return med[a][key] / med[b][key]

    ratios = {
        f"laminar_vs_{b}": ratio(f"laminar_vs_{b}", "laminar", b)
        for b in ("sync", "one_step", "stream", "partial_rollout")
    }
    ratios["laminar_repack_on_vs_off"] = ratio(
        "laminar_repack_on_vs_off", "laminar", "laminar_no_repack"
    )
    # sync's time over Laminar's, each to the threshold of their runs alone
    # (pair_times_to_reward): the table's ttr_s takes every arm's, which moved the ratio
    # with the arms run beside them (1.45 with five, 1.11 with the two, in one bench)
    ttr_pairs: dict[str, dict] = {}
    ttr_notes: list[str] = []
    for name, key, curve in (
        ("ttr_laminar_vs_sync", "ttr_s", "_policy"),
        ("ttr_trained_laminar_vs_sync", "ttr_trained_s", "_trained"),
    ):
        ratios[name], ttr_pairs[name] = _ttr_ratio(
            name, "sync", "laminar", key, curve, results, reward_threshold, null
        )
        if ratios[name] is not None:
            ttr_notes.append(_ttr_note(name, ratios[name], ttr_pairs[name]))
    ratios["gen_throughput_laminar_vs_sync"] = ratio(
        "gen_throughput_laminar_vs_sync", "laminar", "sync", "gen_throughput"
    )
    figures = {f"{arm}_{k}": v for arm, m in med.items() for k, v in m.items()}
    # (each seed's: reward_thresholds; their median for the plot and the table's note)
    figures["reward_threshold"] = float(np.median(list(thresholds.values())))
    locals_ = {
        **locals_,
        "reward_thresholds": {str(k): v for k, v in thresholds.items()},
        "ttr_pairs": ttr_pairs,
    }
    for name, pair in ttr_pairs.items():
        if pair.get("thresholds"):
            figures[f"{name}_threshold"] = float(np.median(list(pair["thresholds"].values())))
    samples = {f"{arm}_{k}": [f[k] for f in rs] for arm, rs in results.items() for k in FIGURES}
    for curve in ("policy", "trained"):  # [(modelled s, reward)] of every run
        samples |= {
            f"{arm}_{curve}_reward": [f[f"_{curve}"] for f in rs] for arm, rs in results.items()
        }
    result = BenchResult(
        name="schedules",
        figures=figures,
        ratios=ratios,
        samples=samples,
        columns=["schedule"] + TABLE,
        rows=[[arm] + [med[arm][c] for c in TABLE] for arm in arms],
        options=_options(cluster, splits, probes, root, **locals_),
        notes=[
            f"{cluster.gpus} emulated H800 GPUs (TP4 replicas; sync colocated on all); "
            f"modelled units of the full-size cluster; medians over {locals_['seeds']} seeds",
            "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None),
            *null,
            *band_notes(splits, probes),
            "time to reward: the policy's reward (its rollouts', at its publication; "
            "ttr_trained_s: the trained batches', at their update), 2-point mean >= "
            + ", ".join(f"{v:.3f} (seed {k})" for k, v in sorted(thresholds.items(), key=str))
            + " in the table (from every arm's runs); the ratios take the two arms' own",
            *ttr_notes,
            *(
                f"{arm}: {note}"
                for arm, rs in results.items()
                for f in rs
                for note in f.get("_notes", ())
            ),
            *failed_notes(failed),
        ],
        failed=failed,
    )
    result.extras = write_extras
    return result


def _unmeasured(arm: str, results: dict[str, list[dict]]) -> str | None:
    """Why ``arm`` has no run to take a ratio of, or None."""
    if arm not in results:
        return "was not measured (not in --arms, or its split search failed)"
    if not results[arm]:
        return "has no run that finished (each failed, or its split search did)"
    return None


def _ttr_ratio(name, a, b, key, curve, results, given, null):
    """``a``'s median time to reward over ``b``'s, each run's to the threshold of the two
    arms' runs alone (:func:`pair_times_to_reward`), and what the JSON keeps of it: the
    thresholds, each run's time with how far its crossing cleared the threshold (and fell
    short before it), and the ratio per seed. ``None`` (and a note in ``null``,
    naming the arm) where it cannot be computed."""
    for arm in (a, b):
        why = _unmeasured(arm, results)
        if why:
            null.append(f"{name} null: {arm} {why}")
            return None, {}
    pair = pair_times_to_reward(results, a, b, curve, given)
    times = {arm: [t for _, t, _, _ in pair[arm]] for arm in (a, b)}
    med = {arm: _median_censored(times[arm]) for arm in (a, b)}
    seeds = sorted({s for arm in (a, b) for s, *_ in pair[arm]}, key=str)

    def per_seed(arm, seed) -> float:
        return _median_censored([t for s, t, _, _ in pair[arm] if s == seed])

    detail = {
        "thresholds": {str(k): pair["thresholds"][k] for k in seeds},
        "median_s": med,
        "runs": {
            arm: [{"seed": s, "time_s": t, "cleared": c, "short": sh} for s, t, c, sh in pair[arm]]
            for arm in (a, b)
        },
        "per_seed": {},
    }
    for seed in seeds:
        ta, tb = per_seed(a, seed), per_seed(b, seed)
        ok = math.isfinite(ta) and math.isfinite(tb) and tb > 0
        detail["per_seed"][str(seed)] = ta / tb if ok else None
    for arm in (a, b):
        if math.isnan(med[arm]):
            null.append(f"{name} null: {arm} has no {key} (NaN: never reached in its median run)")
            return None, detail
    if med[b] == 0:
        null.append(f"{name} null: {b}'s {key} is 0")
        return None, detail
    return med[a] / med[b], detail


def _ttr_note(name: str, value: float, detail: dict) -> str:
    """A time-to-reward ratio with what it rests on: its thresholds, the ratio per seed,
    and each run's margins (how far its crossing cleared the threshold / the highest mean
    before it fell short: a threshold moved by less gives the same time).

    >>> note = _ttr_note("ttr_laminar_vs_sync", 1.2, {"thresholds": {"0": 0.9},
    ...     "per_seed": {"0": 1.2}, "median_s": {"sync": 600.0, "laminar": 500.0},
    ...     "runs": {"sync": [{"seed": 0, "cleared": 0.004, "short": 0.001}],
    ...              "laminar": [{"seed": 0, "cleared": 0.01, "short": math.nan}]}})
    >>> note.split("; ")  # doctest: +NORMALIZE_WHITESPACE
    ['ttr_laminar_vs_sync 1.20 (sync 600 s, laminar 500 s',
     'thresholds of its two arms: 0.900 (seed 0)', 'per seed 1.20',
     'crossings cleared the threshold by / fell short before by:
     sync +0.0040/0.0010 (seed 0), laminar +0.0100/– (seed 0))']
    """

    def fmt(x) -> str:
        return "–" if x is None or not math.isfinite(x) else f"{x:.4f}"

    runs = ", ".join(
        f"{arm} "
        + ("never" if not math.isfinite(r["cleared"]) else f"+{fmt(r['cleared'])}")
        + f"/{fmt(r['short'])} (seed {r['seed']})"
        for arm, rs in detail["runs"].items()
        for r in rs
    )
    return (
        f"{name} {value:.2f} ("
        + ", ".join(f"{arm} {t:,.0f} s" for arm, t in detail["median_s"].items())
        + "; thresholds of its two arms: "
        + ", ".join(f"{v:.3f} (seed {k})" for k, v in detail["thresholds"].items())
        + "; per seed "
        + ", ".join("–" if v is None else f"{v:.2f}" for v in detail["per_seed"].values())
        + "; crossings cleared the threshold by / fell short before by: "
        + runs
        + ")"
    )


# Times to reward: NaN in a run's sample means it never reached the threshold within the
# run, i.e. later than any run that did, not an unknown to leave out of the median.
CENSORED = ("ttr_s", "ttr_trained_s")


def _median_censored(values: list[float]) -> float:
    """The median of times to an event, NaN counted as "not within the run" (later than
    every finite time); NaN when the median run did not reach it, or there is no run.

    >>> _median_censored([600.0, float("nan"), 900.0]), _median_censored([600.0, float("nan")])
    (900.0, nan)
    """
    if not values:
        return math.nan
    med = float(np.median([math.inf if math.isnan(v) else v for v in values]))
    return med if math.isfinite(med) else math.nan


def _median(values: list[float]) -> float:
    """The median of the finite samples; NaN when there is none (no warning).

    >>> _median([3.0, float("nan"), 1.0]), _median([])
    (2.0, nan)
    """
    finite = [v for v in values if not math.isnan(v)]
    return float(np.median(finite)) if finite else math.nan


def write_extras(result, out: Path) -> list[Path]:
    """Beside ``out`` (the JSON): a markdown table and the plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    stem = out.with_suffix("")
    md = stem.with_suffix(".md")
    md.write_text(markdown(result))
    arms = [row[0] for row in result.rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    thr = [result.figures[f"{a}_throughput"] / 1e3 for a in arms]
    colours = {"laminar": "#1f77b4", "laminar_no_repack": "#aec7e8"}  # the baselines grey
    ax[0].bar(arms, thr, color=[colours.get(a, "#999") for a in arms])
    ax[0].set_ylabel("actor-update throughput (k tok/s)")
    ax[0].tick_params(axis="x", rotation=30)
    for a in arms:
        for i, curve in enumerate(result.samples[f"{a}_policy_reward"]):
            t, r = zip(*curve, strict=True) if curve else ((), ())
            ax[1].plot(t, r, lw=0.8, label=a if i == 0 else None)
    ax[1].axhline(result.figures["reward_threshold"], color="k", ls=":", lw=0.8)
    ax[1].set_xlabel("modelled time (s)")
    ax[1].set_ylabel("reward of each version's rollouts")
    ax[1].legend(fontsize=7)
    fig.suptitle(f"laminar bench schedules, {result.options['gpus']} emulated GPUs")
    fig.tight_layout()
    png = stem.parent / f"{stem.name}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [md, png]


def markdown(result) -> str:
    """The bench's table and ratios as markdown."""
    cols = result.columns
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in result.rows:
        cells = [row[0]] + [_md(v) for v in row[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {_md(v)} |" for k, v in result.ratios.items()]
    return "\n".join(lines) + "\n"


def _md(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)
