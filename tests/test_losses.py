import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminar.losses import (
    AGGREGATIONS,
    decoupled_policy_loss,
    entropy,
    group_advantages,
    kl_penalty,
    policy_loss,
    tis_policy_loss,
    truncated_is_weights,
)

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


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batched_step_equals_one_full_batch_step(tiny_policy, agg, correction):
    """Splitting a global batch into length-sorted micro-batches, or into data-parallel
    shards (their gradients summed, as the all-reduce does), leaves the gradient and the
    metrics unchanged: each micro-batch's loss is weighted by its share of the batch's
    loss tokens (token-mean) or sequences (seq-mean-*). Partial loss masks (tool tokens)
    make the two shares differ from the padded tokens'; stale behavior logprobs make the
    clip, dual-clip and truncation bind; the KL and entropy terms follow ``agg`` too.
    (It used to take ``agg`` and ``clip_c`` as parameters and pass neither.)"""
    import copy

    import numpy as np

    from laminar.model import load_policy
    from laminar.update import grpo_step

    model, tok = load_policy(tiny_policy)
    ref, _ = load_policy(tiny_policy)
    with torch.no_grad():  # (a reference that differs from the policy: a KL to pull)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    n = 12
    prompts = [rng.integers(4, 60, rng.integers(2, 6)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(4, 60, rng.integers(1, 30)).astype(np.int32) for _ in range(n)]
    # behavior logprobs around the policy's (about -5.7): ratios from e^-3 to e^3
    logps = [-rng.uniform(2.7, 8.7, len(r)).astype(np.float32) for r in responses]
    masks = [(rng.random(len(r)) > 0.3).astype(np.uint8) for r in responses]
    masks[0][:] = 0  # (a row with no loss token: a sequence all the same under seq-mean)
    rewards = torch.tensor(rng.random(n), dtype=torch.float32)
    groups = torch.arange(n) // 4

    def step(budget, shard=None):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        metrics = grpo_step(
            m, opt, prompts, responses, logps, masks, rewards, groups,
            pad_token_id=tok.pad_token_id, clip_low=0.2, clip_high=0.28, clip_c=3.0,
            micro_batch_tokens=budget, shard=shard, max_grad_norm=1e9, agg=agg,
            correction=correction, ref_model=ref, kl_coef=0.1, entropy_coef=0.01,
        )  # fmt: skip
        grad = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        return grad, metrics

    whole, metrics = step(10**6)
    split, split_metrics = step(40)
    assert torch.allclose(whole, split, atol=1e-6, rtol=1e-4)
    (a, _), (b, _) = step(40, shard=range(0, n, 2)), step(40, shard=range(1, n, 2))
    assert torch.allclose(whole, a + b, atol=1e-6, rtol=1e-4)
    binds = {"none": "dual_clip_frac", "tis": "is_weight_capped_frac"}.get(correction)
    assert binds is None or metrics[binds] > 0  # (the stale tokens reach the clip)
    for k in ("loss", "pg_loss", "entropy", "kl_ref", "clip_frac", "logprob_diff_mean"):
        if k in metrics:
            assert split_metrics[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-7), k
    assert np.isfinite(metrics["loss"]) and metrics["kl_ref"] > 0


def _hand_loss(logp, old, adv, mask, agg, clip_low=0.2, clip_high=0.28, clip_c=None):
    """The same surrogate written out token by token in plain Python."""
    rows = []
    for lp_row, old_row, a, m_row in zip(logp, old, adv, mask, strict=True):
        row = []
        for lp, o, m in zip(lp_row, old_row, m_row, strict=True):
            r = math.exp(lp - o)
            clipped = min(max(r, 1 - clip_low), 1 + clip_high)
            value = -min(r * a, clipped * a)
            if clip_c is not None and a < 0:
                value = min(value, -clip_c * a)
            row.append((value, m))
        rows.append(row)
    if agg == "token-mean":
        return sum(v * m for row in rows for v, m in row) / sum(m for row in rows for _, m in row)
    if agg == "seq-mean-token-sum":
        return sum(sum(v * m for v, m in row) for row in rows) / len(rows)
    return sum(sum(v * m for v, m in row) / sum(m for _, m in row) for row in rows) / len(rows)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_policy_loss_equals_a_hand_computation(agg, clip_c):
    logp = [[0.5, -0.1, 0.0], [-1.5, 0.2, 0.9], [0.05, -2.0, 0.0]]
    old = [[0.0, 0.0, 0.1], [0.0, 0.1, 0.0], [0.0, 0.0, 0.0]]
    adv = [1.0, -2.0, -0.5]
    mask = [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    loss, metrics = policy_loss(
        torch.tensor(logp),
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        clip_c=clip_c,
        agg=agg,
    )
    assert float(loss) == pytest.approx(
        _hand_loss(logp, old, adv, mask, agg, clip_c=clip_c), rel=1e-5
    )
    if clip_c is None:
        assert metrics["dual_clip_frac"] == 0.0
    else:  # only token (1, 2): r = e^0.9 = 2.46 and A = -2, so -r·A = 4.92 > 1.5·2
        assert metrics["dual_clip_frac"] == pytest.approx(1 / 6)


def test_clip_fractions_at_the_boundaries():
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    # ratios exactly at 1 + clip_high and 1 - clip_low are not clipped; just beyond they are.
    ratios = torch.tensor([[1.28, 1.2801, 0.8, 0.7999]])
    _, m = policy_loss(ratios.log(), old, torch.tensor([1.0]), mask)
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.0  # A > 0: low side free
    _, m = policy_loss(ratios.log(), old, torch.tensor([-1.0]), mask)
    assert m["clip_frac_low"] == 0.25 and m["clip_frac_high"] == 0.0  # A < 0: high side free
    with pytest.raises(ValueError, match="must be > 1"):
        policy_loss(old, old, torch.tensor([1.0]), mask, clip_c=1.0)
    with pytest.raises(ValueError, match="choose one of"):
        policy_loss(old, old, torch.tensor([1.0]), mask, agg="sum")


def test_importance_weights_and_decoupled_ppo():
    logp = torch.tensor([[0.1, -0.3, 0.2]], requires_grad=True)
    behavior = torch.tensor([[-0.5, -0.2, 0.0]])
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    w = truncated_is_weights(torch.zeros(1, 3), behavior, cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, math.exp(0.2), 1.0]]))
    # Fresh data (proximal == behavior): weights are 1, decoupled PPO is plain PPO.
    fresh, _ = decoupled_policy_loss(logp, behavior, behavior, adv, mask)
    plain, _ = policy_loss(logp, behavior, adv, mask)
    assert float(fresh.detach()) == pytest.approx(float(plain.detach()))
    stale, m = decoupled_policy_loss(logp, torch.zeros(1, 3), behavior, adv, mask, is_cap=1.5)
    weighted, _ = policy_loss(logp, torch.zeros(1, 3), adv, mask, is_weights=w)
    assert float(stale.detach()) == pytest.approx(float(weighted.detach()))
    assert m["is_weight_capped_frac"] == pytest.approx(1 / 3)
    stale.backward()  # weights are constants: gradient flows through logp only
    assert logp.grad is not None


@given(
    st.lists(st.floats(-3, 3), min_size=1, max_size=8),
    st.lists(st.floats(-3, 3), min_size=1, max_size=8),
)
def test_k3_kl_is_non_negative_and_zero_at_equality(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor([a[:n]]), torch.tensor([b[:n]])
    assert float(kl_penalty(lp, ref, torch.ones(1, n))) >= -1e-6
    assert float(kl_penalty(lp, lp, torch.ones(1, n))) == 0.0


def test_entropy_bounds():
    mask = torch.ones(1, 2)
    peaked = torch.tensor([[[50.0, 0.0, 0.0], [0.0, 50.0, 0.0]]])
    assert float(entropy(peaked, mask)) < 1e-6
    assert float(entropy(torch.zeros(1, 2, 3), mask)) == pytest.approx(math.log(3))


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_token_metrics_do_not_depend_on_the_micro_batch_size(tiny_policy, agg):
    """``clip_frac``, ``approx_kl``, ``ratio_mean``… are fractions and means over the
    batch's loss tokens whatever the loss aggregation: splitting the batch into
    micro-batches (a memory setting) must not change them. Under the ``seq-mean-*``
    aggregations a micro-batch's share of the *sequences* is not its share of the tokens."""
    import numpy as np

    from laminar.model import load_policy
    from laminar.update import grpo_step

    model, tok = load_policy(tiny_policy)
    rng = np.random.default_rng(3)
    n = 8
    prompts = [rng.integers(4, 60, rng.integers(2, 6)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(4, 60, rng.integers(1, 15)).astype(np.int32) for _ in range(n)]
    # behavior logprobs far from the policy's (about -4): many ratios are clipped
    logps = [-rng.uniform(2, 6, len(r)).astype(np.float32) for r in responses]
    masks = [(rng.random(len(r)) > 0.2).astype(np.uint8) for r in responses]
    rewards = torch.tensor(rng.integers(0, 3, n), dtype=torch.float32)
    groups = torch.arange(n) // 4
    out = {}
    for correction in ("none", "decoupled"):
        for budget in (10**6, 30):
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            out[correction, budget] = grpo_step(
                model, opt, prompts, responses, logps, masks, rewards, groups,
                pad_token_id=tok.pad_token_id, clip_low=0.2, clip_high=0.28, clip_c=1.5,
                micro_batch_tokens=budget, agg=agg, correction=correction,
            )  # fmt: skip
        one, split = out[correction, 10**6], out[correction, 30]
        assert split["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
        keys = [
            "clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean",
            "approx_kl", "logprob_diff_mean",
        ]  # fmt: skip
        if correction == "decoupled":
            keys += ["is_weight_mean", "is_weight_capped_frac"]
        assert set(keys) <= set(one) and set(keys) <= set(split), sorted(one)
        for key in keys:
            assert split[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key


def _expected_kl_gradient(kind: str, theta: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E_{a~π}[∇θ kl_penalty(a)] for π = softmax(θ), computed exactly over the actions."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    one = torch.ones(1, 1)
    values = torch.stack(
        [kl_penalty(logp[a].view(1, 1), ref[a].view(1, 1), one, kind=kind) for a in range(5)]
    )
    (logp.exp().detach() * values).sum().backward()
    return theta.grad


def test_kl_penalty_gradients_are_those_of_a_kl():
    """The KL penalty's expected gradient on on-policy samples: k1 and k2 give that of
    KL(π‖π_ref) (k1 as if it were in the reward: its own gradient ∇log π has mean zero,
    so as a loss term it would pull nowhere); k3 gives that of KL(π_ref‖π), as in GRPO."""
    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)
    t = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(t, -1)
    torch.autograd.backward((logp.exp() * (logp - ref)).sum())
    reverse = t.grad
    t = theta.clone().requires_grad_(True)
    torch.autograd.backward((ref.exp() * (ref - torch.log_softmax(t, -1))).sum())
    forward = t.grad
    assert not torch.allclose(reverse, forward, atol=1e-3)
    for kind in ("k1", "k2"):
        assert torch.allclose(_expected_kl_gradient(kind, theta, ref), reverse, atol=1e-12), kind
    assert torch.allclose(_expected_kl_gradient("k3", theta, ref), forward, atol=1e-12)
    # the values are the estimators' own
    lp, rf, m = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    assert float(kl_penalty(lp, rf, m, kind="k1")) == pytest.approx((0.5 - 1.0) / 2)
    assert float(kl_penalty(lp, rf, m, kind="k2")) == pytest.approx((0.125 + 0.5) / 2)


def test_k3_stays_finite_where_the_policy_has_all_but_ruled_a_token_out():
    """log r = -100 (the reference 1e43 times likelier): exp(100) overflows float32 and
    the step used to be skipped as non-finite. Bounded, the other tokens still train."""
    lp = torch.tensor([[-101.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    loss = kl_penalty(lp, ref, torch.ones(1, 2), kind="k3")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    k3 = math.exp(-0.5) - 1 + 0.5
    bound = math.exp(20.0) - 1 - 20.0
    assert float(loss.detach()) == pytest.approx((bound + k3) / 2)  # (the bound's, the other's own)
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == pytest.approx((1 - math.exp(-0.5)) / 2)


def test_the_default_trainer_bounds_a_stale_token_with_a_negative_advantage():
    """One stale token the behavior policy found unlikely (ratio e^9.2 ~ 1e4) with a
    negative advantage, among 999 on-policy ones: without dual-clip its loss is -r·A, and
    it takes all but all of the (then clipped) gradient. Laminar's input is stale by
    design, so dual-clip is on by default (trainer.clip_c=3, verl's clip_ratio_c): that
    token's loss is capped at 3·|A| and its gradient is 0; `clip_c: null` turns it off."""
    from laminar.config import RunConfig, with_overrides

    old = torch.zeros(1, 1000)
    old[0, 0] = -9.2

    def grad(clip_c):
        lp = torch.zeros(1, 1000, requires_grad=True)
        loss, _ = policy_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 1000), clip_c=clip_c)
        loss.backward()
        return lp.grad[0]

    default = RunConfig().trainer.clip_c
    g = grad(default)
    assert g[0] == 0 and g[1] == pytest.approx(1e-3)
    off = with_overrides(RunConfig(), ["trainer.clip_c=null"]).trainer.clip_c
    assert off is None
    g = grad(off)
    assert float(g[0] ** 2 / (g**2).sum()) > 0.99


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_ratio_past_float32_keeps_the_gradient_finite(advantage):
    """log(new / old) = 100: the ratio overflowed float32 to inf, and the branch
    torch.minimum (and dual-clip's where) did not pick back-propagated 0 * inf = NaN,
    so the whole step was skipped as non-finite. Bounded, the other token trains."""
    lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    loss, _ = policy_loss(lp, old, torch.tensor([advantage]), torch.ones(1, 2), clip_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == pytest.approx(-advantage / 2)


@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_what_the_log_ratio_bound_changes(clip_c):
    """What docs/losses.md says of the ±20 bound on log(π/π_old) (it used to say that e^20
    is past any clip, so nothing changes). With A < 0 and no dual-clip, the loss grows
    with the ratio up to log r = 20 (gradient r·|A|), then stays at e^20·|A| with a
    gradient of 0; with dual-clip the loss is clip_c·|A|, gradient 0, on either side
    of the bound. With A > 0 the clip takes it on either side (gradient 0)."""
    from laminar.losses import LOG_RATIO_BOUND

    def at(log_r, advantage):
        lp = torch.zeros(1, 1, requires_grad=True)
        old = torch.tensor([[-log_r]])
        loss, _ = policy_loss(lp, old, torch.tensor([advantage]), torch.ones(1, 1), clip_c=clip_c)
        loss.backward()
        return float(loss.detach()), float(lp.grad)

    for log_r in (15.0, 25.0):
        assert at(log_r, 1.0) == (pytest.approx(-1.28), 0.0)
    if clip_c is None:
        assert at(15.0, -1.0) == (pytest.approx(math.exp(15)), pytest.approx(math.exp(15)))
        assert at(25.0, -1.0) == (pytest.approx(math.exp(LOG_RATIO_BOUND)), 0.0)
    else:
        assert at(15.0, -1.0) == at(25.0, -1.0) == (pytest.approx(clip_c), 0.0)
    # below -20: a gradient under 2e-9·|A| is lost
    loss, grad = at(-25.0, 1.0)
    assert abs(loss) < 3e-9 and grad == 0.0


def test_a_rank_without_rows_issues_the_same_collectives(tiny_policy):
    """Data parallel: every rank must all-reduce tensors of the same shapes in the same
    order, or the collective hangs. A rank whose shard is empty (a batch with fewer rows
    than ranks: one group in a stream mini-batch, say) still reduces every metric."""
    import numpy as np

    from laminar.model import load_policy
    from laminar.update import grpo_step

    model, tok = load_policy(tiny_policy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 60, 3).astype(np.int32)]
    responses = [rng.integers(4, 60, 5).astype(np.int32)]
    logps, masks = [-np.ones(5, np.float32)], [np.ones(5, np.uint8)]
    for options in (
        {},
        {"correction": "decoupled", "clip_c": 3.0},
        {"correction": "tis", "kl_coef": 0.1, "ref_model": model, "entropy_coef": 0.01},
    ):
        calls = {}
        for shard in ([0], []):
            seen = calls[len(shard)] = []
            grpo_step(
                model, torch.optim.SGD(model.parameters(), lr=0.0), prompts, responses,
                logps, masks, torch.tensor([1.0]), torch.tensor([0]),
                pad_token_id=tok.pad_token_id, clip_low=0.2, clip_high=0.28, shard=shard,
                all_reduce=lambda t, op, seen=seen: seen.append((tuple(t.shape), op)),
                **options,
            )  # fmt: skip
        assert calls[0] == calls[1], options


def _nan_loss_step(model, tok, shard=None, all_reduce=None, rank=0, world_size=1):
    """One grpo_step (plain SGD) on two rows, the second with a NaN behavior logprob on a
    trained token: its ratio is NaN, and clamp and torch.minimum pass the NaN on with a
    gradient of 0, so the loss is NaN and the gradient finite."""
    import numpy as np

    from laminar.update import grpo_step

    prompts = [np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32)]
    responses = [np.array([10, 11, 12], np.int32), np.array([13, 14, 15, 16], np.int32)]
    logps = [np.full(3, -2.0, np.float32), np.array([-2.0, math.nan, -2.0, -2.0], np.float32)]
    masks = [np.ones(3, np.uint8), np.ones(4, np.uint8)]
    return grpo_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), prompts, responses, logps,
        masks, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), pad_token_id=tok.pad_token_id,
        clip_low=0.2, clip_high=0.28, shard=shard, all_reduce=all_reduce, rank=rank,
        world_size=world_size,
    )  # fmt: skip


def test_a_nan_loss_with_a_finite_gradient_skips_the_step(tiny_policy):
    """correction=none, a NaN behavior logprob on a trained token: the loss was NaN, the
    gradient norm finite (the NaN token's gradient 0), and the step was taken, its NaN
    loss stored as the version's. A loss that is not finite skips the step now."""
    from laminar.model import load_policy

    model, tok = load_policy(tiny_policy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = _nan_loss_step(model, tok)
    assert math.isnan(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert metrics["grad_norm"] > 0  # (the other tokens' gradient: it would have moved)
    assert metrics["skipped"] == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_ranks_skip_a_step_alike_when_one_ranks_loss_is_nan(tiny_policy):
    """Two data-parallel ranks (threads, summing through a barrier as the collective
    does): only rank 1's row has the NaN. Its loss is summed into every rank's metrics
    before the decision, so both skip; a rank deciding on its own loss would step alone
    and the ranks' weights would part."""
    import copy
    import threading

    from laminar.model import load_policy

    model, tok = load_policy(tiny_policy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    models = [copy.deepcopy(model) for _ in range(2)]
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def reducer(rank):
        def all_reduce(t, op):
            slots[rank] = t.clone()
            barrier.wait()
            both = torch.stack(slots)
            total = both.sum(0) if op == "sum" else both.amax(0)
            barrier.wait()
            t.copy_(total)

        return all_reduce

    def rank_main(rank):
        out[rank] = _nan_loss_step(models[rank], tok, [rank], reducer(rank), rank, 2)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [m["skipped"] for m in out] == [1.0, 1.0], out
    for m in models:
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_trainer_logprobs_without_a_pad_token_and_at_a_vanishing_temperature(tiny_policy):
    """A Llama-3-style tokenizer has no pad token (None): packing padded with None and
    crashed. A vanishing temperature overflowed logits / T in the trainer's forward (NaN
    logprobs); it is the T -> 0 limit now, as in the engines' sampler."""
    import numpy as np

    from laminar.model import load_policy
    from laminar.update import trajectory_logprobs

    model, tok = load_policy(tiny_policy)
    prompts = [np.array([1, 5, 6], np.int32), np.array([1, 7], np.int32)]
    responses = [np.array([8, 9], np.int32), np.array([10, 11, 12], np.int32)]
    padded = trajectory_logprobs(model, prompts, responses, pad_token_id=tok.pad_token_id)
    unpadded = trajectory_logprobs(model, prompts, responses, pad_token_id=None)
    for a, b in zip(padded, unpadded, strict=True):
        np.testing.assert_array_equal(a, b)  # (padding never reaches a real position)
    cold = trajectory_logprobs(model, prompts, responses, pad_token_id=None, temperature=1e-39)
    for lp in cold:
        assert np.isfinite(lp[lp > -np.inf]).all() and not np.isnan(lp).any()
        assert set(np.unique(lp)) <= {0.0, -np.inf}  # (the argmax's 0, the others' -inf)


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_a_masked_token_is_ignored_whatever_its_behavior_logprob(bad):
    """A tool/environment token (loss mask 0) has no engine logprob: a NaN or -inf put
    there must neither poison the loss, its gradient nor the metrics (it skipped the
    whole step)."""
    from laminar.losses import tis_policy_loss

    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.2, bad, -0.4]])
    clean = torch.tensor([[-1.2, -2.0, -0.4]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv = torch.tensor([1.0])
    losses = {
        "ppo": lambda o: policy_loss(logp_, o, adv, mask, clip_c=3.0),
        "tis": lambda o: tis_policy_loss(logp_, o, adv, mask),
        "decoupled": lambda o: decoupled_policy_loss(logp_, clean, o, adv, mask),
        "decoupled-prox": lambda o: decoupled_policy_loss(logp_, o, clean, adv, mask),
    }
    for name, loss_of in losses.items():
        grads = []
        for o in (old, clean):
            logp_ = logp.clone().requires_grad_(True)
            loss, metrics = loss_of(o)
            loss.backward()
            assert math.isfinite(loss.item()), name
            assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
            grads.append((loss.item(), logp_.grad.clone(), metrics))
        assert grads[0][0] == pytest.approx(grads[1][0]), name
        assert torch.allclose(grads[0][1], grads[1][1]), name
        assert grads[0][2] == pytest.approx(grads[1][2]), name


def test_a_group_of_equal_rewards_gets_exactly_zero_advantages():
    """Not the mean's rounding error (-1.1e-10 for six rewards of 0.7), and beside a
    group with signal."""
    rewards = torch.tensor([0.7] * 6 + [0.1] * 3 + [1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0] * 6 + [1] * 3 + [2, 2])
    for norm in (True, False):
        adv = group_advantages(rewards, groups, norm_by_std=norm)
        assert adv[:9].tolist() == [0.0] * 9
        assert adv[9] > 0 > adv[10]


def test_tis_weights_the_trainer_policy_over_the_behavior_policy():
    """By hand, on stale data: ``w = min(π/π_behav, cap)``, the loss ``−w·A·log π`` and
    its gradient ``−w·A`` per token (token-mean over 2). The on-policy doctest has every
    weight 1, so it passed with the ratio upside down (π_behav/π: weights 0.61 and 1.11)."""
    logp = torch.tensor([[0.0, -0.3]], requires_grad=True)
    behavior = torch.tensor([[-0.5, -0.2]])
    loss, m = tis_policy_loss(logp, behavior, torch.tensor([1.0]), torch.ones(1, 2), is_cap=1.5)
    w = [1.5, math.exp(-0.1)]  # e^0.5 = 1.65 truncated at 1.5; e^-0.1 under it
    assert float(loss.detach()) == pytest.approx(-(w[0] * 0.0 + w[1] * -0.3) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-w[0] / 2, -w[1] / 2])
    assert m["is_weight_mean"] == pytest.approx(sum(w) / 2)
    assert m["is_weight_capped_frac"] == 0.5
    # decoupled: the same weights, proximal (here the trainer's own) over behavior
    prox = logp.detach()
    _, md = decoupled_policy_loss(
        logp, prox, behavior, torch.tensor([1.0]), torch.ones(1, 2), is_cap=1.5
    )
    assert md["is_weight_mean"] == pytest.approx(sum(w) / 2)
