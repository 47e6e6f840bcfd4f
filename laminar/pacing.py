"""Emulated accelerator timing: GPU-shaped step times for engines that run the tiny model.

A paced engine computes real tokens with the tiny policy, then waits until the time a
named accelerator would have needed for the same step has passed. Eight to thirty-two
replicas then share a 2-core machine with the timing structure of a GPU cluster — decode
steps whose cost depends on batch size and context, long tails that leave replicas
under-used — which is what the schedules are compared on.

The model (a roofline with fixed costs; constants and sources in ``docs/pacing.md``)::

    decode(b, S) = t_fix + max(W / (tp·BW·η_bw), b · F / (tp·FLOPS·η_dec)) + c_seq·b
                   + S · kv / (tp·BW·η_kv)
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

**Scaled workloads.** The schedules bench emulates a whole cluster with lengths and batch
sizes cut for the CPU: each real token stands for ``length_scale`` modelled tokens and
each real request for ``request_scale`` modelled requests (:class:`Scale`). A real decode
step then stands for ``length_scale`` modelled steps of ``request_scale ×`` as many
requests over ``request_scale · length_scale ×`` as much context, and every modelled time
is compressed by ``length_scale`` (the steps are that many times fewer), so the cluster's
clock runs ``length_scale / dilation`` times faster than the emulated one and every
ratio between its parts — decode, prefill, training, weight syncs — is kept.
:class:`TrainerTimeModel` and :class:`WeightSyncModel` give the trainer's and the weight
movements' modelled times on the same scale (docs/pacing.md).
"""

from __future__ import annotations

import math
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
    kv_efficiency: float | None = None  # of HBM bandwidth for the KV read; None: bw_efficiency
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
    def _kv_bw(self) -> float:
        eff = self.bw_efficiency if self.kv_efficiency is None else self.kv_efficiency
        return self.tp * self.accelerator.mem_bw * eff

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
        kv_read = context_tokens * self.model.kv_bytes_per_token / self._kv_bw
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
            if batch <= 0 and prefill_tokens > 0:
                # decode(0, S): a forward that only prefills still pays the step's fixed
                # cost and reads every weight.
                return self.t_fix + self.weight_read_time + self.prefill_time(prefill_tokens)
            return self.decode_time(batch, context_tokens) + self.prefill_time(prefill_tokens)
        if batch <= 0 and prefill_tokens <= 0:
            return 0.0
        kv_read = context_tokens * self.model.kv_bytes_per_token / self._kv_bw
        compute = batch * self.compute_per_sequence + self.prefill_time(prefill_tokens)
        return self.t_fix + max(self.weight_read_time, compute) + self.c_seq * batch + kv_read


@dataclass(frozen=True)
class Scale:
    """How the emulation maps onto this machine (see the module docstring).

    ``dilation`` stretches every modelled time; ``length_scale`` modelled tokens per real
    token and ``request_scale`` modelled requests per real request shrink the workload.
    :meth:`wall` turns a modelled duration of the full-size cluster into wall seconds here.

    >>> Scale(dilation=16, length_scale=256).wall(8.0)  # an 8 s weight switch
    0.5
    """

    dilation: float = 1.0
    length_scale: float = 1.0
    request_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("dilation", "length_scale", "request_scale"):
            if not getattr(self, name) > 0:
                raise LaminarError(f"pacing.{name}={getattr(self, name)!r}; must be > 0")

    def wall(self, modelled_s: float) -> float:
        return modelled_s * self.dilation / self.length_scale

    def modelled(self, wall_s: float) -> float:
        """The inverse of :meth:`wall`."""
        return wall_s * self.length_scale / self.dilation

    @property
    def tokens(self) -> float:
        """Modelled tokens per real token of a batch (requests × length)."""
        return self.request_scale * self.length_scale


@dataclass(frozen=True)
class TrainerTimeModel:
    """One update of the trainer: ``tokens / (gpus · tok_s_per_gpu) + update_s``.

    ``tok_s_per_gpu`` is the training throughput of one GPU on the model (prompt and
    response tokens, forward, backward and optimizer), ``update_s`` what an update costs
    besides (optimizer step, gradient all-reduce, launch). The defaults are the shared
    cluster model's for a 7B model on H800s: 5,000 tokens/s per GPU and 2 s.

    >>> round(TrainerTimeModel(gpus=32).update_time(8192 * 3000), 1)  # 8192 × 3K tokens
    155.6
    """

    gpus: int
    tok_s_per_gpu: float = 5000.0
    update_s: float = 2.0

    def update_time(self, tokens: float) -> float:
        return tokens / (self.gpus * self.tok_s_per_gpu) + self.update_s

    def tokens_time(self, tokens: float) -> float:
        """The token-proportional part alone (a stream mini-batch's forward/backward)."""
        return tokens / (self.gpus * self.tok_s_per_gpu)


@dataclass(frozen=True)
class WeightSyncModel:
    """What moving a version to the rollouts costs, by how it is done (modelled seconds).

    * ``relay`` (Laminar): the trainer stalls ``publish_s`` while the master relay takes its
      copy (each rollout's own pull at its batch boundary is ``rollout.pacing.pull_s``,
      paced by the rollout);
    * ``global``: an NCCL broadcast to every rollout at once, ``global_s + global_log2_s ·
      log2(replicas)``, while the trainer and every rollout wait;
    * ``colocated``: trainer and rollouts share the GPUs; switching them from training to
      generation (weights resharded, KV re-allocated) costs ``colocated_s`` per iteration.

    >>> round(WeightSyncModel().global_sync(16), 2)
    4.0
    """

    publish_s: float = 0.5
    global_s: float = 3.0
    global_log2_s: float = 0.25
    colocated_s: float = 8.0

    def global_sync(self, replicas: int) -> float:
        return self.global_s + self.global_log2_s * math.log2(max(replicas, 1))


class Pacer:
    """Holds each engine step to ``dilation ×`` the modelled time, and checks it can.

    ``window`` recent steps are kept; if their median actual/modelled ratio exceeds 1 the
    pacer raises :class:`PacingError` (``strict``) naming the dilation that would do.
    Single slow steps (a GC pause, a noisy neighbour) are counted, not fatal: ``overruns``
    steps whose compute (and the host work before it, see :meth:`pace`) passed their
    deadline, and ``overrun_s`` the seconds by which steps ended past it — their compute,
    or the ``sleep`` (a rollout's ``wait_hook``, which serves commands meanwhile)
    returning late — that no next step caught up: each such second a second the modelled
    clock was stretched. ``clock`` is the ``perf_counter`` the step times (``t0``) are
    read on.
    """

    def __init__(
        self,
        model: TimeModel,
        dilation: float = 1.0,
        *,
        strict: bool = True,
        window: int = 32,
        fused_prefill: bool = False,
        length_scale: float = 1.0,
        request_scale: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.scale = Scale(dilation, length_scale, request_scale)  # checks each > 0
        self.clock = clock
        self.model = model
        self.dilation = dilation
        self.strict = strict
        self.fused_prefill = fused_prefill
        self._ratios: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.overruns = 0
        self.overrun_s = 0.0
        self._late = 0.0  # how far the last step ended past its deadline
        self._deadline: float | None = None  # the last step's, while stepping continuously
        self._floor: float | None = None  # the next step is paced from here at the earliest
        self.modelled_s = 0.0
        self.actual_s = 0.0
        self.max_ratio = 0.0

    def modelled(
        self, batch: int, context_tokens: int, prefill_tokens: int, admitted: int = 0
    ) -> float:
        """Wall seconds one real step takes: with the scales of :class:`Scale`, the mean
        of ``length_scale`` modelled steps of which the first also prefills.

        ``admitted``: the requests that step prefills (``prefill_tokens`` are their
        contexts). Their prefill yields their first token; the modelled steps after the
        first decode them too, over their prefilled KV (a step that only admits, as a
        local batch's first, stands for a prefill and ``length_scale - 1`` decode steps
        of the whole batch, not for the prefill alone).

        >>> m = TimeModel.named("H800", "7B", tp=4)
        >>> plain = Pacer(m).modelled(32, 32 * 4000, 0)
        >>> scaled = Pacer(m, length_scale=250, request_scale=8).modelled(4, 4 * 15, 0)
        >>> round(plain * 1e3, 2), round(scaled * 1e3, 2)  # 32 requests at 4K context
        (3.94, 3.96)

        (4 real requests of 16 tokens: 32 modelled ones of 4,000, the last decoded. The
        scaled step stands for 250 steps, over which the KV grows by 250 × 32 tokens.)
        """
        sc = self.scale
        # ``context_tokens`` is Σ (context − 1) over the decoding requests: a real request
        # of c tokens writes its c-th token's KV in this step. Scaled, it holds λ·c − 1
        # modelled KV entries at the first modelled step (its modelled tokens up to λ·c,
        # the last being decoded), not λ·(c − 1): σ·(λ·(S + b) − b) over the batch.
        context_tokens = sc.tokens * (context_tokens + batch) - sc.request_scale * batch
        batch *= sc.request_scale
        prefill_tokens *= sc.tokens
        first = self.model.step_time(
            batch, context_tokens, prefill_tokens, fused=self.fused_prefill
        )
        # The other steps decode the admitted requests too, and read the KV their
        # predecessors wrote: ``decoding`` tokens each, so steps 1 .. L-1 read on average
        # ``L·decoding/2`` more than the first (decode time is linear in the KV read).
        # An admitted request's prefill of λ·n tokens yields its first token, whose KV
        # the next step writes: λ·n − 1 entries read there, as a decoding request's.
        decoding = batch + admitted * sc.request_scale
        kv = context_tokens + (prefill_tokens - admitted * sc.request_scale if admitted else 0)
        mean_context = kv + sc.length_scale * decoding / 2
        rest = (sc.length_scale - 1) * self.model.decode_time(decoding, mean_context)
        return self.dilation * (first + rest) / sc.length_scale

    def until_deadline(self) -> float:
        """Seconds left until the current step's deadline: > 0 only while a paced step
        waits out its modelled time (a command served from its ``wait_hook``)."""
        if self._deadline is None:
            return 0.0
        return max(0.0, self._deadline - self.clock())

    def restart(self) -> None:
        """The engine did not step continuously up to now (a batch boundary: a weight
        pull, a wait for data): the next step is paced from its own start, with no credit
        for the time since the last one's deadline."""
        self.overrun_s += self._late
        self._late = 0.0
        self._deadline = None
        self._floor = None

    def floor(self, t: float) -> None:
        """Requests joined the engine at ``t`` (a ``clock`` time): a move's import, or a
        source taking its export back. The next step is paced from ``t`` at the earliest,
        ``max(previous deadline, t) + its modelled time``: served between two steps after
        a step that ran late, chained to that step's deadline it would inherit the
        catch-up credit, and run the requests that joined ahead of the time model (their
        next token less than a modelled step after they arrived). An import served
        within a step's wait (``t`` before its deadline) changes nothing."""
        self._floor = t if self._floor is None else max(self._floor, t)

    def pace(
        self,
        t0: float,
        *,
        batch: int,
        context_tokens: int,
        prefill_tokens: int,
        admitted: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Wait until the step's deadline, with ``sleep(seconds)`` (which may do other
        work meanwhile, within those seconds); ``t0`` (a ``perf_counter`` time) is when
        the step's real work began.

        The deadline is the previous step's plus the modelled step time while the engine
        steps continuously — the previous deadline at most one step before ``t0`` and no
        :meth:`restart` since — else ``t0`` plus it. Host work between two steps (handing
        finished responses on, pool calls, commands served) then runs within the next
        step's modelled time as long as it fits, as a real engine's CPU work overlaps its
        GPU's, instead of adding to the modelled time at the dilated clock's rate; and a
        step that ran late is caught up by the next — unless requests joined the engine
        after its deadline (:meth:`floor`): then the deadline is the time they joined
        plus the modelled step time. A step whose real compute and the host work before
        it pass its deadline is an overrun."""
        target = self.modelled(batch, context_tokens, prefill_tokens, admitted)
        prev = self._deadline
        floor, self._floor = self._floor, None
        chained = prev is not None and t0 - prev <= target
        base = prev if chained else t0
        if chained and floor is not None and floor > prev:
            # requests joined after the previous deadline (:meth:`floor`): no credit
            # from before they came, and the lateness up to them is not caught up
            chained, base = False, floor
        if not chained:  # the previous step's lateness was not caught up
            self.overrun_s += self._late
        deadline = base + target
        self._deadline = deadline
        now = self.clock()
        actual = now - t0  # the step's real compute
        self.steps += 1
        self.modelled_s += target
        self.actual_s += actual
        ratio = actual / target if target > 0 else 0.0
        self.max_ratio = max(self.max_ratio, ratio)
        self._ratios.append(ratio)
        if now > deadline:
            self.overruns += 1
            self._late = now - deadline
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
            sleep(deadline - now)
            # (a command served in the wait may run past the deadline)
            self._late = max(0.0, self.clock() - deadline)

    def stats(self) -> dict:
        return {
            "paced_steps": self.steps,
            "modelled_s": self.modelled_s,
            "compute_s": self.actual_s,
            "overruns": self.overruns,
            # (with the last step's lateness, which no later step has caught up yet)
            "overrun_s": self.overrun_s + self._late,
            "max_compute_ratio": self.max_ratio,
            "dilation": self.dilation,
        }


class Clock:
    """Holds stretches of real work (trainer updates, weight movements) to their
    modelled durations on a :class:`Scale`, and checks the real work fits.

    ``hold(t0, modelled_s, what)`` waits until ``t0`` (a ``time.time()``) plus the wall
    time of ``modelled_s``; a stretch whose real work already took longer is counted as
    an overrun of ``what``, and the seconds it ran past its end (or the ``sleep`` woke
    past it) add to ``what``'s ``overrun_s``: wall seconds by which the emulated clock
    was stretched. With ``strict``, once the median of the last ``window`` stretches of
    one kind overran, :class:`PacingError` names the dilation that would do.
    """

    def __init__(
        self,
        scale: Scale,
        *,
        strict: bool = True,
        window: int = 8,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.scale = scale
        self.strict = strict
        self.window = window
        self.sleep = sleep
        self.clock = clock
        self._ratios: dict[str, deque[float]] = {}
        self.figures: dict[str, dict[str, float]] = {}

    def hold(self, t0: float, modelled_s: float, what: str) -> float:
        """Wait out ``modelled_s`` from ``t0``; returns the wall seconds since ``t0``.
        A stretch modelled to take no time (e.g. ``publish_s=0``) is not held or counted."""
        target = self.scale.wall(modelled_s)
        actual = self.clock() - t0
        if target <= 0:
            return actual
        fig = self.figures.setdefault(
            what, {"n": 0, "modelled_s": 0.0, "compute_s": 0.0, "overruns": 0, "overrun_s": 0.0}
        )
        fig["n"] += 1
        fig["modelled_s"] += target
        fig["compute_s"] += actual
        ratios = self._ratios.setdefault(what, deque(maxlen=self.window))
        ratios.append(actual / target)
        if actual <= target:
            self.sleep(target - actual)
            held = self.clock() - t0
            fig["overrun_s"] += max(0.0, held - target)
            return held
        fig["overruns"] += 1
        fig["overrun_s"] += actual - target
        if self.strict and len(ratios) == self.window and statistics.median(ratios) > 1.0:
            median = statistics.median(ratios)
            raise PacingError(
                f"{what}: real work takes {median:.2f}× its modelled time (median of the "
                f"last {self.window}): this machine cannot keep the emulated cluster's pace. "
                f"Raise rollout.pacing.dilation to at least "
                f"{self.scale.dilation * median * 1.5:.3g}"
            )
        return actual

    def stats(self) -> dict[str, dict[str, float]]:
        # (read from the actor's thread while hold() adds a kind: list() copies the
        # items in one step under the GIL, where iterating the dict could meet a new key)
        return {k: dict(v) for k, v in list(self.figures.items())}


def scale_of(pacing) -> Scale:
    """The :class:`Scale` of a ``rollout.pacing`` config section."""
    return Scale(pacing.dilation, pacing.length_scale, pacing.request_scale)
