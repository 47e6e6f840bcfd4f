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
    centred = rewards - mean[inverse]
    if not norm_by_std:
        return centred.float()
    var = zeros.index_add(0, inverse, centred.pow(2)) / count
    return (centred / (var.sqrt()[inverse] + eps)).float()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate with clip-higher, token-mean aggregated.

    ``logprobs``, ``old_logprobs`` and ``mask`` are ``[batch, tokens]``; ``advantages`` is
    ``[batch]`` (one per sequence) or ``[batch, tokens]``. Returns the loss and metrics
    (clip fractions, mean ratio).

    >>> lp = torch.zeros(2, 3)
    >>> loss, m = policy_loss(lp, lp, torch.tensor([1., -1.]), torch.ones(2, 3))
    >>> float(loss), m["clip_frac"]
    (0.0, 0.0)
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    n_tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        was_clipped = (ratio * advantages > clipped * advantages) & (mask > 0)
        metrics = {
            "clip_frac": float(was_clipped.sum() / n_tokens),
            "clip_frac_low": float(((ratio < 1 - clip_low) & was_clipped).sum() / n_tokens),
            "clip_frac_high": float(((ratio > 1 + clip_high) & was_clipped).sum() / n_tokens),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "approx_kl": float(((ratio - 1 - torch.log(ratio)) * mask).sum() / n_tokens),
        }
    return loss, metrics
