"""The analysis layer's figures of resumed and still-running runs (a review's findings):
a stop ends at the resume the store recorded, in ``open_run``, the buffer's resume and
the driver's ``oldest_buffered_age_s`` alike; throughput windows carry their running
seconds; a resumed run's ``consumed`` counter agrees with the store; reward windows
carry their counts; empty figures stay valid."""

import json
import shutil
import warnings

import numpy as np
import pytest
import xarray as xr
from factories import timed, trajectory

from storage import StoreError, TrajectoryWriter, open_run, open_runs, open_trajectories
from storage.metrics import MetricsWriter

T0 = 1.8e9


def _traj(u, finish, insert=None, sample=None, *, version=0, status=None, reward=1.0):
    """A trajectory finished at ``finish`` s (the run's clock), submitted 1 s before,
    inserted at ``insert`` (default: then), consumed at ``sample`` (None: buffered)."""
    return timed(u, finish, insert, sample, t0=T0, version=version, status=status, reward=reward)


def _event(uid, status, sample_version, t):
    return {"uid": uid, "status": status, "sample_version": sample_version, "t_sample": T0 + t}


def _rows(path, starts, **columns):
    """``cluster`` rows every 5 s of each start (segment, from, to: the run's clock)."""
    rows = []
    for seg, a, b in starts:
        for t in np.arange(a, b + 0.1, 5.0):
            rows.append(
                {"segment": seg, "elapsed_s": float(t), "wall_time": T0 + t, "version": 0} | columns
            )
    MetricsWriter(path).append("cluster", rows)


def _stopped_and_resumed(path):
    """Ran 0-18 s (rows to 15 s, its last trajectory time 18 s); resumed at 118 s (the
    store's record), its first trajectory submitted at 123 s, its first row at 125 s.
    ``held`` was inserted at 15 s, buffered across the stop, consumed at 126 s."""
    writer = TrajectoryWriter(path)
    writer.append([_traj("a", 1, sample=3), _traj("held", 15, sample=126), _traj("b", 18)])
    writer.record_resume(0, T0 + 118)
    writer.append([_traj("c", 124, sample=126), _traj("d", 130, sample=131)])
    _rows(path, [(0, 0, 15), (1, 125, 140)])


def test_a_stop_ends_at_the_resume_the_store_recorded(tmp_path):
    """The resume records itself before it generates anything, and its buffer holds the
    trajectories held across the stop from then on: the stop ends there, not at the
    resumed start's first trajectory time (123 s), which left 5 s of their wait out of
    their age and divided a throughput window's tokens by a sliver of it."""
    from pipelines.report import _load
    from storage.trajectories_read import run_stops

    _stopped_and_resumed(tmp_path)
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == [(T0 + 18, T0 + 118)]
    assert ds.attrs["segment_start_s"] == [T0, T0 + 118]
    # held: 15 -> 18 s, then 118 -> 126 s in the resumed buffer
    age = ds.laminar.buffer_age()
    np.testing.assert_allclose(age.values, [2.0, 3.0 + 8.0, 2.0, 1.0])
    # the window [115, 120) ran 2 s (118 -> 120): 5 tokens finished at 119 s a 2.5 tokens/s
    # (ended at the first trajectory time, 123 s, the window was stopped throughout)
    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("e", 119.0)])
    tp = open_run(tmp_path).laminar.throughput(window=5.0)
    assert tp["generated"].sel(time=115.0).item() == pytest.approx(5 / 2)
    # the buffer's resume reads the same stops; the report's grey bands are them too
    pauses, last = run_stops(tmp_path, open_trajectories(tmp_path))
    assert pauses == [(T0 + 18, T0 + 118)] and last == pytest.approx(T0 + 18)
    assert _load(tmp_path)["gaps"] == [(18.0, 118.0)]


def test_a_run_resumed_now_is_stopped_until_its_recorded_resume(tmp_path):
    """As a resume starts (the store records it, its buffer holds trajectories again,
    the driver starts its loop), the stop before it ends at the record, whatever this
    start did since: what the driver's ``oldest_buffered_age_s`` leaves out, and what
    ``open_run`` says once the start writes its first row."""
    from storage.trajectories_read import resume_stops

    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("a", 10, sample=12), _traj("held", 15), _traj("b", 18)])
    _rows(tmp_path, [(0, 0, 20)])
    writer.record_resume(0, T0 + 118)
    # held again by the resume's buffer at 118.1 s; a new one in at 121 s
    writer.append([_traj("c", 121)], [_event("b", "buffered", -1, 118.1)])
    assert resume_stops(tmp_path, T0 + 119) == [(T0 + 20, T0 + 118)]
    # no resume recorded (a stand-in buffer): the stop ends when the driver's loop begins
    plain = tmp_path / "plain"
    TrajectoryWriter(plain).append([_traj("a", 10, sample=12), _traj("b", 23)])
    _rows(plain, [(0, 0, 20)])
    assert resume_stops(plain, T0 + 119) == [(T0 + 23, T0 + 119)]


def _resumed_twice(path, rows):
    """Ran 0-18 s; resumed at 118 s (the store's record), a start that generated one
    trajectory (150 s) and was lost before it wrote a row; resumed again at 200 s.
    ``held`` was inserted at 15 s, buffered across both stops, consumed at 226 s.
    ``rows``: the ``cluster`` rows of the metrics (segment, from, to), if any."""
    writer = TrajectoryWriter(path)
    writer.append([_traj("a", 1, sample=3), _traj("held", 15, sample=226), _traj("b", 18)])
    writer.record_resume(0, T0 + 118)
    writer.append([_traj("x", 150)])
    writer.record_resume(0, T0 + 200)
    writer.append([_traj("c", 224, sample=226), _traj("d", 230, sample=231)])
    if rows:
        _rows(path, rows)


@pytest.mark.parametrize(
    "rows",
    [[(0, 0, 15), (1, 225, 240)], [], [(1, 225, 240)]],
    ids=["both-starts-rows", "no-metrics", "resumed-start-rows-only"],
)
def test_every_recorded_resume_ends_a_stop_whatever_the_metrics_hold(tmp_path, rows):
    """Each resume the store recorded ends a stop, from the last sign of the start
    before it (its rows or its trajectories' times since the resume before), whether the
    metrics hold rows of both starts, of the resumed one alone (its metrics moved aside)
    or none; and a start lost before its first row (150 s) is a start too. Read from
    the metrics' gaps alone, the first stop (18 -> 118 s) was running time with rows of
    both starts, and both were with fewer: ``held``'s age counted the stops, and a
    throughput window's rate divided by time the run was stopped."""
    from storage.trajectories_read import resume_stops, run_stops

    _resumed_twice(tmp_path, rows)
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == [(T0 + 18, T0 + 118), (T0 + 150, T0 + 200)]
    # held: 15 -> 18 s, 118 -> 150 s (the lost start's buffer), 200 -> 226 s
    age = ds.laminar.buffer_age()
    np.testing.assert_allclose(age.values, [2.0, 3.0 + 32.0 + 26.0, 2.0, 1.0])
    tp = ds.laminar.throughput(window=10.0)
    end = 240.0 if rows else 231.0
    assert tp["running_s"].sum().item() == pytest.approx(end - 100.0 - 50.0)
    # the buffer's and the driver's reading of the same stops
    pauses, last = run_stops(tmp_path, open_trajectories(tmp_path))
    assert pauses == ds.laminar.pauses_s and last == T0 + 150
    assert resume_stops(tmp_path, T0 + 250) == ds.laminar.pauses_s
    if rows:  # (a start per segment of the metrics, as superseded() zips them)
        assert len(ds.attrs["segment_start_s"]) == len(ds.attrs["segment_first_version"])
        assert ds.attrs["segment_start_s"][-1] == (T0 + 200 if len(rows) > 1 else T0 + 225)


def test_a_stop_begins_at_the_lost_starts_last_sampling_of_what_was_held_again(tmp_path):
    """The lost start's last act was an update (20 s) that sampled ``b``, lost with it:
    the resume holds ``b`` again, so its record no longer says when it was sampled, but
    its leave event does. The stop begins there, not at the last finish (18 s)."""
    from storage.trajectories_read import resume_stops, run_stops

    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("a", 1, sample=3), _traj("b", 18)])
    writer.append([], [_event("b", "consumed", 0, 20)])
    _rows(tmp_path, [(0, 0, 15)])
    writer.record_resume(0, T0 + 118)
    writer.append([_traj("c", 121)], [_event("b", "buffered", -1, 118.1)])
    assert resume_stops(tmp_path, T0 + 119) == [(T0 + 20, T0 + 118)]
    writer.append([], [_event("b", "consumed", 1, 125)])
    _rows(tmp_path, [(1, 125, 130)])
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == [(T0 + 20, T0 + 118)]
    # b: 18 -> 20 s, then 118.1 -> 125 s
    assert ds["held_s"].sel(trajectory=1).item() == pytest.approx(2.0)
    assert ds.laminar.buffer_age().sel(trajectory=1).item() == pytest.approx(2.0 + 6.9)
    assert run_stops(tmp_path, open_trajectories(tmp_path))[0] == ds.laminar.pauses_s


class _Driver:
    """What :meth:`MetricsRecording._origin` and ``_record`` read of a driver."""

    def __init__(self, run_dir, resume):
        from laminar.config import RunConfig

        self.run_dir, self.resume = run_dir, resume
        self.cfg = RunConfig()  # (no trainer.resume_from: no checkpoint's rows to write back)
        self._carry = {"cluster": {}, "rollouts": {}}
        self._earlier_segments, self._segment, self._pauses = [], 0, []
        self._rows = {"cluster": [], "rollouts": []}
        self._trainer_wait = (0.0, 0.0)


def _record(driver, now, consumed, oldest_age_s):
    stats = {"version": 9, "wait_s": 0.0}
    buffer = {
        "depth": 4,
        "ready_groups": 0,
        "partial_groups": 0,
        "inserted": 4,
        "consumed": consumed,
        "discarded": 0,
        "oldest_age_s": oldest_age_s,
    }
    driver._record(now - T0, now, stats, buffer, {"outstanding": 0, "dispatched": 0}, [], 0)
    return driver._rows["cluster"][-1]


def test_a_resumed_driver_counts_consumed_as_the_store_and_ages_as_open_run(tmp_path):
    """A run lost at version 11 whose last row counted 1280 consumed, resumed from its
    checkpoint of version 8: the updates 9-11 that consumed 256 of them are lost, and
    the resume holds those again. ``consumed`` goes on from what the store says the
    updates up to 8 consumed (the plan's ``consumed_before``, 1024), not from 1280
    (which counted the 256 twice once trained again). Its ``oldest_buffered_age_s``
    leaves out the stop up to the resume the store recorded, as ``buffer_age`` does,
    not up to the driver's loop start."""
    from pipelines.driver_metrics import MetricsRecording
    from storage.resume import ResumePlan

    class Driver(_Driver, MetricsRecording):
        pass

    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("a", 10, sample=12), _traj("held", 15), _traj("b", 18)])
    _rows(tmp_path, [(0, 0, 20)], inserted=1536, consumed=1280)
    writer.record_resume(8, T0 + 118)
    driver = Driver(tmp_path, ResumePlan(version=8, stored=1536, consumed=1024))
    assert driver._origin(T0 + 121) == T0
    assert driver._pauses == [(T0 + 20, T0 + 118)]  # (not to 121 s: the loop's start)
    # 130 s: the buffer's oldest (held, in since 15 s) reads 115 s by its clock
    row = _record(driver, T0 + 130, consumed=64, oldest_age_s=115.0)
    assert row["consumed"] == 1024 + 64
    assert row["inserted"] == 1536 + 4
    assert row["oldest_buffered_age_s"] == pytest.approx(5.0 + 12.0)
    # once the start writes its rows, open_run reads the same stop, and the same age
    _rows(tmp_path, [(1, 125, 130)])
    writer.append([], [_event("held", "consumed", 8, 130)])
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == driver._pauses
    age = ds.laminar.buffer_age()
    assert age.sel(trajectory=1).item() == pytest.approx(row["oldest_buffered_age_s"])


def test_a_resumed_driver_without_metrics_still_leaves_the_stop_out_of_the_age(tmp_path):
    """metrics.zarr moved aside before the resume (as a StoreError advises), or the
    lost start killed before its first metrics flush: the driver's
    ``oldest_buffered_age_s`` still leaves out the stop the store records (from the
    lost start's last sign to the resume), as ``buffer_age`` does; it counted the whole
    stop as buffered time."""
    from pipelines.driver_metrics import MetricsRecording
    from storage.resume import ResumePlan

    class Driver(_Driver, MetricsRecording):
        pass

    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("a", 10, sample=12), _traj("held", 15), _traj("b", 18)])
    writer.record_resume(8, T0 + 118)  # (no metrics.zarr)
    driver = Driver(tmp_path, ResumePlan(version=8, stored=3, consumed=1))
    assert driver._origin(T0 + 121) == T0 + 121  # (its clock starts again)
    assert driver._pauses == [(T0 + 18, T0 + 118)]
    assert driver._pauses == open_run(tmp_path).laminar.pauses_s


def test_throughput_windows_carry_their_running_seconds_for_the_rate(tmp_path):
    """Windows differ in length (the last cut where the run ended, those around a stop):
    the rate while the run ran is their mean weighted by ``running_s``, which a plain
    mean is not (it weighs a sliver of a window like a whole one)."""
    writer = TrajectoryWriter(tmp_path)
    # ran 0-19 s and 118-131 s; 5 tokens each
    writer.append([_traj("a", 1, sample=6), _traj("b", 9, sample=11), _traj("c", 18, sample=19)])
    writer.record_resume(0, T0 + 118)
    writer.append([_traj("d", 124, sample=126), _traj("e", 130, sample=131)])
    _rows(tmp_path, [(0, 0, 15), (1, 125, 130)])
    ds = open_run(tmp_path)
    assert ds.laminar.t0 == T0 and ds.laminar.t_end == T0 + 131
    ran = 19.0 + 13.0  # (the stop: 19 s to the resume at 118 s)
    tp = ds.laminar.throughput(window=15.0)
    assert float(tp["running_s"].sum()) == pytest.approx(ran)
    rate = tp.weighted(tp["running_s"]).mean("time")
    assert float(rate["trained"]) == pytest.approx(25 / ran)
    assert float(rate["generated"]) == pytest.approx(25 / ran)
    assert float(tp["trained"].mean("time")) != pytest.approx(25 / ran)
    # stopped throughout: no rate, no running seconds
    stopped = tp["running_s"] == 0
    assert stopped.any() and tp["trained"].where(stopped).isnull().all()
    TrajectoryWriter(tmp_path / "empty").append([])
    empty = open_run(tmp_path / "empty").laminar.throughput()
    assert empty["running_s"].sizes == {"time": 0}


def test_buffer_age_by_version_of_a_run_that_consumed_nothing_yet(tmp_path):
    """A run still going, 3 trajectories stored and none consumed: the docs' age by
    version raised xarray's "behavior_version must not be empty"; it is empty."""
    TrajectoryWriter(tmp_path).append([_traj("a", 1), _traj("b", 2, version=1), _traj("c", 3)])
    ds = open_run(tmp_path)
    assert ds.laminar.buffer_age().sizes == {"trajectory": 0}
    median = ds.laminar.buffer_age(by_version="median")
    assert median.sizes == {"behavior_version": 0} and median.name == "buffer_age_s"
    with pytest.raises(ValueError, match="choose from"):
        ds.laminar.buffer_age(by_version="avg")
    # something consumed: the groupby's figures
    more = tmp_path / "more"
    TrajectoryWriter(more).append(
        [_traj("a", 1, sample=3), _traj("b", 2, sample=3), _traj("c", 2, sample=6, version=1)]
    )
    age = open_run(more).laminar.buffer_age(by_version="median")
    assert age["behavior_version"].values.tolist() == [0, 1]
    np.testing.assert_allclose(age.values, [1.5, 4.0])


def test_reward_windows_carry_their_counts_and_the_report_leaves_out_the_few(tmp_path):
    """The last window by time holds only the slow tail of the final batches: its count
    says so, and the report's reward by time leaves out windows of under a quarter of
    the median window's trajectories."""
    from pipelines.report import few_left_out

    records = [_traj(f"u{i}", 1 + 0.8 * (i % 10) + 10 * (i // 10)) for i in range(30)]
    records += [_traj("tail", 30.5, reward=0.0)]
    records += [_traj("err", 31, status="discarded", reward=np.nan)]
    records[-1]["finish_reason"] = "error"
    TrajectoryWriter(tmp_path).append(records)
    curve = open_run(tmp_path).laminar.reward_curve(by="time", window=10.0)
    assert curve["trajectories"].values.tolist() == [10, 10, 10, 1]  # (the error left out)
    assert curve.values.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert few_left_out(curve)["time"].values.tolist() == [0.0, 10.0, 20.0]
    by_version = open_run(tmp_path).laminar.reward_curve()
    assert by_version["trajectories"].values.tolist() == [31]


def test_the_docs_concat_of_runs_with_different_versions(tmp_path):
    """docs/analysis.md's reward curves of several runs side by side: runs of different
    versions are aligned (outer), with no warning of xarray's change of default join."""
    TrajectoryWriter(tmp_path / "a").append([_traj("a", 1), _traj("b", 2, version=1)])
    TrajectoryWriter(tmp_path / "b").append([_traj("a", 1)])
    runs = [tmp_path / "a", tmp_path / "b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curves = xr.concat(
            [open_run(r).laminar.reward_curve() for r in runs], dim="run", join="outer"
        )
    assert curves.sizes == {"run": 2, "behavior_version": 2}
    assert np.isnan(curves.values[1, 1])


def test_a_resumed_driver_counts_from_the_store_whatever_ended_the_start_before(tmp_path):
    """A start killed after its last row (an abort, the OOM killer, a Slurm timeout)
    admitted, discarded, evicted and filtered more than that row says. The resume's
    counters go on from the store's rows and statuses, so that the table's identity
    inserted = consumed + discarded + evicted + filtered + depth + dropped holds at
    every row of the resumed start (it went on from the stale row: -32 on every row of
    segment 1 of a real run, helper 110's)."""
    from pipelines.driver_metrics import MetricsRecording
    from storage.resume import plan_resume

    class Driver(_Driver, MetricsRecording):
        pass

    writer = TrajectoryWriter(tmp_path)
    done = [_traj(u, 5, sample=6, version=1) for u in ("c1", "c2")]
    left = [
        _traj(u, 7, status=s, version=2)
        for u, s in (("d", "discarded"), ("e", "evicted"), ("f", "filtered"))
    ]
    writer.append([*done, *left, _traj("b1", 8, version=3), _traj("b2", 9, version=4)])
    # the last row before the kill: 3 admitted, 2 consumed, nothing left untrained yet
    _rows(tmp_path, [(0, 0, 5)], inserted=3, consumed=2, discarded=0, evicted=0, filtered=0)
    plan = plan_resume(tmp_path, 4)
    assert (plan.stored, plan.consumed, plan.discarded, plan.evicted, plan.filtered) == (
        7,
        2,
        1,
        1,
        1,
    )
    assert len(plan.readmit) == 2 and not plan.drop
    driver = Driver(tmp_path, plan)
    driver._origin(T0 + 20)
    # the resumed buffer: the 2 held again, nothing new yet
    stats = {"version": 4, "wait_s": 0.0}
    buffer = {"depth": 2, "ready_groups": 2, "partial_groups": 0, "inserted": 0}
    buffer |= {"consumed": 0, "discarded": 0, "evicted": 0, "filtered": 0, "oldest_age_s": 1.0}
    driver._record(25.0, T0 + 25, stats, buffer, {"outstanding": 0, "dispatched": 0}, [], 0)
    row = driver._rows["cluster"][-1]
    left_untrained = row["discarded"] + row["evicted"] + row["filtered"]
    assert row["inserted"] == row["consumed"] + left_untrained + row["buffer_depth"] == 7


# --- staleness along the weights' lineage (a trainer restarted within the run) ---------


def _versioned(u, behavior, finish, sample, status="consumed"):
    """A trajectory generated from ``behavior``, finished at ``finish``, consumed by the
    trainer at ``sample`` (-1: never sampled)."""
    return trajectory(
        u,
        f"g{u}",
        group_size=1,
        behavior_version=behavior,
        finish_version=finish,
        status=status,
        sample_version=sample,
        t_submit=T0,
        t_start=T0,
        t_finish=T0 + 1,
        t_insert=T0 + 1,
        t_sample=T0 + 2 if sample >= 0 else np.nan,
    ).to_record()


def _restarted_run(path):
    """A run whose trainer, lost after publishing 19, restarted from its checkpoint of
    10, numbering its updates after 19 (the restart (10, 19)), recorded as the driver
    does (``summary.json``'s ``faults``, with a core restart that branched nothing and a
    try that did not get to a trainer)."""
    TrajectoryWriter(path).append(
        [
            _versioned("v", 10, 10, 19),  # V's weights, the new trainer's first update
            _versioned("lost", 15, 16, 21),  # generated on the lost branch 11..19
            _versioned("m", 19, 19, 19),  # the lost trainer's last weights
            _versioned("after", 20, 21, 22),  # the new trainer's
            _versioned("before", 3, 4, 6),  # before the restart
            _versioned("waiting", 20, 20, -1, status="buffered"),
        ]
    )
    summary = {
        "faults": {
            "trainer_restarts": [
                {"time": T0 + 50, "checkpoint_version": 10, "after_version": 19},
                {"time": T0 + 90, "checkpoint_version": 7},  # (gave up before a trainer)
            ],
            "core_restarts": [{"time": T0 + 80, "checkpoint_version": 22, "after_version": 22}],
        }
    }
    (path / "summary.json").write_text(json.dumps(summary))


def test_staleness_along_the_lineage_of_a_restarted_trainer(tmp_path):
    """By the numbers the new trainer's first update trained V's weights M - V versions
    stale; along the weights' lineage (what ``max_train_staleness`` counts) it held them:
    0. The stored names keep the numbers; ``*_lineage`` counts the tree's paths."""
    from storage.lineage import run_restarts

    _restarted_run(tmp_path)
    assert run_restarts(tmp_path) == [(10, 19)]
    ds = open_run(tmp_path)
    plain = ds.laminar.staleness()
    assert "s_train_lineage" not in plain
    st = ds.laminar.staleness(restarts="run")
    assert st.attrs["restarts"] == [[10, 19]]
    assert "restarts" not in ds.attrs and "restarts" not in plain.attrs
    xr.testing.assert_identical(st[list(plain.data_vars)].drop_attrs(), plain.drop_attrs())
    consumed = ds["uid"].values[ds["status"].values == "consumed"]
    by_uid = {str(u): i for i, u in enumerate(consumed)}
    want = {  # uid: (s_train, s_train_lineage, s_gen_lineage, residence_lineage)
        "v": (9, 0, 0, 0),
        "lost": (6, 2 + 5, 1, 2 + 6),  # up the lost branch to 10, then 20 .. 21
        "m": (0, 9, 0, 9),
        "after": (2, 2, 1, 1),
        "before": (3, 3, 1, 2),
    }
    for uid, (s_train, lineage, s_gen, residence) in want.items():
        row = st.isel(trajectory=by_uid[uid])
        assert row["s_train"].item() == s_train, uid
        assert row["s_train_lineage"].item() == lineage, uid
        assert row["s_gen_lineage"].item() == s_gen, uid
        assert row["residence_lineage"].item() == residence, uid
    # a list given is the same; none given: the numbers
    st2 = ds.laminar.staleness(restarts=[(10, 19)])
    xr.testing.assert_identical(st2, st)
    none = ds.laminar.staleness(restarts=[])
    np.testing.assert_array_equal(none["s_train_lineage"].values, none["s_train"].values)
    with pytest.raises(ValueError, match="restarts="):
        ds.laminar.staleness(restarts="summary")


def test_staleness_lineage_of_a_consumed_trajectory_never_sampled_is_nan():
    """A damaged store's consumed trajectory without a ``sample_version`` (-1): its
    trained lags are unknown, along the lineage as by the numbers."""
    ds = xr.Dataset(
        {
            "status": ("trajectory", np.array(["consumed", "consumed"], dtype=object)),
            "behavior_version": ("trajectory", [10, 12]),
            "finish_version": ("trajectory", [10, 13]),
            "sample_version": ("trajectory", [-1, 19]),
            "s_gen": ("trajectory", [0, 1]),
            "residence": ("trajectory", [np.nan, 6.0]),
            "s_train": ("trajectory", [np.nan, 7.0]),
        }
    )
    st = ds.laminar.staleness(restarts=[(10, 19)])
    np.testing.assert_array_equal(st["s_train_lineage"].values, [np.nan, 2.0])
    np.testing.assert_array_equal(st["s_gen_lineage"].values, [0.0, 1.0])
    with pytest.raises(ValueError, match="open_run"):
        ds.laminar.staleness(restarts="run")


def _ancestors(n, restarts):
    """``n`` and the weights it descends from, by parent links: ``n - 1``, or ``V`` for
    the first number of the newest restart ``(V, M)`` whose ``M`` is below ``n``."""
    out = [n]
    while n > 0:
        below = [(v, m) for v, m in restarts if m < n]
        n = below[-1][0] if below and n == below[-1][1] + 1 else n - 1
        out.append(n)
    return out


def _tree_lag(version, behavior, restarts, trainer=True):
    """The path between two weights in the tree the restarts make, walking parent links
    (a count independent of :func:`storage.lineage.lineage_lag`)."""
    if trainer:
        version = next((v for v, m in reversed(restarts) if m == version), version)
    a, b = _ancestors(version, restarts), _ancestors(behavior, restarts)
    common = next(n for n in a if n in set(b))
    return a.index(common) + b.index(common)


def _random_restarts(rng):
    """Restarts as a run makes them: each from a checkpoint on the lineage the trainer
    then held, numbering after the newest version published (``top``)."""
    restarts, top = [], int(rng.integers(1, 15))
    for _ in range(int(rng.integers(0, 5))):
        held = next((v for v, m in reversed(restarts) if m == top), top)
        v = int(rng.choice(_ancestors(held, restarts)))
        if v != top:  # (M == V branches nothing: left out)
            restarts.append((v, top))
        top += int(rng.integers(0, 8))
    return restarts, top


def test_lineage_lag_is_the_path_in_the_tree_and_the_buffers_lag():
    """On random restarts: :func:`lineage_lag` is the path between the two weights in
    the tree, and :meth:`BufferCore.lag` counts the same (it delegates: one count)."""
    from laminar.buffer_core import BufferCore
    from storage.lineage import lineage_lag, lineage_lags

    rng = np.random.default_rng(0)
    for _ in range(200):
        restarts, top = _random_restarts(rng)
        core = BufferCore(restarts=restarts)
        for _ in range(20):
            b, t = sorted(int(x) for x in rng.integers(0, top + 1, size=2))  # (b <= t)
            want = _tree_lag(t, b, restarts)
            assert lineage_lag(t, b, restarts) == want, (restarts, t, b)
            assert core.lag(t, b) == want, (restarts, t, b)
            assert lineage_lag(t, b, restarts, trainer=False) == _tree_lag(
                t, b, restarts, trainer=False
            )
            assert lineage_lags(np.array([t]), np.array([b]), restarts)[0] == want
            if not restarts:
                assert want == t - b


def test_each_trajectory_stands_where_its_last_leave_event_puts_it(tmp_path):
    """Several events name one trajectory, interleaved with others' in one batch and
    across batches, and one names a trajectory the store does not hold: each stands
    where its last event put it, in ``open_run`` and ``open_trajectories`` alike (the
    reader picks each row's last event itself, not NumPy's order of a repeated-index
    assignment, which it does not promise)."""
    writer = TrajectoryWriter(tmp_path)
    writer.append([_traj("a", 1), _traj("b", 2), _traj("c", 3)])
    writer.append(
        [],
        [
            _event("a", "consumed", 1, 10),
            _event("b", "consumed", 1, 11),
            _event("a", "buffered", -1, 12),
            _event("ghost", "consumed", 1, 12),
            _event("b", "dropped", -1, 13),
            _event("a", "consumed", 2, 14),
        ],
    )
    writer.append([], [_event("c", "consumed", 3, 15), _event("c", "buffered", -1, 16)])
    want_status = ["consumed", "dropped", "buffered"]
    want_version = [2, -1, -1]
    for arrays in (open_run(tmp_path), open_trajectories(tmp_path)):
        status = [str(s) for s in np.asarray(arrays["status"]).tolist()]
        assert status == want_status
        assert np.asarray(arrays["sample_version"]).tolist() == want_version
        t = np.asarray(arrays["t_sample"], dtype=np.float64)
        assert t[0] == T0 + 14 and np.isnan(t[2])


def test_buffer_age_of_a_slice_is_labelled_with_its_trajectories(tmp_path):
    """``buffer_age`` of a Dataset cut on ``trajectory`` labels each age with the
    trajectory's own label, so that it lines up with the Dataset's (it was labelled
    with positions in the slice: each age stood against another trajectory)."""
    _stopped_and_resumed(tmp_path)
    ds = open_run(tmp_path)
    whole = ds.laminar.buffer_age()
    part = ds.isel(trajectory=slice(2, None)).laminar.buffer_age()
    assert part["trajectory"].values.tolist() == [3, 4]
    xr.testing.assert_identical(part, whole.sel(trajectory=[3, 4]))
    t_in = ds["t_held"].sel(trajectory=part["trajectory"])
    np.testing.assert_allclose(part.values, (ds["t_sample"] - t_in).sel(trajectory=[3, 4]))


def _partial(u, behavior, finish, tokens, t):
    """A partial rollout's trajectory: its response tokens' ``versions``, finished at
    ``t`` s (the run's clock)."""
    rec = trajectory(
        u,
        f"g{u}",
        group_size=1,
        response=np.arange(len(tokens)),
        behavior_version=behavior,
        finish_version=finish,
        status="dropped",
        t_submit=T0 + t - 1,
        t_start=T0 + t - 1,
        t_finish=T0 + t,
        t_insert=T0 + t,
    ).to_record()
    rec["token_versions"] = np.asarray(tokens, np.int32)
    return rec


def test_a_partial_rollout_carried_on_by_lost_weights_is_superseded(tmp_path, monkeypatch):
    """A run of partial rollouts lost at version 11 and resumed from its checkpoint of
    8: a response begun on version 7's weights and carried on by 9's and 10's (lost) is
    theirs in part: superseded, though its ``behavior_version`` (the oldest) stands. One
    whose tokens are all of 8 or older, or that finished after the resume, is not;
    whatever the blocks its token versions are read in, however the Dataset was cut."""
    import storage.accessor

    writer = TrajectoryWriter(tmp_path, schedule="partial_rollout")
    writer.append(
        [
            _partial("crossed", 7, 10, [7, 7, 9, 10], 50),
            _partial("stood", 7, 9, [7, 8, 8], 51),  # (finished at 9: its tokens are 8's)
            _partial("lost", 9, 10, [9, 10], 52),
            _partial("old", 3, 4, [3, 4], 20),
        ]
    )
    writer.record_resume(8, T0 + 100)
    writer.append([_partial("after", 7, 9, [7, 9], 120)])
    ds = open_run(tmp_path)
    want = [True, False, True, False, False]
    for block in (storage.accessor.AUDIT_BLOCK_TOKENS, 1, 3):
        monkeypatch.setattr(storage.accessor, "AUDIT_BLOCK_TOKENS", block)
        assert ds.laminar.superseded().values.tolist() == want, block
        back = ds.isel(trajectory=slice(None, None, -1))
        assert back.laminar.superseded().values.tolist() == want[::-1], block
    # (a schedule whose responses hold one version: its behavior_version says)
    ds.attrs["schedule"] = "laminar"
    assert ds.laminar.superseded().values.tolist() == [False, False, True, False, False]


def test_by_rollout_leaves_failed_rewards_out_of_its_mean_as_reward_curve(tmp_path):
    """A trajectory marked failed with a reward (a behavior logprob that was not finite:
    scored, then marked ``finish_reason="error"``) is left out of ``reward_mean``, as
    ``reward_curve`` leaves it out; a resumed run's start reuses the rollout names, and
    one start's rollouts are read from its trajectories (the docstring's recipe)."""
    writer = TrajectoryWriter(tmp_path)
    failed = _traj("bad", 3, reward=0.0)
    failed["finish_reason"] = "error"
    writer.append([_traj("a", 1), _traj("b", 2), failed])
    writer.record_resume(0, T0 + 100)
    writer.append([_traj("c", 101, reward=0.5)])
    ds = open_run(tmp_path)
    per = ds.laminar.by_rollout()
    assert per["rollout"].values.tolist() == ["r0"]
    assert per["trajectories"].values.tolist() == [4]
    assert per["reward_mean"].sel(rollout="r0").item() == pytest.approx((1 + 1 + 0.5) / 3)
    assert ds.laminar.reward_curve(by="time", window=1000.0).item() == pytest.approx(2.5 / 3)
    last = ds.isel(trajectory=ds.t_finish >= ds.attrs["resumed_at_s"][-1])
    assert last.laminar.by_rollout()["reward_mean"].values.tolist() == [0.5]


@pytest.mark.parametrize("spread", [300, 10**9], ids=["versions", "far-apart"])
def test_lineage_lags_once_per_distinct_pair_agree_with_each_pairs_lag(spread):
    """``lineage_lags`` computes each distinct (version, behavior) pair's lag once and
    spreads it (a table of the pairs' range, or np.unique's where that range is wide),
    as each pair's own ``lineage_lag`` says; NaN where either is unknown."""
    from storage.lineage import lineage_lag, lineage_lags

    rng = np.random.default_rng(5)
    restarts = [(spread // 3, spread // 3 + 20), (spread // 2, spread // 2 + 30)]
    b = rng.integers(0, spread, 2000).astype(np.float64)
    v = b + rng.integers(0, 40, b.size)
    v[::37], b[::41] = -1, np.nan
    for trainer in (True, False):
        got = lineage_lags(v, b, restarts, trainer=trainer)
        want = [
            lineage_lag(int(x), int(y), restarts, trainer=trainer)
            if np.isfinite(x) and np.isfinite(y) and x >= 0 and y >= 0
            else np.nan
            for x, y in zip(v.tolist(), b.tolist(), strict=True)
        ]
        np.testing.assert_array_equal(got, want)
    # (broadcast: one version against many behaviors)
    np.testing.assert_array_equal(
        lineage_lags(np.float64(v[1]), b[:5], restarts),
        lineage_lags(np.full(5, v[1]), b[:5], restarts),
    )


def test_staleness_along_the_lineage_counts_each_distinct_pair_once(monkeypatch):
    """staleness(restarts=...) counts three lags a consumed trajectory: once per
    distinct pair of versions, not in a Python loop per trajectory (that took 0.9 s a
    lag at 1M trajectories with two restarts; its time is docs/analysis.md's, measured,
    not asserted here)."""
    import storage.lineage as lineage

    n = 200_000
    rng = np.random.default_rng(0)
    k = rng.integers(0, 300, n)
    f = k + rng.integers(0, 3, n)
    s = f + rng.integers(0, 3, n)
    ds = xr.Dataset(
        {
            "status": ("trajectory", np.full(n, "consumed")),
            "behavior_version": ("trajectory", k),
            "finish_version": ("trajectory", f),
            "sample_version": ("trajectory", s),
        }
    )
    ds["s_gen"] = ds.finish_version - ds.behavior_version
    ds["residence"] = ds.sample_version - ds.finish_version
    ds["s_train"] = ds.sample_version - ds.behavior_version
    restarts = [(100, 120), (200, 230)]
    lag, calls = lineage.lineage_lag, []

    def counted(*a, **kw):
        calls.append(a[:2])
        return lag(*a, **kw)

    monkeypatch.setattr(lineage, "lineage_lag", counted)
    st = ds.laminar.staleness(restarts=restarts)
    lags = ((f, k), (s, f), (s, k))  # (s_gen, residence, s_train)
    pairs = sum(len(set(zip(x.tolist(), y.tolist(), strict=True))) for x, y in lags)
    assert len(calls) == pairs and pairs < n // 50  # (3,306 distinct pairs)
    at = np.flatnonzero((s >= 120) & (s <= 125))[:200]  # (across the first restart)
    want = [lag(int(x), int(y), restarts) for x, y in zip(s[at], k[at], strict=True)]
    assert st["s_train_lineage"].values[at].tolist() == want


def test_summary_means_are_over_the_same_sampled_trajectories(tmp_path):
    """A damaged store holds a trajectory ``consumed`` with no ``sample_version``: its
    ``residence`` and ``s_train`` are unknown, so it is left out of all three means (its
    ``s_gen`` of 4 was averaged with the others' before, over a different set than the
    other two), and ``unsampled`` counts it, as staleness_histogram's attribute."""
    damaged = trajectory(
        "lost-sample",
        "g9",
        group_size=1,
        behavior_version=0,
        finish_version=4,
        status="consumed",
        sample_version=-1,
        t_sample=np.nan,
    ).to_record()
    records = [
        trajectory(
            f"u{i}",
            f"g{i}",
            group_size=1,
            behavior_version=1,
            finish_version=1 + i,
            status="consumed",
            sample_version=3,
            t_sample=5.0,
        ).to_record()
        for i in range(2)
    ]
    TrajectoryWriter(tmp_path).append([*records, damaged])
    ds = open_run(tmp_path)
    summary = ds.laminar.summary()
    assert summary["unsampled"] == ds.laminar.staleness_histogram().attrs["unsampled"] == 1
    assert summary["s_gen_mean"] == pytest.approx(0.5)  # (0 and 1, not 0, 1 and 4)
    assert summary["residence_mean"] == pytest.approx(1.5)
    assert summary["s_train_mean"] == pytest.approx(2.0)
    assert summary["s_gen_mean"] + summary["residence_mean"] == summary["s_train_mean"]


def test_a_run_opened_by_a_relative_path_reads_its_tokens_after_a_change_of_directory(
    tmp_path, monkeypatch
):
    """The token arrays are read when asked for: a notebook that opened ``runs/x`` and
    changed directory since read zeros (and a NaN mean) where its tokens were, and its
    ``staleness(restarts="run")`` looked for ``runs/x/summary.json`` elsewhere. The path
    is made absolute at the open, and kept so in ``attrs["run_dir"]``."""
    run = tmp_path / "runs" / "x"
    TrajectoryWriter(run).append(
        [
            trajectory(
                f"u{i}", "g", response=(5 + i, 2), behavior_logprobs=(-0.5, -1.5)
            ).to_record()
            for i in range(3)
        ]
    )
    (run / "summary.json").write_text(json.dumps({"faults": {}}))
    monkeypatch.chdir(tmp_path)
    ds = open_run("runs/x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert ds.attrs["run_dir"] == str(run)
    assert ds.laminar.tokens("response_tokens", 1).tolist() == [6, 2]
    assert ds["response_tokens"][:4].values.tolist() == [5, 2, 6, 2]
    assert float(ds["behavior_logprobs"].mean()) == -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ds.laminar.staleness(restarts="run").attrs["restarts"] == []
    monkeypatch.chdir(tmp_path)
    assert open_runs(["runs/x"]).attrs["run_dirs"] == [str(run)]


def test_tokens_of_a_store_gone_since_it_was_opened_raise_rather_than_read_zeros(tmp_path):
    """zarr reads a chunk that is not there as the fill value: a store deleted (or moved)
    after ``open_run`` read its tokens as zeros; now the read says the store is gone."""
    run = tmp_path / "x"
    TrajectoryWriter(run).append([trajectory("u0", "g", response=(5, 2)).to_record()])
    ds = open_run(run)
    shutil.rmtree(run / "trajectories.zarr")
    with pytest.raises(StoreError, match="not there any more"):
        ds.laminar.tokens("response_tokens", 0)
    with pytest.raises(StoreError, match="not there any more"):
        ds["behavior_logprobs"].load()


def test_the_summary_counts_every_status_and_open_run_its_unknown_events_when_none(tmp_path):
    """`ds.laminar.summary()` (and summary.json's `status_counts`) left out a status no
    trajectory had, so `summary()["n_evicted"]` was a KeyError on a run that evicted
    nothing; `unknown_events` was there only when there were some."""
    from pipelines.summary import store_figures
    from storage.schema import STATUSES

    TrajectoryWriter(tmp_path).append([trajectory("u0", "g", group_size=1).to_record()])
    ds = open_run(tmp_path)
    every = {f"n_{s}": 0 for s in STATUSES} | {"n_buffered": 1}
    assert {k: v for k, v in ds.laminar.summary().items() if k.startswith("n_")} == every
    assert store_figures(ds)["status_counts"] == every
    assert ds.attrs["unknown_events"] == 0 and "unknown_event_uid" not in ds.attrs


def test_the_audit_note_of_groups_still_generating_says_nothing_dropped_before_a_resume(
    tmp_path,
):
    """The note said "1 groups were still generating when the run stopped (1 of their
    trajectories are stored as buffered, 0 were dropped when it resumed)" of a run never
    resumed."""
    from storage.audit import audit_run

    w = TrajectoryWriter(tmp_path)
    w.append([trajectory("g-0", "g", group_size=2).to_record()])
    note = "1 group was still generating when the run stopped"
    notes = [n for n in audit_run(tmp_path).notes if "still generating" in n]
    assert notes == [f"{note} (1 of its trajectories is stored as buffered)"], notes
    TrajectoryWriter(tmp_path).record_resume(0, 1.0)  # (a resume: its own writer)
    notes = [n for n in audit_run(tmp_path).notes if "still generating" in n]
    assert notes == [
        f"{note} (1 of its trajectories is stored as buffered, 0 were dropped when it resumed)"
    ], notes
