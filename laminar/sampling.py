"""Token sampling whose randomness is a pure function of ``(seed, token index)``.

An engine that keeps a ``torch.Generator`` per request cannot hand a half-finished request
to another engine and have it continue as it would have: the generator's position is
engine state. Here each draw is a counter-based hash instead — token ``i`` of a request
with seed ``s`` uses ``u = uniform(s, i)`` — so a request's random stream is carried by its
seed and length alone, does not depend on which other requests share its batch, and
survives export, re-prefill and import anywhere.

A token is drawn by inverting the CDF of the (filtered) tempered distribution at ``u``.
The filters apply in HF's and vLLM's order: top-k, then top-p over the top-k tokens'
renormalised mass. The behavior logprob returned with it is that of the tempered
distribution *before* top-k/top-p filtering (what the trainer recomputes with
``log_softmax(logits / T)``); greedy rows (``T = 0``) report the ``T = 1`` logprob.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # Steele et al.'s SplitMix64 finaliser; numpy uint64 arithmetic wraps modulo 2**64.
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def uniforms(seeds, counters) -> np.ndarray:
    """One uniform in ``[0, 1)`` per ``(seed, counter)`` pair (float64, 53 random bits).

    >>> u = uniforms([7, 7, 8], [0, 1, 0])
    >>> bool(((0 <= u) & (u < 1)).all()), bool(u[0] == uniforms([7], [0])[0])
    (True, True)
    """
    s = np.asarray(seeds, dtype=np.uint64)
    c = np.asarray(counters, dtype=np.uint64)
    x = _splitmix64(s ^ _splitmix64(c))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def tempered_log_softmax(logits: torch.Tensor, temperature) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last axis: what the engines sample
    from and the trainer recomputes (the same function, so the two agree bit for bit).

    A vanishing temperature overflows ``logits / T`` to +inf, or all of a row whose
    logits are negative to -inf (NaN after the softmax); such a row is shifted by its
    max first, which gives its T -> 0 limit: the argmax with logprob 0. Other rows are
    computed as written.

    >>> tempered_log_softmax(torch.tensor([[1.0, 3.0], [-1.0, -3.0]]), 1e-39).tolist()
    [[-inf, 0.0], [0.0, -inf]]
    """
    tempered = logits / temperature
    over = torch.isposinf(tempered).any(-1, keepdim=True)
    over |= torch.isneginf(tempered).all(-1, keepdim=True)
    if over.any():
        shifted = (logits - logits.amax(-1, keepdim=True)) / temperature
        tempered = torch.where(over, shifted, tempered)
    return torch.log_softmax(tempered, dim=-1)


def sample(
    logits: torch.Tensor,
    u: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` ``[n, vocab]``; return ``(tokens, logprobs)``.

    ``u``, ``temperature``, ``top_k`` and ``top_p`` hold one value per row. Each row's
    result depends only on that row's logits and parameters.
    """
    logits = logits.float()
    n, vocab = logits.shape
    dev = logits.device
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev)
    greedy = temp <= 0
    scale = torch.where(greedy, torch.ones_like(temp), temp)
    logp = tempered_log_softmax(logits, scale[:, None])
    probs = logp.double().exp()
    k = np.asarray(top_k)
    p = np.asarray(top_p, dtype=np.float64)
    if ((k > 0) & (k < vocab)).any() or (p < 1).any():
        probs = probs * _filter_mask(probs, k, p)
    cdf = probs.cumsum(-1)
    target = torch.as_tensor(u, dtype=torch.float64, device=dev) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
    # u * total can round up to total: step back onto the last token with mass.
    dead = probs.gather(1, tokens[:, None])[:, 0] <= 0
    if dead.any():
        last = vocab - 1 - (probs.flip(-1) > 0).long().argmax(-1)
        tokens = torch.where(dead, last, tokens)
    if greedy.any():
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _filter_mask(probs: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Keep, per row, the ``top_k`` most likely tokens, then of those the smallest set
    whose share of their mass is ≥ ``top_p`` — top-p over the distribution renormalised
    after top-k, as HF's warpers and vLLM's sampler apply them (top-p over the full
    distribution kept more: probabilities [.3, .25, .2, .15, .1], k = 3, p = 0.7 kept
    three tokens where they keep two).

    >>> p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10]], dtype=torch.float64)
    >>> _filter_mask(p, np.array([3]), np.array([0.7])).tolist()
    [[1.0, 1.0, 0.0, 0.0, 0.0]]
    """
    n, vocab = probs.shape
    dev = probs.device
    # Stable: tied tokens keep id order, so top-1 is the argmax (the first maximum) and
    # which of them a filter keeps does not depend on a device's sort.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = torch.as_tensor(np.where(top_k > 0, np.minimum(top_k, vocab), vocab), device=dev)
    keep_sorted = rank < k[:, None]
    # Nucleus, over what top-k kept: a token stays if the mass strictly before it is
    # below top_p of the kept mass (not divided: no rounding of a row that keeps all).
    kept_p = sorted_p * keep_sorted
    before = kept_p.cumsum(-1) - kept_p
    # (only rows that filter: rounding can sum a row's mass past 1, and `before < 1`
    # would then drop its tail, so a row's draw would depend on its neighbours' filters)
    p = torch.as_tensor(top_p, dtype=torch.float64, device=dev)[:, None]
    keep_sorted &= (before < p * kept_p.sum(-1, keepdim=True)) | (p >= 1)
    keep_sorted[:, 0] = True
    mask = torch.zeros_like(keep_sorted)
    mask.scatter_(1, order, keep_sorted)
    return mask.to(probs.dtype)
