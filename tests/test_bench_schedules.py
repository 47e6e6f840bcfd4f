"""``laminar bench schedules``' measurement rules, without running a cluster: the split
search's probes and their noise, and the time-to-reward ratio's threshold."""

from __future__ import annotations

import inspect
import math

import pytest

# -- the split search's probes ---------------------------------------------------------------

OPTIMUM = 9


def true_throughput(r: int) -> float:
    """A unimodal throughput in the split: 4% less per replica from the optimum (neighbouring
    splits differed by 3-6% at 64 GPUs)."""
    return 200e3 * (1 - 0.04 * abs(r - OPTIMUM))


# A fixed ±8% pattern per interval (one-step's ranged 136-210k tok/s within a run): the
# probe at R = 10 came out high, the one at the optimum low.
PATTERN = {10: (1, 1, 1, -1), 9: (-1, -1, -1, 1)}


def noisy_probe(r: int):
    from pipelines.bench_schedules_cluster import Probe

    signs = PATTERN.get(r, (1, -1, 1, -1))
    intervals = [true_throughput(r) * (1 + 0.08 * s) for s in signs]
    return Probe(sum(intervals) / len(intervals), intervals)


def test_a_probe_keeps_its_intervals_and_the_search_says_which_splits_it_did_not_separate():
    """One noisy probe per split stops the climb at whichever came out high (here R = 10,
    a neighbour of the optimum): the result says so, naming the splits within the probes'
    own noise (their intervals' standard error), the optimum among them, and the JSON keeps
    every probe's intervals and spread."""
    from pipelines.bench_schedules_cluster import Cluster, noise_band, search_split
    from pipelines.bench_schedules_report import _search_result

    best, seen = search_split(noisy_probe, lo=1, hi=15, start=5)
    assert best == 10  # the probe that came out high
    band = noise_band(best, seen)
    assert OPTIMUM in band and best in band
    # the band holds the splits within their probes' noise of the chosen one's, not those
    # the probes told apart (R = 7 and 11, 8% lower)
    assert band == [9, 10] and {7, 11} <= set(seen)
    top = seen[best]
    assert top - seen[9] <= math.hypot(top.spread, seen[9].spread)
    # the probes' spread is their intervals' standard error
    assert seen[9].spread == pytest.approx(
        0.08 * true_throughput(9) * math.sqrt(4 * 0.75 / 3) / 2, rel=1e-9
    )

    res = _search_result(Cluster(64), ("laminar",), {"laminar": best}, {"laminar": seen}, "d")
    opts = res.options
    assert opts["probes"]["laminar"]["9"] == pytest.approx(float(seen[9]))
    assert opts["probe_intervals"]["laminar"]["9"] == pytest.approx(list(seen[9].intervals))
    assert len(opts["probe_intervals"]["laminar"]["9"]) == 4
    assert opts["probe_spread"]["laminar"]["9"] == pytest.approx(seen[9].spread)
    assert opts["split_band"]["laminar"] == band
    note = [n for n in res.notes if n.startswith("laminar: split R=10")]
    assert note and "R=9 (" in note[0] and "within noise" in note[0]
    # a plain float (no intervals) has no spread: the band is the split alone
    plain = {r: float(v) for r, v in seen.items()}
    assert noise_band(best, plain) == [best]


def test_the_probes_measure_four_updates_by_default():
    """Two measured intervals a probe varied by more than neighbouring splits differ."""
    from pipelines.bench_schedules import bench_schedules

    assert inspect.signature(bench_schedules).parameters["probe_iterations"].default >= 4


# -- the time-to-reward ratio ----------------------------------------------------------------


def _fig(curve, first, last, seed=0) -> dict:
    from pipelines.bench_schedules_report import FIGURES

    return {k: 1.0 for k in FIGURES} | {
        "throughput": 100.0,
        "_policy": curve,
        "_trained": curve,
        "reward_first": first,
        "reward_last": last,
        "_seed": seed,
    }


SYNC = [(0, 0.5), (100, 0.57), (200, 0.7), (300, 0.8), (400, 0.9)]
LAMINAR = [(0, 0.5), (50, 0.58), (100, 0.7), (150, 0.85), (200, 0.9)]
LOW = [(0, 0.5), (50, 0.55), (100, 0.6)]  # a third arm whose final reward is the lowest


def test_the_ttr_ratio_takes_its_threshold_from_its_two_arms_alone():
    """From every arm's runs, a third arm with a lower final reward lowered the threshold
    and moved ``ttr_laminar_vs_sync`` (in one bench 1.45 with five arms, 1.11 with two)."""
    from pipelines.bench_schedules_cluster import Cluster
    from pipelines.bench_schedules_figures import reward_thresholds
    from pipelines.bench_schedules_report import _result

    two = {"sync": [_fig(SYNC, 0.5, 0.9)], "laminar": [_fig(LAMINAR, 0.5, 0.9)]}
    three = two | {"stream": [_fig(LOW, 0.5, 0.6)]}
    pair = ("sync", "laminar")
    assert reward_thresholds(three, None, arms=pair) == reward_thresholds(two, None)
    assert reward_thresholds(three, None) != reward_thresholds(two, None)

    def result(results, given=None):
        arms = tuple(results)
        splits = dict.fromkeys(arms, 5)
        return _result(Cluster(64), arms, results, splits, {}, given, "d", [], dict(seeds=1))

    alone, beside = result(two), result(three)
    # threshold 0.8: sync at 400 s, Laminar at 200 s, with or without the third arm
    assert alone.ratios["ttr_laminar_vs_sync"] == pytest.approx(2.0)
    assert beside.ratios["ttr_laminar_vs_sync"] == pytest.approx(2.0)
    assert beside.ratios["ttr_trained_laminar_vs_sync"] == pytest.approx(2.0)
    assert beside.figures["ttr_laminar_vs_sync_threshold"] == pytest.approx(0.8)
    # (the table's ttr_s keeps one threshold for every arm: each reaches it)
    assert beside.figures["sync_ttr_s"] == 200 and beside.figures["laminar_ttr_s"] == 50
    # the JSON says what the ratio rests on: each run's margins, the ratio per seed
    detail = beside.options["ttr_pairs"]["ttr_laminar_vs_sync"]
    assert detail["thresholds"] == {"0": pytest.approx(0.8)}
    assert detail["per_seed"] == {"0": pytest.approx(2.0)}
    sync_run = detail["runs"]["sync"][0]
    assert sync_run["time_s"] == 400
    assert sync_run["cleared"] == pytest.approx(0.05) and sync_run["short"] == pytest.approx(0.05)
    assert any(n.startswith("ttr_laminar_vs_sync 2.00 (sync 400 s") for n in beside.notes)
    # an explicit threshold still wins, for every arm and the ratio alike
    given = result(three, given=0.6)
    assert given.options["ttr_pairs"]["ttr_laminar_vs_sync"]["thresholds"] == {"0": 0.6}
    assert given.options["ttr_pairs"]["ttr_laminar_vs_sync"]["runs"]["laminar"][0]["time_s"] == 100
    assert given.options["reward_thresholds"] == {"0": 0.6}
