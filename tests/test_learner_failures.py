"""The learner's edge cases: a failing data-parallel rank, degenerate rows, masked tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from learner_cases import failing_rank_main, run_ranks


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.correction=decoupled", "trainer.mini_batches=2"]],
    ids=["in-the-step", "in-the-proximal-pass"],
)
def test_a_rank_that_fails_its_update_fails_every_rank_at_once(tiny_policy, tmp_path, overrides):
    """One rank's forward raises (in its part of the step, or in decoupled PPO's proximal
    pass before the steps): the other learns of it at once (an error that names the
    rank), not after the group's collective timeout (60 s here); no rank took a step, so
    the group trains on in step."""
    exits = run_ranks(failing_rank_main, 2, str(tiny_policy), str(tmp_path), overrides)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1["raised"] == "IndexError"  # its own error, as it was
    assert r0["raised"] == "RankStepFailed", r0
    assert "rank 1" in r0["message"]
    assert r0["t"] - r1["t"] < 20  # (the group's timeout is 60 s)
    assert exits == [0, 0]
    assert r0["version"] == r1["version"] == 1
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_a_micro_batch_of_one_token_prompts_with_empty_responses(tiny_policy):
    """Rows of a 1-token prompt and no response are a micro-batch of their own (the
    shortest): their logprobs are empty, and a step with them trains the other rows."""
    from laminar.model import load_policy
    from laminar.update import grpo_step, trajectory_logprobs

    model, tok = load_policy(tiny_policy)
    prompts = [np.array([5]), np.array([6]), np.array([7, 8, 9])]
    responses = [np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([10, 11])]
    lps = trajectory_logprobs(
        model, prompts, responses, pad_token_id=tok.pad_token_id, micro_batch_tokens=2
    )
    assert [len(x) for x in lps] == [0, 0, 2] and np.isfinite(lps[2]).all()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = grpo_step(
        model,
        opt,
        prompts,
        responses,
        [np.full(len(r), -5.0, np.float32) for r in responses],
        [np.ones(len(r), np.uint8) for r in responses],
        torch.tensor([0.0, 0.0, 1.0]),
        torch.tensor([0, 0, 0]),
        pad_token_id=tok.pad_token_id,
        clip_low=0.2,
        clip_high=0.28,
        micro_batch_tokens=2,
    )
    assert m["skipped"] == 0 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_empty_prompt_is_refused_naming_the_row(tiny_policy):
    """No logits predict the first response token of an empty prompt: a clear error,
    not an index error from deep inside the gather."""
    from laminar.errors import LaminarError
    from laminar.model import load_policy
    from laminar.update import trajectory_logprobs

    model, tok = load_policy(tiny_policy)
    with pytest.raises(LaminarError, match=r"row 1 has an empty prompt"):
        trajectory_logprobs(
            model,
            [np.array([5]), np.zeros(0, np.int32)],
            [np.array([6]), np.array([7, 8])],
            pad_token_id=tok.pad_token_id,
        )


def test_a_step_with_a_masked_nan_behavior_logprob_is_taken_and_its_metrics_finite(
    tiny_policy,
):
    """A tool token (loss mask 0) without an engine logprob (NaN) neither skips the step
    nor makes a metric NaN."""
    from laminar.model import load_policy
    from laminar.update import grpo_step

    model, tok = load_policy(tiny_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = grpo_step(
        model,
        opt,
        [np.array([5, 6]), np.array([5, 6])],
        [np.array([7, 8, 9]), np.array([10, 11])],
        [np.array([-4.0, np.nan, -4.0], np.float32), np.array([-4.0, -4.0], np.float32)],
        [np.array([1, 0, 1], np.uint8), np.array([1, 1], np.uint8)],
        torch.tensor([1.0, 0.0]),
        torch.tensor([0, 0]),
        pad_token_id=tok.pad_token_id,
        clip_low=0.2,
        clip_high=0.28,
    )
    assert m["skipped"] == 0
    assert all(np.isfinite(v) for v in m.values()), m


def _two_responses(tiny_policy):
    """The tiny policy and a packed batch of two short responses to two prompts."""
    from laminar.model import load_policy
    from laminar.update import pack

    model, tok = load_policy(tiny_policy)
    batch = pack(
        [np.array([1, 5, 6]), np.array([1, 7])],
        [np.array([8, 9]), np.array([10, 11, 12])],
        [np.zeros(2, np.float32), np.zeros(3, np.float32)],
        [np.ones(2, np.uint8), np.ones(3, np.uint8)],
        tok.pad_token_id,
    )
    return model, batch


def test_entropy_at_a_vanishing_temperature_is_zero_not_nan(tiny_policy):
    """At T -> 0 every token but the argmax has logprob -inf: its term of the entropy is
    0 (p log p -> 0), not 0·(-inf) = NaN, and its gradient is finite."""
    from laminar.update import response_logprobs

    model, batch = _two_responses(tiny_policy)
    _, ent = response_logprobs(model, batch, 1e-39, with_entropy=True)
    assert torch.equal(ent, torch.zeros_like(ent))
    ent.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_loss_without_an_entropy_term_keeps_no_graph_of_it(tiny_policy):
    """``trainer.entropy_coef=0`` (the default): the entropy is still reported, but its
    graph (three ``[B, R, vocab]`` tensors, ~7 GB at 4k tokens of a 152k vocabulary)
    is not kept through the backward pass. The values are the same either way."""
    from laminar.update import response_logprobs

    model, batch = _two_responses(tiny_policy)
    logp, ent = response_logprobs(model, batch, 0.7, with_entropy=True, entropy_grad=False)
    assert logp.requires_grad and not ent.requires_grad
    logp_g, ent_g = response_logprobs(model, batch, 0.7, with_entropy=True)
    assert ent_g.requires_grad
    assert torch.equal(logp.detach(), logp_g.detach()) and torch.equal(ent, ent_g.detach())


def test_a_batch_with_a_partial_group_is_refused_by_name():
    """GRPO's advantages compare a group's rewards: a group trained short would train on
    wrong advantages, silently. It is refused before any weight moves, naming the group.
    The buffer never releases one; a store restored by hand, or a caller of the
    learner, could."""
    from factories import trajectory

    from laminar.errors import LaminarError
    from laminar.learner import check_groups

    whole = [trajectory(f"p0-{i}", "p0", sample_idx=i) for i in range(2)]
    check_groups(whole)
    with pytest.raises(LaminarError, match=r"group 'p0': 1 of its 2 trajectories"):
        check_groups(whole[:1] + [trajectory("p1-0", "p1", group_size=1)])
