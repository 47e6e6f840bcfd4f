"""GRPO loss maths: pure tensor functions, no Dask, no model.

Formulas (``i`` a trajectory, ``g(i)`` its prompt group, ``t`` a response token):

* group advantage ``A_i = (r_i - mean_{g(i)} r) / (std_{g(i)} r + eps)``
  (``std`` is the population standard deviation; ``norm_by_std=False`` keeps the centring only);
* ratio ``rho_t = exp(logp_t - old_logp_t)`` against the behavior logprobs of the engine
  that sampled the token;
* clipped surrogate with clip-higher (DAPO):
  ``L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)``;
* token-mean aggregation: ``sum_t mask_t L_t / sum_t mask_t`` over the whole batch.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantage: one scalar per trajectory, normalised within its group.

    Parameters
    ----------
    rewards
        ``[n]`` float rewards.
    group_index
        ``[n]`` integer group ids (any values; trajectories with equal ids are siblings).

    Examples
    --------
    >>> group_advantages(torch.tensor([1., 0., 5., 5.]), torch.tensor([0, 0, 1, 1]))
    tensor([ 1.0000, -1.0000,  0.0000,  0.0000])
    """
    # float64 inside: with a near-zero group std, float32 rounding of a shifted reward
    # would be amplified into a visibly different advantage.
    rewards = rewards.double()
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float64)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.index_add(0, inverse, rewards) / count
    # A group whose rewards are all equal carries no signal: exactly 0, not the
    # mean's rounding error (1e-10 for six rewards of 0.7).
    lo = zeros.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    centred = torch.where((hi == lo)[inverse], 0.0, rewards - mean[inverse])
    if not norm_by_std:
        return centred.float()
    var = zeros.index_add(0, inverse, centred.pow(2)) / count
    return (centred / (var.sqrt()[inverse] + eps)).float()


def _on_loss_tokens(other: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor):
    """``other`` logprobs where ``mask`` is set, ``logprobs`` (detached) elsewhere: a
    masked token (a tool's, or padding) may carry any value there, NaN or -inf included,
    and must not reach the loss: ``inf·0`` and ``NaN·0`` are NaN, in the loss and its
    gradient alike."""
    return torch.where(mask > 0, other, logprobs.detach())


AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# |log r| a token's ratio is taken at, in :func:`policy_loss` (r = π/π_old: past ~88 it
# overflows float32; what the bound changes is said there) and, below, in
# :func:`kl_penalty`'s k3 (r = π/π_ref = e^-20: 2e-9)
LOG_RATIO_BOUND = 20.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Reduce per-token ``values`` ``[batch, tokens]`` under ``mask`` to a scalar.

    * ``token-mean``: ``sum(v·m) / sum(m)`` — every token weighs the same (DAPO);
    * ``seq-mean-token-sum``: mean over sequences of ``sum_t v·m`` (Dr. GRPO style);
    * ``seq-mean-token-mean``: mean over sequences of ``sum_t v·m / sum_t m`` (GRPO paper).

    >>> v = torch.tensor([[1., 1., 1.], [4., 0., 0.]])
    >>> m = torch.tensor([[1., 1., 1.], [1., 0., 0.]])
    >>> [float(aggregate(v, m, a)) for a in AGGREGATIONS]
    [1.75, 3.5, 2.5]
    """
    mask = mask.to(values.dtype)
    if agg == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (values * mask).sum(-1)
    if agg == "seq-mean-token-sum":
        return per_seq.mean()
    if agg == "seq-mean-token-mean":
        return (per_seq / mask.sum(-1).clamp(min=1.0)).mean()
    raise ValueError(f"agg={agg!r}; choose one of {AGGREGATIONS}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate with clip-higher, optional dual-clip and importance weights.

    ``logprobs``, ``old_logprobs`` and ``mask`` are ``[batch, tokens]``; ``advantages`` is
    ``[batch]`` (one per sequence) or ``[batch, tokens]``. Per token, with
    ``r = exp(logprobs - old_logprobs)``::

        L = -min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)
        L = min(L, -clip_c·A)   where A < 0, if clip_c is set (dual-clip, clip_c > 1)
        L = w·L                 if is_weights w is given (treated as constants)

    aggregated by :func:`aggregate`. Returns the loss and metrics: ``clip_frac`` (tokens
    whose clipped branch is active, ``_low``/``_high`` by side), ``dual_clip_frac``,
    ``ratio_mean``, ``approx_kl`` (k3 of old vs new).

    >>> lp = torch.zeros(2, 3)
    >>> loss, m = policy_loss(lp, lp, torch.tensor([1., -1.]), torch.ones(2, 3))
    >>> float(loss), m["clip_frac"]
    (0.0, 0.0)
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c={clip_c!r} must be > 1 (dual-clip bounds the loss at c·|A|)")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logprobs)
    mask = mask.to(logprobs.dtype)
    old_logprobs = _on_loss_tokens(old_logprobs, logprobs, mask)
    # (the log-ratio bounded, as verl does: past ~88 the ratio overflows to inf, and the
    # branch torch.minimum does not pick back-propagates 0 * inf = NaN, which skipped the
    # step. Below -20 nothing is lost: a gradient under 2e-9·|A| becomes 0. Above +20 the
    # clip takes A > 0 and dual-clip A < 0 (from r = clip_c on) long before: the bound
    # changes nothing. Without dual-clip, though, a token with A < 0 and log r > 20 is the
    # one case where it does: its loss stays e^20·|A| and its gradient, e^(log r)·|A| as
    # the ratio grows, drops to 0.)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_c is not None:
        bound = -clip_c * advantages
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1.0)
        was_clipped = (ratio * advantages > clipped * advantages) & (mask > 0)
        metrics = {
            "clip_frac": float(was_clipped.sum() / n_tokens),
            "clip_frac_low": float(((ratio < 1 - clip_low) & was_clipped).sum() / n_tokens),
            "clip_frac_high": float(((ratio > 1 + clip_high) & was_clipped).sum() / n_tokens),
            "dual_clip_frac": float((dual & (mask > 0)).sum() / n_tokens),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "approx_kl": float(((ratio - 1 - torch.log(ratio)) * mask).sum() / n_tokens),
        }
    return loss, metrics


def truncated_is_weights(
    target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights ``min(π_target / π_behavior, cap)`` per token, detached.

    The behavior policy is the engine that sampled the token (possibly several versions
    old); the target is the trainer-side policy the loss is taken against.

    >>> truncated_is_weights(torch.tensor([0.0, 2.0]), torch.zeros(2), cap=2.0)
    tensor([1., 2.])
    """
    return torch.exp(target_logprobs - behavior_logprobs).clamp(max=cap).detach()


def tis_policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_cap: float = 2.0,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated-IS policy gradient: ``L = -sg(min(π/π_behav, is_cap))·A·log π``.

    No trust-region clip: every token keeps a gradient, weighted by its importance
    ratio against the behavior policy, truncated at ``is_cap`` and detached (the
    estimator of IMPALA-style V-trace without values, and of CISPO). On-policy it is
    plain REINFORCE with group advantages.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> loss, m = tis_policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2))
    >>> round(float(loss), 4), m["is_weight_mean"]
    (0.6931, 1.0)
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logprobs)
    mask = mask.to(logprobs.dtype)
    behavior_logprobs = _on_loss_tokens(behavior_logprobs, logprobs, mask)
    weights = truncated_is_weights(logprobs.detach(), behavior_logprobs, is_cap)
    loss = aggregate(-weights * advantages * logprobs, mask, agg)
    n = mask.sum().clamp(min=1.0)
    metrics = {
        "is_weight_mean": float((weights * mask).sum() / n),
        "is_weight_capped_frac": float(((weights >= is_cap) * mask).sum() / n),
    }
    return loss, metrics


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_cap: float = 2.0,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL): clip against the *proximal* policy (the trainer's weights
    before this update), and correct for the stale behavior policy with truncated
    importance weights ``min(π_prox / π_behav, is_cap)``. ``kwargs`` go to
    :func:`policy_loss`. With fresh data (proximal = behavior) it equals plain PPO.
    """
    proximal_logprobs = _on_loss_tokens(proximal_logprobs, logprobs, mask)
    behavior_logprobs = _on_loss_tokens(behavior_logprobs, proximal_logprobs, mask)
    weights = truncated_is_weights(proximal_logprobs, behavior_logprobs, is_cap)
    loss, metrics = policy_loss(
        logprobs, proximal_logprobs, advantages, mask, is_weights=weights, **kwargs
    )
    n = mask.sum().clamp(min=1.0)
    metrics["is_weight_mean"] = float((weights * mask).sum() / n)
    metrics["is_weight_capped_frac"] = float(((weights >= is_cap) * mask).sum() / n)
    return loss, metrics


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "k3",
    agg: str = "token-mean",
) -> torch.Tensor:
    """KL(π‖π_ref) estimated from sampled tokens: ``k1 = log r``, ``k2 = (log r)²/2``,
    ``k3 = r⁻¹ - 1 + log r`` with ``r = π/π_ref`` (k1 and k3 unbiased, k3 always ≥ 0).

    The value is the estimator's; the gradient, on samples of π, is in expectation:

    * k1 and k2: ``∇ KL(π‖π_ref)``. k1's own gradient ``∇ log π`` has mean zero, so as a
      loss term it would be noise with no pull; it is given the gradient it has when
      ``-log r`` is put in the reward (classic RLHF), which is k2's;
    * k3: ``∇ KL(π_ref‖π)``, the forward KL (GRPO's loss, as published). A token's k3
      takes log r no lower than ``-LOG_RATIO_BOUND``, so one token the policy has all
      but ruled out cannot make the loss infinite.

    >>> float(kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)))
    0.0
    """
    log_r = logprobs - ref_logprobs
    if kind == "k1":
        k2 = 0.5 * log_r.pow(2)  # value log r, gradient log r · ∇log π (k2's)
        values = log_r.detach() + (k2 - k2.detach())
    elif kind == "k2":
        values = 0.5 * log_r.pow(2)
    elif kind == "k3":
        # exp(-log r) overflows float32 past log r < -88 (a token the reference finds far
        # likelier than the policy): the loss turned inf and the whole step was skipped.
        # log r is bounded below instead, where such a token pulls no gradient. (verl also
        # caps each token's k3 at 10; that cap binds from π_ref/π ≈ 13 on, and would bend
        # the gradient of ordinary tokens.)
        log_r = log_r.clamp(min=-LOG_RATIO_BOUND)
        values = torch.exp(-log_r) - 1 + log_r
    else:
        raise ValueError(f"kind={kind!r}; choose k1, k2 or k3")
    return aggregate(values, mask, agg)


def entropy(logits: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Mean entropy of the token distributions ``logits`` ``[batch, tokens, vocab]``.

    >>> round(float(entropy(torch.zeros(1, 1, 4), torch.ones(1, 1))), 4)  # uniform over 4
    1.3863
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return aggregate(-(logp.exp() * logp).sum(-1), mask, agg)
