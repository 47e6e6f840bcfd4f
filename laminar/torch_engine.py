"""The torch engine: continuous batching over a slotted KV cache, on CPU or CUDA.

Each running request owns one row of a preallocated cache (:class:`CachedDecoder`) and
rows stay packed at the front, so every step works on a plain view of the cache. A step:

1. **make room** — the running requests each need one more KV slot; if that would exceed
   the token capacity ``C_max``, the most recently admitted requests are *preempted*:
   their cache rows are dropped and they go back to the head of the queue, to resume by
   re-prefill (their sampling stream is ``(seed, token index)``, so nothing changes);
2. **admit** waiting requests (imported and preempted ones first) while a row is free and
   their context plus one decode step for everyone fits in ``C_max``;
3. **compute** one decode forward for the running rows and one prefill forward for the
   admitted ones, then sample a token for every row at once;
4. **finish** rows that hit a stop condition; the last row moves into the freed one.

Steps 1-2 are the rule every engine shares (:func:`laminar.engine_base.plan_admission`), and
the queue, request checks, export/import and weight-load refusal are
:class:`laminar.engine_base.EngineBase`'s: this module is the cache and the compute.

``kv_stats().used_tokens`` counts the KV entries written, and never exceeds
``capacity_tokens`` (a property test checks it after every step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch

from laminar.engine import FinishedOutput, RequestState
from laminar.engine_base import EngineBase
from laminar.model import CachedDecoder
from laminar.sampling import sample, uniforms


@dataclass
class _Row:
    state: RequestState
    cache_len: int  # KV entries written: the context minus the last sampled token
    admitted: int  # admission order, for LIFO preemption


class TorchEngine(EngineBase):
    """Continuous-batching engine over :class:`CachedDecoder` (see the module docstring).

    Parameters
    ----------
    config, state
        The HF model config (``LlamaConfig``/``Qwen2Config``) and a state dict of
        ``version``'s weights.
    eos_token_id, pad_token_id
        The end-of-sequence token (stops a request unless it sets ``ignore_eos``)
        and the padding token (``None``: the tokenizer has none; 0 pads).
    max_batch
        Rows of the cache: the most requests decoding at once.
    max_seq_len
        Columns of the cache: the longest prompt + response a request may reach.
    kv_capacity_tokens
        ``C_max``: KV entries the engine may hold at once (default: every slot,
        ``max_batch * max_seq_len``). A smaller value emulates a device whose KV memory
        binds before its batch limit.
    seed
        The engine seed; a request without its own seed gets one derived from this and
        its id (:func:`laminar.engine.default_seed`).
    tokenizer
        Needed only for requests with ``stop`` strings.
    pacer
        A :class:`laminar.pacing.Pacer` makes each step last as long as the modelled
        accelerator would take (``None``: as fast as this machine goes).

    Examples
    --------
    >>> from laminar.engine import GenerationRequest, SamplingParams
    >>> from laminar.model import build_tiny_policy, load_policy
    >>> import tempfile
    >>> model, tok = load_policy(build_tiny_policy(tempfile.mkdtemp()))
    >>> eng = TorchEngine(model.config, model.state_dict(), eos_token_id=tok.eos_token_id,
    ...                   pad_token_id=tok.pad_token_id, max_batch=4, max_seq_len=32)
    >>> eng.add_request(GenerationRequest("a", (1, 5, 6), SamplingParams(max_new_tokens=4)))
    >>> outs = []
    >>> while eng.has_work():
    ...     outs += eng.step()
    >>> len(outs[0].response_tokens) == len(outs[0].logprobs) <= 4
    True
    """

    def __init__(
        self,
        config,
        state: dict[str, torch.Tensor],
        *,
        eos_token_id: int,
        pad_token_id: int | None,
        max_batch: int = 64,
        max_seq_len: int = 256,
        kv_capacity_tokens: int | None = None,
        seed: int = 0,
        version: int = 0,
        device: str = "cpu",
        tokenizer=None,
        pacer=None,
    ) -> None:
        super().__init__(
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            kv_capacity_tokens=kv_capacity_tokens,
            seed=seed,
            version=version,
            tokenizer=tokenizer,
            pacer=pacer,
        )
        self.decoder = CachedDecoder(config, state, device=device)
        self.vocab_size = self.decoder.vocab_size
        self.device = torch.device(device)
        self._cache = self.decoder.new_cache(max_batch, max_seq_len)
        self._rows: list[_Row] = []
        self._admissions = count()

    # -- the protocol (the rest is EngineBase's) ----------------------------------------
    def close(self) -> None:
        self._rows.clear()
        self._waiting.clear()
        self._cache = torch.empty(0)

    def step(self) -> list[FinishedOutput]:
        """Make room, admit, decode + prefill, sample, finish (see the module docstring)."""
        start = self._begin_step()
        if not self._rows:
            return []
        n_old, admitted = start.decoding, start.admitted  # admitted rows come last
        logits = []
        if n_old:
            last = torch.tensor([r.state.tokens[-1] for r in self._rows[:n_old]])
            cols = torch.tensor([r.cache_len for r in self._rows[:n_old]])
            logits.append(
                self.decoder.decode(
                    last.to(self.device), cols.to(self.device), self._cache[:, :, :n_old]
                )
            )
            for r in self._rows[:n_old]:
                r.cache_len += 1
        if admitted:
            width = max(s.context_len for s in admitted)
            toks = torch.full((len(admitted), width), self.pad, dtype=torch.long)
            for i, s in enumerate(admitted):
                toks[i, : s.context_len] = torch.tensor([*s.request.prompt_tokens, *s.tokens])
            lengths = torch.tensor([s.context_len for s in admitted])
            view = self._cache[:, :, n_old : n_old + len(admitted)]
            logits.append(self.decoder.prefill(toks.to(self.device), lengths.to(self.device), view))
        finished = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])
        self._end_step(start, finished)
        return finished

    # -- EngineBase's hooks -----------------------------------------------------------------
    # (_running_states and _used_tokens are read from other threads too, through
    # kv_stats: sorted() and tuple() copy the row list in one step under the GIL, where
    # a generator over it could meet a row twice as _remove_row moves it)
    def _running_states(self) -> list[RequestState]:
        return [r.state for r in sorted(self._rows, key=lambda r: r.admitted)]

    def _start(self, state: RequestState) -> None:
        # The next compute prefills its whole context into the first free row.
        self._rows.append(_Row(state, cache_len=state.context_len, admitted=next(self._admissions)))

    def _stop(self, request_ids: list[str]) -> list[RequestState]:
        where = {r.state.request_id: i for i, r in enumerate(self._rows)}
        states = [self._rows[where[rid]].state for rid in request_ids]
        for i in sorted((where[rid] for rid in request_ids), reverse=True):
            self._remove_row(i)  # from the back: it moves the last row forward
        return states

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self.decoder.load(state)

    def _used_tokens(self) -> int:
        return sum(r.cache_len for r in tuple(self._rows))

    # -- internals ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor) -> list[FinishedOutput]:
        states = [r.state for r in self._rows]
        params = [s.request.params for s in states]
        tokens, logprobs = sample(
            logits,
            uniforms([s.seed for s in states], [len(s.tokens) for s in states]),
            np.array([p.temperature for p in params]),
            np.array([p.top_k for p in params]),
            np.array([p.top_p for p in params]),
        )
        now = time.time()
        done: list[tuple[int, str]] = []
        for i, (s, t, lp) in enumerate(
            zip(states, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.token_versions.append(self.version)
            reason = self._stop_reason(s, t)
            if reason is not None:
                done.append((i, reason))
        finished = [FinishedOutput.from_state(states[i], reason, now) for i, reason in done]
        for i, _ in sorted(done, reverse=True):
            self._remove_row(i)
        return finished

    def _remove_row(self, i: int) -> None:
        """Drop row ``i``; the last row moves into its cache slot, keeping rows packed."""
        last = len(self._rows) - 1
        if i != last:
            n = self._rows[last].cache_len
            self._cache[:, :, i, :, :n] = self._cache[:, :, last, :, :n]
            self._rows[i] = self._rows[last]
        self._rows.pop()
