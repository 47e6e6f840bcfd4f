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

``kv_stats().used_tokens`` counts the KV entries written, and never exceeds
``capacity_tokens`` (a property test checks it after every step).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch

from laminar.engine import (
    EngineError,
    FinishedOutput,
    GenerationRequest,
    KVStats,
    RequestState,
    default_seed,
)
from laminar.model import CachedDecoder
from laminar.sampling import sample, uniforms


@dataclass
class _Row:
    state: RequestState
    cache_len: int  # KV entries written: the context minus the last sampled token
    admitted: int  # admission order, for LIFO preemption


class TorchEngine:
    """Continuous-batching engine over :class:`CachedDecoder` (see the module docstring).

    Parameters
    ----------
    config, state
        The HF model config (``LlamaConfig``/``Qwen2Config``) and a state dict of
        ``version``'s weights.
    eos_token_id, pad_token_id
        The end-of-sequence token (stops a request unless it sets ``ignore_eos``)
        and the padding token.
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
    >>> from laminar.engine import SamplingParams
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
        pad_token_id: int,
        max_batch: int = 64,
        max_seq_len: int = 256,
        kv_capacity_tokens: int | None = None,
        seed: int = 0,
        version: int = 0,
        device: str = "cpu",
        tokenizer=None,
        pacer=None,
    ) -> None:
        if max_batch <= 0 or max_seq_len <= 1:
            raise EngineError(f"max_batch={max_batch}, max_seq_len={max_seq_len}: need ≥ 1 and ≥ 2")
        capacity = max_batch * max_seq_len if kv_capacity_tokens is None else kv_capacity_tokens
        if not 1 < capacity <= max_batch * max_seq_len:
            raise EngineError(
                f"kv_capacity_tokens={kv_capacity_tokens} must be in [2, max_batch * "
                f"max_seq_len = {max_batch * max_seq_len}]"
            )
        self.decoder = CachedDecoder(config, state, device=device)
        self.device = torch.device(device)
        self.version = version
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.capacity = capacity
        self.seed = seed
        self.tokenizer = tokenizer
        self.pacer = pacer
        self._cache = self.decoder.new_cache(max_batch, max_seq_len)
        self._rows: list[_Row] = []
        self._waiting: deque[RequestState] = deque()
        self._admissions = count()
        self.counters = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "preemptions": 0,
            "finished": 0,
            "exported": 0,
            "imported": 0,
        }

    # -- the protocol -------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        self._check(request)
        seed = request.params.seed
        if seed is None:
            seed = default_seed(self.seed, request.request_id)
        self._waiting.append(RequestState(request, seed=seed, t_start=time.time()))

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting)

    def request_ids(self) -> list[str]:
        running = sorted(self._rows, key=lambda r: r.admitted)
        return [r.state.request_id for r in running] + [s.request_id for s in self._waiting]

    def kv_stats(self) -> KVStats:
        return KVStats(
            used_tokens=sum(r.cache_len for r in self._rows),
            capacity_tokens=self.capacity,
            running=len(self._rows),
            waiting=len(self._waiting),
        )

    def stats(self) -> dict[str, float]:
        return {**self.counters, **(self.pacer.stats() if self.pacer is not None else {})}

    def export(self, request_ids: list[str]) -> list[RequestState]:
        wanted = list(dict.fromkeys(request_ids))
        where = {r.state.request_id: i for i, r in enumerate(self._rows)}
        queued = {s.request_id: s for s in self._waiting}
        unknown = [rid for rid in wanted if rid not in where and rid not in queued]
        if unknown:
            raise EngineError(f"export: no request {unknown[0]!r} in flight on this engine")
        states = {}
        for i in sorted((where[rid] for rid in wanted if rid in where), reverse=True):
            states[self._rows[i].state.request_id] = self._rows[i].state
            self._remove_row(i)
        self._waiting = deque(s for s in self._waiting if s.request_id not in wanted)
        states.update({rid: queued[rid] for rid in wanted if rid in queued})
        self.counters["exported"] += len(wanted)
        return [states[rid].moved() for rid in wanted]

    def import_(self, states: list[RequestState], *, allow_version_change: bool = False) -> None:
        present = set(self.request_ids())
        for s in states:
            self._check(s.request)
            rid = s.request_id
            if rid in present:
                raise EngineError(f"import: request {rid!r} is already in flight here")
            present.add(rid)
            if not len(s.tokens) == len(s.logprobs) == len(s.token_versions):
                raise EngineError(
                    f"import: request {rid!r} has {len(s.tokens)} tokens, "
                    f"{len(s.logprobs)} logprobs and {len(s.token_versions)} versions"
                )
            if len(s.tokens) >= s.request.params.max_new_tokens:
                raise EngineError(f"import: request {rid!r} already has all its tokens")
            if s.tokens and s.token_versions[-1] != self.version and not allow_version_change:
                raise EngineError(
                    f"import: request {rid!r} was sampled by version {s.token_versions[-1]} "
                    f"and this engine holds version {self.version}; import it on an engine "
                    "of that version, or pass allow_version_change=True to mix versions"
                )
        self._waiting.extendleft(reversed(states))
        self.counters["imported"] += len(states)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        partial = sum(1 for s in self._waiting if s.tokens)
        if self._rows or partial:
            raise EngineError(
                f"cannot load version {version}: {len(self._rows)} running and {partial} "
                f"preempted requests hold tokens of version {self.version}; drain the "
                "batch or export them first"
            )
        self.decoder.load(state)
        self.version = version

    def close(self) -> None:
        self._rows.clear()
        self._waiting.clear()
        self._cache = torch.empty(0)

    def step(self) -> list[FinishedOutput]:
        """Make room, admit, decode + prefill, sample, finish (see the module docstring)."""
        t0 = time.perf_counter()
        self._make_room()
        n_old = len(self._rows)
        admitted = self._admit()
        if not self._rows:
            return []
        logits = []
        context = sum(r.cache_len for r in self._rows[:n_old])
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
        prefill_tokens = sum(s.context_len for s in admitted)
        if admitted:
            width = max(s.context_len for s in admitted)
            toks = torch.full((len(admitted), width), self.pad, dtype=torch.long)
            for i, s in enumerate(admitted):
                toks[i, : s.context_len] = torch.tensor(s.request.prompt_tokens + tuple(s.tokens))
            lengths = torch.tensor([s.context_len for s in admitted])
            view = self._cache[:, :, n_old : n_old + len(admitted)]
            logits.append(self.decoder.prefill(toks.to(self.device), lengths.to(self.device), view))
        finished = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])
        self.counters["steps"] += 1
        self.counters["decode_tokens"] += n_old
        self.counters["prefill_tokens"] += prefill_tokens
        if self.pacer is not None:
            self.pacer.pace(t0, batch=n_old, context_tokens=context, prefill_tokens=prefill_tokens)
        return finished

    # -- internals ------------------------------------------------------------------------
    def _check(self, request: GenerationRequest) -> None:
        rid = request.request_id
        request.params.check(rid)
        n = len(request.prompt_tokens)
        if n == 0:
            raise EngineError(f"request {rid!r} has an empty prompt; give at least one token")
        bad = [t for t in request.prompt_tokens if not 0 <= t < self.decoder.vocab_size]
        if bad:
            raise EngineError(
                f"request {rid!r}: prompt token id {bad[0]} is outside the model's vocabulary "
                f"[0, {self.decoder.vocab_size}); encode prompts with the policy's tokenizer"
            )
        if n + request.params.max_new_tokens > self.max_seq_len:
            raise EngineError(
                f"request {rid!r}: prompt ({n}) + max_new_tokens "
                f"({request.params.max_new_tokens}) exceeds the engine's max_seq_len "
                f"({self.max_seq_len}); raise rollout.max_seq_len or lower max_new_tokens"
            )
        if n + request.params.max_new_tokens > self.capacity:
            raise EngineError(
                f"request {rid!r}: prompt ({n}) + max_new_tokens "
                f"({request.params.max_new_tokens}) exceeds the KV capacity "
                f"({self.capacity} tokens); it could never finish here"
            )
        if request.params.stop and self.tokenizer is None:
            raise EngineError(
                f"request {rid!r} has stop strings but the engine has no tokenizer; "
                "build the engine with tokenizer=..."
            )

    def _make_room(self) -> None:
        # Every running row writes one KV entry this step.
        while self._rows and sum(r.cache_len + 1 for r in self._rows) > self.capacity:
            i = max(range(len(self._rows)), key=lambda j: self._rows[j].admitted)
            self._waiting.appendleft(self._rows[i].state)
            self._remove_row(i)
            self.counters["preemptions"] += 1

    def _admit(self) -> list[RequestState]:
        admitted: list[RequestState] = []
        # KV entries once this step has run: one more per running row, the context of
        # each admitted one. A request is admitted if, on top of that, the next step's
        # decode (one entry per row, itself included) fits too.
        after = sum(r.cache_len + 1 for r in self._rows)
        while self._waiting and len(self._rows) < self.max_batch:
            s = self._waiting[0]
            if self._rows and after + s.context_len + len(self._rows) + 1 > self.capacity:
                break
            self._waiting.popleft()
            admitted.append(s)
            self._rows.append(_Row(s, cache_len=s.context_len, admitted=next(self._admissions)))
            after += s.context_len
        return admitted

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
        for i, (s, p, t, lp) in enumerate(
            zip(states, params, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.token_versions.append(self.version)
            reason = self._stop_reason(s, p, t)
            if reason is not None:
                done.append((i, reason))
        finished = [FinishedOutput.from_state(states[i], reason, now) for i, reason in done]
        for i, _ in sorted(done, reverse=True):
            self._remove_row(i)
        self.counters["finished"] += len(finished)
        return finished

    def _stop_reason(self, s: RequestState, p, token: int) -> str | None:
        if token == self.eos and not p.ignore_eos:
            return "eos"
        if token in p.stop_token_ids:
            return "stop"
        if p.stop and any(x in self.tokenizer.decode(s.tokens) for x in p.stop):
            return "stop"
        if len(s.tokens) >= p.max_new_tokens:
            return "length"
        return None

    def _remove_row(self, i: int) -> None:
        """Drop row ``i``; the last row moves into its cache slot, keeping rows packed."""
        last = len(self._rows) - 1
        if i != last:
            n = self._rows[last].cache_len
            self._cache[:, :, i, :, :n] = self._cache[:, :, last, :, :n]
            self._rows[i] = self._rows[last]
        self._rows.pop()
