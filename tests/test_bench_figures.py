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


def _updates(intervals: list[float], tokens: float = 1000.0):
    import numpy as np
    import xarray as xr

    n = len(intervals)
    return xr.Dataset(
        {
            "version": ("update", np.arange(1, n + 1)),
            "interval_s": ("update", np.array(intervals)),
            "time": ("update", 1000.0 + np.cumsum(intervals)),
            "tokens": ("update", np.full(n, tokens)),
        }
    )


def test_one_steps_last_publication_which_waits_for_no_next_batch_is_not_measured():
    """One-step publishes version v once the batch of v + 1 is complete, so each interval
    holds the wait for the next batch; the run's last version is published straight
    after its update, waiting for none. Measured with the others, its short interval
    flattered one-step alone; it is left out, and the bench runs one-step one update
    longer so that every schedule measures as many intervals."""
    from pipelines.bench_schedules import run_steps, steady_updates

    # every interval 10 s (7 s training + 3 s waiting for the next batch) but the last
    ups = _updates([10.0] * 9 + [7.0])
    kept = steady_updates(ups, "one_step")
    assert kept["version"].values.tolist() == list(range(1, 10))
    measured = kept["version"].values > 3
    assert kept["interval_s"].values[measured].sum() == 60.0  # 6 intervals of 10 s
    for schedule in ("sync", "stream", "partial_rollout", "laminar"):
        assert steady_updates(ups, schedule)["version"].values.tolist() == list(range(1, 11))
    assert run_steps("one_step", 9) == 10
    assert run_steps("laminar", 9) == run_steps("laminar_no_repack", 9) == 9
