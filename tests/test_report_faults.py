"""``laminar report`` says what a run lost beyond its rollouts: a trainer or data module
restarted within the run (summary.json's ``faults.trainer_restarts``, ``data_restarts``,
``core_restarts``), and what each cost; relays lost and hangs. A run with no
summary.json (its driver killed) has them unknown, said so, not "none"."""

from __future__ import annotations

import json

import matplotlib
from test_report_columns import T0, _events_row
from test_storage import record

from pipelines import report
from pipelines.summary import RESTART_KINDS, faults_summary
from storage import TrajectoryWriter
from storage.metrics import MetricsWriter

# A trainer and data module lost together at 16 s and running again 4.7 s later, from
# the checkpoint of version 6 after version 7 was out (the record CoreRestart writes:
# r2 of the reviewer's runs, a shared worker SIGKILLed).
CORE = {
    "lost_worker": "tcp://127.0.0.1:38249",
    "time": T0 + 16.0,
    "worker": "tcp://127.0.0.1:45743",
    "held_again": 256,
    "registered": 0,
    "restart_s": 4.7,
    "checkpoint_version": 6,
    "after_version": 7,
    "lost_updates": 1,
    "steps": 17,
}
# A data module rebuilt on its own worker at 30 s, in 2.9 s (r6: cluster.data_apart).
DATA = {"lost_worker": "tcp://d:1", "time": T0 + 30.0, "held_again": 0, "restart_s": 2.9}


def _run(run_dir, summary: dict | None):
    """A run of 40 s, one start, 8 publications, no rollout lost; ``summary``: its summary.json."""
    TrajectoryWriter(run_dir).append([record(0), record(1)])
    MetricsWriter(run_dir).append(
        "cluster",
        [
            {"segment": 0, "elapsed_s": t, "wall_time": T0 + t, "version": t // 5}
            | {"buffer_depth": 1, "oldest_buffered_age_s": 0.5}
            for t in range(0, 41, 5)
        ],
    )
    MetricsWriter(run_dir).append(
        "publications",
        [{"version": v, "t_publish": T0 + 5 * v, "stall_s": 0.001} for v in range(8)],
    )
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def _faults_title(run_dir, tmp_path, monkeypatch) -> tuple[str, list[str]]:
    """events-0.png's faults panel: its title and the words along its lines."""
    matplotlib.use("Agg")
    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, out, name: drawn.setdefault(name, fig))
    report.plot_events(report._load(run_dir) | {"index": 0}, tmp_path)
    ax_f = drawn["events-0.png"].axes[2]
    return ax_f.get_title(), [t.get_text() for t in ax_f.texts]


def test_a_core_restart_and_a_data_rebuild_are_in_the_table_and_the_figure(tmp_path, monkeypatch):
    """The events table read rollout losses alone: "rollouts lost 0 | - | replacements
    0" and a figure titled "faults: none" for a run whose trainer and data module were
    lost and restarted."""
    run = tmp_path / "run"
    faults = faults_summary({"lost": {}, "chain": ["master"]}, None, (), [DATA], [CORE])
    _run(run, {"reason": "completed", "segments": 1, "faults": faults})
    row = _events_row(report.build_report([run], tmp_path / "out"))
    assert row[5:] == [
        "0",
        "-",
        "0",
        "2: trainer + data: v6→7, 1 update redone, 4.7 s down; data module: rebuilt, 2.9 s down",
        "0 / 0",
    ]
    title, words = _faults_title(run, tmp_path, monkeypatch)
    assert title == "faults: 1 data module restart, 1 trainer + data restart"
    assert words == ["trainer + data restarted v6→7", "data module rebuilt"]


def test_relays_lost_and_hangs_are_named(tmp_path):
    run = tmp_path / "run"
    m = {"lost": {}, "relays_lost": {"relay-1": {"time": T0 + 9}}, "hung": {"r1": {}}}
    _run(run, {"reason": "completed", "segments": 1, "faults": faults_summary(m, None)})
    row = _events_row(report.build_report([run], tmp_path / "out"))
    assert row[8:] == ["0", "1 (relay-1) / 1 (r1)"]


def test_without_summary_json_what_only_it_records_is_unknown_not_none(tmp_path, monkeypatch):
    """A run whose driver was killed has no summary.json: its restarts, replacements and
    relays lost are not known (the figure said "faults: none")."""
    run = tmp_path / "run"
    _run(run, None)
    made = report.build_report([run], tmp_path / "out")
    assert _events_row(made)[8:] == ["unknown (summary.json absent)"] * 2
    text = made.read_text()
    assert "## Missing stores" in text and "- run: no summary.json (its driver was" in text
    title, _ = _faults_title(run, tmp_path, monkeypatch)
    assert title == "faults: restarts unknown (summary.json absent)"
    # A failed driver's summary records its restarts (none here), not its relays
    failed = {"reason": "failed: …", "driver_failed": True, "segments": 1}
    failed["faults"] = {k: [] for k in RESTART_KINDS}  # (summarize_failed's)
    (run / "summary.json").write_text(json.dumps(failed))
    row = _events_row(report.build_report([run], tmp_path / "out"))
    assert row[8:] == ["0", "unknown (the driver failed)"]
