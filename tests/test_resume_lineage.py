"""Resuming from a checkpoint that a trainer restarted within the run wrote.

A trainer restarted within the run numbers its updates after the newest version the lost
one published, skipping the numbers in between (docs/faults.md, "Trainer loss"), and makes
that many updates more. Its checkpoints must say how many numbers their weights' lineage
skipped: a run resumed from one (``laminar run --resume``), or a trainer restarted again
from one after a resume, makes exactly the updates the run still owed. Driven in process
(the trainer's loop with a fake buffer and master relay, as in tests/test_trainer.py).

And the analysis of such a run: ``storage.lineage.run_restarts`` finds the restarts of
every start, its earlier ones' in the checkpoint the last resume started from, from a
run directory built as the driver and trainers write it (real checkpoints, summary.json
and store; a real one, restarted in more than one start, needs a cluster and a fault per
restart).
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


# --- storage.lineage.run_restarts: the restarts of every start of a resumed run ----------

T0 = 1.8e9


class _Start:
    """One start of a run, recorded as the driver records it: a resumed one reads its
    checkpoint's restarts (pipelines.driver) and records the resume in the store
    (laminar.buffer); each trainer is handed the run's restarts so far
    (pipelines.restart_steps._lineage) and records them in its checkpoints; an orderly
    stop writes the start's own restarts and resume into summary.json."""

    def __init__(self, run, learner, resume_from: int | None = None, t: float = T0):
        from laminar.learner import checkpoint_restarts
        from storage.resume import ResumePlan
        from storage.trajectories import TrajectoryWriter

        self.run, self.learner, self.records, self.plan = run, learner, [], None
        if resume_from is not None:
            self.plan = ResumePlan(version=resume_from)
            self.plan.restarts = checkpoint_restarts(self.ckpt(resume_from))
            TrajectoryWriter(run).record_resume(resume_from, t)
        # (a resumed trainer: its checkpoint's; laminar.learner.Learner._restore)
        self.handed = [] if self.plan is None else list(self.plan.restarts)

    def ckpt(self, version: int):
        return self.run / "checkpoints" / f"version-{version:06d}"

    def checkpoint(self, version: int) -> None:
        self.learner.version, self.learner.restarts = version, list(self.handed)
        self.learner.save(self.ckpt(version))

    def restart(self, t: float, checkpoint_version: int, after_version: int) -> None:
        """The trainer lost after publishing ``after_version``, restarted from the
        checkpoint of ``checkpoint_version``: the new one is handed the run's restarts."""
        from pipelines.restart_steps import _lineage, _point_fields

        ckpt = self.ckpt(checkpoint_version)
        point = _point_fields(ckpt, checkpoint_version, after_version)
        self.records.append({"lost_worker": "tcp://w", "time": t, **point})
        s = SimpleNamespace(resume=self.plan, trainer_restarts=self.records, core_restarts=[])
        self.handed = _lineage(s)

    def stop(self) -> None:
        from pipelines.summary import faults_summary, write_summary

        summary = {
            "run_dir": str(self.run),
            "faults": faults_summary(None, None, self.records),
            "resumed": self.plan.summary() if self.plan is not None else None,
        }
        write_summary(self.run, summary)


def test_a_resumed_runs_restarts_are_its_checkpoints_then_its_own(tiny_policy, tmp_path, caplog):
    """Three starts. The first: checkpoints at 2, restarts (2, 4) and (6, 7), a
    checkpoint at 10, a restart (10, 12) whose trainer writes none, then its driver
    fails. The second resumes from 10 (numbering 11, 12, ... again: the branch of
    (10, 12) is superseded), restarts (12, 14), stops in order. The third resumes from 16
    and restarts (16, 18). run_restarts read the last start's summary alone: the
    restarts of the earlier starts were missing, and a trajectory the first start
    generated on a lost branch and consumed at 8 was counted by the numbers."""
    import logging

    from factories import trajectory

    from pipelines.summary import summarize_failed
    from storage import open_run
    from storage.lineage import lineage_lag, run_restarts
    from storage.trajectories import TrajectoryWriter

    run = tmp_path / "run"
    learner = Learner(CFG, tiny_policy)
    first = _Start(run, learner)
    first.checkpoint(2)
    first.restart(T0 + 10, 2, 4)
    first.checkpoint(6)
    first.restart(T0 + 20, 6, 7)
    first.checkpoint(10)
    first.restart(T0 + 30, 10, 12)
    # generated by the first trainer's lost 3, consumed by the third trainer's update at 8
    lost = trajectory(
        "lost-0",
        "g",
        group_size=1,
        behavior_version=3,
        finish_version=4,
        status="consumed",
        sample_version=8,
        t_submit=T0,
        t_start=T0,
        t_finish=T0 + 1,
        t_insert=T0 + 1,
        t_sample=T0 + 25,
    ).to_record()
    TrajectoryWriter(run).append([lost])
    summarize_failed(run, RuntimeError("the cluster was lost"), CFG)
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        # (the newest checkpoint's: (10, 12) came after its trainer started)
        assert run_restarts(run) == [(2, 4), (6, 7)]
    assert "is a failed driver's" in caplog.text and "version-000010" in caplog.text
    # What the failed driver still knew of its start (Schedule.start_records): recorded,
    # its restart after the newest checkpoint is counted too, with nothing to warn of.
    start = {"trainer_restarts": first.records, "data_restarts": [], "core_restarts": []}
    summarize_failed(run, RuntimeError("the cluster was lost"), CFG, start | {"resumed": None})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(run) == [(2, 4), (6, 7), (10, 12)]
    assert caplog.text == ""

    second = _Start(run, learner, resume_from=10, t=T0 + 100)
    assert second.handed == [(2, 4), (6, 7)]
    second.checkpoint(12)
    second.restart(T0 + 120, 12, 14)
    second.checkpoint(16)
    second.stop()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="storage.lineage"):
        assert run_restarts(run) == [(2, 4), (6, 7), (12, 14)]  # (not (10, 12))
    assert caplog.text == ""
    st = open_run(run).laminar.staleness(restarts="run")
    assert st["s_train"].item() == 5 and st["s_train_lineage"].item() == 4
    assert lineage_lag(8, 3, [(2, 4), (6, 7), (12, 14)]) == 4  # 8 → 6 → 2, then up to 3

    third = _Start(run, learner, resume_from=16, t=T0 + 200)
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):  # (still going)
        assert run_restarts(run) == [(2, 4), (6, 7), (12, 14)]
    assert "is of an earlier start" in caplog.text and "version 16" in caplog.text
    third.restart(T0 + 210, 16, 18)
    third.checkpoint(20)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(run) == [(2, 4), (6, 7), (12, 14), (16, 18)]
    assert "version-000020" in caplog.text
    third.stop()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="storage.lineage"):
        assert run_restarts(run) == [(2, 4), (6, 7), (12, 14), (16, 18)]
    assert caplog.text == ""
    # (the final checkpoint's list is the same: its trainer was handed them all)
    state = json.loads((third.ckpt(20) / "trainer_state.json").read_text())
    assert state["restarts"] == [[2, 4], [6, 7], [12, 14], [16, 18]]


def test_the_resumes_checkpoint_gone_or_damaged_is_said_and_read_from_a_later_one(
    tiny_policy, tmp_path, caplog
):
    """Resumed from 10, whose checkpoint records (2, 4), then restarted (12, 14). The
    checkpoint of 10 deleted: the later checkpoints the resumed start wrote record the
    same restarts before theirs. With none of them readable either: a WARNING naming the
    checkpoint, and the start's own restarts alone. Nothing is moved or written."""
    import logging
    import shutil

    from storage.lineage import run_restarts

    run = tmp_path / "run"
    learner = Learner(CFG, tiny_policy)
    first = _Start(run, learner)
    first.checkpoint(2)
    first.restart(T0 + 10, 2, 4)
    first.checkpoint(10)
    second = _Start(run, learner, resume_from=10, t=T0 + 100)
    second.checkpoint(12)
    second.restart(T0 + 120, 12, 14)
    second.checkpoint(16)
    second.stop()
    assert run_restarts(run) == [(2, 4), (12, 14)]

    shutil.rmtree(second.ckpt(10))
    with caplog.at_level(logging.INFO, logger="storage.lineage"):
        assert run_restarts(run) == [(2, 4), (12, 14)]
    assert "version-000010' is not there" in caplog.text and "version-000012" in caplog.text

    (second.ckpt(12) / "trainer_state.json").write_text('{"version": 12, "restar')
    state16 = second.ckpt(16) / "trainer_state.json"
    state = json.loads(state16.read_text())
    state16.write_text(json.dumps(state | {"version": 15}))  # (not the folder's)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(run) == [(12, 14)]
    assert "version-000010' is not there" in caplog.text
    assert "restarts before the resume from version 10" in caplog.text
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "version-000002",
        "version-000012",
        "version-000016",
    ]

    # The checkpoint there but damaged; one written before laminar recorded the list.
    first.checkpoint(10)
    (second.ckpt(10) / "trainer_state.json").write_text("{")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(run) == [(12, 14)]
    assert "version-000010/trainer_state.json' does not read (JSONDecodeError" in caplog.text
    first.checkpoint(10)
    state10 = second.ckpt(10) / "trainer_state.json"
    state = json.loads(state10.read_text())
    del state["restarts"]
    state10.write_text(json.dumps(state))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(run) == [(12, 14)]
    assert "records no trainer restarts" in caplog.text


def test_a_run_started_once_reads_its_summary_alone(tmp_path, caplog):
    """No resume: the summary's restarts, no checkpoint read (there are none here), no
    warning; no summary at all (a run still going): none, said."""
    import logging

    from storage.lineage import run_restarts

    run = tmp_path / "run"
    run.mkdir()
    start = _Start(run, learner=None)
    start.restart(T0 + 10, 0, 3)
    start.stop()
    with caplog.at_level(logging.INFO, logger="storage.lineage"):
        assert run_restarts(run) == [(0, 3)]
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="storage.lineage"):
        assert run_restarts(tmp_path / "other") == []
    assert "summary.json' is not there" in caplog.text
