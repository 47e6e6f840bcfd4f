"""The learner: exact resume, data-parallel ranks, mini-batches, non-finite updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_cases import CFG, batch, rank_main, run_ranks, weights

from laminar.config import with_overrides
from laminar.contract import Trajectory
from laminar.learner import (
    CheckpointError,
    Learner,
    check_checkpoint,
    newest_checkpoint,
    step_means,
)


def test_resume_from_a_checkpoint_is_bit_identical(tiny_policy, tmp_path):
    straight = Learner(CFG, tiny_policy)
    for s in range(4):
        straight.update(batch(s))
    first = Learner(CFG, tiny_policy)
    for s in range(2):
        first.update(batch(s))
    ckpt = first.save(tmp_path / "version-000002")
    resumed = Learner(CFG, tiny_policy, resume_from=ckpt)
    assert resumed.version == 2
    for s in range(2, 4):
        resumed.update(batch(s))
    assert resumed.version == straight.version == 4
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    for pid, st in sa["state"].items():
        assert all(torch.equal(st[k], sb["state"][pid][k]) for k in st)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(tiny_policy, tmp_path):
    from laminar.model import build_tiny_policy

    ckpt = Learner(CFG, tiny_policy).save(tmp_path / "ckpt")
    said = r"trainer.weight_decay: checkpoint 0.0, now 0.1.*trainer.lr alone may change"
    with pytest.raises(CheckpointError, match=said):
        Learner(with_overrides(CFG, ["trainer.weight_decay=0.1"]), tiny_policy, resume_from=ckpt)
    wide = build_tiny_policy(tmp_path / "wide", hidden_size=64, num_heads=4)
    with pytest.raises(CheckpointError, match=r"another model \(hidden_size: checkpoint 128"):
        Learner(CFG, wide, resume_from=ckpt)
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks \['optimizer.pt'\]"):
        Learner(CFG, tiny_policy, resume_from=ckpt)


def test_the_newest_checkpoint_is_the_highest_version_not_a_folder_set_aside(tmp_path):
    """A damaged checkpoint the user renamed aside (as our error says to) is not resumed
    from again, and versions compare as numbers (past the six digits of the name)."""
    ck = tmp_path / "checkpoints"
    for name in ["version-000009", "version-000014.damaged", "version-000010", "version-x"]:
        (ck / name).mkdir(parents=True)
    assert newest_checkpoint(tmp_path) == ck / "version-000010"
    (ck / "version-1000000").mkdir()
    (ck / "version-999999").mkdir()
    assert newest_checkpoint(tmp_path) == ck / "version-1000000"
    assert newest_checkpoint(tmp_path / "nowhere") is None


def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_weights_load(
    tiny_policy, tmp_path
):
    """The pre-start check reads config.json and the safetensors header (not the
    tensors): garbage in either is a CheckpointError naming the file and the fix."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(tiny_policy)
    ckpt = Learner(CFG, tiny_policy).save(tmp_path / "version-000000")
    assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0
    good = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"config.json' is damaged.*move this one aside"):
        check_checkpoint(ckpt, model_config, CFG)
    (ckpt / "config.json").write_text(good)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model.safetensors' is damaged.*move this one"):
        check_checkpoint(ckpt, model_config, CFG)
    with pytest.raises(CheckpointError, match=r"model.safetensors' is damaged"):
        Learner(CFG, tiny_policy, resume_from=ckpt)
    # the optimizer's and RNG's files: torch.save's zips, their directories read
    ckpt = Learner(CFG, tiny_policy).save(tmp_path / "version-000001")
    for name in ("optimizer.pt", "rng.pt"):
        good = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(good[: len(good) // 2])  # (cut short: no directory)
        with pytest.raises(CheckpointError, match=rf"{name}' is damaged.*move this one"):
            check_checkpoint(ckpt, model_config, CFG)
        (ckpt / name).write_bytes(good)
    assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0


def test_a_non_finite_update_is_skipped_and_counted(tiny_policy):
    learner = Learner(CFG, tiny_policy)
    before = weights(learner)
    metrics = learner.update(batch(0, nan=True))
    assert metrics["skipped"] == 1 and metrics["applied_steps"] == 0
    assert learner.version == 0 and learner.skipped_steps == 1
    after = weights(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not learner.optimizer.state  # AdamW's moments untouched too
    learner.update(batch(1))
    assert learner.version == 1


def test_mini_batches_take_several_steps_for_one_version(tiny_policy):
    learner = Learner(with_overrides(CFG, ["trainer.mini_batches=2"]), tiny_policy)
    metrics = learner.update(batch(0))
    assert metrics["applied_steps"] == 2 and learner.version == 1
    steps = {int(s["step"]) for s in learner.optimizer.state_dict()["state"].values()}
    assert steps == {2}


@pytest.mark.parametrize(
    "agg, correction",
    [("token-mean", "none"), ("seq-mean-token-sum", "tis"), ("seq-mean-token-mean", "decoupled")],
)
def test_a_versions_metrics_are_those_of_its_whole_batch(tiny_policy, agg, correction):
    """Split into mini-batches of unequal tokens (2, 1 and 1 groups), a version reports
    the metrics of its whole batch, as one step over it would: per-token ones weighted by
    each step's loss tokens, the aggregated losses by tokens or sequences as ``agg``
    weighs them, ``logprob_diff_max`` the batch's maximum, not a mean of the steps'. (A
    learning rate of 1e-12 leaves the weights as they were between the steps.)"""
    overrides = [
        "trainer.lr=1e-12", f"trainer.loss_agg={agg}", f"trainer.correction={correction}",
        "trainer.kl_coef=0.1", "trainer.entropy_coef=0.01",
    ]  # fmt: skip
    if correction != "tis":
        overrides.append("trainer.clip_c=3")  # (dual_clip_frac)
    cfg = with_overrides(CFG, overrides)
    data = batch(0)
    whole = Learner(cfg, tiny_policy).update(data)
    split = Learner(with_overrides(cfg, ["trainer.mini_batches=3"]), tiny_policy).update(data)
    assert split["mini_batches"] == split["applied_steps"] == 3
    per_step = {"grad_norm", "mini_batches", "applied_steps"}
    assert set(split) == set(whole)
    keys = sorted(set(whole) - per_step)
    assert {"logprob_diff_max", "logprob_diff_mean", "loss", "kl_ref", "adv_abs_mean"} <= set(keys)
    # (the clip binds under none; decoupled's proximal policy is the weights themselves)
    assert whole["clip_frac" if correction == "none" else "is_weight_mean"] > 0
    want = {k: pytest.approx(whole[k], rel=1e-5, abs=1e-7) for k in keys}
    assert {k: split[k] for k in keys} == want
    if correction == "decoupled":
        return  # (the stream schedule's parts, below, refuse it)
    # The stream schedule's way: one part at a time, combined by the trainer's call.
    cfg = with_overrides(cfg, ["trainer.mini_batches=3"])
    learner, uids = Learner(cfg, tiny_policy), list(dict.fromkeys(x.prompt_uid for x in data))
    parts = [[x for x in data if x.prompt_uid in uids[a:b]] for a, b in ((0, 2), (2, 3), (3, 4))]
    steps = [learner.update_part(part, last=i == 2) for i, part in enumerate(parts)]
    streamed = step_means(
        [{k: v for k, v in m.items() if k != "applied_steps"} for m in steps], agg
    )
    assert {k: streamed[k] for k in keys} == want


def test_a_bad_group_or_row_in_a_later_mini_batch_fails_before_any_step(tiny_policy):
    """The whole batch is checked before its first optimizer step: a group short of a
    trajectory, or an empty prompt, in the last mini-batch fails the update with the
    weights and the optimizer as they were, not after the first step moved them."""
    from dataclasses import replace

    from laminar.errors import LaminarError

    learner = Learner(with_overrides(CFG, ["trainer.mini_batches=2"]), tiny_policy)
    before = weights(learner)
    short = batch(0)[:-1]
    empty = batch(0)
    empty[-1] = replace(empty[-1], prompt_tokens=np.zeros(0, np.int32))
    for bad, message in ((short, r"group 's0g3': 3 of its 4"), (empty, r"empty prompt")):
        with pytest.raises(LaminarError, match=message):
            learner.update(bad)
        after = weights(learner)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not learner.optimizer.state and learner.version == 0


def test_a_group_with_a_sample_twice_and_one_missing_is_refused_by_name(tiny_policy):
    """A group of 4 holding sample 0 twice and no sample 3 has 4 rows: counting rows,
    the check passed it, and the update trained one draw twice with advantages from the
    wrong rewards. The samples must be 0..3 once each; the error names the group, the
    sample twice and the one missing, before any weight moves (a stream update's part
    too)."""
    from dataclasses import replace

    from laminar.errors import LaminarError
    from laminar.learner import check_groups

    data = batch(0)
    group = [x for x in data if x.prompt_uid == "s0g1"]
    assert sorted(x.sample_idx for x in group) == [0, 1, 2, 3]
    bad = [replace(x, uid="s0g1-0b", sample_idx=0) if x is group[3] else x for x in data]
    check_groups(data)
    learner = Learner(CFG, tiny_policy)
    before = weights(learner)
    said = r"group 's0g1': .*sample_idx \[0\] more than once, \[3\] missing"
    for update in (learner.update, lambda b: learner.update_part(b, last=True)):
        with pytest.raises(LaminarError, match=said):
            update(bad)
    after = weights(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not learner.optimizer.state and learner.version == 0
    outside = [replace(x, sample_idx=7) if x is group[3] else x for x in data]
    with pytest.raises(LaminarError, match=r"group 's0g1': .*\[3\] missing, \[7\] outside"):
        check_groups(outside)


def test_two_ranks_train_the_same_weights_as_one(tiny_policy, tmp_path):
    """Two gloo ranks, each computing half of every batch, end where one rank does."""
    assert run_ranks(rank_main, 2, str(tiny_policy), str(tmp_path)) == [0, 0]
    single = Learner(CFG, tiny_policy)
    for s in range(3):
        single.update(batch(s))
    one = weights(single)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # ranks agree exactly
    # vs one rank: the gradients differ by fp32 summation order only. Adam divides by
    # sqrt(v): a weight whose gradient is zero up to rounding steps by about lr either
    # way, so a few weights may differ by up to 2·lr a step (seen: 1.1e-4 after 3 steps
    # of 1e-3); 99.9% agree within 1e-6, and the two policies compute the same logprobs.
    worst = max(float((r0[k] - one[k]).abs().max()) for k in one)
    assert worst <= 2 * 3 * CFG.trainer.lr
    off = sum(int(((r0[k] - one[k]).abs() > 1e-6).sum()) for k in one)
    assert off < 1e-3 * sum(v.numel() for v in one.values())
    ranked = Learner(CFG, tiny_policy)
    ranked.model.load_state_dict(r0)
    seen = [t for s in range(3) for t in batch(s)]
    gap = np.abs(np.concatenate(ranked.logprobs(seen)) - np.concatenate(single.logprobs(seen)))
    assert gap.max() < 1e-4
    assert any(
        not torch.equal(one[k], Learner(CFG, tiny_policy).model.state_dict()[k]) for k in one
    )  # and training did move the weights


def on_policy(learner: Learner, trajs: list[Trajectory]) -> list[Trajectory]:
    """The batch with behavior logprobs replaced by the learner's own (fresh data)."""
    for t, lp in zip(trajs, learner.logprobs(trajs), strict=True):
        t.behavior_logprobs = lp.astype(np.float32)
    return trajs


def test_corrections_agree_on_fresh_data_and_differ_on_stale(tiny_policy):
    """On-policy, the paper's loss, truncated IS and decoupled PPO give the same update
    (every ratio and weight is 1); on stale data they differ."""
    results = {}
    for correction in ("none", "tis", "decoupled"):
        cfg = with_overrides(CFG, [f"trainer.correction={correction}"])
        fresh = Learner(cfg, tiny_policy)
        fresh.update(on_policy(fresh, batch(0)))
        stale = Learner(cfg, tiny_policy)
        m = stale.update(batch(0))  # behavior logprobs unrelated to the policy
        results[correction] = (weights(fresh), weights(stale), m)
    ref_fresh, ref_stale, _ = results["none"]
    for correction in ("tis", "decoupled"):
        fresh, stale, metrics = results[correction]
        assert max(float((fresh[k] - ref_fresh[k]).abs().max()) for k in fresh) < 1e-6
        assert max(float((stale[k] - ref_stale[k]).abs().max()) for k in stale) > 1e-5
        assert 0 < metrics["is_weight_mean"] <= 2.0


def test_decoupled_ppo_keeps_the_proximal_policy_across_mini_batches(tiny_policy):
    """With two optimizer steps per batch, the second step's proximal policy is still the
    weights before the first: on fresh data its importance weights are exactly 1."""
    cfg = with_overrides(CFG, ["trainer.correction=decoupled", "trainer.mini_batches=2"])
    learner = Learner(cfg, tiny_policy)
    metrics = learner.update(on_policy(learner, batch(0)))
    assert metrics["applied_steps"] == 2
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # the policy did move


def test_kl_and_entropy_terms(tiny_policy):
    cfg = with_overrides(CFG, ["trainer.kl_coef=0.5", "trainer.entropy_coef=0.01"])
    learner = Learner(cfg, tiny_policy)
    first = learner.update(batch(0))
    second = learner.update(batch(1))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the policy *is* the reference
    assert second["kl_ref"] > 0 and first["entropy"] > 0
    # (that each term changes the update it is in: tests/test_trainer.py)


def test_the_rank_group_backend_follows_the_learners_tensors(tiny_policy):
    """The ranks' group reduces the learner's gradients, so its backend is chosen by
    where they live (the CPU: gloo), not by the host: on a GPU node NCCL would refuse
    them at the first all-reduce."""
    from laminar.trainer import LEARNER_DEVICE, group_backend

    device = next(Learner(CFG, tiny_policy).model.parameters()).device
    assert device == torch.device(LEARNER_DEVICE)
    assert group_backend(device) == "gloo"
    assert group_backend("cuda:0") == "nccl" and group_backend(torch.device("cpu")) == "gloo"


def test_advantages_are_divided_by_the_group_std_unless_told_not_to(tiny_policy):
    """trainer.norm_adv_by_std=false (Dr. GRPO): the advantage is r - group mean."""
    data = batch(0)
    rewards = np.array([x.reward for x in data]).reshape(4, 4)  # (4 groups of 4, in order)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    scaled = centred / (rewards.std(axis=1, keepdims=True) + 1e-6)
    for setting, want in (("true", scaled), ("false", centred)):
        cfg = with_overrides(CFG, [f"trainer.norm_adv_by_std={setting}"])
        metrics = Learner(cfg, tiny_policy).update(data)
        assert metrics["adv_abs_mean"] == pytest.approx(np.abs(want).mean(), rel=1e-6)
    assert np.abs(scaled).mean() != pytest.approx(np.abs(centred).mean())  # (tells them apart)


def test_a_checkpoint_folder_reaches_the_disk_before_its_name(tiny_policy, tmp_path, monkeypatch):
    """The trainer writes a checkpoint aside and renames it into place: without an fsync
    of its files (and folders) first, a crash (power, a node lost) could leave the name
    pointing at files the disk never got, which a resume then loads. On CPU its RNG state
    holds no GPU's (``cuda`` None), and a checkpoint without the key still restores."""
    import os

    from laminar import files

    folder = Learner(CFG, tiny_policy).save(tmp_path / "aside")
    synced: set[str] = set()
    fsync = os.fsync

    def recorded(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(files.os, "fsync", recorded)
    files.sync_tree(folder)
    written = {str(p.resolve()) for p in folder.rglob("*")}
    assert written and written | {str(folder.resolve())} <= synced
    rng = torch.load(folder / "rng.pt", weights_only=False)
    assert "cuda" in rng and rng["cuda"] is None
    del rng["cuda"]  # (written before the GPUs' state was kept)
    torch.save(rng, folder / "rng.pt")
    (folder / "manifest.json").unlink()  # (and before manifests: its rng.pt is not as listed)
    Learner(CFG, tiny_policy, resume_from=folder)


def test_rewards_train_as_stored_so_a_group_trains_alike_after_a_resume(tiny_policy):
    """Rewards 1000.0 and 1000.00001 are one float32 (the store's type, which the
    buffer's no-signal filter and a resumed run read): the group has no signal there,
    so it has none here either (advantages exactly 0), rather than ±0.83 before a
    resume and 0 after it."""
    from dataclasses import replace

    data = batch(0)
    siblings = [x for x in data if x.prompt_uid == data[0].prompt_uid]
    flat = [replace(x, reward=1000.0 + 1e-5 * (i % 2)) for i, x in enumerate(siblings)]
    metrics = Learner(CFG, tiny_policy).update(flat)
    assert metrics["adv_abs_mean"] == 0.0


def test_a_checkpoint_keeps_the_trainer_restarts_and_an_older_one_reads_none(
    tiny_policy, tmp_path, caplog
):
    """``trainer_state.json`` records the run's trainer restarts (V, M), in order, for a
    resumed run's buffer to count staleness along the weights' lineage; a learner resumed
    from it keeps them for its own checkpoints. One written before the field existed
    loads with none, said at INFO, not refused."""
    import json
    import logging

    from laminar.files import write_manifest
    from laminar.learner import checkpoint_restarts
    from laminar.prompt_pool import DATA_STATE

    first = Learner(CFG, tiny_policy)
    first.restarts = [(0, 2), (0, 5), (4, 7)]
    first.update(batch(0))
    ckpt = first.save(tmp_path / "version-000001")
    assert Learner(CFG, tiny_policy, resume_from=ckpt).restarts == [(0, 2), (0, 5), (4, 7)]
    assert checkpoint_restarts(ckpt) == [(0, 2), (0, 5), (4, 7)]

    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["restarts"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt, leave_out=(DATA_STATE,))
    with caplog.at_level(logging.INFO, logger="laminar.learner"):
        assert Learner(CFG, tiny_policy, resume_from=ckpt).restarts == []
    assert "records no trainer restarts" in caplog.text

    state["restarts"] = [[0, "two"]]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint_restarts(ckpt)


def _perturbed(learner: Learner, trajs: list[Trajectory], seed: int = 0) -> list[Trajectory]:
    """The batch with behavior logprobs the learner's own moved by ±0.5 at random: every
    ratio is e^±0.5 (1.65 or 0.61), on both sides of any clip range below 0.6."""
    rng = np.random.default_rng(seed)
    for t, lp in zip(trajs, learner.logprobs(trajs), strict=True):
        t.behavior_logprobs = (lp + rng.choice([-0.5, 0.5], size=lp.shape)).astype(np.float32)
    return trajs


def test_the_clip_and_cap_settings_reach_the_loss_each_on_its_own_side(tiny_policy):
    """Each of ``clip_low``, ``clip_high``, ``clip_c`` and ``is_cap`` is read by the loss
    as what it names: a learner that swapped the clip sides, dropped dual-clip or ignored
    the cap passed every other test."""

    def first_step(*overrides: str) -> dict[str, float]:
        learner = Learner(with_overrides(CFG, list(overrides)), tiny_policy)
        return learner.update(_perturbed(learner, batch(0)))

    low_only = first_step("trainer.clip_low=0.1", "trainer.clip_high=10", "trainer.clip_c=null")
    assert low_only["clip_frac_low"] > 0 and low_only["clip_frac_high"] == 0
    high_only = first_step("trainer.clip_low=0.9", "trainer.clip_high=0.1", "trainer.clip_c=null")
    assert high_only["clip_frac_high"] > 0 and high_only["clip_frac_low"] == 0
    assert high_only["dual_clip_frac"] == 0
    # dual-clip: a negative-advantage token whose ratio (1.65) is above clip_c
    assert first_step("trainer.clip_c=1.5")["dual_clip_frac"] > 0
    assert first_step("trainer.clip_c=2.0")["dual_clip_frac"] == 0
    # the cap: weights e^±0.5, so a cap of 1.2 truncates about half, one of 2 none
    capped = first_step("trainer.correction=tis", "trainer.is_cap=1.2")
    assert 0.25 < capped["is_weight_capped_frac"] < 0.75
    assert first_step("trainer.correction=tis", "trainer.is_cap=2.0")["is_weight_capped_frac"] == 0


def test_an_update_raises_the_responses_above_their_groups_mean_and_lowers_those_below(
    tiny_policy,
):
    """One update on fresh data: a response rewarded above its group's mean gets likelier,
    one below less likely (by the mean over each side of the summed logprob change). With
    the advantages' sign flipped, only two tests failed, and by accident."""
    learner = Learner(CFG, tiny_policy)
    trajs = on_policy(learner, batch(0, groups=4, size=4))
    before = [float(lp.sum()) for lp in learner.logprobs(trajs)]
    learner.update(trajs)
    after = [float(lp.sum()) for lp in learner.logprobs(trajs)]
    means = {}
    for t in trajs:
        means.setdefault(t.prompt_uid, []).append(t.reward)
    up, down = [], []
    for t, b, a in zip(trajs, before, after, strict=True):
        mean = np.mean(means[t.prompt_uid])
        if t.reward != mean:
            (up if t.reward > mean else down).append(a - b)
    assert up and down
    assert np.mean(up) > 0 > np.mean(down)


def test_the_entropy_bonus_raises_the_entropy_and_the_kl_term_pulls_back_to_the_reference(
    tiny_policy,
):
    """The two terms' signs. With every reward equal (no policy gradient) the entropy
    bonus alone moves the policy, and its entropy rises. The KL term, once the policy has
    left the reference, brings it back: three such steps end nearer the reference (k3 on
    the batch's tokens) than three without the term, which drift on their momentum.
    Flipped, each term still changed the update, which was all that was tested."""
    import dataclasses

    flat = [dataclasses.replace(t, reward=1.0) for t in batch(0)]
    learner = Learner(
        with_overrides(CFG, ["trainer.entropy_coef=1.0", "trainer.betas=[0.0,0.999]"]), tiny_policy
    )
    entropies = [learner.update(flat)["entropy"] for _ in range(3)]
    assert entropies[0] < entropies[1] < entropies[2]

    reference = np.concatenate(Learner(CFG, tiny_policy).logprobs(flat))

    def k3_after(kl_coef: float) -> float:
        learner = Learner(with_overrides(CFG, [f"trainer.kl_coef={kl_coef}"]), tiny_policy)
        learner.update(batch(1))  # away from the reference (k3's gradient is 0 on it)
        for _ in range(3):
            learner.update(flat)
        d = reference - np.concatenate(learner.logprobs(flat))
        return float(np.mean(np.exp(d) - d - 1))

    pulled, drifted = k3_after(1.0), k3_after(0.0)
    assert pulled < 0.5 * drifted


def test_mini_batches_are_whole_groups_shuffled_alike_on_every_rank_and_resume():
    """The groups come in the order they finished (short ones first); the split into
    mini-batches is drawn from the seed and the batch's groups, the same wherever and in
    whatever order they are given."""
    from laminar.learner import split_groups

    chunks = [{"g0", "g1"}, {"g2", "g3"}, {"g4", "g5"}, {"g6", "g7"}]
    draws = [split_groups([f"g{i + 8 * b}" for i in range(8)], 4, seed=0) for b in range(20)]
    for b, parts in enumerate(draws):
        uids = {f"g{i + 8 * b}" for i in range(8)}
        assert sorted(len(p) for p in parts) == [2, 2, 2, 2]
        assert set().union(*parts) == uids
    assert split_groups([f"g{i}" for i in range(8)], 4, seed=0) != chunks  # not as given
    assert len({str(sorted(map(sorted, p))) for p in draws}) == 20
    uids = [f"g{i}" for i in range(8)]
    assert split_groups(uids, 4, seed=0) == split_groups(uids[::-1], 4, seed=0)
    assert split_groups(uids, 4, seed=1) != split_groups(uids, 4, seed=0)
    assert split_groups(uids, 1, seed=0) == [set(uids)]


def test_every_rank_splits_a_batch_alike_whatever_version_its_learner_counts(tiny_policy):
    """A trainer restarted within the run renumbers rank 0's learner after the lost
    one's versions; the other ranks, built from the same checkpoint, keep its number. A
    split drawn from the version gave each rank other mini-batches of the broadcast batch
    (their gradients summed across mismatched rows, the weight checksums still equal).
    Learners of one policy, at versions 0 to 4, train one batch to the same weights."""
    cfg = with_overrides(CFG, ["trainer.mini_batches=2"])
    trained = []
    for skipped in range(5):
        learner = Learner(cfg, tiny_policy)
        learner.version += skipped  # (as Trainer does with a restart's skipped versions)
        learner.update(batch(0))
        trained.append(weights(learner))
    for w in trained[1:]:
        assert all(torch.equal(w[k], trained[0][k]) for k in w)


def test_mask_truncated_trains_as_if_the_cut_responses_had_no_loss_tokens(tiny_policy):
    """``trainer.mask_truncated`` (DAPO's overlong filtering): one update equals the one on
    the same batch with the cut responses' loss masks zeroed by hand, and differs from
    the update that trains them; their rewards still count in their groups' advantages."""
    import dataclasses

    trajs = batch(0)
    cut = {t.uid for t in trajs[::3]}
    marked = [dataclasses.replace(t, finish_reason="length") if t.uid in cut else t for t in trajs]
    zeroed = [
        dataclasses.replace(t, loss_mask=np.zeros_like(t.loss_mask)) if t.uid in cut else t
        for t in trajs
    ]

    def after(cfg, data) -> dict[str, torch.Tensor]:
        learner = Learner(cfg, tiny_policy)
        learner.update(data)
        return weights(learner)

    masked = after(with_overrides(CFG, ["trainer.mask_truncated=true"]), marked)
    by_hand = after(CFG, zeroed)
    trained = after(CFG, marked)
    assert all(torch.equal(masked[k], by_hand[k]) for k in masked)
    assert not all(torch.equal(masked[k], trained[k]) for k in masked)


def test_a_resume_may_lower_the_learning_rate_keeping_the_moments(tiny_policy, tmp_path, caplog):
    """Lowering the learning rate of a run that went unstable is a resume's commonest
    change; it was refused ("set them to the checkpoint's values") with no route, a new
    run from the checkpoint too. Now the run goes on at the new rate, AdamW's moments as
    they were, and the start says so. (The optimizer's state holds the checkpoint's
    rate: loaded as it was, the new one would have been ignored.)"""
    import logging

    first = Learner(CFG, tiny_policy)
    first.update(batch(0))
    ckpt = first.save(tmp_path / "version-000001")
    lower = with_overrides(CFG, ["trainer.lr=1e-4"])
    with caplog.at_level(logging.INFO, logger="laminar.learner"):
        resumed = Learner(lower, tiny_policy, resume_from=ckpt)
    assert "trainer.lr: checkpoint 0.001, now 0.0001: the run goes on" in caplog.text
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [1e-4]
    sa, sb = first.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[p][k], sb[p][k]) for p in sa for k in sa[p])
    # one step at each rate from the same state: the lower moves the weights less
    same = Learner(CFG, tiny_policy, resume_from=ckpt)
    before = weights(same)
    same.update(batch(1))
    resumed.update(batch(1))
    moved = lambda w: sum(float((w[k] - before[k]).abs().sum()) for k in w)  # noqa: E731
    assert 0 < moved(weights(resumed)) < 0.5 * moved(weights(same))
