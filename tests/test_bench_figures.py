"""The benches' figures from small synthetic inputs: which updates, trajectories and moves
each figure counts (``pipelines/bench_schedules.py``, ``pipelines/bench_repack.py``)."""

import math

import pytest


def _fig(ttr_s: float, ttr_trained_s: float, throughput: float = 100.0) -> dict:
    from pipelines.bench_schedules import FIGURES

    return {k: 1.0 for k in FIGURES} | {
        "throughput": throughput,
        "reward_first": 0.5,
        "reward_last": 0.9,
        "_policy": [(0.0, 0.5), (ttr_s, 0.9)],
        "_trained": [(0.0, 0.5)] + ([] if math.isnan(ttr_trained_s) else [(ttr_trained_s, 0.9)]),
    }


def _result(results: dict, threshold: float = 0.65):  # (crossed at the 2nd point)
    from pipelines.bench_schedules import Cluster, _result

    arms = tuple(results)
    splits = {a: 5 for a in arms}
    return _result(Cluster(64), arms, results, splits, {}, threshold, "d", [], dict(seeds=3))


def test_a_seed_that_never_reaches_the_reward_counts_as_later_than_any_that_did():
    """Time to reward of a run that never reached the threshold is longer than the run,
    not unknown: the median over seeds counts it as later than every seed that did, so an
    arm is not credited with the median of its fastest seeds alone."""
    sync = [_fig(100.0, 1000.0), _fig(100.0, 1000.0), _fig(100.0, 1000.0)]
    laminar = [_fig(100.0, 600.0), _fig(100.0, math.nan), _fig(100.0, 900.0)]
    res = _result({"sync": sync, "laminar": laminar})
    assert math.isnan(res.samples["laminar_ttr_trained_s"][1])  # the sample: never
    assert res.figures["laminar_ttr_trained_s"] == 900.0  # not 750, the mean of 600 and 900
    assert res.ratios["ttr_trained_laminar_vs_sync"] == pytest.approx(1000 / 900)
    # most seeds never reached it: the median run did not, within the run
    laminar = [_fig(100.0, 600.0), _fig(100.0, math.nan), _fig(100.0, math.nan)]
    res = _result({"sync": sync, "laminar": laminar})
    assert math.isnan(res.figures["laminar_ttr_trained_s"])
    assert res.ratios["ttr_trained_laminar_vs_sync"] is None


def test_replica_seconds_freed_count_each_moved_request_once_from_its_own_move():
    """A move frees its source from the move to the last of *its* requests finishing
    elsewhere; a later move between the same two rollouts moves other requests, whose
    finish is not this move's."""
    import numpy as np
    import xarray as xr

    from pipelines.bench_repack import _freed

    ds = xr.Dataset(
        {
            "rollout_ids": ("trajectory", ["a,b", "a,b", "a,b", "a,b,c", "a"]),
            "t_submit": ("trajectory", [5.0, 6.0, 90.0, 7.0, 95.0]),
            "t_finish": ("trajectory", [20.0, 18.0, 130.0, 40.0, 200.0]),
        }
    )
    moves = xr.Dataset(
        {
            "source": ("move", ["a", "b", "a", "a"]),
            "destination": ("move", ["b", "c", "b", "b"]),
            "time": ("move", [10.0, 15.0, 100.0, 50.0]),
            "ok": ("move", np.array([True, True, True, False])),
        }
    )
    # a -> b at 10: the first two and the third's first hop (last finish 40); b -> c at 15:
    # the third (40); a -> b at 100: the later one (130); the move at 50 was rolled back
    assert _freed(ds, moves) == pytest.approx((40 - 10) + (40 - 15) + (130 - 100))
    assert _freed(ds, None) == 0.0
