"""Generation engines behind one protocol, and the torch engine.

An engine holds requests, advances them one decode step at a time, and hands back each
finished request with the logprob of every sampled token under the policy that sampled it
(the *behavior* logprobs the trainer corrects against). It reports its KV-cache use and
loads new weights only when no request of the old version is running.

:class:`TorchEngine` is deliberately minimal: static batches (requests join when the
running batch has drained, finished rows leave at once), a slotted KV cache of
``max_batch × max_seq_len`` token slots, temperature sampling. Continuous batching,
export/import of in-flight requests and pacing come with the engine issue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from laminar.errors import LaminarError
from laminar.model import CachedDecoder


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt to complete. ``meta`` travels untouched to the finished output."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishedOutput:
    """A completed request: response tokens, behavior logprobs and how it ended."""

    request: GenerationRequest
    response_tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per response token
    finish_reason: str  # "eos" | "length"
    version: int
    t_start: float
    t_finish: float

    @property
    def ended(self) -> bool:
        """Whether the response ended with the stop token (else it was cut at the limit)."""
        return self.finish_reason == "eos"

    def text(self, tok) -> str:
        """The response as text, without the stop token: what a reward function scores."""
        return tok.decode(self.response_tokens[:-1] if self.ended else self.response_tokens)


@dataclass(frozen=True)
class KVStats:
    """KV-cache use at one moment, in token slots."""

    used_tokens: int
    capacity_tokens: int
    running: int
    waiting: int


class Engine(Protocol):
    """What a rollout needs from a generation engine."""

    version: int

    def add_request(self, request: GenerationRequest) -> None: ...

    def step(self) -> list[FinishedOutput]: ...

    def has_work(self) -> bool: ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None: ...

    def kv_stats(self) -> KVStats: ...


class TorchEngine:
    """Batched decode with a preallocated KV cache over :class:`CachedDecoder`.

    Parameters
    ----------
    config
        The HF model config (``LlamaConfig``/``Qwen2Config``).
    state
        An HF state dict holding the weights of ``version``.
    eos_token_id, pad_token_id
        Token ids that end a response / fill left padding.
    max_batch, max_seq_len
        The cache holds ``max_batch`` rows of ``max_seq_len`` tokens (prompt + response).
    temperature
        Sampling temperature; behavior logprobs are those of the tempered distribution.
    seed
        Seeds this engine's sampler.

    Examples
    --------
    >>> from laminar.model import build_tiny_policy, load_policy
    >>> import tempfile
    >>> model, tok = load_policy(build_tiny_policy(tempfile.mkdtemp()))
    >>> eng = TorchEngine(model.config, model.state_dict(), eos_token_id=tok.eos_token_id,
    ...                   pad_token_id=tok.pad_token_id, max_batch=4, max_seq_len=32)
    >>> eng.add_request(GenerationRequest("a", (1, 5, 6), max_new_tokens=4))
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
        temperature: float = 1.0,
        seed: int = 0,
        version: int = 0,
        device: str = "cpu",
    ) -> None:
        self.decoder = CachedDecoder(config, state, device=device)
        self.version = version
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.temperature = temperature
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._waiting: deque[GenerationRequest] = deque()
        self._rows: list[_Row] = []
        self._cache: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._col = 0  # next cache column to write
        self._last: torch.Tensor | None = None  # last sampled token per row

    # -- protocol ---------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        n = len(request.prompt_tokens)
        if n == 0:
            raise LaminarError(f"request {request.request_id!r} has an empty prompt")
        if n + request.max_new_tokens > self.max_seq_len:
            raise LaminarError(
                f"request {request.request_id!r}: prompt ({n}) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds the engine's max_seq_len "
                f"({self.max_seq_len}); raise rollout.max_seq_len or lower max_new_tokens"
            )
        self._waiting.append(request)

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting)

    def kv_stats(self) -> KVStats:
        used = sum(r.n_prompt + len(r.tokens) for r in self._rows)
        return KVStats(
            used_tokens=used,
            capacity_tokens=self.max_batch * self.max_seq_len,
            running=len(self._rows),
            waiting=len(self._waiting),
        )

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        if self._rows:
            raise LaminarError(
                f"cannot load version {version} while {len(self._rows)} requests of version "
                f"{self.version} are running; drain the batch first"
            )
        self.decoder.load(state)
        self.version = version

    def step(self) -> list[FinishedOutput]:
        """Advance every running request by one token (admitting a new batch if idle)."""
        if not self._rows:
            if not self._waiting:
                return []
            logits = self._prefill()
        else:
            logits = self._decode()
        return self._sample(logits)

    # -- internals --------------------------------------------------------------------
    def _prefill(self) -> torch.Tensor:
        batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
        plen = max(len(req.prompt_tokens) for req in batch)
        width = plen + max(req.max_new_tokens for req in batch)
        bsz = len(batch)
        tokens = torch.full((bsz, plen), self.pad, dtype=torch.long)
        self._valid = torch.zeros(bsz, width, dtype=torch.bool, device=self.device)
        now = time.time()
        self._rows = []
        for i, req in enumerate(batch):
            n = len(req.prompt_tokens)
            tokens[i, plen - n :] = torch.tensor(req.prompt_tokens)
            self._valid[i, plen - n : plen] = True
            self._rows.append(_Row(req, n, now))
        self._cache = self.decoder.new_cache(bsz, width)
        positions = (self._valid[:, :plen].long().cumsum(1) - 1).clamp(min=0)
        self._col = plen
        return self.decoder.forward(tokens.to(self.device), positions, self._cache, 0, self._valid)

    def _decode(self) -> torch.Tensor:
        assert self._cache is not None and self._valid is not None and self._last is not None
        self._valid[:, self._col] = True
        positions = torch.tensor(
            [[r.n_prompt + len(r.tokens) - 1] for r in self._rows], device=self.device
        )
        logits = self.decoder.forward(
            self._last[:, None], positions, self._cache, self._col, self._valid
        )
        self._col += 1
        return logits

    def _sample(self, logits: torch.Tensor) -> list[FinishedOutput]:
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]
        tok_logp = logp.gather(1, tok[:, None])[:, 0]
        now = time.time()
        finished, keep = [], []
        for i, (row, t, lp) in enumerate(
            zip(self._rows, tok.tolist(), tok_logp.tolist(), strict=True)
        ):
            row.tokens.append(t)
            row.logprobs.append(lp)
            reason = None
            if t == self.eos:
                reason = "eos"
            elif len(row.tokens) >= row.request.max_new_tokens:
                reason = "length"
            if reason is None:
                keep.append(i)
            else:
                finished.append(row.finish(reason, self.version, now))
        if len(keep) < len(self._rows):
            # Finished rows leave the batch now, so the tail of a batch decodes only the
            # requests still running (a cheap gather of the cache rows).
            self._rows = [self._rows[i] for i in keep]
            if keep:
                idx = torch.tensor(keep, device=self.device)
                self._cache = self._cache.index_select(2, idx)
                self._valid = self._valid.index_select(0, idx)
                tok = tok.index_select(0, idx)
            else:
                self._cache = self._valid = None
        self._last = tok if keep else None
        return finished


@dataclass
class _Row:
    request: GenerationRequest
    n_prompt: int
    t_start: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def finish(self, reason: str, version: int, now: float) -> FinishedOutput:
        return FinishedOutput(
            request=self.request,
            response_tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason=reason,
            version=version,
            t_start=self.t_start,
            t_finish=now,
        )
