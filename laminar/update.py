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
    for i, (p, r, lp, m) in enumerate(
        zip(prompts, responses, behavior_logprobs, loss_masks, strict=True)
    ):
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


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split row indices into micro-batches of similar length, each at most ``max_tokens``
    padded tokens (a single longer row gets a micro-batch of its own).

    Long-tailed lengths make one padded batch mostly padding; sorting by length first
    keeps the short majority in dense micro-batches.

    >>> micro_batches([5, 100, 6, 7], max_tokens=21)
    [[0, 2, 3], [1]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def grpo_step(
    model,
    optimizer: torch.optim.Optimizer,
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    behavior_logprobs: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    pad_token_id: int,
    clip_low: float,
    clip_high: float,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    micro_batch_tokens: int = 4096,
    agg: str = "token-mean",
    clip_c: float | None = None,
) -> dict[str, float]:
    """One optimizer step of GRPO on a global batch; returns metrics.

    The batch is processed in length-sorted micro-batches whose losses are weighted by
    their share of the batch (of its loss tokens for ``token-mean``, of its sequences for
    the ``seq-mean-*`` aggregations), so the gradient equals that of one aggregation over
    the whole batch.
    """
    model.train()
    adv = group_advantages(rewards, group_index)
    n_total = float(sum(np.asarray(m).sum() for m in loss_masks)) or 1.0
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    diff_max = 0.0
    for idx in micro_batches(lengths, micro_batch_tokens):
        batch = pack(
            [prompts[i] for i in idx],
            [responses[i] for i in idx],
            [behavior_logprobs[i] for i in idx],
            [loss_masks[i] for i in idx],
            pad_token_id,
        )
        if agg == "token-mean":
            weight = float(batch.response_mask.sum()) / n_total
        else:
            weight = len(idx) / len(prompts)
        logp = response_logprobs(model, batch, temperature)
        loss, metrics = policy_loss(
            logp,
            batch.old_logprobs,
            adv[idx],
            batch.response_mask,
            clip_low=clip_low,
            clip_high=clip_high,
            clip_c=clip_c,
            agg=agg,
        )
        (loss * weight).backward()
        with torch.no_grad():
            diff = (logp.detach() - batch.old_logprobs).abs() * batch.response_mask
        metrics["loss"] = float(loss.detach())
        # Behavior vs trainer logprob mismatch on the same tokens: 0 when on-policy and
        # the engine agrees with the trainer's forward; grows with staleness.
        metrics["logprob_diff_mean"] = float(diff.sum()) / max(
            float(batch.response_mask.sum()), 1.0
        )
        diff_max = max(diff_max, float(diff.max()) if diff.numel() else 0.0)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + weight * v
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return {
        **sums,
        "grad_norm": float(grad_norm),
        "logprob_diff_max": diff_max,
        "adv_abs_mean": float(adv.abs().mean()),
    }
