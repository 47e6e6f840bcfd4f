"""laminar.sampling's filters against the samplers users compare it with: top-k and top-p
applied in HF's and vLLM's order (top-k, renormalise, top-p), behavior logprobs of the
unfiltered tempered distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laminar.sampling import _filter_mask, sample, tempered_log_softmax, uniforms


def hf_kept(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens HF's warpers leave drawable (top-k, then top-p on what it left)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores)


def test_top_p_is_taken_over_what_top_k_kept():
    """Probabilities [.3, .25, .2, .15, .1], k = 3, p = 0.7: HF and vLLM renormalise the
    three tokens top-k keeps (.4, .33, .27) and top-p keeps two. The nucleus used to be
    measured against the full distribution (.3 + .25 < .7): three."""
    probs = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10]], dtype=torch.float64)
    mask = _filter_mask(probs, np.array([3]), np.array([0.7]))
    assert mask.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    assert mask.bool().tolist() == hf_kept(probs.log(), 3, 0.7).tolist()


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (5, 1.0), (5, 0.8), (20, 0.5), (3, 0.95)])
def test_the_filters_keep_what_hfs_warpers_keep(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(64, 300, dtype=torch.float64) * 3
    probs = torch.softmax(logits, -1)
    n = len(logits)
    mask = _filter_mask(probs, np.full(n, top_k), np.full(n, top_p))
    assert torch.equal(mask.bool(), hf_kept(logits, top_k, top_p))


def test_draws_follow_the_filtered_distribution_and_logprobs_the_unfiltered_one():
    """With both filters on, every draw is a token HF would keep, drawn in proportion to
    its renormalised probability; its behavior logprob is still that of the unfiltered
    tempered distribution (docs/engines.md: what the trainer recomputes)."""
    torch.manual_seed(1)
    vocab, n, temp, k, p = 8, 40_000, 0.7, 4, 0.7
    logits = (torch.randn(1, vocab) * 2).expand(n, vocab).contiguous()
    u = uniforms(np.full(n, 12345, dtype=np.uint64), np.arange(n))
    tokens, logprobs = sample(logits, u, np.full(n, temp), np.full(n, k), np.full(n, p))
    tempered = tempered_log_softmax(logits[:1], temp)[0]
    kept = hf_kept(tempered.double()[None], k, p)[0]
    assert kept.sum() < k  # (top-p binds after top-k here)
    want = torch.where(kept, tempered.double().exp(), 0.0)
    want /= want.sum()
    seen = torch.bincount(tokens, minlength=vocab).double() / n
    assert torch.allclose(seen, want, atol=0.01)
    assert torch.equal(logprobs, tempered[tokens])
