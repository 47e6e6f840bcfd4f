"""Resuming from a checkpoint that a trainer restarted within the run wrote.

A trainer restarted within the run numbers its updates after the newest version the lost
one published, skipping the numbers in between (docs/faults.md, "Trainer loss"), and makes
that many updates more. Its checkpoints must say how many numbers their weights' lineage
skipped: a run resumed from one (``laminar run --resume``), or a trainer restarted again
from one after a resume, makes exactly the updates the run still owed. Driven in process
(the trainer's loop with a fake buffer and master relay, as in tests/test_trainer.py).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from learner_cases import CFG
from test_trainer import groups, make, run_until_starved

from laminar.config import with_overrides
from laminar.learner import CheckpointError, Learner


def restarted_after_update_1(cfg, policy, run):
    """The config of a trainer restarted within the run from version 1: a first trainer
    made update 1 and checkpointed it under ``run`` (and was lost after publishing more)."""
    first = Learner(cfg, policy)
    first.update(groups(0, 2))
    ckpt = first.save(run / "checkpoints" / "version-000001")
    return with_overrides(cfg, [f"trainer.resume_from={ckpt}"])


def run_to_end(trainer, timeout: float = 120) -> dict:
    """Start the loop and wait until it ends by itself (at its steps)."""
    trainer.start()
    deadline = time.time() + timeout
    while not trainer.done and time.time() < deadline:
        time.sleep(0.05)
    assert trainer.done, "the trainer did not end at its steps"
    return trainer.stats()


def _checkpoint(tmp_path, policy, version: int, skipped: int | None) -> str:
    """A checkpoint at ``version`` whose lineage skipped ``skipped`` numbers (``None``: one
    written before the field existed)."""
    learner = Learner(CFG, policy)
    learner.version = version
    learner.skipped_versions = skipped or 0
    out = learner.save(tmp_path / "checkpoints" / f"version-{version:06d}")
    if skipped is None:  # (and before manifests: its trainer_state.json is not as listed)
        state = json.loads((out / "trainer_state.json").read_text())
        del state["skipped_versions"], state["restarts"]
        (out / "trainer_state.json").write_text(json.dumps(state))
        (out / "manifest.json").unlink()
    return str(out)


def test_a_run_resumed_from_a_restarted_trainers_checkpoint_makes_the_updates_it_owed(
    tiny_policy, tmp_path
):
    """trainer.steps=6. The first trainer makes update 1 and checkpoints it; it is lost
    after publishing 3. The restarted trainer loads version 1, numbers its updates from 4,
    makes 4 and 5 and stops (the run is lost) with a checkpoint at 5: 3 updates made, 3
    owed. Resumed from it with the run's config (trainer.steps=6), the trainer must make
    those 3 (versions 6-8). It made 1 (version 6): the checkpoint did not say that its
    version number counts 2 skipped numbers."""
    cfg = with_overrides(CFG, ["trainer.steps=6", "trainer.groups_per_step=2"])
    run = tmp_path / "run"
    restarted_cfg = restarted_after_update_1(cfg, tiny_policy, run)
    batches = [groups(1, 2), groups(2, 2)]
    trainer, buffer, master = make(
        tiny_policy, run, restarted_cfg, batches=batches, after_version=3
    )
    assert trainer.steps == 8  # (the run's 6 updates: 1, then 4-8)
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and master.order == [4, 5]
    assert stats["checkpoint"].endswith("version-000005")
    state = json.loads((run / "checkpoints" / "version-000005" / "trainer_state.json").read_text())
    assert state["skipped_versions"] == 2

    # `laminar run --resume`: the run's config, the newest checkpoint, no after_version.
    resumed_cfg = with_overrides(cfg, [f"trainer.resume_from={stats['checkpoint']}"])
    batches = [groups(3 + i, 2) for i in range(5)]
    trainer, buffer, master = make(tiny_policy, run, resumed_cfg, batches=batches)
    assert trainer.steps == 8
    stats = run_to_end(trainer)
    assert stats["error"] is None
    assert [h["version"] for h in trainer.history] == [6, 7, 8]  # the 3 owed updates
    assert master.order == [5, 6, 7, 8] and len(buffer.batches) == 2
    # Its checkpoint keeps the lineage's count: 6 updates under version 8.
    state = json.loads((run / "checkpoints" / "version-000008" / "trainer_state.json").read_text())
    assert state["version"] - state["skipped_versions"] == 6


def test_a_checkpoint_past_trainer_steps_with_updates_owed_is_not_refused(tiny_policy, tmp_path):
    """A checkpoint at version 7 whose lineage skipped 2 numbers holds 5 updates: with
    trainer.steps=6 one is owed, so the checkpoint is not "nothing left to train". At
    version 8 (6 updates) it is; and one written before the field existed is read as
    before (its version is its count of updates)."""
    cfg = with_overrides(CFG, ["trainer.steps=6"])
    owed = _checkpoint(tmp_path / "a", tiny_policy, 7, skipped=2)
    learner = Learner(cfg, tiny_policy, resume_from=owed)
    assert learner.version == 7 and learner.skipped_versions == 2
    done = _checkpoint(tmp_path / "b", tiny_policy, 8, skipped=2)
    with pytest.raises(CheckpointError, match="nothing left to train"):
        Learner(cfg, tiny_policy, resume_from=done)
    old = _checkpoint(tmp_path / "c", tiny_policy, 6, skipped=None)
    with pytest.raises(CheckpointError, match="nothing left to train"):
        Learner(cfg, tiny_policy, resume_from=old)
    old = _checkpoint(tmp_path / "d", tiny_policy, 5, skipped=None)
    old_cfg = with_overrides(cfg, [f"trainer.resume_from={old}"])
    trainer, _, _ = make(tiny_policy, tmp_path / "d", old_cfg)
    assert trainer.steps == 6 and trainer.skipped_versions == 0


def test_a_trainer_restarted_after_a_resume_counts_the_checkpoints_skipped_numbers(
    tiny_policy, tmp_path
):
    """After a resume the driver has no record of the restarts before it: a trainer
    restarted from a checkpoint whose lineage skipped 3 numbers must still end 3 later
    (`pipelines.restart._steps` reads the checkpoint), and so must a trainer the driver
    starts with the checkpoint's own steps."""
    from pipelines.restart import _steps

    cfg = with_overrides(CFG, ["trainer.steps=20"])
    ckpt = _checkpoint(tmp_path, tiny_policy, 10, skipped=3)  # 7 updates made
    s = SimpleNamespace(cfg=cfg, trainer_restarts=[], core_restarts=[])
    steps = _steps(s, 10, {"time": 1.0}, ckpt)
    assert steps == 23
    # Lost at 12: the new trainer ends at 12 + (20 - 7) = 25.
    restarted_cfg = with_overrides(cfg, [f"trainer.resume_from={ckpt}", f"trainer.steps={steps}"])
    trainer, _, _ = make(tiny_policy, tmp_path, restarted_cfg, after_version=12)
    assert trainer.steps == 25 and trainer.version == 12
    assert trainer.learner.skipped_versions == 5
    # (the warm start: nothing skipped)
    assert _steps(s, 0, {}, None) == 20


def test_a_resumed_buffer_starts_with_the_restarts_its_checkpoint_records(
    tiny_policy, tmp_path, caplog
):
    """The first trainer checkpoints version 1 and is lost after publishing 3; the
    restarted one (handed the run's restarts, its own (1, 3) last) checkpoints 5. A run
    resumed from 5 holds again a group generated by the lost 3: four updates down a
    branch from 1, and one more to the resumed trainer's first update, 6. The resumed
    buffer, which heard no restart, counted it 3 stale by the numbers (trained at
    max_train_staleness 3); it starts with the checkpoint's list and evicts it. A
    checkpoint written before the list existed reads as none, said at INFO."""
    import asyncio
    import logging

    from factories import trajectory
    from test_buffer import _buffer_config, _Pool, _pool

    from laminar.buffer import ExperienceBuffer
    from laminar.learner import checkpoint_restarts
    from storage.resume import plan_resume
    from storage.trajectories import TrajectoryWriter

    cfg = with_overrides(CFG, ["trainer.steps=6", "trainer.groups_per_step=2"])
    run = tmp_path / "run"
    restarted_cfg = restarted_after_update_1(cfg, tiny_policy, run)
    batches = [groups(1, 2), groups(2, 2)]
    trainer, buffer, _ = make(
        tiny_policy, run, restarted_cfg, batches=batches, after_version=3, restarts=[(1, 3)]
    )
    stats = run_until_starved(trainer, buffer)
    assert stats["checkpoint"].endswith("version-000005")
    state = json.loads((run / "checkpoints" / "version-000005" / "trainer_state.json").read_text())
    assert state["restarts"] == [[1, 3]]

    def lost_branch(uid):
        return trajectory(
            uid, "g", sample_idx=int(uid[-1]), behavior_version=3, finish_version=3
        ).to_record() | {"status": "buffered", "sample_version": -1}

    TrajectoryWriter(run).append([lost_branch("g-0"), lost_branch("g-1")])
    plan = plan_resume(run, 5)
    assert plan.readmit == ["g-0", "g-1"]
    # (pipelines.driver: `laminar run --resume` resumes from trainer.resume_from)
    plan.restarts = checkpoint_restarts(stats["checkpoint"])
    assert plan.restarts == [(1, 3)]

    async def resumed(plan):
        buf = ExperienceBuffer(
            str(run), _Pool(_pool(4, 2)), _buffer_config(max_train_staleness=3), resume=plan
        )
        evicted = buf.core.evict_stale(6)
        await buf.close()
        return buf.core.lag(6, 3), [t.uid for t in evicted]

    assert asyncio.run(resumed(plan)) == (5, ["g-0", "g-1"])

    old = _checkpoint(tmp_path / "old", tiny_policy, 5, skipped=None)
    with caplog.at_level(logging.INFO, logger="laminar.learner"):
        assert checkpoint_restarts(old) == []
    assert "records no trainer restarts" in caplog.text
