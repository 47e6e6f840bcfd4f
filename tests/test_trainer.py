"""The trainer actor's loop, driven in process: a fake buffer hands it batches, a fake
master relay records what it publishes, and the checkpoints it writes are read back."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch
from factories import InProcess
from learner_cases import CFG, batch, weights

from laminar.config import with_overrides
from laminar.contract import Trajectory
from laminar.files import ManifestCheck, check_manifest
from laminar.schedule import LAMINAR, ScheduleSpec
from laminar.trainer import Trainer

STREAM = ScheduleSpec("stream", dispatch="batches", trainer="stream", weights="global")
ONE_STEP = ScheduleSpec("one_step", dispatch="batches", lag=1, trainer="one_step", weights="global")


def groups(step: int, n: int) -> list[Trajectory]:
    """``n`` complete groups of 2 (small: every update is one forward of a few rows)."""
    return batch(step, groups=n, size=2)


class FakeBuffer:
    """Hands out the given batches in order (each must hold the groups asked for), then
    nothing; records what the trainer tells it."""

    def __init__(self, batches: list[list[Trajectory]]) -> None:
        self.batches = list(batches)
        self.published: list[int] = []
        self.skipped = 0
        self.empty = threading.Event()  # asked for a batch it does not have

    def sample(self, n_groups: int, version: int, request=None) -> list[Trajectory] | None:
        if not self.batches:
            self.empty.set()
            return None
        out = self.batches.pop(0)
        assert len({t.prompt_uid for t in out}) == n_groups
        for t in out:
            t.sample_version, t.status = version, "consumed"
        return out

    def version_published(self, version: int) -> None:
        self.published.append(version)

    def update_skipped(self) -> None:
        self.skipped += 1

    def sync(self) -> dict:
        return {"written": 0, "consumed_unstored": {}}

    def pool_stats(self) -> dict:
        return {"dispatched": 0}

    def stats(self) -> dict:
        return {}


class FakeMaster:
    """The master relay: every version published, with a copy of its weights."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.order: list[int] = []

    def publish(self, version: int, state: dict) -> float:
        self.order.append(version)
        self.versions[version] = {k: v.clone() for k, v in state.items()}
        return 0.0


def make(policy, tmp_path, cfg=CFG, spec=LAMINAR, batches=(), **kw):
    buffer, master = FakeBuffer(list(batches)), FakeMaster()
    trainer = Trainer(
        cfg, str(policy), str(tmp_path), InProcess(buffer), InProcess(master), "", spec, **kw
    )
    return trainer, buffer, master


def run_until_starved(trainer: Trainer, buffer: FakeBuffer, timeout: float = 120) -> dict:
    """Start the loop, stop it once it waits for a batch the buffer does not have."""
    trainer.start()
    assert buffer.empty.wait(timeout), "the trainer never asked for more"
    return trainer.stop(timeout=timeout)


def checkpoint_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    shared = set(a) & set(b)
    assert shared
    return all(torch.equal(a[k], b[k]) for k in shared)


def test_a_stream_batch_stopped_midway_is_published_and_its_checkpoint_matches(
    tiny_policy, tmp_path
):
    """Stopped after the first of two mini-batches, whose step moved the weights: the
    update ends with what it trained (a version, published, recorded as one mini-batch),
    and the final checkpoint holds exactly the weights published under its version. (It
    used to be written under the last published version with the half-trained weights,
    which a resume would then train that mini-batch's groups into again.)"""
    cfg = with_overrides(CFG, ["trainer.mini_batches=2", "trainer.groups_per_step=4"])
    parts = [groups(0, 2), groups(1, 2), groups(2, 2)]  # a whole batch, then half of one
    trainer, buffer, master = make(tiny_policy, tmp_path, cfg, STREAM, parts)
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and stats["done"]
    assert master.order == [0, 1, 2] and buffer.published == [1, 2]
    assert [h["mini_batches"] for h in trainer.history] == [2.0, 1.0]
    assert trainer.history[-1]["applied_steps"] == 1.0
    assert stats["checkpoint"].endswith("version-000002")
    assert same(checkpoint_weights(stats["checkpoint"]), master.versions[2])
    assert not same(master.versions[1], master.versions[2])


def test_a_restarted_trainer_stopped_before_its_first_update_writes_no_checkpoint(
    tiny_policy, tmp_path
):
    """Restarted from its checkpoint at version 1 after the lost trainer had published 3,
    the trainer holds version 1's weights under the number 3. Stopped before it trains
    (a stop during the restart), it must not write them as ``version-000003``: version 3
    was published with other weights, and a resume from that folder would publish them as
    3 again. Its first update is version 4, checkpointed with the weights it published."""
    from laminar.learner import Learner

    first = Learner(CFG, tiny_policy)
    first.update(groups(0, 2))
    ckpt = first.save(tmp_path / "lost" / "checkpoints" / "version-000001")
    cfg = with_overrides(CFG, [f"trainer.resume_from={ckpt}", "trainer.groups_per_step=2"])
    run = tmp_path / "run"
    trainer, buffer, master = make(tiny_policy, run, cfg, after_version=3)
    assert trainer.version == 3 and trainer.steps == CFG.trainer.steps + 2
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and master.order == []
    assert stats["checkpoint"] is None
    assert not (run / "checkpoints" / "version-000003").exists()

    trainer, buffer, master = make(tiny_policy, run, cfg, batches=[groups(1, 2)], after_version=3)
    stats = run_until_starved(trainer, buffer)
    assert master.order == [4] and buffer.published == [3, 4]
    assert stats["checkpoint"].endswith("version-000004")
    assert same(checkpoint_weights(stats["checkpoint"]), master.versions[4])
    assert not (run / "checkpoints" / "version-000003").exists()


def test_fingerprints_are_read_while_the_loop_publishes(tiny_policy, tmp_path):
    """The driver asks for the published fingerprints every poll (``relay.audit_weights``)
    from the actor's thread while the training loop publishes: the answer is a
    consistent copy, never "dictionary changed size during iteration" (which the driver
    would take for a failed trainer)."""
    cfg = with_overrides(CFG, ["relay.audit_weights=true"])
    trainer, _, master = make(tiny_policy, tmp_path, cfg)
    done = threading.Event()

    def publish_many() -> None:
        while not done.is_set() and trainer.version < 2000:
            trainer.learner.version += 1
            trainer.publish()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (thread switches as often as they can come)
    loop = threading.Thread(target=publish_many)
    loop.start()
    try:
        deadline = time.time() + 3
        while time.time() < deadline:
            seen = trainer.get_fingerprints(-1)
            assert sorted(seen) == list(range(1, len(seen) + 1))
    finally:
        done.set()
        loop.join()
        sys.setswitchinterval(switch)
    assert len(trainer.get_fingerprints(-1)) == trainer.version > 10
    assert trainer.get_fingerprints(5) == {
        v: fp for v, fp in trainer.get_fingerprints(-1).items() if v > 5
    }


def test_one_step_publishes_each_version_once_in_order_and_checkpoints_what_it_published(
    tiny_policy, tmp_path
):
    """One-step holds version v+1 back until the next batch is complete, and publishes the
    last one held at the stop; every checkpoint holds the weights published under its
    number. A non-finite batch in between publishes nothing and tells the buffer."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=1"])
    bad = batch(9, groups=2, size=2, nan=True)
    trainer, buffer, master = make(
        tiny_policy, tmp_path, cfg, ONE_STEP, [groups(0, 2), groups(1, 2), bad, groups(2, 2)]
    )
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and stats["skipped_steps"] == 1 and buffer.skipped == 1
    assert master.order == [0, 1, 2, 3] and buffer.published == [1, 2, 3]
    assert [h["version"] for h in trainer.history] == [1, 2, 3]
    for v in (1, 2, 3):
        path = tmp_path / "checkpoints" / f"version-{v:06d}"
        assert same(checkpoint_weights(path), master.versions[v])
        # its manifest, written in the same rename, lists every file but the data
        # position (rewritten at the stop), each as it is on disk
        listed = json.loads((path / "manifest.json").read_text())["files"]
        assert set(listed) == {p.name for p in path.iterdir()} - {
            "manifest.json",
            "data_state.json",
        }
        assert check_manifest(path, leave_out=("data_state.json",)) == ManifestCheck(True)
    assert stats["checkpoint"].endswith("version-000003")


def test_a_rebuilt_buffer_takes_the_version_told_not_one_still_unpublished(tiny_policy, tmp_path):
    """One-step's update moves the learner's version and publishes it only with the next
    batch. A data module lost in between is rebuilt at the version the trainer told the
    buffer (pipelines/restart.py plans with ``consumed_record``): at the learner's, the
    rebuilt buffer stamped trajectories with a version no rollout held, and the pool's
    staleness bound and the buffer's eviction ran one version ahead."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2"])
    trainer, buffer, _ = make(tiny_policy, tmp_path, cfg, ONE_STEP, [groups(0, 2)])
    trainer.start()
    assert buffer.empty.wait(120), "the trainer never asked for its second batch"
    # (waiting for the batch that lets it publish version 1)
    assert trainer.version == 1 and buffer.published == []
    assert trainer.consumed_record()["version"] == 0
    # (and what the driver reads for a core restart's M, pipelines/restart.py)
    assert trainer.stats()["version"] == 1 and trainer.stats()["published"] == 0
    stats = trainer.stop(timeout=120)
    assert stats["error"] is None and buffer.published == [1]
    assert trainer.consumed_record()["version"] == 1 and stats["published"] == 1


def test_keep_checkpoints_removes_the_oldest_once_a_newer_is_in_place(
    tiny_policy, tmp_path, caplog
):
    """``trainer.keep_checkpoints=2``: a run that checkpoints every version keeps its two
    newest, whole and loadable. A newer one of a start a resume superseded is not the
    trainer's to remove; a folder a removal left half done (renamed aside) goes as the
    next trainer starts."""
    import logging

    cfg = with_overrides(
        CFG,
        ["trainer.groups_per_step=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"],
    )
    folder = tmp_path / "checkpoints"
    superseded = folder / "version-000009"  # (a lost start's, past this one's versions)
    superseded.mkdir(parents=True)
    half = folder / ".version-000004.removed"
    half.mkdir()
    (half / "optimizer.pt").write_bytes(b"\0" * 4096)
    trainer, buffer, master = make(
        tiny_policy, tmp_path, cfg, LAMINAR, [groups(0, 2), groups(1, 2), groups(2, 2)]
    )
    with caplog.at_level(logging.INFO, logger="laminar"):
        stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and trainer.version == 3
    assert sorted(p.name for p in folder.iterdir()) == [
        "version-000002",
        "version-000003",
        "version-000009",
    ]
    for v in (2, 3):
        path = folder / f"version-{v:06d}"
        assert same(checkpoint_weights(path), master.versions[v])
        assert check_manifest(path, leave_out=("data_state.json",)) == ManifestCheck(True)
    said = caplog.text
    assert "version-000001 (trainer.keep_checkpoints=2)" in said
    assert ".version-000004.removed, a checkpoint a trainer left half removed" in said


def test_a_trainer_stopped_without_a_checkpoint_writes_none(tiny_policy, tmp_path):
    """An aborted run stops its trainer with ``checkpoint=False`` (the driver's
    ``_abort``): a trainer still finishing its update after the driver has given up
    must not put a checkpoint into a run directory a resume may already use."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=0"])
    trainer, buffer, master = make(tiny_policy, tmp_path, cfg, LAMINAR, [groups(0, 2)])
    trainer.start()
    assert buffer.empty.wait(120), "the trainer never asked for its second batch"
    stats = trainer.stop(timeout=120, checkpoint=False)
    assert stats["error"] is None and stats["done"] and master.order == [0, 1]
    assert stats["checkpoint"] is None
    assert not list((tmp_path / "checkpoints").glob("*")), "a checkpoint was written"


class LateBuffer(FakeBuffer):
    """Keeps its last batch for the request id it answered, as the buffer does
    (:meth:`laminar.buffer.ExperienceBuffer.sample`), and the first time it hands one out,
    its answer is lost: the trainer's call times out."""

    def __init__(self, batches) -> None:
        super().__init__(batches)
        self.requests: list = []
        self.answer: tuple | None = None
        self.late = True

    def sample(self, n_groups: int, version: int, request=None) -> list[Trajectory] | None:
        self.requests.append(request)
        if request is not None and self.answer is not None and self.answer[0] == request:
            return self.answer[1]
        out = super().sample(n_groups, version)
        if out is not None:
            self.answer = (request, out)
            if self.late:
                self.late = False
                raise TimeoutError("the buffer's answer came too late")
        return out


def test_a_batch_asked_again_after_a_timeout_is_the_same_one(tiny_policy, tmp_path):
    """The trainer's call for a batch timed out after the buffer took it; the buffer
    answered its probe (slow, not lost) and the trainer asked again. It asks under the
    same request id, and gets that batch: it used to ask anew, and the batch taken was
    never trained. Each batch after (stream: two per version) is asked for under an id of
    its own."""
    cfg = with_overrides(CFG, ["trainer.mini_batches=2", "trainer.groups_per_step=4"])
    parts = [groups(i, 2) for i in range(4)]
    buffer, master = LateBuffer(parts), FakeMaster()
    trainer = Trainer(
        cfg, str(tiny_policy), str(tmp_path), InProcess(buffer), InProcess(master), "", STREAM
    )
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and not buffer.late
    assert [h["mini_batches"] for h in trainer.history] == [2.0, 2.0], "a batch was lost"
    asked = [r[1] for r in buffer.requests]
    assert asked[:2] == [0, 0] and asked[2:6] == [1, 2, 3, 4]
    assert len({r[0] for r in buffer.requests}) == 1


def test_the_entropy_and_kl_terms_each_change_the_update_they_are_in(tiny_policy):
    """(tests/test_learner.py's ``test_kl_and_entropy_terms`` compares two updates with
    one, which differ whatever the terms do.) Same batch, one step each: the entropy
    bonus changes the step; the KL to the reference does not on the first step (the
    policy is the reference: k3's gradient is zero there) and does on the second."""
    from laminar.learner import Learner

    def after(overrides: list[str], steps: int) -> dict[str, torch.Tensor]:
        learner = Learner(with_overrides(CFG, overrides), tiny_policy)
        for s in range(steps):
            learner.update(batch(s))
        return weights(learner)

    def close(a, b) -> bool:
        return all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)

    plain1, plain2 = after([], 1), after([], 2)
    assert not close(after(["trainer.entropy_coef=0.05"], 1), plain1)
    assert close(after(["trainer.kl_coef=0.5"], 1), plain1)
    assert not close(after(["trainer.kl_coef=0.5"], 2), plain2)


def test_a_version_reports_the_steps_that_made_it_not_the_skipped_ones(tiny_policy, tmp_path):
    """Two mini-batches, the second non-finite (a NaN reward): the version is the first
    step's, and its record says so — loss and grad norm of that step, half the steps
    skipped — instead of a NaN mean over both. Alike in a stream update."""
    from laminar.learner import Learner

    cfg = with_overrides(CFG, ["trainer.mini_batches=2", "trainer.groups_per_step=2"])
    good, bad = groups(0, 1), batch(1, groups=1, size=2, nan=True)
    alone = Learner(with_overrides(cfg, ["trainer.mini_batches=1"]), tiny_policy).update(good)
    metrics = Learner(cfg, tiny_policy).update(good + bad)
    assert metrics["applied_steps"] == 1 and metrics["skipped"] == 0.5
    for k in ("loss", "pg_loss", "grad_norm", "clip_frac"):
        assert metrics[k] == pytest.approx(alone[k], rel=1e-5), k

    trainer, buffer, _ = make(tiny_policy, tmp_path, cfg, STREAM, [good, bad])
    run_until_starved(trainer, buffer)
    (record,) = trainer.history
    assert record["applied_steps"] == 1 and record["skipped"] == 0.5
    for k in ("loss", "pg_loss", "grad_norm", "clip_frac"):
        assert record[k] == pytest.approx(alone[k], rel=1e-5), k


@pytest.mark.parametrize("spec", [LAMINAR, STREAM], ids=["laminar", "stream"])
def test_updates_skipped_in_a_row_fail_the_trainer_with_the_fix(tiny_policy, tmp_path, spec):
    """A learning rate that blows the weights up (AdamW's first step at 1e25) makes every
    later update non-finite. Each was skipped, its batch consumed, the version left as it
    was: the trainer ate the buffer forever, published nothing, and its heartbeat kept
    ticking. After trainer.max_skipped_updates_in_a_row in a row it fails instead, its
    error (what the driver reports, stats()["error"]) naming the last loss and grad norm
    and the fix, and it consumes no batch after."""
    settings = ["trainer.lr=1e25", "trainer.max_skipped_updates_in_a_row=2"]
    if spec is STREAM:
        settings += ["trainer.mini_batches=2", "trainer.groups_per_step=2"]
        parts = [groups(i, 1) for i in range(10)]
    else:
        settings += ["trainer.groups_per_step=2"]
        parts = [groups(i, 2) for i in range(5)]
    cfg = with_overrides(CFG, settings)
    trainer, buffer, master = make(tiny_policy, tmp_path, cfg, spec, parts)
    trainer.start()
    trainer._thread.join(60)
    done = trainer.stats()["done"]
    stats = trainer.stop(timeout=60)  # (without the limit, it would go on forever)
    assert done, "the trainer went on consuming batches it could not train on"
    assert master.order == [0, 1] and buffer.skipped == 2
    assert stats["skipped_updates"] == [1, 1]
    assert len(buffer.batches) == len(parts) - (6 if spec is STREAM else 3)
    last = stats["error"].strip().splitlines()[-1]
    assert last.startswith("laminar.trainer.NonFiniteUpdates: 2 updates in a row skipped")
    for named in ("loss=", "grad_norm=nan", "trainer.lr (now 1e+25)", "(now 2)"):
        assert named in last, named


def test_the_count_of_skipped_updates_in_a_row_is_validated():
    from laminar.errors import ConfigError

    with pytest.raises(ConfigError, match="max_skipped_updates_in_a_row"):
        with_overrides(CFG, ["trainer.max_skipped_updates_in_a_row=0"])


def test_a_rank_whose_update_raises_leaves_the_group_with_rank_0(tiny_policy, tmp_path):
    """A data-parallel rank whose part of an update raises (the ranks agree on it, and
    rank 0's trainer stops) still meets rank 0's stop: rank 0 leaves the group at once,
    where it used to wait for the group's collective timeout (60 s here) before it could
    checkpoint and say it was done."""
    import json

    from learner_cases import run_ranks, trainer_rank_case

    exits = run_ranks(trainer_rank_case, str(tiny_policy), str(tmp_path))
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["raised"] == "RankStepFailed"
    assert r1["done"] and "IndexError" in r1["error"], r1
    assert r0["stop_s"] < 20, r0  # (the group's timeout is 60 s)
    assert exits == [0, 0]


@pytest.mark.parametrize(
    ("error", "fails_the_run"),
    [
        (OSError(28, "No space left on device"), False),
        # (torch.save's zip writer on a full disk: it names no disk error)
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
            False,
        ),
        (ValueError("a bug, not the disk"), True),
    ],
    ids=["oserror", "torch_save", "not_the_disk"],
)
def test_a_checkpoint_the_disk_refuses_is_removed_and_the_run_goes_on(
    tiny_policy, tmp_path, caplog, error, fails_the_run
):
    """A checkpoint whose write failed on a full disk failed the run and left its
    ``.version-N.partial`` folder (a model and its optimizer: gigabytes) that nothing
    removed. The folder is removed, a warning names the error and the folder, the newest
    checkpoint stands and the run goes on: the next checkpoint is written. Another error
    still fails the run (its folder removed too). A partial folder a killed trainer left
    is removed as the next one starts."""
    import logging

    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=1"])
    folder = tmp_path / "checkpoints"
    stale = folder / ".version-000007.partial"
    stale.mkdir(parents=True)
    (stale / "optimizer.pt").write_bytes(b"\0" * 4096)
    trainer, buffer, master = make(tiny_policy, tmp_path, cfg, batches=[groups(0, 2), groups(1, 2)])
    real = trainer.learner.save

    def full(out):  # version 1's write fails part-way
        if trainer.version != 1:
            return real(out)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"\0" * 4096)
        raise error

    trainer.learner.save = full
    with caplog.at_level(logging.INFO, logger="laminar"):
        if fails_the_run:  # (it never asks for another batch)
            trainer.start()
            trainer._thread.join(60)
            stats = trainer.stats()
        else:
            stats = run_until_starved(trainer, buffer)
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".partial")]
    assert not (folder / "version-000001").exists()
    assert f"removed {stale}" in caplog.text
    if fails_the_run:
        assert "a bug, not the disk" in stats["error"] and master.order == [0, 1]
        return
    assert stats["error"] is None and master.order == [0, 1, 2]
    (warning,) = [r for r in caplog.records if "no checkpoint at version 1" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert str(error) in warning.getMessage()
    assert str(folder / ".version-000001.partial") in warning.getMessage()
    assert stats["checkpoint"].endswith("version-000002")
    assert same(checkpoint_weights(stats["checkpoint"]), master.versions[2])


@pytest.mark.parametrize("weights", ["relay", "global", "colocated"])
def test_a_paced_publication_holds_before_its_copy_so_no_rollout_loads_it_early(weights):
    """Paced (trainer.pacing), a version exists for the rollouts only once its modelled
    movement is over. A global broadcast and a colocated switch were held before the
    real copy; a relay publication after it, so a rollout could pull a version up to
    trainer.pacing.publish_s modelled early (helper 149's review)."""
    from types import SimpleNamespace

    from laminar.config_sections import TrainerPacingConfig
    from laminar.trainer_publish import PublicationMixin

    pacing = TrainerPacingConfig()
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(pacing=pacing), rollout=SimpleNamespace(replicas=4)
    )
    said: list[str] = []
    trainer = SimpleNamespace(
        cfg=cfg,
        clock=object(),  # (paced)
        spec=SimpleNamespace(weights=weights),
        publish=lambda: said.append("copy"),
        _hold=lambda t0, modelled_s, what: said.append(f"hold {what}"),
    )
    PublicationMixin._move_weights(trainer)
    assert said[-1] == "copy" and len(said) == 2 and said[0].startswith("hold "), said


class RebuiltBuffer(FakeBuffer):
    """A rebuilt buffer that still waits for its rollout to send again what the trainer
    consumed from the lost one before its store had it: the first batch's trajectories
    (:meth:`laminar.buffer.ExperienceBuffer.sync` ``consumed_unstored``)."""

    def __init__(self, batches) -> None:
        super().__init__(batches)
        self.unstored = {t.uid for t in batches[0]}
        self.consumed: dict[str, tuple[int, float]] = {}

    def sample(self, n_groups: int, version: int, request=None) -> list[Trajectory] | None:
        out = super().sample(n_groups, version, request)
        for t in out or []:
            if t.uid in self.unstored:
                self.consumed[t.uid] = (version, time.time())
        return out

    def sync(self) -> dict:
        return {"written": 0, "consumed_unstored": dict(self.consumed)}


def test_a_checkpoint_keeps_in_the_record_what_the_store_still_lacks(tiny_policy, tmp_path):
    """A checkpoint drops from the trainer's record what the store has (sampled before its
    version), but not what a rebuilt buffer still waits to store consumed: dropped, a
    second data-module loss before it arrived rebuilt from a record without it, and the
    trajectory was admitted as new (its group never complete, or trained twice)."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=1"])
    parts = [groups(0, 2), groups(1, 2), groups(2, 2)]
    first = {t.uid for t in parts[0]}
    buffer = RebuiltBuffer(parts)
    args = (str(tmp_path), InProcess(buffer), InProcess(FakeMaster()), "", LAMINAR)
    trainer = Trainer(cfg, str(tiny_policy), *args)
    stats = run_until_starved(trainer, buffer)
    assert stats["error"] is None and stats["checkpoint"].endswith("version-000003")
    record = trainer.consumed_record()
    assert record["since"] == 3  # (the final checkpoint's version)
    assert first <= set(record["consumed"])
    assert all(record["consumed"][u][0] == 0 for u in first)


def test_a_restarted_trainer_begins_its_record_with_what_the_buffer_still_waits_for(
    tiny_policy, tmp_path
):
    """A trainer restarted within the run (after the lost one published up to 5, from its
    checkpoint at 3) begins its consumed record with what the rebuilt buffer still waits
    to store consumed (the buffer's answer to the restart), and counts it from its
    checkpoint's version, not from the 5 it numbers after: a data module lost before its
    first checkpoint rebuilds from this record (storage.resume.plan_rebuild). With an
    empty record from 5, it admitted those trajectories as new when sent again and their
    group was trained twice (helper 183)."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=1"])
    buffer = FakeBuffer([groups(0, 2), groups(1, 2), groups(2, 2)])
    args = (str(tmp_path), InProcess(buffer), InProcess(FakeMaster()), "", LAMINAR)
    first = Trainer(cfg, str(tiny_policy), *args)
    ckpt = run_until_starved(first, buffer)["checkpoint"]
    assert ckpt.endswith("version-000003")
    unstored = {"p9-0": (1, 123.0), "p9-1": (1, 123.5)}  # (consumed at 1, never stored)
    restarted = Trainer(
        with_overrides(cfg, [f"trainer.resume_from={ckpt}"]),
        str(tiny_policy),
        *args,
        after_version=5,
        consumed=unstored,
    )
    assert restarted.version == 5
    assert restarted.consumed_record() == {"consumed": unstored, "since": 3, "version": 5}
