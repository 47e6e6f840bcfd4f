"""One GRPO update of an HF causal LM from a list of rewarded trajectories.

No Dask here: the :class:`~laminar.trainer.Trainer` actor calls :func:`grpo_step`, and so
can a test or a notebook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from laminar.errors import DataError, LaminarError
from laminar.losses import (
    aggregate,
    decoupled_policy_loss,
    group_advantages,
    kl_penalty,
    policy_loss,
    tis_policy_loss,
)
from laminar.sampling import tempered_log_softmax

CORRECTIONS = ("none", "tis", "decoupled")
# Metrics that follow the loss aggregation (``agg``); every other metric is a fraction or a
# mean over loss tokens (clip_frac, approx_kl, ratio_mean, ...), whatever ``agg``.
AGG_METRICS = frozenset({"pg_loss", "loss", "entropy", "kl_ref"})
# How a version's metrics combine those of its optimizer steps (laminar.learner.step_means),
# so that they are the metrics of its whole batch: the counts :func:`grpo_step` returns
# weigh the means; a maximum is the steps' maximum.
STEP_COUNTS = ("loss_tokens", "sequences")  # a step's loss tokens and rows (all ranks')
SEQUENCE_METRICS = frozenset({"adv_abs_mean"})  # a mean over the step's rows
PER_STEP_METRICS = frozenset({"grad_norm"})  # of the step itself: their plain mean


def metric_weight(key: str, agg: str) -> str | None:
    """The count of :data:`STEP_COUNTS` that weighs metric ``key`` when a version's steps
    are combined; ``None``: not a weighted mean (a ``*_max`` or ``*_min``, the steps'
    maximum or minimum, or a metric of the step itself).

    >>> [metric_weight(k, "seq-mean-token-sum") for k in ("clip_frac", "loss", "grad_norm")]
    ['loss_tokens', 'sequences', None]
    """
    if key.endswith(("_max", "_min")) or key in PER_STEP_METRICS:
        return None
    if key in SEQUENCE_METRICS or (key in AGG_METRICS and agg != "token-mean"):
        return "sequences"
    return "loss_tokens"  # (AGG_METRICS under token-mean, and every per-token metric)


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded ``prompt + response`` rows and the response-token view of them."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, R] (1 where a response token is trained on)
    old_logprobs: torch.Tensor  # [B, R] behavior logprobs
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]


def _pad(values: Sequence[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def pack(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    behavior_logprobs: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    pad_token_id: int | None,
) -> PackedBatch:
    """Pad a list of trajectories into tensors (right padding, so positions start at 0).
    A tokenizer without a pad token (``None``, as Llama 3's) pads with id 0: the mask
    keeps every padded position out of attention and the loss."""
    bsz = len(prompts)
    plens = torch.tensor([len(p) for p in prompts])
    rlens = torch.tensor([len(r) for r in responses])
    width = int((plens + rlens).max())
    rwidth = int(rlens.max())
    pad = 0 if pad_token_id is None else pad_token_id
    ids = torch.full((bsz, width), pad, dtype=torch.long)
    att = torch.zeros(bsz, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, k = len(p), len(r)
        ids[i, :n] = torch.as_tensor(p, dtype=torch.long)
        ids[i, n : n + k] = torch.as_tensor(r, dtype=torch.long)
        att[i, : n + k] = 1
    rmask, old = _pad(loss_masks, rwidth), _pad(behavior_logprobs, rwidth)
    # A masked (tool) token may have no engine logprob (NaN): it must reach no metric.
    old = torch.where(rmask > 0, old, 0.0)
    return PackedBatch(ids, att, rmask, old, plens, rlens)


def check_prompts(prompts: Sequence[np.ndarray]) -> None:
    """Refuse an empty prompt: no logits predict its first response token (a prompt
    needs a token, e.g. ``<bos>``, to condition on)."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise DataError(
                f"row {i} has an empty prompt: no logits predict its first response "
                "token; give every prompt at least one token (e.g. <bos>)"
            )


def response_logprobs(
    model,
    batch: PackedBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
):
    """Log-probabilities ``[B, R]`` the model gives each response token (0 on padding);
    with ``with_entropy``, also the entropy ``[B, R]`` of each token's distribution,
    differentiable unless ``entropy_grad`` is off (a loss without an entropy term:
    its graph would hold three ``[B, R, vocab]`` tensors through the backward pass)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # Token at column c is predicted by the logits at column c-1.
    bsz, rwidth = batch.response_mask.shape
    cols = batch.prompt_lens[:, None] - 1 + torch.arange(rwidth)[None, :]
    cols = cols.clamp(max=batch.input_ids.shape[1] - 2)
    targets = batch.input_ids.gather(1, cols + 1)
    rows = torch.arange(bsz)[:, None]
    # Only the response positions' distributions, [B, R, vocab]: the prompt's positions
    # ([B, L, vocab], prompts included) are never normalised, nor held for the backward.
    logp = tempered_log_softmax(logits[rows, cols].float(), temperature)  # (the engines' own)
    out = logp.gather(-1, targets[..., None]).squeeze(-1)
    valid = torch.arange(rwidth)[None, :] < batch.response_lens[:, None]
    if not with_entropy:
        return out * valid
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # A token of probability 0 (logprob -inf: every token but the argmax at T -> 0)
        # adds p·log p -> 0, not 0·(-inf) = NaN; clamped, its gradient is 0 as well.
        finite = logp.clamp(min=torch.finfo(logp.dtype).min)
        ent = -(finite.exp() * finite).sum(-1)
    return out * valid, ent * valid


@torch.no_grad()
def trajectory_logprobs(
    model,
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    *,
    pad_token_id: int,
    temperature: float = 1.0,
    micro_batch_tokens: int = 4096,
) -> list[np.ndarray]:
    """``model``'s logprobs of each response's tokens (one array per response), computed
    in length-sorted micro-batches."""
    check_prompts(prompts)
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(responses)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    for idx in micro_batches(lengths, micro_batch_tokens):
        rows = [responses[i] for i in idx]
        zeros = [np.zeros(len(r), np.float32) for r in rows]
        packed = pack([prompts[i] for i in idx], rows, zeros, zeros, pad_token_id)
        lp = response_logprobs(model, packed, temperature)
        for j, i in enumerate(idx):
            out[i] = lp[j, : len(responses[i])].numpy()
    return out


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
    clip_c: float | None = 3.0,
    shard: Sequence[int] | None = None,
    all_reduce=None,
    correction: str = "none",
    is_cap: float = 2.0,
    proximal_logprobs: Sequence[np.ndarray] | None = None,
    ref_model=None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    norm_by_std: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """One optimizer step of GRPO on a global batch; returns metrics.

    The batch is processed in length-sorted micro-batches whose losses are weighted by
    their share of the batch (of its loss tokens for ``token-mean``, of its sequences for
    the ``seq-mean-*`` aggregations), so the gradient equals that of one aggregation over
    the whole batch. So do the metrics: ``loss``, ``pg_loss``, ``entropy`` and ``kl_ref``
    follow ``agg``; the others (``clip_frac``, ``approx_kl``, ``ratio_mean``, …) are over
    the batch's loss tokens. ``loss_tokens`` and ``sequences`` count the batch's loss
    tokens and rows: they weigh the step among a version's (:func:`metric_weight`).

    Data parallelism: with ``shard`` (the rows this rank computes) and ``all_reduce``
    (``all_reduce(tensor, op)`` reduces in place over ranks, ``op`` "sum" or "max"), each
    rank computes its rows' share of the *global* gradient, the shares are summed, and
    every rank takes the same optimizer step. ``rank`` of ``world_size``: if any rank's
    part raises, every rank raises before the gradients are reduced (the others
    :class:`RankStepFailed`, naming it) and no rank takes the step.

    The surrogate (``docs/losses.md``): ``correction="none"`` clips the ratio to the
    behavior policy (the paper's); ``"tis"`` is the truncated-IS policy gradient;
    ``"decoupled"`` clips around the proximal policy — ``proximal_logprobs`` if given,
    else this very forward pass (exact when this is the batch's first optimizer step) —
    with truncated weights for the behavior gap. ``clip_c`` is dual-clip's bound on the
    loss of negative-advantage tokens (3, as ``trainer.clip_c``; ``None``: off).
    ``kl_coef`` adds a KL penalty to
    ``ref_model``; ``entropy_coef`` subtracts an entropy bonus.

    A non-finite loss or gradient skips the step (``metrics["skipped"] == 1``), leaving
    the weights and the optimizer state untouched.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"trainer.correction={correction!r}; choose one of {CORRECTIONS}")
    check_prompts(prompts)  # (every rank checks every row: they all raise, none waits)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    objective = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, agg=agg, is_cap=is_cap)
    rows = list(range(len(prompts))) if shard is None else list(shard)
    # This rank's part: the gradients of ``rows``, accumulated. With ranks, a part that
    # raises still meets the others (failing_together), and all raise: alone, it would
    # leave them waiting in the gradient all-reduce for the group's timeout, or (if it
    # went on to another update) pair that all-reduce with the next step's gradients.
    with failing_together(all_reduce, rank, world_size):
        adv = group_advantages(rewards, group_index, norm_by_std=norm_by_std)
        loss_tokens = float(sum(np.asarray(m).sum() for m in loss_masks))
        n_total = loss_tokens or 1.0
        lengths = [len(prompts[i]) + len(responses[i]) for i in rows]
        sums: dict[str, float] = {}
        diff_max = 0.0
        for local in micro_batches(lengths, micro_batch_tokens) if rows else []:
            idx = [rows[j] for j in local]
            batch = pack(
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                [behavior_logprobs[i] for i in idx],
                [loss_masks[i] for i in idx],
                pad_token_id,
            )
            token_share = float(batch.response_mask.sum()) / n_total
            weight = token_share if agg == "token-mean" else len(idx) / len(prompts)
            logp, ent = response_logprobs(
                model, batch, temperature, with_entropy=True, entropy_grad=bool(entropy_coef)
            )
            mask = batch.response_mask
            prox = None
            if correction == "decoupled" and proximal_logprobs is not None:
                prox = _pad([proximal_logprobs[i] for i in idx], mask.shape[1])
            loss, metrics = _objective(
                correction, logp, batch.old_logprobs, adv[idx], mask, prox, **objective
            )
            metrics["pg_loss"] = float(loss.detach())
            ent_mean = aggregate(ent, mask, agg)
            metrics["entropy"] = float(ent_mean.detach())
            if entropy_coef:
                loss = loss - entropy_coef * ent_mean
            if kl_coef:
                with torch.no_grad():
                    ref = response_logprobs(ref_model, batch, temperature)
                kl = kl_penalty(logp, ref, mask, kind=kl_kind, agg=agg)
                metrics["kl_ref"] = float(kl.detach())
                loss = loss + kl_coef * kl
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
            # A token metric is weighted by the micro-batch's share of the loss tokens, so it
            # is the same whatever the micro-batch size (under seq-mean the loss's weight, a
            # share of the sequences, would skew it towards micro-batches of short rows).
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (weight if k in AGG_METRICS else token_share) * v
    params = [p for p in model.parameters() if p.requires_grad]
    if all_reduce is not None:
        _all_reduce_grads(params, all_reduce)
        if not rows:  # an empty shard reduces the same metrics as the others, as zeros
            empty = torch.zeros(0, 0)
            _, names = _objective(
                correction, empty, empty, torch.zeros(0), empty, None, **objective
            )
            names |= dict.fromkeys(["pg_loss", "entropy", "loss", "logprob_diff_mean"], 0.0)
            sums = dict.fromkeys(list(names) + (["kl_ref"] if kl_coef else []), 0.0)
        keys = sorted(sums)
        packed = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        all_reduce(packed, "sum")  # the weighted metric sums add up over ranks
        sums = dict(zip(keys, packed.tolist(), strict=True))
        worst = torch.tensor([diff_max], dtype=torch.float64)
        all_reduce(worst, "max")
        diff_max = float(worst[0])
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    # A loss that is not finite skips the step too, whatever its gradient: a NaN goes
    # through clamp (the ratio's) and torch.minimum with a gradient of 0, so the step
    # would be taken with NaN metrics. ``sums`` and the gradient are every rank's, summed
    # (a NaN or inf on one rank is on all), so every rank decides alike.
    skipped = not (torch.isfinite(grad_norm) and np.isfinite(sums.get("loss", 0.0)))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {
        **sums,
        "grad_norm": float(grad_norm),
        "logprob_diff_max": diff_max,
        "adv_abs_mean": float(adv.abs().mean()),
        "skipped": float(skipped),
        # (the whole step's, every rank's rows: what weighs it among a version's steps)
        "loss_tokens": loss_tokens,
        "sequences": float(len(prompts)),
    }


class RankStepFailed(LaminarError):
    """Another data-parallel rank failed its part of this update; no rank took the step."""


@contextlib.contextmanager
def failing_together(all_reduce, rank: int, world_size: int):
    """A rank's own work, which every rank of the group runs: if any rank's raises,
    every rank raises as the block ends — the failed one its own error, the others
    :class:`RankStepFailed` naming it — before any reaches a later collective (one
    small all-reduce says which failed). Without ``all_reduce`` (one rank), the block's
    error is raised as it is."""
    if all_reduce is None:
        yield
        return
    failed = torch.zeros(world_size, dtype=torch.float64)
    try:
        yield
    except Exception:
        failed[rank] = 1.0
        all_reduce(failed, "sum")
        raise
    all_reduce(failed, "sum")
    if failed.any():
        which = ", ".join(f"rank {r}" for r in range(world_size) if failed[r])
        raise RankStepFailed(
            f"data-parallel {which} failed its part of this update (its own error is in "
            "its log); no rank took the step: every rank's weights are as before it"
        )


def _objective(
    correction: str,
    logp: torch.Tensor,
    behavior: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    prox: torch.Tensor | None,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
    agg: str,
    is_cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``correction`` and its metrics; ``prox`` ``None``: the proximal
    policy of decoupled PPO is this forward pass (``logp`` detached)."""
    clip = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, agg=agg)
    if correction == "none":
        return policy_loss(logp, behavior, adv, mask, **clip)
    if correction == "tis":
        return tis_policy_loss(logp, behavior, adv, mask, is_cap=is_cap, agg=agg)
    prox = logp.detach() if prox is None else prox
    return decoupled_policy_loss(logp, prox, behavior, adv, mask, is_cap=is_cap, **clip)


def _all_reduce_grads(params: list[torch.Tensor], all_reduce) -> None:
    """Sum every parameter's gradient over ranks, as one flat buffer (one collective)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, "sum")
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
