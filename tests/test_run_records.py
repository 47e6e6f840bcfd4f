"""What a run's records say of its faults across its starts and losses: the audit's
check of each lost rollout, the summary's and the report's counts of them, the
progress a notebook shows. Synthetic stores, no cluster."""

from __future__ import annotations

import json

from factories import trajectory

from storage import TrajectoryWriter
from storage.metrics import MetricsWriter

T0 = 1.8e9  # the run's start, epoch seconds


def _store(run_dir, paths=("r0", "r1,r0", "r1,r0", "r0")) -> None:
    TrajectoryWriter(run_dir).append(
        [
            trajectory(f"u{i}", f"g{i}", group_size=1, rollout_ids=p, finish_version=0).to_record()
            for i, p in enumerate(paths)
        ]
    )


def _fault(rollout: str, t: float, **row) -> dict:
    return {
        "time": t,
        "rollout": rollout,
        "destination": "r0",
        "how": "import",
        "version": 1,
        "requests": 2,
        "tokens_recovered": 4,
        "max_since_flush_s": 0.1,
        "recovery_s": 0.1,
        **row,
    }


def test_the_audit_flags_a_lost_rollout_whose_recovery_rows_were_lost(tmp_path):
    """summary.json names r1 lost, but its recovery rows died with the data module before
    the driver wrote them: the audit said "rollouts lost 0 ... CLEAN", its recovery
    check skipped. It counts the loss and says it cannot check it."""
    from storage.audit import audit_run

    _store(tmp_path)
    summary = {"reason": "completed", "segments": 1, "faults": {"lost": {"r1": T0 + 3}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = audit_run(tmp_path)
    assert report.figures["rollouts lost"] == 1
    assert report.problems == [
        "1 rollouts summary.json names as lost (r1 (start 0)) have no row in the faults "
        "table of metrics.zarr: their recovery rows were lost (with the data module, "
        "before the driver copied them), so their recovery is unchecked"
    ]
    # with its rows, the check is made
    MetricsWriter(tmp_path).append("faults", [_fault("r1", T0 + 3, segment=0)])
    report = audit_run(tmp_path)
    assert report.ok, report.text()
    assert report.figures["rollouts lost"] == 1
    assert report.figures["  r1: resumed and stored"] == 2
