"""report.md's events table counts every start of a run, from the tables the figures
draw: summary.json is of the last start only (and absent while a run goes, or after a
kill)."""

from __future__ import annotations

import json

import numpy as np
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


def _crossings(ax, a: float, b: float) -> list[str]:
    """The lines of ``ax`` drawn from before ``a`` to after ``b`` (a segment between two
    finite points on either side: straight across the stop)."""
    out = []
    for line in ax.lines:
        x = np.asarray(line.get_xdata(), dtype=float)
        y = np.asarray(line.get_ydata(), dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        across = ok[:-1] & ok[1:] & (x[:-1] <= a) & (x[1:] >= b)
        if across.any():
            out.append(line.get_label())
    return out


def test_the_version_and_publication_lines_break_at_a_stop(tmp_path, monkeypatch):
    """plot_rollouts' version panel and plot_events' publications drew straight across
    the time a resumed run was stopped, where the other figures break their lines and
    shade the stop."""
    import matplotlib

    matplotlib.use("Agg")
    from test_analysis import _resumed_run

    from pipelines import report

    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, out, name: drawn.setdefault(name, fig))
    run_dir = tmp_path / "run"
    _resumed_run(run_dir, [(1, 3), (8, 9), (125, 126)])
    w = MetricsWriter(run_dir)
    times = [*range(0, 21, 5), *range(120, 141, 5)]
    w.append(
        "rollouts",
        [
            {"elapsed_s": t, "rollout": r, "kv_used": 1, "kv_capacity": 10, "version": t // 10}
            for t in times
            for r in ("r0", "r1")
        ],
    )
    w.append(
        "publications",
        [
            {"version": v, "t_publish": T0 + t, "stall_s": 0.001, "broadcast_s": 0.01}
            for v, t in [(0, 1), (1, 10), (2, 18), (2, 121), (3, 130)]
        ],
    )
    run = report._load(run_dir) | {"index": 0}
    ((a, b),) = run["gaps"]
    assert a <= 20 and b >= 120
    report.plot_rollouts(run, tmp_path)
    _, ax_v = drawn["rollouts-0.png"].axes
    assert sorted(line.get_label() for line in ax_v.lines) == ["r0", "r1", "trainer"]
    assert _crossings(ax_v, a, b) == []
    report.plot_events(run, tmp_path)
    ax_w = drawn["events-0.png"].axes[0]
    assert len(ax_w.lines) == 2 and _crossings(ax_w, a, b) == []
    assert any(p.get_label() == report.NOT_RUNNING for p in ax_w.patches)


def test_publications_leave_out_each_starts_first(tmp_path):
    """Version 0's publication, and a resumed start's of its checkpoint's version again,
    are made as a start sets up, not by an update: the column counted them (3 updates
    made 5 publications), and their stall (a cold first copy) in its median."""
    run = tmp_path / "run"
    w = _resumed(run)
    w.append(
        "publications",
        [
            {"version": v, "t_publish": T0 + t, "stall_s": stall, "broadcast_s": 0.01}
            for v, t, stall in [(0, 1, 0.05), (1, 10, 0.001), (2, 18, 0.002), (2, 121, 0.05)]
            + [(3, 130, 0.003)]
        ],
    )
    row = _events_row(build_report([run], tmp_path / "out"))
    assert row[1:4] == ["3", "2.0", "10.0"]


def _runs_row(report, name: str) -> dict[str, str]:
    """The run table's row of run ``name``, by column."""
    lines = report.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| run | versions"))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    for line in lines[i + 2 :]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == name:
            return dict(zip(head, cells, strict=True))
    raise AssertionError(f"no row of {name!r}")


def test_the_runs_table_says_what_was_evicted_or_filtered_and_the_worst_lag(tmp_path):
    """`buffer.max_train_staleness=1` evicted 32% of what a run generated, and the table
    had no column for it (its trajectories counted them, as generated): base and k1 read
    alike but for the staleness means. Evicted and filtered, each with its share of those
    generated, and s_train max, with the bound the run's config.yaml set."""
    from test_storage import record

    base, k1 = tmp_path / "base", tmp_path / "k1"
    TrajectoryWriter(base).append([record(i, sample_version=3 + i // 4) for i in range(8)])
    TrajectoryWriter(k1).append(
        [record(i, sample_version=2) for i in range(6)]
        + [record(i, status="evicted", sample_version=-1, t_sample=np.nan) for i in (6, 7)]
        + [record(i, status="filtered", sample_version=-1, t_sample=np.nan) for i in (8, 9)]
    )
    (k1 / "config.yaml").write_text("buffer:\n  max_train_staleness: 1\n")
    report = build_report([base, k1], tmp_path / "out")
    row = _runs_row(report, "base")
    assert (row["trajectories"], row["evicted"], row["filtered"]) == ("8", "0", "0")
    assert row["s_train max"] == "3"  # (behavior 1, sampled at 4)
    row = _runs_row(report, "k1")
    assert (row["trajectories"], row["evicted"], row["filtered"]) == ("10", "2 (20%)", "2 (20%)")
    assert row["s_train max"] == "1 (bound 1)"


def test_s_train_max_counts_along_a_restarted_trainers_lineage(tmp_path):
    """A trainer restarted from version 1's checkpoint numbers its updates after 3: its
    first batch, of version 1's weights, sampled at 3, is none behind (as the buffer's
    bound counts it), not 2."""
    from test_storage import record

    run = tmp_path / "run"
    TrajectoryWriter(run).append([record(i) for i in range(4)])  # (behavior 1, sampled at 3)
    restart = {"time": 10.0, "checkpoint_version": 1, "after_version": 3}
    faults = {"trainer_restarts": [restart]}
    summary = {"reason": "completed", "segments": 1, "faults": faults}
    (run / "summary.json").write_text(json.dumps(summary))
    assert _runs_row(build_report([run], tmp_path / "out"), "run")["s_train max"] == "0"
