"""The emulated cluster and workload of ``laminar bench schedules`` (the module docstring of
:mod:`pipelines.bench_schedules` describes both), and the search for a schedule's
trainer/rollout split on it.

Apart from the bench because they are its fixed inputs, read by more than it: ``laminar
bench repack`` runs Laminar's generation alone on the same workload and cluster
(:class:`Cluster`), and the CLI checks ``--arms`` against :data:`ARMS` before any run.
:func:`search_split` is the pure hill climb; the bench gives it the probe runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from laminar.errors import ConfigError

# The benches' base config, found from the checkout (not the working directory: a bench
# run from anywhere else stopped at "config file 'configs/tiny.yaml' does not exist")
TINY_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")

GPUS_PER_REPLICA = 4
# The smallest emulated cluster: one replica, and a trainer on at least one GPU of the
# next replica's (the split search needs two replica counts; sync colocates on two).
MIN_GPUS = 2 * GPUS_PER_REPLICA
# The paper's workload (§8): responses lognormal, median 1,500 and P99/median 10, capped
# at 16,384 tokens; their mean, clipped: ≈ 2,420 tokens.
PAPER_RESPONSE_CAP = 16384
PAPER_RESPONSE_MEAN = 2420.0
LENGTH_SCALE = 256  # modelled tokens per real token: 16,384 / 64
REQUEST_SCALE = 8  # modelled requests per real request
CAP = PAPER_RESPONSE_CAP // LENGTH_SCALE  # 64 real tokens, the answer's <eos> included
# The count_range task answers k symbols and <eos>, k lognormal with P99/median 10, half
# of its log-variance fixed by the prompt and half drawn per response (the shared cluster
# model's): a median of 5.2 gives a mean response of 9.25 tokens (measured on the
# demonstrations) and cap / mean = 6.9, the paper's 6.8.
MEDIAN_LEN = 5.2
MEAN_PROMPT, MEAN_RESPONSE = 5.0, 9.25  # real tokens: "<bos> b lo hi >", k + <eos>
GROUPS_PER_STEP = 64  # 64 × 16 = 1,024 real trajectories, 8,192 modelled
GROUP_SIZE = 16
# Time to reward: the threshold lies this far from the base policy's reward to the lowest
# final reward of the runs compared (a ratio's: its two arms'; the table's: every arm's).
TTR_FRACTION = 0.75
CONCURRENCY = 256 // REQUEST_SCALE  # the paper's per-rollout max concurrency, 256
# Laminar's back-pressure and partial rollout's bound alike: 4 global batches out, s_train
# at most 4 (the shared cluster model's staleness bound). At 1, with lengths that vary
# within a group, the window bound Laminar: its rollouts idled 43% waiting for it.
ETA = 3
# Dilation grows with the cluster, so that the real compute per wall second stays the same.
# At 32 per 64 GPUs real compute stays at a quarter (replicas) to a half (the trainer) of the
# model's time here; at 16 the machine saturated and replicas overran the model.
DILATION_PER_64_GPUS = 32.0
REPACK_INTERVAL_S = 5.0  # the paper's, in modelled seconds

# name -> (pipeline.schedule, repack on)
ARMS = {
    "sync": ("sync", False),
    "one_step": ("one_step", False),
    "stream": ("stream", False),
    "partial_rollout": ("partial_rollout", False),
    "laminar": ("laminar", True),
    "laminar_no_repack": ("laminar", False),
}

# An ablation runs at the split searched for the schedule it ablates: repack on vs off
# is then measured at one placement.
ABLATION_OF = {"laminar_no_repack": "laminar"}

# The workload and the replicas' emulation, the same for every schedule (and for
# ``laminar bench repack``, which runs Laminar's generation alone on it).
GENERATION_WORKLOAD = [
    "task.name=count_range",
    "task.reward=count_in_range",
    "task.length_share=0.5",
    "task.num_prompts=20000",
    f"task.median_len={MEDIAN_LEN}",
    "task.tail_ratio=10",
    f"task.max_len={CAP - 1}",
    f"rollout.group_size={GROUP_SIZE}",
    f"rollout.max_new_tokens={CAP}",
    f"rollout.max_seq_len={CAP + CAP + 2}",
    f"rollout.max_concurrency={CONCURRENCY}",
    "rollout.parity_every=0",
    "rollout.pacing.accelerator=H800",
    "rollout.pacing.model=7B",
    f"rollout.pacing.tp={GPUS_PER_REPLICA}",
    "rollout.pacing.strict=false",  # overruns are counted and reported, not fatal
    "rollout.pacing.prefill=fused",  # chunked prefill, as vLLM V1 and SGLang do
    f"rollout.pacing.length_scale={LENGTH_SCALE}",
    f"rollout.pacing.request_scale={REQUEST_SCALE}",
    "rollout.pacing.pull_s=1.0",
]
WORKLOAD = GENERATION_WORKLOAD + [
    # Laminar's local batch (its own knob: the others do not read it) at twice what one
    # engine holds, the cluster model's tuned setting: a batch drains into its tail half
    # as often. Measured at 64 GPUs, R = 5, seeds 0 and 1: 192k -> 207k tok/s, decode
    # batch 96 -> 131, s_train 0.92 -> 1.15. (The repack bench keeps one engine full.)
    f"rollout.groups_per_batch={2 * CONCURRENCY // GROUP_SIZE}",
    f"trainer.groups_per_step={GROUPS_PER_STEP}",
    "trainer.mini_batches=4",
    # The workload must stay the same for every schedule, and the policy's lengths move
    # as it learns, faster on fresher data: at the run's 3e-4, sync's and stream's mean
    # response fell to 0.6 of the base policy's within 9 updates while the asynchronous
    # schedules' held at 0.8-1.0 (len_drift), so sync was measured on shorter responses
    # with a heavier tail relative to them. At 3e-5 (seed 0, 64 GPUs) sync's held at
    # 0.88 and Laminar's at 1.01: a policy that moves little per update, as a 7B's does.
    # The reward rises less (0.88 -> 0.91 over 9 updates), which time to reward measures.
    "trainer.lr=3e-5",
    # the same gradient, in length-sorted micro-batches that fit this CPU's caches
    # (measured: 6.5k tokens/s at 1024 against 4.8k at the default 4096)
    "trainer.micro_batch_tokens=1024",
    # replicas have slack against their model, the trainer (on the critical path) less: the
    # OS serves the trainer first where it may (root; else a warning and normal priority)
    "trainer.pacing.nice=-10",
    f"buffer.max_outstanding_groups={(ETA + 1) * GROUPS_PER_STEP}",
    f"pipeline.eta={ETA}",
    "cluster.memory_limit=2GiB",
    # every poll calls each of up to 32 rollouts: once a second leaves the CPU to them
    "metrics.poll_s=1.0",
    "faults.detect_interval_s=2",  # no faults here: the manager's checks cost CPU alone
]


# Laminar's own knobs (the others refuse or ignore them), for its ablation too: its local
# batches top up while their version is the newest published (docs/schedules.md). Measured
# at 64 GPUs, R = 5, seeds 0 and 1: 185k, 199k -> 208k, 204k tok/s; decode batch 126 ->
# 153; trainer idle 8% -> 4% (`--arms laminar --splits laminar=5 --seeds 2`, without and
# with `--set rollout.top_up=true`).
LAMINAR_KNOBS = ["rollout.top_up=true"]


@dataclass(frozen=True)
class Cluster:
    """The emulated cluster of one bench: ``gpus`` in all, replicas of 4."""

    gpus: int = 64

    def __post_init__(self) -> None:
        if self.gpus < MIN_GPUS:
            raise ConfigError(
                f"--gpus {self.gpus}: the emulated cluster needs at least {MIN_GPUS} GPUs "
                f"(a replica is {GPUS_PER_REPLICA}, and the trainer needs GPUs of its own)"
            )

    @property
    def dilation(self) -> float:
        return DILATION_PER_64_GPUS * self.gpus / 64

    @property
    def max_replicas(self) -> int:
        return self.gpus // GPUS_PER_REPLICA

    def kv_capacity(self, model: str = "7B") -> int:
        """A replica's KV capacity in real tokens (TP4 H800s beside ``model``)."""
        from laminar.pacing import TimeModel

        m = TimeModel.named("H800", model, tp=GPUS_PER_REPLICA)
        return int(m.kv_capacity_tokens / (REQUEST_SCALE * LENGTH_SCALE))

    @property
    def scale(self):
        from laminar.pacing import Scale

        return Scale(self.dilation, LENGTH_SCALE, REQUEST_SCALE)

    def balanced_replicas(self) -> int:
        """Where the search starts: the split at which the trainer's and the rollouts'
        work per global batch take equally long (mean prompt and response lengths of
        the workload; a replica at 60% of its full-batch peak)."""
        from laminar.pacing import TimeModel

        m = TimeModel.named("H800", "7B", tp=GPUS_PER_REPLICA)
        tokens = GROUPS_PER_STEP * GROUP_SIZE * REQUEST_SCALE * LENGTH_SCALE
        train = tokens * (MEAN_PROMPT + MEAN_RESPONSE) / 5000.0  # GPU-seconds
        context = 256 * (MEAN_PROMPT + MEAN_RESPONSE / 2) * LENGTH_SCALE
        peak = 256 / m.decode_time(256, context)  # tokens/s of one replica
        gen = tokens * MEAN_RESPONSE / (0.6 * peak) * GPUS_PER_REPLICA  # GPU-seconds
        trainer_gpus = self.gpus * train / (train + gen)
        r = round((self.gpus - trainer_gpus) / GPUS_PER_REPLICA)
        return min(max(r, 1), self.max_replicas - 1)

    def overrides(self, arm: str, replicas: int, steps: int, seed: int) -> list[str]:
        schedule, repack = ARMS[arm]
        colocated = schedule == "sync"
        trainer_gpus = self.gpus if colocated else self.gpus - GPUS_PER_REPLICA * replicas
        if trainer_gpus <= 0:
            raise ConfigError(f"{replicas} replicas leave no trainer GPU of {self.gpus}")
        out = WORKLOAD + [
            f"seed={seed}",
            f"pipeline.schedule={schedule}",
            f"rollout.replicas={replicas}",
            f"rollout.kv_capacity_tokens={self.kv_capacity()}",
            f"rollout.pacing.dilation={self.dilation}",
            f"trainer.pacing.gpus={trainer_gpus}",
            f"trainer.steps={steps}",
        ]
        if schedule == "laminar":
            out += LAMINAR_KNOBS
        if repack:
            out.append(f"repack.interval_s={self.scale.wall(REPACK_INTERVAL_S):.4g}")
        return out


class Probe(float):
    """One probe's throughput (a float: the window's tokens over its time, as every
    measured run's) with the throughputs of its measured intervals, each a global batch
    over the time between two adjacent publications. ``spread`` is their standard error
    (sample standard deviation over sqrt(n)): what the probe's figure is known to,
    judged by the run itself; 0 with fewer than two intervals (nothing to judge by).

    >>> p = Probe(200e3, [180e3, 220e3, 190e3, 210e3])
    >>> p > 199e3, round(p.spread)
    (True, 9129)
    >>> Probe(200e3).spread
    0.0
    """

    __slots__ = ("intervals",)

    def __new__(cls, throughput: float, intervals=()):
        self = super().__new__(cls, throughput)
        self.intervals = tuple(float(v) for v in intervals)
        return self

    @property
    def spread(self) -> float:
        n = len(self.intervals)
        if n < 2:
            return 0.0
        mean = sum(self.intervals) / n
        var = sum((v - mean) ** 2 for v in self.intervals) / (n - 1)
        se = math.sqrt(var / n)
        return se if math.isfinite(se) else 0.0


def spread_of(value: float) -> float:
    """A probe's standard error (:class:`Probe`); 0 for a plain float."""
    return getattr(value, "spread", 0.0)


def search_split(
    evaluate: Callable[[int], float], *, lo: int, hi: int, start: int
) -> tuple[int | None, dict[int, float]]:
    """The replica count in ``[lo, hi]`` that maximises ``evaluate``, by hill climbing
    from ``start`` in steps of 2, then 1 (throughput is unimodal in the split: too few
    rollouts starve the trainer, too few trainer GPUs leave rollouts back-pressured).
    Returns the best count and every value evaluated; the count is ``None`` where the
    search found no finite value (``-inf``: every probe it ran failed), since a failed
    probe is never the chosen split.

    A probe (:class:`Probe`) is noisy: within one run a schedule's intervals vary by
    7-10%, neighbouring splits by 3-6%, so the climb may stop at a neighbour of the
    optimum whose probe came out high. It still moves on any gain: moving only on a gain
    beyond the probes' combined standard error stopped early instead, on the slope, and
    lost about twice as much throughput on average in simulation (unimodal curves,
    Gaussian interval noise of 6-9%, 4 intervals a probe), and a quadratic fit of the
    probes around the top chose worse on asymmetric peaks; the noise is cut by measuring
    more updates per probe (``probe_iterations``) instead, and :func:`noise_band` says
    which probed splits the chosen one is not told apart from.

    >>> best, seen = search_split(lambda r: -abs(r - 9), lo=1, hi=15, start=4)
    >>> best, sorted(seen)
    (9, [4, 6, 8, 9, 10])
    >>> search_split(lambda r: -math.inf, lo=1, hi=15, start=4)[0] is None
    True
    """
    seen: dict[int, float] = {}

    def f(r: int) -> float:
        if r not in seen:
            seen[r] = evaluate(r)
        return seen[r]

    best = min(max(start, lo), hi)
    for step in (2, 1):
        moved = True
        while moved:
            moved = False
            for r in (best + step, best - step):
                if lo <= r <= hi and f(r) > f(best):
                    best, moved = r, True
                    break
    return (best if math.isfinite(f(best)) else None), seen


def noise_band(best: int | None, seen: dict[int, float]) -> list[int]:
    """The probed splits (``best`` among them) whose probe lies within the noise of the
    chosen split's: below it by no more than the two probes' combined standard error,
    ``hypot(spread_a, spread_b)`` (:class:`Probe`; a plain float has none). More than
    ``best`` alone: the probes did not tell those splits apart, and the split is known
    to that resolution only.

    >>> seen = {7: Probe(190, [180, 200]), 9: Probe(210, [200, 220]), 8: Probe(203, [193, 213])}
    >>> noise_band(9, seen), noise_band(9, {r: float(v) for r, v in seen.items()})
    ([8, 9], [9])
    """
    if best is None or best not in seen:
        return []
    top = seen[best]
    return sorted(
        r
        for r, v in seen.items()
        if math.isfinite(v) and top - v <= math.hypot(spread_of(top), spread_of(v))
    )
