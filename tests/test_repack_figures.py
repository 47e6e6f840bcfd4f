"""``laminar bench repack``'s move figures: the steady window's moves, their pause per
committed move and summed, and the replica-seconds freed from each source's release."""

import numpy as np
import pytest
import xarray as xr

from laminar.pacing import Scale


def test_the_pause_is_summed_over_every_move_and_averaged_over_the_committed_ones():
    """``moves`` counted the committed moves while ``pause_s`` summed the rolled-back
    ones' pause too, and the figures were the whole run's (warm-up included). Now the
    sum says it is one (``pause_sum_s``), a committed move's mean is its own figure, and
    the share divides by the window the rows were taken from."""
    from pipelines.bench_repack import pause_figures

    scale = Scale(dilation=32, length_scale=256)  # 8 modelled s a wall s
    ok = np.array([True, False, True, True])
    pause = np.array([0.25, 2.0, 0.5, 0.75])
    fig = pause_figures(ok, pause, replicas=2, window_s=35.0, scale=scale)
    assert fig["moves"] == 3 and fig["rolled_back"] == 1
    assert fig["pause_sum_s"] == pytest.approx(8 * 3.5)
    assert fig["pause_per_move_s"] == pytest.approx(8 * 0.5)  # committed moves only
    assert fig["overhead_frac"] == pytest.approx(3.5 / (35.0 * 2))
    none = pause_figures(ok[:0], pause[:0], replicas=2, window_s=35.0, scale=scale)
    assert none == {
        "moves": 0,
        "rolled_back": 0,
        "pause_sum_s": 0.0,
        "pause_per_move_s": 0.0,
        "overhead_frac": 0.0,
    }


def test_replica_seconds_freed_count_from_the_release_and_within_the_window():
    """A source is free from its release, not from its round's start (which a paced
    source's withheld export and the import lengthen); only the moves of the steady
    window count, though a trajectory's hops are matched over every move."""
    from pipelines.bench_repack import _freed

    ds = xr.Dataset(
        {
            "rollout_ids": ("trajectory", ["a,b", "a,b,c", "a,b"]),
            "t_submit": ("trajectory", [5.0, 7.0, 90.0]),
            "t_finish": ("trajectory", [20.0, 40.0, 101.0]),
        }
    )
    moves = xr.Dataset(
        {
            "source": ("move", ["a", "b", "a"]),
            "destination": ("move", ["b", "c", "b"]),
            "time": ("move", [10.0, 15.0, 100.0]),
            "t_released": ("move", [12.0, 16.0, 102.0]),  # (the last: all done by then)
            "ok": ("move", np.array([True, True, True])),
        }
    )
    # a -> b: released at 12, its requests' last finish 40; b -> c: 16 to 40; the move
    # at 100 freed nothing (its request finished before the release)
    assert _freed(ds, moves) == pytest.approx((40 - 12) + (40 - 16) + 0)
    # From 14 on: the b -> c move alone, its trajectory's first hop matched all the same.
    assert _freed(ds, moves, since=14.0) == pytest.approx(40 - 16)
    # A store from before the rows had t_released: from the round's start.
    old = moves.drop_vars("t_released")
    assert _freed(ds, old) == pytest.approx((40 - 10) + (40 - 15) + (101 - 100))
