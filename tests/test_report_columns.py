"""report.md's events table counts every start of a run, from the tables the figures
draw: summary.json is of the last start only (and absent while a run goes, or after a
kill)."""

from __future__ import annotations

import json

from test_storage import record

from pipelines.report import build_report
from storage import TrajectoryWriter
from storage.metrics import MetricsWriter

T0 = 1.8e9  # the run's start, epoch seconds


def _resumed(run_dir):
    """A run that ran from 0 to 20 s, stopped, and ran again from 120 to 140 s."""
    TrajectoryWriter(run_dir).append([record(0), record(1)])
    w = MetricsWriter(run_dir)
    rows = [(0, t, t // 10) for t in range(0, 21, 5)] + [
        (1, t, 1 + t // 60) for t in range(120, 141, 5)
    ]
    w.append(
        "cluster",
        [
            {
                "segment": s,
                "elapsed_s": t,
                "wall_time": T0 + t,
                "version": v,
                "buffer_depth": 1,
                "oldest_buffered_age_s": 0.5,
            }
            for s, t, v in rows
        ],
    )
    return w


def _events_row(report) -> list[str]:
    lines = report.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| run | publications"))
    return [c.strip() for c in lines[i + 2].strip("|").split("|")]


def test_repack_moves_are_the_tables_ok_rows_of_every_start(tmp_path):
    """The column read summary.json's repack.moves: 0 for a live, killed or failed run,
    only the last start's after a resume, while events-N.png counted the table."""
    run = tmp_path / "run"
    w = _resumed(run)
    w.append(
        "repacks",
        [
            {
                "time": T0 + t,
                "source": "r0",
                "destination": "r1",
                "ok": ok,
                "requests": 3,
                "pause_s": 0.01,
                "segment": s,
            }
            for s, t, ok in [(0, 5, 1), (0, 10, 1), (0, 12, 0), (1, 125, 1), (1, 130, 1)]
        ],
    )
    moves = 4  # (the columns: run, publications, stall, broadcast, moves, ...)
    assert _events_row(build_report([run], tmp_path / "live"))[moves] == "4"
    (run / "summary.json").write_text(json.dumps({"segments": 2, "repack": {"moves": 2}}))
    assert _events_row(build_report([run], tmp_path / "resumed"))[moves] == "4"


def test_without_a_repacks_table_the_moves_are_summary_jsons(tmp_path):
    run = tmp_path / "run"
    _resumed(run)
    (run / "summary.json").write_text(json.dumps({"segments": 2, "repack": {"moves": 3}}))
    assert _events_row(build_report([run], tmp_path / "out"))[4] == "3"
