"""Emulated accelerator timing: GPU-shaped step times for engines that run the tiny model.

A paced engine computes real tokens with the tiny policy, then waits until the time a
named accelerator would have needed for the same step has passed. Eight to thirty-two
replicas then share a 2-core machine with the timing structure of a GPU cluster — decode
steps whose cost depends on batch size and context, long tails that leave replicas
under-used — which is what the schedules are compared on.

The model (a roofline with fixed costs; constants and sources in ``docs/pacing.md``)::

    decode(b, S) = t_fix + max(W / (tp·BW·η_bw), b · F / (tp·FLOPS·η_dec)) + c_seq·b
                   + S · kv / (tp·BW·η_bw)
    prefill(n)   = n · F / (tp·FLOPS·η_pre)

``b`` requests decoding one token each over ``S`` context tokens in all; ``W`` the weight
bytes and ``F = 2·params`` the FLOPs per token; ``kv`` the KV bytes per token. The two
terms in ``max`` cross at the *memory-bound batch limit* ``B = W·FLOPS·η_dec /
(F·BW·η_bw)``: below it a step costs the same whatever the batch, so a replica with few
requests left wastes its device. ``dilation`` multiplies every modelled time alike —
ratios between schedules are unchanged — so that the real compute of many replicas and a
trainer on two cores stays under the modelled times. A pacer that finds its steps
*longer* than the model (the median of a recent window) stops the run with an error:
its timings would be this machine's, not the accelerator's.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from laminar.errors import LaminarError


class PacingError(LaminarError):
    """Real compute is slower than the modelled accelerator: the timing would be wrong."""


@dataclass(frozen=True)
class Accelerator:
    """Per-device figures from the vendor's datasheet (dense bf16, no sparsity)."""

    name: str
    hbm_bytes: float
    mem_bw: float  # bytes/s
    flops: float  # FLOP/s


@dataclass(frozen=True)
class ModelShape:
    """What a decode step of a model reads and computes (bf16 weights and KV)."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.params


ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("H800", hbm_bytes=80e9, mem_bw=3.35e12, flops=989e12),
        Accelerator("H100", hbm_bytes=80e9, mem_bw=3.35e12, flops=989e12),
        Accelerator("H200", hbm_bytes=141e9, mem_bw=4.8e12, flops=989e12),
        Accelerator("A100", hbm_bytes=80e9, mem_bw=2.039e12, flops=312e12),
        Accelerator("L40S", hbm_bytes=48e9, mem_bw=0.864e12, flops=362e12),
    )
}

MODELS = {
    m.name: m
    for m in (
        ModelShape("1.5B", params=1.54e9, layers=28, kv_heads=2, head_dim=128),
        ModelShape("7B", params=7.62e9, layers=28, kv_heads=4, head_dim=128),
        ModelShape("32B", params=32.8e9, layers=64, kv_heads=8, head_dim=128),
        ModelShape("72B", params=72.7e9, layers=80, kv_heads=8, head_dim=128),
    )
}


@dataclass(frozen=True)
class TimeModel:
    """Step times of one replica: ``tp`` devices of ``accelerator`` serving ``model``.

    Efficiencies and fixed costs default to values that reproduce the 7B/H800/TP4
    figures of ``shared/notes/cluster-model.md`` (weight read 1.27 ms, 7.7 µs of compute
    per sequence, 4.8 ns per context token, 6.4 µs per prefill token).

    >>> m = TimeModel.named("H800", "7B", tp=4)
    >>> round(m.decode_time(1, 0) * 1e3, 2), round(m.batch_limit)
    (3.27, 164)
    """

    accelerator: Accelerator
    model: ModelShape
    tp: int = 1
    t_fix: float = 2e-3  # launches, all-reduces, scheduler, per step
    c_seq: float = 2e-6  # per sequence per step (sampling, bookkeeping)
    bw_efficiency: float = 0.9
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.6
    memory_utilization: float = 0.9  # of HBM given to weights + KV

    @classmethod
    def named(cls, accelerator: str, model: str, tp: int = 1, **kw) -> TimeModel:
        if accelerator not in ACCELERATORS:
            raise LaminarError(
                f"pacing.accelerator {accelerator!r} is unknown; known: {sorted(ACCELERATORS)}"
            )
        if model not in MODELS:
            raise LaminarError(f"pacing.model {model!r} is unknown; known: {sorted(MODELS)}")
        return cls(ACCELERATORS[accelerator], MODELS[model], tp=tp, **kw)

    @property
    def _bw(self) -> float:
        return self.tp * self.accelerator.mem_bw * self.bw_efficiency

    @property
    def weight_read_time(self) -> float:
        return self.model.weight_bytes / self._bw

    @property
    def compute_per_sequence(self) -> float:
        return self.model.flops_per_token / (self.tp * self.accelerator.flops * self.decode_mfu)

    @property
    def batch_limit(self) -> float:
        """``B``: the batch at which a decode step turns from memory- to compute-bound."""
        return self.weight_read_time / self.compute_per_sequence

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit beside the weights on the replica's devices."""
        free = self.tp * self.accelerator.hbm_bytes * self.memory_utilization
        free -= self.model.weight_bytes
        if free <= 0:
            raise LaminarError(
                f"{self.model.name} weights ({self.model.weight_bytes / 1e9:.0f} GB) do not fit "
                f"on {self.tp} × {self.accelerator.name}; raise pacing.tp"
            )
        return int(free // self.model.kv_bytes_per_token)

    def decode_time(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch`` requests over ``context_tokens`` of KV."""
        if batch <= 0:
            return 0.0
        kv_read = context_tokens * self.model.kv_bytes_per_token / self._bw
        body = max(self.weight_read_time, batch * self.compute_per_sequence)
        return self.t_fix + body + self.c_seq * batch + kv_read

    def prefill_time(self, tokens: int) -> float:
        """Seconds to prefill (or recompute the KV of) ``tokens`` tokens."""
        flops = self.tp * self.accelerator.flops * self.prefill_mfu
        return tokens * self.model.flops_per_token / flops

    def step_time(
        self, batch: int, context_tokens: int, prefill_tokens: int, *, fused: bool = False
    ) -> float:
        """One engine step: ``batch`` requests decode over ``context_tokens`` of KV and
        ``prefill_tokens`` are prefilled (new requests, or the KV of resumed ones).

        ``fused=False`` adds the prefill's compute to the decode step. ``fused=True`` is
        a chunked-prefill engine (vLLM V1): decode and prefill tokens share one forward
        pass, whose weight read hides as much compute as it takes.

        >>> m = TimeModel.named("H800", "7B", tp=4)
        >>> round(m.step_time(32, 4000, 500) * 1e3, 2)  # decode 3.35 + prefill 3.21
        6.56
        >>> round(m.step_time(32, 4000, 500, fused=True) * 1e3, 2)  # the weight read hidden
        5.54
        >>> round(m.step_time(32, 4000, 50, fused=True) * 1e3, 2)  # a small prefill: free
        3.35
        """
        if not fused:
            return self.decode_time(batch, context_tokens) + self.prefill_time(prefill_tokens)
        if batch <= 0 and prefill_tokens <= 0:
            return 0.0
        kv_read = context_tokens * self.model.kv_bytes_per_token / self._bw
        compute = batch * self.compute_per_sequence + self.prefill_time(prefill_tokens)
        return self.t_fix + max(self.weight_read_time, compute) + self.c_seq * batch + kv_read


class Pacer:
    """Holds each engine step to ``dilation ×`` the modelled time, and checks it can.

    ``window`` recent steps are kept; if their median actual/modelled ratio exceeds 1 the
    pacer raises :class:`PacingError` (``strict``) naming the dilation that would do.
    Single slow steps (a GC pause, a noisy neighbour) are counted, not fatal.
    """

    def __init__(
        self,
        model: TimeModel,
        dilation: float = 1.0,
        *,
        strict: bool = True,
        window: int = 32,
        fused_prefill: bool = False,
    ) -> None:
        if dilation <= 0:
            raise LaminarError(f"pacing.dilation={dilation}; must be > 0")
        self.model = model
        self.dilation = dilation
        self.strict = strict
        self.fused_prefill = fused_prefill
        self._ratios: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.overruns = 0
        self.modelled_s = 0.0
        self.actual_s = 0.0
        self.max_ratio = 0.0

    def modelled(self, batch: int, context_tokens: int, prefill_tokens: int) -> float:
        t = self.model.step_time(batch, context_tokens, prefill_tokens, fused=self.fused_prefill)
        return self.dilation * t

    def pace(
        self,
        t0: float,
        *,
        batch: int,
        context_tokens: int,
        prefill_tokens: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Wait until ``t0`` (a ``perf_counter`` time) plus the modelled step time, with
        ``sleep(seconds)`` (which may do other work meanwhile, within those seconds)."""
        target = self.modelled(batch, context_tokens, prefill_tokens)
        actual = time.perf_counter() - t0
        self.steps += 1
        self.modelled_s += target
        self.actual_s += actual
        ratio = actual / target if target > 0 else 0.0
        self.max_ratio = max(self.max_ratio, ratio)
        self._ratios.append(ratio)
        if actual > target:
            self.overruns += 1
            if self.strict and len(self._ratios) == self._ratios.maxlen:
                median = statistics.median(self._ratios)
                if median > 1.0:
                    raise PacingError(
                        f"engine steps take {median:.2f}× the modelled time (median of the "
                        f"last {len(self._ratios)}): this machine cannot keep the pace of "
                        f"{self.model.tp}×{self.model.accelerator.name} serving "
                        f"{self.model.model.name}. Raise rollout.pacing.dilation to at least "
                        f"{self.dilation * median * 1.5:.3g}, or run fewer replicas per core"
                    )
        else:
            sleep(target - actual)

    def stats(self) -> dict:
        return {
            "paced_steps": self.steps,
            "modelled_s": self.modelled_s,
            "compute_s": self.actual_s,
            "overruns": self.overruns,
            "max_compute_ratio": self.max_ratio,
            "dilation": self.dilation,
        }
