"""summary.json's run totals count every start, as the ``cluster`` table's columns do."""

from __future__ import annotations

import json

import pytest
from test_analysis_fixes import _Driver as _Recording
from test_storage import record
from test_summary import _raw as _stopped

from laminar.config import RunConfig
from pipelines.driver_metrics import MetricsRecording
from pipelines.summary import summarize
from storage import TrajectoryWriter
from storage.metrics import MetricsWriter, open_metrics
from storage.resume import ResumePlan

T0 = 1.8e9


class _Driver(MetricsRecording, _Recording):
    """What ``_origin``, ``_record`` and ``_trainer_wait_run`` read of a driver."""

    def __init__(self, run_dir, resume):
        _Recording.__init__(self, run_dir, resume)
        self._old_publications, self._master_publications, self._n_pubs = [], [], 0


def _raw(trainer_wait_s: float, wait_s: float) -> dict:
    """What the driver collects at a run's stop (``Schedule.shutdown``), with its last
    trainer's ``wait_s`` and the run's ``trainer_wait_s``."""
    trainer = {"version": 2, "steps": 2, "wait_s": wait_s, "paced": None}
    trainer |= {"skipped_steps": 0, "skipped_updates": [], "checkpoint": None}
    trainer |= {"weights_checksum": "x"}
    return _stopped(trainer) | {"trainer_wait_s": trainer_wait_s}


def test_trainer_wait_s_is_the_runs_as_the_cluster_column_is(tmp_path):
    """A first start whose trainers waited 30 s; resumed, its first trainer waited 5 s
    and was restarted within the run, the restarted one 2 s so far. The cluster column
    says 37 s; summary.json said 2 s (the last trainer's of the last start)."""
    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    MetricsWriter(tmp_path).append(
        "cluster",
        [
            {"segment": 0, "elapsed_s": t, "wall_time": T0 + t, "version": 1, "trainer_wait_s": w}
            for t, w in ((5.0, 10.0), (10.0, 30.0))
        ],
    )
    driver = _Driver(tmp_path, ResumePlan(version=1, stored=2, consumed=2))
    driver._origin(T0 + 60)
    driver._trainer_wait = (5.0, 0.0)  # (the lost trainer's 5 s: Schedule._trainer_back)
    stats = {"version": 2, "wait_s": 2.0}
    buffer = {"depth": 0, "ready_groups": 0, "partial_groups": 0, "inserted": 0}
    buffer |= {"consumed": 0, "discarded": 0, "oldest_age_s": float("nan")}
    driver._record(61.0, T0 + 61, stats, buffer, {"outstanding": 0, "dispatched": 0}, [], 0)
    driver.metrics = MetricsWriter(tmp_path)
    driver._write_rows(final=True)
    column = open_metrics(tmp_path, "cluster")["trainer_wait_s"].values[-1]
    assert column == pytest.approx(37.0)

    summary = summarize(tmp_path, _raw(driver._trainer_wait_run(2.0), 2.0), {}, RunConfig())
    assert summary["trainer_wait_s"] == pytest.approx(column)
    assert (
        json.loads((tmp_path / "summary.json").read_text())["trainer_wait_s"]
        == summary["trainer_wait_s"]
    )


def test_rl_wall_s_total_leaves_out_a_stop_its_unmarked_rows_show(tmp_path):
    """A store whose first two starts wrote their cluster rows before rows named their
    start (2026-12-04: no segment column; 0-20 s, stopped, 200-220 s), resumed again
    now: the earlier rows read as one start, and rl_wall_s_total counted the stop
    (180 s) as wall time."""
    from storage.metrics import segments

    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    MetricsWriter(tmp_path).append(
        "cluster",
        [
            {"elapsed_s": float(t), "wall_time": T0 + t, "version": 1}
            for t in [*range(0, 21, 5), *range(200, 221, 5)]
        ],
    )
    earlier = segments(open_metrics(tmp_path, "cluster"))
    assert [(s["start_s"], s["end_s"], s["stopped_s"]) for s in earlier] == [(0.0, 220.0, 180.0)]
    raw = _raw(0.0, 0.0) | {"earlier_segments": earlier, "wall_s": 30.0}
    summary = summarize(tmp_path, raw, {}, RunConfig())
    assert summary["rl_wall_s_total"] == pytest.approx(30.0 + 40.0)
    # rows a start marked: its polls' spacing, however long, is its own
    MetricsWriter(tmp_path).append(
        "cluster",
        [{"segment": 1, "elapsed_s": t, "wall_time": T0 + t, "version": 2} for t in (300.0, 500.0)],
    )
    marked = segments(open_metrics(tmp_path, "cluster"))[1]
    assert (marked["start_s"], marked["end_s"], marked["stopped_s"]) == (300.0, 500.0, 0.0)
