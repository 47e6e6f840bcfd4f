import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from laminar.losses import group_advantages, policy_loss

rewards_and_groups = st.integers(1, 6).flatmap(
    lambda n_groups: st.lists(
        st.tuples(st.integers(0, n_groups - 1), st.floats(-10, 10, allow_nan=False)),
        min_size=1,
        max_size=40,
    )
)


@given(rewards_and_groups)
def test_advantages_zero_mean_per_group(rows):
    groups = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    adv = group_advantages(rewards, groups)
    for g in groups.unique():
        assert abs(float(adv[groups == g].mean())) < 1e-4


@given(rewards_and_groups, st.floats(-100, 100, allow_nan=False))
def test_advantages_invariant_to_constant_shift(rows, shift):
    groups = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    a = group_advantages(rewards, groups)
    b = group_advantages(rewards + shift, groups)
    assert torch.allclose(a, b, atol=1e-3)


def test_advantages_normalised_by_group_std():
    adv = group_advantages(
        torch.tensor([0.0, 2.0, 0.0, 0.0, 4.0, 4.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    )
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-5)
    centred = group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([7, 7]), norm_by_std=False)
    assert torch.allclose(centred, torch.tensor([-1.0, 1.0]))


def test_policy_loss_gradient_raises_logprob_of_positive_advantage():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss.backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()  # descent raises row 0


def test_policy_loss_clip_higher_bounds():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    # ratio e^0.5 = 1.65 > 1.28 with a positive advantage: clipped, no gradient.
    logp = torch.full((1, 2), 0.5, requires_grad=True)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert math.isclose(float(loss.detach()), -1.28, rel_tol=1e-6)
    assert m["clip_frac"] == 1.0 and m["clip_frac_high"] == 1.0
    assert torch.all(logp.grad == 0)
    # ratio e^-0.5 = 0.61 < 0.8 with a negative advantage: clipped at 0.8.
    logp = torch.full((1, 2), -0.5, requires_grad=True)
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert math.isclose(float(loss.detach()), 0.8, rel_tol=1e-6) and m["clip_frac_low"] == 1.0


def test_policy_loss_token_mean_ignores_masked_tokens():
    logp = torch.tensor([[0.0, 5.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    loss, _ = policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, 2.0]), mask)
    # three unmasked tokens with ratio 1: -(1 + 2 + 2) / 3
    assert math.isclose(float(loss), -5 / 3, rel_tol=1e-6)


def test_micro_batched_step_equals_one_full_batch_step(tiny_policy):
    """Splitting a global batch into length-sorted micro-batches leaves the gradient unchanged."""
    import copy

    import numpy as np

    from laminar.model import load_policy
    from laminar.update import grpo_step

    model, tok = load_policy(tiny_policy)
    rng = np.random.default_rng(0)
    n = 12
    prompts = [rng.integers(4, 60, rng.integers(2, 6)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(4, 60, rng.integers(1, 30)).astype(np.int32) for _ in range(n)]
    logps = [-rng.random(len(r)).astype(np.float32) for r in responses]
    masks = [np.ones(len(r), np.uint8) for r in responses]
    rewards = torch.tensor(rng.random(n), dtype=torch.float32)
    groups = torch.arange(n) // 4
    grads = []
    for budget in (10**6, 40):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        metrics = grpo_step(
            m,
            opt,
            prompts,
            responses,
            logps,
            masks,
            rewards,
            groups,
            pad_token_id=tok.pad_token_id,
            clip_low=0.2,
            clip_high=0.28,
            micro_batch_tokens=budget,
        )
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        assert np.isfinite(metrics["loss"])
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
