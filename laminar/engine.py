"""The generation-engine contract: requests, sampling parameters, in-flight state.

An engine holds requests, advances them one decode step at a time, and hands back each
finished request with the logprob of every sampled token under the policy that sampled it
(the *behavior* logprobs the trainer corrects against). Besides generating, an engine
must let the rollout tier manage it while it runs:

* :meth:`Engine.kv_stats` — KV-cache use now (repack decides from it);
* :meth:`Engine.export` / :meth:`Engine.import_` — move unfinished requests between
  engines (repack, recovery). A request's whole state is a :class:`RequestState`: its
  tokens and logprobs so far, sampling parameters and seed. Sampling randomness is a pure
  function of ``(seed, token index)`` (:mod:`laminar.sampling`), so a request resumed
  elsewhere by re-prefilling its tokens continues exactly as it would have unmoved;
* :meth:`Engine.load_weights` — in place, refused while a request of the old version is
  in flight (the rollout drains or exports first).

Implementations: :class:`laminar.torch_engine.TorchEngine` (continuous batching over a
slotted KV cache, CPU or CUDA) and :class:`laminar.vllm_engine.VLLMEngine`. Every engine
passes the shipped contract suite, :class:`laminar.testing.EngineContract`. What they
share beyond this contract — the request checks, the finish reason, the admission rule
and :class:`~laminar.engine_base.EngineBase` — is in :mod:`laminar.engine_base`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from laminar.errors import LaminarError


class EngineError(LaminarError):
    """A request or call the engine cannot take; the message names what to change."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    ``temperature=0`` is greedy decoding. ``top_k=0`` and ``top_p=1`` switch those filters
    off. Generation stops at the engine's end-of-sequence token (unless ``ignore_eos``),
    at any of ``stop_token_ids`` (both kept as the last response token), when the decoded
    response contains one of ``stop`` (the tokens are kept; ``finish_reason`` is
    ``"stop"``), or after ``max_new_tokens``. ``seed=None`` lets the engine derive a seed
    from its own seed and the request id, so a run is reproducible either way.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens

    def check(self, request_id: str) -> None:
        """Raise :class:`EngineError` naming the first bad field."""
        where = f"request {request_id!r}: sampling"
        real, integral = numbers.Real, numbers.Integral
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise EngineError(f"{where} max_new_tokens={self.max_new_tokens!r}; must be ≥ 1")
        t = self.temperature
        if not (isinstance(t, real) and t >= 0 and math.isfinite(t)):
            raise EngineError(f"{where} temperature={t!r}; must be ≥ 0 (0: greedy)")
        if not (isinstance(self.top_p, real) and 0 < self.top_p <= 1):
            raise EngineError(f"{where} top_p={self.top_p!r}; must be in (0, 1] (1: off)")
        if not isinstance(self.top_k, integral) or self.top_k < 0:
            raise EngineError(f"{where} top_k={self.top_k!r}; must be an integer ≥ 0 (0: off)")
        # A bare string or id would be read element by element, or fail in the step.
        if not _collection_of(self.stop_token_ids, integral):
            raise EngineError(
                f"{where} stop_token_ids={self.stop_token_ids!r}; must be a tuple of token "
                "ids, e.g. (7,)"
            )
        if not _collection_of(self.stop, str):
            raise EngineError(
                f"{where} stop={self.stop!r}; must be a tuple of strings, e.g. ('\\n\\n',)"
            )
        if any(not s for s in self.stop):
            raise EngineError(f"{where} stop contains an empty string; remove it")
        if self.seed is not None and not (
            isinstance(self.seed, numbers.Integral) and 0 <= self.seed < 2**64
        ):
            raise EngineError(
                f"{where} seed={self.seed!r}; must be an integer in [0, 2**64) or None"
            )


def _collection_of(values, kind) -> bool:
    return (
        isinstance(values, Collection)
        and not isinstance(values, (str, bytes))
        and all(isinstance(v, kind) for v in values)
    )


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt to complete. ``meta`` travels untouched to the finished output."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestState:
    """Everything needed to continue a request on another engine.

    The sampler's random stream is ``(seed, len(tokens))``: nothing else to carry.
    ``token_versions`` is the weight version that sampled each token.
    """

    request: GenerationRequest
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    t_start: float = math.nan
    n_moves: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context_len(self) -> int:
        """Tokens a (re-)prefill writes to the KV cache: prompt plus response so far."""
        return len(self.request.prompt_tokens) + len(self.tokens)

    def moved(self) -> RequestState:
        """A copy counted as moved once more (what :meth:`Engine.export` hands out)."""
        return replace(
            self,
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            token_versions=list(self.token_versions),
            n_moves=self.n_moves + 1,
        )


@dataclass(frozen=True)
class FinishedOutput:
    """A completed request: response tokens, behavior logprobs and how it ended."""

    request: GenerationRequest
    response_tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per response token
    token_versions: np.ndarray  # int32, the version that sampled each token
    finish_reason: str  # "eos" | "stop" | "length"
    version: int  # the version of the last token
    t_start: float
    t_finish: float
    n_moves: int = 0

    @property
    def ended(self) -> bool:
        """Whether the response ended on its own (stop token/string), not at the limit."""
        return self.finish_reason in ("eos", "stop")

    def text(self, tok) -> str:
        """The response as text, without a final stop token (eos or one of
        ``stop_token_ids``; a stop string stays): what a reward function scores."""
        resp = self.response_tokens
        stop_token = self.finish_reason == "stop" and (
            len(resp) and int(resp[-1]) in self.request.params.stop_token_ids
        )
        if self.finish_reason == "eos" or stop_token:
            resp = resp[:-1]
        return tok.decode(resp)

    @classmethod
    def from_state(
        cls, state: RequestState, reason: str, t_finish: float, version: int | None = None
    ) -> FinishedOutput:
        """``state`` ended with ``reason``. Its version is its last token's; one with no
        token yet (a recovered request dropped before it decoded) takes ``version``."""
        if state.token_versions:
            version = state.token_versions[-1]
        elif version is None:
            raise ValueError(f"request {state.request_id!r} has no token: give its version")
        return cls(
            request=state.request,
            response_tokens=np.asarray(state.tokens, dtype=np.int32),
            logprobs=np.asarray(state.logprobs, dtype=np.float32),
            token_versions=np.asarray(state.token_versions, dtype=np.int32),
            finish_reason=reason,
            version=version,
            t_start=state.t_start,
            t_finish=t_finish,
            n_moves=state.n_moves,
        )


@dataclass(frozen=True)
class KVStats:
    """KV-cache use at one moment, in tokens. ``waiting_tokens``: the contexts of the
    waiting requests, the KV they take once admitted (new, imported or preempted ones);
    ``used_tokens + waiting_tokens`` is what the requests here will hold."""

    used_tokens: int
    capacity_tokens: int
    running: int
    waiting: int
    waiting_tokens: int = 0

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens


@runtime_checkable
class Engine(Protocol):
    """What the rollout tier needs from a generation engine.

    Methods are called from one thread at a time (the rollout serialises them).
    """

    version: int

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; raise :class:`EngineError` if it can never run here."""

    def step(self) -> list[FinishedOutput]:
        """Admit what fits, advance every running request one token; return those done."""

    def has_work(self) -> bool:
        """Whether any request is running or waiting."""

    def request_ids(self) -> list[str]:
        """Ids of every request in flight (running or waiting), oldest first."""

    def in_flight(self) -> list[RequestState]:
        """The in-flight requests' states as of the last step, read-only (the
        partial-response log reads their tokens between steps)."""

    def finishing(self) -> list[FinishedOutput]:
        """While a paced step waits out its modelled time (``wait_hook``): the outputs it
        finished, no longer in flight and not yet returned by :meth:`step`; else []."""

    def kv_stats(self) -> KVStats: ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters (steps, prefill/decode tokens, preemptions, pacing...)."""

    def export(self, request_ids: list[str], *, moved: bool = True) -> list[RequestState]:
        """Remove these requests and return their states (unknown ids raise), each
        counted as moved once more (``n_moves``) unless ``moved=False`` (a request paused
        to resume here, as partial rollout does)."""

    def import_(self, states: list[RequestState], *, allow_version_change: bool = False) -> None:
        """Resume exported requests here (ahead of new requests), re-prefilling them.

        A state whose last token was sampled by another version is refused unless
        ``allow_version_change`` (then its response mixes versions, recorded per token).
        """

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap weights in place; refused while any request of the old version is in flight."""

    def close(self) -> None:
        """Release the engine's resources (processes, memory)."""


def default_seed(engine_seed: int, request_id: str) -> int:
    """The seed of a request that names none: stable across processes (no ``hash()``)."""
    import zlib

    return (engine_seed * 0x9E3779B1 + zlib.crc32(request_id.encode())) % (1 << 63)


def make_engine(rollout, policy_dir: str, *, seed: int, version: int = 0) -> Engine:
    """The engine ``rollout.engine`` names, built from a policy folder for one replica.

    ``rollout`` is a :class:`~laminar.config.RolloutConfig`; its ``pacing`` section, if
    set, paces the engine (:mod:`laminar.pacing`).
    """
    from laminar.model import load_policy, load_tokenizer

    pacer = None
    if rollout.pacing is not None:
        from laminar.pacing import Pacer

        p = rollout.pacing
        pacer = Pacer(
            p.time_model(),
            p.dilation,
            strict=p.strict,
            fused_prefill=p.prefill == "fused",
            length_scale=p.length_scale,
            request_scale=p.request_scale,
        )
    tok = load_tokenizer(policy_dir)
    options = dict(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch=rollout.max_batch,
        max_seq_len=rollout.max_seq_len,
        kv_capacity_tokens=rollout.kv_capacity_tokens,
        seed=seed,
        version=version,
        tokenizer=tok,
        pacer=pacer,
    )
    if rollout.engine == "vllm":
        from laminar.vllm_engine import VLLMEngine

        return VLLMEngine(policy_dir, **options)
    from laminar.torch_engine import TorchEngine

    model, _ = load_policy(policy_dir)
    return TorchEngine(model.config, model.state_dict(), **options)
