"""What ``laminar run``'s summary says of a lost rollout's recovery: the unfinished
trajectories resumed and the finished ones rescored apart (the ``faults`` table's
``how``), and the rollout that replaced it."""

from __future__ import annotations

from test_cli import _summary

from pipelines import cli
from pipelines.summary import faults_summary
from storage.metrics import MetricsWriter

T0 = 1.8e9


def _row(how: str, requests: int, version: int, segment: int = 0) -> dict:
    """A recovery's row as the manager writes it (laminar.manager_recovery.recover)."""
    return {
        "time": T0 + 30,
        "rollout": "r0",
        "destination": "r1",
        "how": how,
        "version": version,
        "requests": requests,
        "tokens_recovered": 10 * requests,
        "max_since_flush_s": 1.0,
        "recovery_s": 0.1,
        "segment": segment,
    }


def _said(run_dir, capsys, rows: list[dict], manager: dict) -> str:
    """The summary's faults line of a run whose manager ended with ``manager`` (its
    stats) after writing ``rows``."""
    MetricsWriter(run_dir).append("faults", rows)
    faults = faults_summary({"lost": {"r0": T0 + 30}, **manager}, None)
    cli._print_summary({**_summary(str(run_dir)), "faults": faults})
    return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("faults"))


def test_rescored_finished_trajectories_are_not_called_unfinished(tmp_path, capsys):
    """r7 of the reviewer's runs: r0's 120 finished trajectories (rewards in flight)
    were rescored on r1, and the summary read "120 unfinished trajectories resumed
    elsewhere in 2 recoveries"; its replacement r2 was only in summary.json."""
    rows = [_row("rescore", 56, 1), _row("rescore", 64, 2)]
    manager = {"recoveries": 2, "recovered_requests": 120, "replacements": {"r0": "r2"}}
    assert _said(tmp_path, capsys, rows, manager) == (
        "faults             1 rollout(s) lost (r0 → r2); 0 unfinished trajectories resumed "
        "elsewhere, 120 finished rescored in 2 recoveries (`laminar audit RUN_DIR`)"
    )


def test_resumed_and_rescored_are_split_and_a_short_table_says_both(tmp_path, capsys):
    rows = [_row("import", 7, 2), _row("adopt", 3, 1), _row("rescore", 4, 2)]
    manager = {"recoveries": 3, "recovered_requests": 14}
    said = _said(tmp_path / "a", capsys, rows, manager)
    assert "(r0 not replaced); 10 unfinished trajectories resumed elsewhere, 4 finished " in said
    # Rows the table lacks (lost with a data module before the driver copied them): the
    # total, said as either
    said = _said(tmp_path / "b", capsys, rows[:2], manager)
    assert "; 14 trajectories recovered elsewhere (unfinished resumed or finished rescored)" in said
