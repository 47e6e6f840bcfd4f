"""The run summary (pipelines/summary.py) from a run's stores and its last trainer's
stats: what ``summary.json`` says of the run's versions and updates."""

from __future__ import annotations

import json

from learner_cases import CFG
from test_resume_lineage import restarted_after_update_1, run_to_end
from test_trainer import groups, make

from laminar.config import with_overrides
from pipelines.summary import summarize, updates_made
from storage import TrajectoryWriter


def _raw(trainer: dict) -> dict:
    """What the driver collects at a run's stop (:meth:`pipelines.driver.Schedule.shutdown`),
    with ``trainer`` its last trainer's stats and nothing else to report."""
    return {
        "reason": "completed",
        "earlier_segments": [],
        "wall_s": 1.0,
        "trainer": {**trainer, "ranks_stats": []},
        "buffer": {},
        "pool": {},
        "rollouts": [],
        "relay": {},
        "repack": None,
        "faults": None,
        "resumed": None,
    }


def test_the_summary_counts_updates_made_beside_the_last_version_number(tiny_policy, tmp_path):
    """trainer.steps=4. The first trainer makes update 1, checkpoints it, and is lost
    after publishing 3; the trainer restarted within the run loads version 1 and
    numbers its updates after 3, skipping 2 and 3: it ends at version 6 with the run's 4
    updates made (1, then 4-6). ``versions`` is the last number (6); ``updates`` (4) is
    what ``trainer.steps`` counts, which the summary had no figure for."""
    cfg = with_overrides(CFG, ["trainer.steps=4", "trainer.groups_per_step=2"])
    run = tmp_path / "run"
    # (as pipelines.restart starts it: trainer.steps plus the checkpoint's skips, none)
    restarted = restarted_after_update_1(cfg, tiny_policy, run)
    batches = [groups(1 + i, 2) for i in range(3)]
    trainer, buffer, master = make(tiny_policy, run, restarted, batches=batches, after_version=3)
    stats = run_to_end(trainer)
    assert stats["done"] and stats["error"] is None and master.order == [4, 5, 6]
    assert updates_made(stats, cfg.trainer.steps) == 4

    TrajectoryWriter(run).append([t.to_record() for b in batches for t in b])
    summary = summarize(run, _raw(stats), {}, cfg)
    assert (summary["versions"], summary["updates"]) == (6, 4)
    on_disk = json.loads((run / "summary.json").read_text())
    assert (on_disk["versions"], on_disk["updates"]) == (6, 4)


def test_summary_json_is_strict_json_written_whole(tmp_path):
    """A run stopped before any trajectory has no reward figures: summary.json said
    ``NaN``, which strict JSON readers (jq, JavaScript, most languages' parsers) refuse;
    now ``null``. And it is replaced whole (a new file renamed over the old), never
    rewritten in place where a reader could see half of it."""
    import math
    import os

    from pipelines.summary import summarize_failed

    run = tmp_path / "run"
    TrajectoryWriter(run)  # (an empty store)
    (run / "summary.json").write_text('{"reason": "completed"}')  # (an earlier start's)
    before = os.stat(run / "summary.json").st_ino
    summary = summarize_failed(run, RuntimeError("lost"), CFG)
    assert math.isnan(summary["reward_first_20pct"])  # (the returned summary: a float)

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    on_disk = json.loads((run / "summary.json").read_text(), parse_constant=refuse)
    assert on_disk["reward_first_20pct"] is None and on_disk["reward_gain"] is None
    assert on_disk["reason"] == "failed: RuntimeError: lost"
    assert os.stat(run / "summary.json").st_ino != before
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("summary")) == ["summary.json"]


def test_a_file_written_whole_keeps_the_mode_a_plain_write_gives(tmp_path):
    """replace_text writes through mkstemp, whose file is 0600: summary.json (and a
    checkpoint's data position) became unreadable to the teammates of a shared project
    folder. A new file takes the umask's mode; a replaced one keeps its own."""
    import os
    import stat

    from laminar.files import replace_text

    old = os.umask(0o022)
    try:
        plain, whole = tmp_path / "plain.json", tmp_path / "whole.json"
        plain.write_text("{}")
        replace_text(whole, "{}")
        assert stat.S_IMODE(whole.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o644
        whole.chmod(0o640)
        replace_text(whole, "[]")
        assert stat.S_IMODE(whole.stat().st_mode) == 0o640 and whole.read_text() == "[]"
    finally:
        os.umask(old)


def test_the_summarys_reward_errors_count_a_lost_rollouts_too():
    """The summary counted the reward failures of the rollouts that answered the stop
    alone: a rollout lost during the run took its failures with it. The driver hands
    every rollout of the start at its latest answer (``rollouts_seen``)."""
    from pipelines.summary import reward_errors, rollouts_seen

    live = {"rollout_id": "r1", "reward_errors": 2, "rewards_scored": 30}
    lost = {"rollout_id": "r0", "reward_errors": 5, "rewards_scored": 10}
    lost["last_reward_error"] = "reward m:f raised KeyError"
    earlier = {"rollout_id": "r1", "reward_errors": 1, "rewards_scored": 20}
    seen = rollouts_seen({"r0": lost, "r1": earlier}, [live])
    errors = reward_errors(seen, {"groups_discarded": 3})
    assert (errors["failed"], errors["scored"], errors["groups_discarded"]) == (7, 40, 3)
    assert errors["latest"] == "reward m:f raised KeyError"
