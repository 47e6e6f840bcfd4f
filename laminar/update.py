"""One GRPO update of an HF causal LM from a list of rewarded trajectories.

No Dask here: the :class:`~laminar.trainer.Trainer` actor calls :func:`grpo_step`, and so
can a test or a notebook.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from laminar.losses import group_advantages, policy_loss


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded ``prompt + response`` rows and the response-token view of them."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, R] (1 where a response token is trained on)
    old_logprobs: torch.Tensor  # [B, R] behavior logprobs
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]


def pack(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    behavior_logprobs: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    pad_token_id: int,
) -> PackedBatch:
    """Pad a list of trajectories into tensors (right padding, so positions start at 0)."""
    bsz = len(prompts)
    plens = torch.tensor([len(p) for p in prompts])
    rlens = torch.tensor([len(r) for r in responses])
    width = int((plens + rlens).max())
    rwidth = int(rlens.max())
    ids = torch.full((bsz, width), pad_token_id, dtype=torch.long)
    att = torch.zeros(bsz, width, dtype=torch.long)
    rmask = torch.zeros(bsz, rwidth)
    old = torch.zeros(bsz, rwidth)
    for i, (p, r, lp, m) in enumerate(zip(prompts, responses, behavior_logprobs, loss_masks)):
        n, k = len(p), len(r)
        ids[i, :n] = torch.as_tensor(p, dtype=torch.long)
        ids[i, n : n + k] = torch.as_tensor(r, dtype=torch.long)
        att[i, : n + k] = 1
        rmask[i, :k] = torch.as_tensor(m, dtype=torch.float32)
        old[i, :k] = torch.as_tensor(lp, dtype=torch.float32)
    return PackedBatch(ids, att, rmask, old, plens, rlens)


def response_logprobs(model, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``[B, R]`` the model gives each response token (0 on padding)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    # Token at column c is predicted by the logits at column c-1.
    bsz, rwidth = batch.response_mask.shape
    cols = batch.prompt_lens[:, None] - 1 + torch.arange(rwidth)[None, :]
    cols = cols.clamp(max=batch.input_ids.shape[1] - 2)
    targets = batch.input_ids.gather(1, cols + 1)
    picked = logp.gather(1, cols[..., None].expand(-1, -1, logp.shape[-1]))
    out = picked.gather(2, targets[..., None])[..., 0]
    valid = torch.arange(rwidth)[None, :] < batch.response_lens[:, None]
    return out * valid


def grpo_step(
    model,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """One optimizer step of GRPO on ``batch``; returns metrics."""
    model.train()
    adv = group_advantages(rewards, group_index)
    logp = response_logprobs(model, batch, temperature)
    loss, metrics = policy_loss(
        logp, batch.old_logprobs, adv, batch.response_mask, clip_low=clip_low, clip_high=clip_high
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        n = batch.response_mask.sum().clamp(min=1)
        diff = (logp.detach() - batch.old_logprobs).abs() * batch.response_mask
    metrics.update(
        loss=float(loss.detach()),
        grad_norm=float(grad_norm),
        # Behavior vs trainer logprob mismatch on the same tokens: 0 when on-policy and
        # the engine agrees with the trainer's forward; grows with staleness.
        logprob_diff_mean=float(diff.sum() / n),
        logprob_diff_max=float(diff.max()) if diff.numel() else 0.0,
        adv_abs_mean=float(adv.abs().mean()),
    )
    return metrics
