"""``laminar bench schedules``: the five schedules side by side on one emulated cluster,
measured as the paper measures them (§8.1–8.2), with the accounting it leaves out.

**The emulated cluster** (default 64 GPUs, ``--gpus 128`` for twice that): H800s serving a
7B model in rollout replicas of 4 GPUs (TP4), the trainer on the rest. Every rollout
engine is paced by the roofline of ``laminar.pacing``, the trainer by its time model
(5,000 tokens/s per GPU + 2 s per update), weight movements by what each schedule does
(a relay publication and per-rollout pulls, a global NCCL broadcast, or the colocated
switch): ``docs/pacing.md``. Sync is colocated and uses every GPU for both; every other
schedule runs at its best trainer/rollout split, searched here (:func:`search_split`).

**The workload**, the same for every schedule: the paper's shape scaled down so that one
real token stands for ``length_scale = 256`` modelled ones and one real request for
``request_scale = 8``: 16 responses per prompt, response lengths lognormal with
``P99/median = 10`` and a hard cap of 64 real tokens (16,384 modelled), the median
chosen so that cap / mean is the paper's (16,384 / ≈2,420 ≈ 6.8), half of the
log-variance shared by a prompt's responses and half their own (the ``count_range``
task: the policy samples each response's length, as a reasoning trace's); a global batch of 64
prompts × 16 = 1,024 real trajectories (8,192 modelled); at most 32 real requests (256
modelled) decoding per replica. Four optimizer steps per global batch for every
schedule; Laminar and partial rollout share the staleness bound η = 3 (back-pressure of
``(η + 1)`` global batches for Laminar).

**Figures** per schedule (medians over seeds; modelled units of the full-size cluster):
actor-update throughput (prompt + response tokens of a global batch over the time
between adjacent updates, after warm-up), generation throughput, time to a training
reward, rollout and trainer idle fractions, mean decode batch, staleness (``s_gen``,
residence, ``s_train``: mean / p99 / max), buffer depth and age, arrival vs consumption
rate, evicted / discarded / filtered trajectories, wasted and recomputed tokens,
whether the real compute stayed under the model, how much of the rollouts' decode time
fell outside their modelled steps (``decode_unmodelled``: the work between two steps,
and overruns, which a run on GPUs would pay otherwise or not at all; ``top_up_share``:
the part of it that Laminar's top-up asks took), and the measured length shape with its
drift (``len_drift``: the measured batches' mean response length over the base policy's
first batch's; the policy learns, and a schedule that trains on fresher data moves its
lengths faster).

Run it::

    laminar bench schedules --out schedules.json            # 64 GPUs, 3 seeds
    laminar bench schedules --gpus 128 --out schedules-128.json
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from laminar.errors import ConfigError

GPUS_PER_REPLICA = 4
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
# final reward of any run.
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


def length_shape(lengths: np.ndarray, groups: np.ndarray, cap: int) -> dict[str, float]:
    """The measured shape of the generated responses (in tokens, ``<eos>`` included):
    ``len_p99_over_median``, ``len_cap_over_mean`` and ``len_within_share``, the share of
    the log-length variance within a prompt's group (the rest is between prompts).

    >>> lengths = np.array([2, 4, 2, 4, 8, 16, 8, 16])
    >>> shape = length_shape(lengths, np.array([0, 0, 0, 0, 1, 1, 1, 1]), cap=32)
    >>> round(shape["len_within_share"], 2), round(shape["len_cap_over_mean"], 2)
    (0.2, 4.27)
    """
    logs = np.log(np.maximum(lengths, 1).astype(np.float64))
    _, inverse = np.unique(groups, return_inverse=True)
    n = np.bincount(inverse)
    mean = np.bincount(inverse, logs) / n
    within = float(((logs - mean[inverse]) ** 2).sum() / logs.size)
    total = float(logs.var())
    return {
        "len_p99_over_median": float(np.percentile(lengths, 99) / np.median(lengths)),
        "len_cap_over_mean": float(cap / lengths.mean()),
        "len_within_share": within / total if total > 0 else 0.0,
    }


def search_split(
    evaluate: Callable[[int], float], *, lo: int, hi: int, start: int
) -> tuple[int, dict[int, float]]:
    """The replica count in ``[lo, hi]`` that maximises ``evaluate``, by hill climbing
    from ``start`` in steps of 2, then 1 (throughput is unimodal in the split: too few
    rollouts starve the trainer, too few trainer GPUs leave rollouts back-pressured).
    Returns the best count and every value evaluated.

    >>> best, seen = search_split(lambda r: -abs(r - 9), lo=1, hi=15, start=4)
    >>> best, sorted(seen)
    (9, [4, 6, 8, 9, 10])
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
    return best, seen


# -- figures of one run, from its stores -------------------------------------------------


def steady_updates(ups, schedule: str):
    """A run's ``updates`` rows that its figures measure: all but one-step's last.

    One-step publishes version ``v`` once the batch of ``v + 1`` is complete, so each of
    its intervals holds the wait for that batch; its last version is published straight
    after its update (no next batch), an interval short by that wait, which measured with
    the others would flatter one-step alone. The run's figures (window, rewards, lengths)
    end at the version before; :func:`run_steps` runs one-step one update longer."""
    if schedule == "one_step" and ups.sizes["update"]:
        return ups.isel(update=slice(0, -1))
    return ups


def run_steps(arm: str, steps: int) -> int:
    """``trainer.steps`` of an arm's run that measures ``steps`` updates
    (:func:`steady_updates`).

    >>> run_steps("one_step", 9), run_steps("sync", 9)
    (10, 9)
    """
    return steps + (ARMS[arm][0] == "one_step")


def arm_figures(run_dir: Path, summary: dict, warmup: int) -> dict:
    """Every figure of one run (see the module docstring), in modelled units of the
    full-size cluster: the run's ``rollout.pacing`` scales and dilation convert them."""
    from laminar.config import load_config
    from laminar.pacing import scale_of
    from storage import open_run
    from storage.audit import audit_run
    from storage.metrics import open_metrics

    cfg = load_config(Path(run_dir) / "config.yaml")
    sc = scale_of(cfg.rollout.pacing)
    # a version's policy reward counts once its rollouts finished a quarter of a batch
    min_samples = max(1, cfg.trainer.groups_per_step * cfg.rollout.group_size // 4)
    scale_tok, scale_req = sc.tokens, sc.request_scale
    modelled = sc.modelled

    ups = steady_updates(open_metrics(run_dir, "updates").sortby("version"), cfg.pipeline.schedule)
    version = ups["version"].values
    measured = version > warmup
    if measured.sum() < 1:
        raise RuntimeError(f"{run_dir}: no update after the {warmup} warm-up ones")
    tokens = ups["tokens"].values[measured].sum()
    interval = ups["interval_s"].values[measured].sum()
    t_end = ups["time"].values[measured][-1]
    t_begin = t_end - interval
    out: dict[str, float] = {
        # prompt + response tokens of a global batch / time between adjacent updates
        "throughput": tokens * scale_tok / modelled(interval),
        "iteration_s": modelled(interval / measured.sum()),
    }
    # The trainer's idle share on its own clock, over the throughput's window: what each
    # measured interval between publications leaves besides training (``update_s``) and
    # moving the weights (``sync_s``), i.e. the wait for its batch (and a few ms of
    # bookkeeping per update). Its cumulative ``wait_s`` in the ``cluster`` table has no
    # read time of its own (the row's comes after the poll has read every rollout), and
    # counts a wait only once it has ended: a poll during one missed it.
    if "update_s" in ups and "sync_s" in ups:
        busy = ups["update_s"].values[measured] + ups["sync_s"].values[measured]
        if np.isfinite(busy).all():
            out["trainer_idle"] = float(1 - busy.sum() / interval)
    # The policy learns, and its response lengths move as it does: the workload is the
    # same for every schedule at the start (the base policy's first batch), not after.
    # The measured batches' mean response length, and over the first batch's.
    lengths = ups["response_len_mean"].values
    mean_len = float(lengths[measured].mean())
    out["response_len"] = mean_len * sc.length_scale
    out["len_drift"] = mean_len / float(lengths[0])
    # Reward against modelled time since the first publication, two ways: the trained
    # batches' (an update's batch, when it is published: what a trainer logs, lagging the
    # policy by its staleness) and the policy's (the rollouts of version v, at the time v
    # was published: when the trainer first held a policy that good).
    t0 = ups["time"].values[0] - ups["interval_s"].values[0]
    published = {0: t0} | dict(zip(version.tolist(), ups["time"].values.tolist(), strict=True))
    out["_trained"] = [
        (modelled(t - t0), float(r))
        for t, r in zip(ups["time"].values, ups["reward_mean"].values, strict=True)
    ]
    ds = open_run(run_dir)
    ok = ds["finish_reason"].values != "error"
    k = ds["behavior_version"].values[ok]
    rew = ds["reward"].values[ok]
    out["_policy"] = [
        (modelled(published[v] - t0), float(rew[k == v].mean()))
        for v in sorted(published)
        if (k == v).sum() >= min_samples
    ]
    if not out["_policy"]:
        raise RuntimeError(
            f"{run_dir}: no version generated {min_samples} finished responses; the run "
            "is too short to measure (raise --iterations)"
        )

    # Trajectories entering and leaving the buffer between the publications that bound
    # the window, each at its own time (``t_insert``, ``t_sample``: the buffer's clock at
    # the event). The buffer's counters in the ``cluster`` table carry no time of their
    # own: a poll reads them first and its row's time comes after it has read every
    # rollout, seconds later on a loaded host. (Consumption then counts whole batches:
    # as many as the window has updates.)
    def events(t: np.ndarray) -> float:  # per modelled second of the window
        return float(((t > t_begin) & (t <= t_end)).sum()) * scale_req / modelled(interval)

    out["arrivals_per_s"] = events(ds["t_insert"].values)
    out["consumption_per_s"] = events(ds["t_sample"].values[ds["status"].values == "consumed"])
    out["reward_first"] = out["_policy"][0][1]
    out["reward_last"] = float(np.mean([r for _, r in out["_policy"][-2:]]))

    # The figures read from the driver's polls, over the polls between the publications
    # that bound the window. Fewer than two there (polls slower than the window: one took
    # up to a minute at 128 emulated GPUs) measure nothing of it: NaN, and a note, rather
    # than a window widened to the run's start (model load included).
    cl = open_metrics(run_dir, "cluster")
    wall = cl["wall_time"].values.astype("datetime64[ns]").astype(np.float64) / 1e9
    window = np.flatnonzero((wall >= t_begin) & (wall <= t_end))
    polled = [*ROLLOUT_FIGURES, "buffer_depth", "buffer_age_s"]
    if "trainer_idle" not in out:  # (runs recorded before update_s and sync_s)
        polled.append("trainer_idle")
    out["_notes"] = []
    if len(window) < 2:
        n = len(window)
        out |= dict.fromkeys(polled, math.nan)
        out["_notes"].append(
            f"{run_dir}: {n} poll{'' if n == 1 else 's'} of the metrics between publications "
            f"{version[measured][0] - 1} and {version[measured][-1]} "
            f"({modelled(interval):,.0f} modelled s): {', '.join(polled)} not measured (NaN); "
            "polls slower than the window (a loaded host): measure more updates"
        )
    else:
        first, last = window[[0, -1]]
        if "trainer_idle" in polled:
            wait = cl["trainer_wait_s"].values
            out["trainer_idle"] = float(wait[last] - wait[first]) / (wall[last] - wall[first])
        depth = cl["buffer_depth"].values[first : last + 1]
        out["buffer_depth"] = float(np.mean(depth)) * scale_req
        age = cl["oldest_buffered_age_s"].values[first : last + 1]
        out["buffer_age_s"] = modelled(float(np.nanmean(age))) if np.isfinite(age).any() else 0.0
        ro = open_metrics(run_dir, "rollouts")
        rt = ro["time"].values  # (the same polls: the rows share their elapsed_s)
        a, b = cl["time"].values[first], cl["time"].values[last]
        out |= rollout_figures(ro.isel(time=(rt >= a) & (rt <= b)), sc)

    # The measured updates' batches alone (update v trains what was sampled at v - 1):
    # the warm-up's first batches are structurally fresher (one_step's first has
    # s_train 0, every other 1: over the whole run its mean read 0.90).
    st = ds.laminar.staleness()
    sampled = ds["sample_version"].values[ds["status"].values == "consumed"]
    in_window = (sampled >= version[measured][0] - 1) & (sampled <= version[measured][-1] - 1)
    for name in ("s_gen", "residence", "s_train"):
        v = st[name].values[in_window]
        out[f"{name}_mean"] = float(v.mean()) if v.size else math.nan
        out[f"{name}_p99"] = float(np.percentile(v, 99)) if v.size else math.nan
        out[f"{name}_max"] = float(v.max()) if v.size else math.nan
    status = ds["status"].values
    resp_len = ds["response_len"].values
    out.update(length_shape(resp_len, ds["prompt_uid"].values, cfg.rollout.max_new_tokens))
    for s in ("evicted", "discarded", "filtered"):
        out[s] = int((status == s).sum()) * scale_req
    wasted = np.isin(status, ["evicted", "discarded", "filtered"])
    out["wasted_tokens"] = float(resp_len[wasted].sum()) * scale_tok
    out["recomputed_tokens"] = (
        float(sum(r.get("recomputed_tokens", 0) for r in summary["rollouts"])) * scale_tok
    )
    eng = summary["engine"]
    out["compute_vs_modelled"] = (
        eng["compute_s"] / eng["modelled_s"] if eng.get("modelled_s") else math.nan
    )
    out["overrun_steps"] = eng.get("overruns", 0)
    # Wall time of the decode loops that no modelled step accounts for: between-step work
    # (rewards handed off, partial log, pool calls, commands served) and overruns.
    decode_s = sum(r.get("decode_s", 0.0) for r in summary["rollouts"])
    out["decode_unmodelled"] = (
        1 - eng["modelled_s"] / decode_s if eng.get("modelled_s") and decode_s else math.nan
    )
    top_up_s = [r["top_up_s"] for r in summary["rollouts"] if "top_up_s" in r]
    out["top_up_share"] = sum(top_up_s) / decode_s if top_up_s and decode_s else math.nan
    paced = (summary.get("trainer_pacing") or {}).get("update", {})
    out["trainer_compute_vs_modelled"] = (
        paced["compute_s"] / paced["modelled_s"] if paced.get("modelled_s") else math.nan
    )
    out["trainer_overruns"] = paced.get("overruns", 0)
    out["audit_ok"] = float(audit_run(run_dir).ok)
    out["moves"] = (summary.get("repack") or {}).get("moves", 0)
    out["replicas"] = cfg.rollout.replicas
    out["trainer_gpus"] = cfg.trainer.pacing.gpus if cfg.trainer.pacing else math.nan
    return out


ROLLOUT_FIGURES = ("gen_throughput", "rollout_idle", "decode_batch")


def admitted_decodes(ro, sc) -> np.ndarray:
    """What the requests admitted so far decoded in the steps that admitted them, per
    real step's worth: a scaled step stands for ``length_scale`` modelled steps, the first
    of which prefills the admitted requests and the others decode them too
    (:meth:`laminar.pacing.Pacer.modelled`), so each counts ``(L - 1) / L`` of a request
    in that step's decode batch. (``engine_decode_tokens`` counts only the requests a
    step found running.) Zero for runs recorded before ``engine_admitted`` existed."""
    if "engine_admitted" not in ro:
        return np.zeros(ro["engine_steps"].shape)
    return ro["engine_admitted"].values * (sc.length_scale - 1) / sc.length_scale


def rollout_figures(ro, sc) -> dict[str, float]:
    """``gen_throughput``, ``rollout_idle`` and ``decode_batch`` from the ``rollouts``
    rows of the window (``time × rollout``), each rollout's counters from its first to
    its last reading there, over its own clock.

    A poll reads the rollouts one after another, and on a loaded host (128 emulated GPUs:
    a poll took up to a minute) the row's time is none of theirs: dividing by it read
    busy fractions of 0.82-1.16 per poll and an idle fraction of -0.02 over a run. So
    each rollout's growth is over the span between its own readings (``read_at``), and
    generation throughput is the sum of the rollouts' rates. A rollout that did not
    answer one poll is read from its nearest readings in the window rather than left
    out of the sum. Runs recorded before ``read_at`` existed: the row's time.
    """
    if "read_at" in ro:
        clock = ro["read_at"].values
    else:
        clock = np.where(
            np.isfinite(ro["response_tokens"].values), ro["time"].values[:, None], np.nan
        )
    if ro.sizes["time"] < 2:
        return dict.fromkeys(ROLLOUT_FIGURES, math.nan)
    read = np.isfinite(clock)
    cols = np.arange(clock.shape[1])
    first = np.argmax(read, axis=0)
    last = len(read) - 1 - np.argmax(read[::-1], axis=0)
    twice = read.sum(axis=0) >= 2

    def delta(v: np.ndarray) -> np.ndarray:  # per rollout (NaN: read fewer than twice)
        return np.where(twice, v[last, cols] - v[first, cols], np.nan)

    span = delta(clock)
    ok = np.isfinite(span) & (span > 0)
    busy = delta(ro["decode_s"].values)
    idle = np.isfinite(busy) & ok
    tokens = delta(ro["response_tokens"].values)
    steps = delta(ro["engine_steps"].values)
    decoded = delta(ro["engine_decode_tokens"].values) + delta(admitted_decodes(ro, sc))
    return {
        "gen_throughput": float(np.sum(tokens[ok] / span[ok])) * sc.tokens / sc.modelled(1.0)
        if ok.any()
        else math.nan,
        "rollout_idle": float(1 - busy[idle].sum() / span[idle].sum()) if idle.any() else math.nan,
        "decode_batch": float(np.nansum(decoded) / max(np.nansum(steps), 1)) * sc.request_scale,
    }


def time_to_reward(curve: list[tuple[float, float]], threshold: float) -> float:
    """Modelled seconds until a reward curve (two-point moving average) first reaches
    ``threshold`` (NaN: never, within the run). The base policy's point is left out of
    the average: a run whose version 0 already scored above the threshold counted 0 s.

    >>> time_to_reward([(0, 0.5), (10, 0.6), (20, 0.8), (30, 0.9)], 0.7)
    20
    >>> time_to_reward([(0, 0.9), (10, 0.6), (20, 0.8)], 0.7)
    20
    """
    for i in range(1, len(curve)):
        window = [r for _, r in curve[max(1, i - 1) : i + 1]]  # (never the base's point)
        if np.mean(window) >= threshold:
            return curve[i][0]
    return math.nan


def reward_thresholds(results: dict[str, list[dict]], given: float | None) -> dict:
    """Each seed's time-to-reward threshold (``given``: one for all). Three quarters
    (``TTR_FRACTION``) of the way from the seed's base reward (the median over its runs'
    version 0) to the lowest final reward of its runs: every run of the seed reaches
    it, late enough that the first iterations do not decide it. Per seed, because a
    seed's prompts set its base: on the 64-GPU workload the bases of two seeds differ by
    0.02 against a rise of 0.03, and one threshold for all lay below one seed's base.

    >>> runs = {"a": [{"_seed": 0, "reward_first": 0.8, "reward_last": 0.9},
    ...               {"_seed": 1, "reward_first": 0.6, "reward_last": 0.7}]}
    >>> {k: round(v, 3) for k, v in reward_thresholds(runs, None).items()}
    {0: 0.875, 1: 0.675}
    """
    seeds = {f.get("_seed") for rs in results.values() for f in rs}
    if given is not None:
        return dict.fromkeys(seeds, given)
    out = {}
    for seed in seeds:
        runs = [f for rs in results.values() for f in rs if f.get("_seed") == seed]
        base = float(np.median([f["reward_first"] for f in runs]))
        out[seed] = base + TTR_FRACTION * (min(f["reward_last"] for f in runs) - base)
    return out


# -- the bench -------------------------------------------------------------------------------


def _run(client, run_dir: Path, overrides: list[str]) -> dict:
    """The summary of one bench run that ran all its steps. One that ended otherwise is
    no measurement: a stop raises :class:`~laminar.errors.RunFailed` (left out and listed
    as a failed run); an interrupt (:class:`pipelines.api.RunInterrupted`) ends the
    bench, exit 130."""
    import pipelines
    from laminar.errors import RunFailed

    run = pipelines.submit("configs/tiny.yaml", client, run_dir=run_dir, overrides=overrides)
    summary = run.wait(timeout=3600)
    if summary["reason"] != "completed":
        raise RunFailed(
            f"run {str(run_dir)!r} ended {summary['reason']!r} before its steps", summary
        )
    return summary


def bench_schedules(
    gpus: int = 64,
    seeds: int = 3,
    warmup: int = 3,
    iterations: int = 6,
    search: bool = True,
    probe_warmup: int = 2,
    probe_iterations: int = 2,
    arms: tuple[str, ...] = tuple(ARMS),
    splits: dict[str, int] | None = None,
    reward_threshold: float | None = None,
    runs_dir: str | None = None,
    overrides: tuple[str, ...] = (),
):
    """The schedules bench; see the module docstring.

    ``splits`` fixes an arm's rollout replicas (skipping its search); ``overrides``
    (``--set``) go to every arm's config after the bench's own; ``reward_threshold``
    the time-to-reward threshold (default: ``TTR_FRACTION`` of the way from the base
    policy's reward to the lowest final reward of any schedule, so that every schedule
    reaches it)."""
    from distributed import Client

    from laminar.cluster import local_cluster

    cluster = Cluster(gpus)
    if seeds < 0:
        raise ConfigError(f"--seeds {seeds}: give a count >= 0 (0 searches the splits only)")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arms {unknown}; known: {list(ARMS)}")
    splits = dict(splits or {})
    splits.setdefault("sync", cluster.max_replicas)  # colocated: every GPU generates
    searched = [a for a in arms if a not in splits and ABLATION_OF.get(a) not in {*splits, *arms}]
    if seeds == 0 and not (search and searched):
        raise ConfigError(
            "--seeds 0 runs the split search alone, but no arm's split is searched here "
            "(--splits fixes it, --no-search skips it): drop them, or give --seeds 1 or more"
        )
    if overrides:  # a bad --set fails here, naming the field, not after the cluster starts
        from laminar.config import load_config

        for arm in arms:
            r = splits.get(arm, cluster.balanced_replicas())
            load_config("configs/tiny.yaml", [*cluster.overrides(arm, r, 1, 0), *overrides])
    probes: dict[str, dict[int, float]] = {}
    results: dict[str, list[dict]] = {a: [] for a in arms}
    failed: list[dict] = []  # runs that failed: left out of every figure, and listed
    root = Path(runs_dir or tempfile.mkdtemp(prefix="laminar-bench-schedules-"))
    root.mkdir(parents=True, exist_ok=True)
    t_bench = time.time()
    with (
        # The data module on a worker of its own, as on the paper's CPU nodes: the
        # trainer's process then runs its (paced) updates undisturbed.
        local_cluster(cluster.max_replicas, memory_limit="2GiB", data_apart=True) as lc,
        Client(lc) as client,
    ):

        def run(arm: str, replicas: int, steps: int, seed: int, tag: str) -> dict | None:
            """One run's figures; ``None`` for a run that failed (in order: a reward
            that never scores, a lost actor past recovery): it is recorded and left
            out, and the bench goes on with the other runs."""
            from laminar.errors import RunFailed
            from pipelines.bench import failed_run

            run_dir = root / f"{arm}-r{replicas}-{tag}"
            steps = run_steps(arm, steps)
            arm_overrides = [*cluster.overrides(arm, replicas, steps, seed), *overrides]
            try:
                summary = _run(client, run_dir, arm_overrides)
            except RunFailed as e:
                failed.append(failed_run(e, arm=arm, replicas=replicas, run=tag, run_dir=run_dir))
                print(
                    f"  {arm:<18} R={replicas:<2} {tag:<8} FAILED: {failed[-1]['reason']}; "
                    f"left out, the bench goes on (the run is kept in {run_dir})",
                    flush=True,
                )
                return None
            fig = _figures(run_dir, summary, warmup, probe_warmup)
            fig["_seed"] = seed
            print(
                f"  {arm:<18} R={replicas:<2} {tag:<8} throughput {fig['throughput']:>10,.0f} "
                f"tok/s  iteration {fig['iteration_s']:6.1f} s  rollout idle "
                f"{fig['rollout_idle']:.2f}  decode batch {fig['decode_batch']:5.0f}  "
                f"s_train {fig['s_train_mean']:.2f}  ({time.time() - t_bench:,.0f} s)",
                flush=True,
            )
            for note in fig["_notes"]:
                print(f"    {note}", flush=True)
            return fig

        for arm in arms:
            base = ABLATION_OF.get(arm)
            if arm not in splits and base in splits:  # an ablation: at its base's placement
                splits[arm] = splits[base]
                continue
            if arm in splits or not search:
                splits.setdefault(arm, cluster.balanced_replicas())
                continue
            steps = probe_warmup + probe_iterations

            def evaluate(r: int, arm=arm, steps=steps) -> float:
                fig = run(arm, r, steps, seed=0, tag="probe")
                return -math.inf if fig is None else fig["throughput"]  # (never chosen)

            best, seen = search_split(
                evaluate, lo=1, hi=cluster.max_replicas - 1, start=cluster.balanced_replicas()
            )
            splits[arm], probes[arm] = best, seen
        for seed in range(seeds):
            order = list(arms)[seed % len(arms) :] + list(arms)[: seed % len(arms)]
            for arm in order:
                fig = run(arm, splits[arm], warmup + iterations, seed, f"s{seed}")
                if fig is not None:
                    results[arm].append(fig)
    if seeds == 0:
        return _search_result(cluster, arms, splits, probes, root, failed)
    return _result(
        cluster,
        arms,
        results,
        splits,
        probes,
        reward_threshold,
        root,
        failed,
        locals_=dict(
            seeds=seeds,
            warmup=warmup,
            iterations=iterations,
            search=search,
            probe_warmup=probe_warmup,
            probe_iterations=probe_iterations,
            overrides=list(overrides),
        ),
    )


FIGURES = [
    "throughput",
    "gen_throughput",
    "ttr_s",
    "ttr_trained_s",
    "iteration_s",
    "rollout_idle",
    "trainer_idle",
    "decode_batch",
    "s_gen_mean",
    "s_gen_p99",
    "s_gen_max",
    "residence_mean",
    "residence_p99",
    "residence_max",
    "s_train_mean",
    "s_train_p99",
    "s_train_max",
    "buffer_depth",
    "buffer_age_s",
    "arrivals_per_s",
    "consumption_per_s",
    "evicted",
    "discarded",
    "filtered",
    "wasted_tokens",
    "recomputed_tokens",
    "reward_first",
    "reward_last",
    "compute_vs_modelled",
    "overrun_steps",
    "decode_unmodelled",
    "top_up_share",
    "trainer_compute_vs_modelled",
    "trainer_overruns",
    "audit_ok",
    "moves",
    "len_p99_over_median",
    "len_cap_over_mean",
    "len_within_share",
    "response_len",
    "len_drift",
    "replicas",
    "trainer_gpus",
]
TABLE = [
    "replicas",
    "trainer_gpus",
    "throughput",
    "gen_throughput",
    "ttr_s",
    "rollout_idle",
    "trainer_idle",
    "decode_batch",
    "s_train_mean",
    "s_train_max",
    "buffer_depth",
    "wasted_tokens",
    "len_drift",
]


def _figures(run_dir, summary, warmup, probe_warmup) -> dict:
    """:func:`arm_figures` of one bench run (``ARM-rR-sN`` measured, ``ARM-rR-probe``)."""
    probe = run_dir.name.endswith("-probe")
    return arm_figures(run_dir, summary, probe_warmup if probe else warmup)


def reanalyse(
    runs_dir: str,
    warmup: int = 3,
    probe_warmup: int = 2,
    reward_threshold: float | None = None,
):
    """The bench's result from the runs a previous ``--runs-dir`` kept, without running
    anything: the same figures, e.g. with another ``reward_threshold`` or ``warmup``, or
    of a bench stopped before its end (the runs it finished)."""
    import json
    import re

    from laminar.config import load_config
    from pipelines.bench import failed_run

    root = Path(runs_dir)
    found = []
    for d in sorted(root.iterdir()):
        m = re.fullmatch(r"(.+)-r(\d+)-(probe|s(\d+))", d.name)
        if m and m.group(1) in ARMS and (d / "summary.json").exists():
            found.append((m.group(1), int(m.group(2)), m.group(4), d))
    if not found:
        raise FileNotFoundError(f"{runs_dir}: no finished bench runs (ARM-rR-sN/summary.json)")
    arm, r, _, d = found[0]  # the cluster: the trainer's GPUs and the replicas' (sync: all)
    trainer_gpus = load_config(d / "config.yaml").trainer.pacing.gpus
    cluster = Cluster(trainer_gpus + (0 if arm == "sync" else GPUS_PER_REPLICA * r))
    arms = [a for a in ARMS if any(f[0] == a for f in found if f[2] is not None)]
    results: dict[str, list[dict]] = {a: [] for a in arms}
    splits: dict[str, int] = {}
    probes: dict[str, dict[int, float]] = {}
    failed: list[dict] = []
    for arm, r, seed, d in found:
        summary = json.loads((d / "summary.json").read_text())
        reason = str(summary.get("reason"))
        if reason.startswith("failed"):  # (left out and listed, as the bench did)
            tag = "probe" if seed is None else f"s{seed}"
            failed.append(failed_run(reason, arm=arm, replicas=r, run=tag, run_dir=d))
        if reason != "completed":
            continue
        fig = _figures(d, summary, warmup, probe_warmup)
        fig["_seed"] = seed
        if seed is None:
            probes.setdefault(arm, {})[r] = fig["throughput"]
        elif arm in results:
            results[arm].append(fig)
            splits[arm] = r
    if not any(results.values()):  # a search-only bench (--seeds 0), or one stopped in it
        if not probes:
            raise FileNotFoundError(f"{runs_dir}: no completed bench run to read")
        arms = [a for a in ARMS if a in probes]
        best = {a: max(seen, key=seen.__getitem__) for a, seen in probes.items()}
        return _search_result(cluster, arms, best, probes, root, failed)
    seeds = max(len(rs) for rs in results.values()) if results else 0
    locals_ = dict(seeds=seeds, warmup=warmup, probe_warmup=probe_warmup, reanalysed=str(root))
    return _result(cluster, arms, results, splits, probes, reward_threshold, root, failed, locals_)


def _search_result(cluster, arms, splits, probes, root, failed=()):
    """``--seeds 0``: the splits alone, searched (or fixed), and every probe; nothing is
    measured beyond the probes, so there are no medians and no ratios."""
    from pipelines.bench import BenchResult, failed_notes

    figures: dict[str, float | None] = {}
    rows = []
    for arm in arms:
        seen = probes.get(arm, {})
        best = seen.get(splits[arm])
        figures[f"{arm}_replicas"] = float(splits[arm])
        figures[f"{arm}_probe_throughput"] = best
        probed = ", ".join(f"{r}: {v / 1e3:,.0f}k" for r, v in seen.items())
        if not probed:
            base = ABLATION_OF.get(arm)
            probed = (
                "colocated"
                if arm == "sync"
                else f"at {base}'s split"
                if base in splits and splits[base] == splits[arm]
                else "fixed"
            )
        rows.append(
            [
                arm,
                splits[arm],
                cluster.gpus if arm == "sync" else cluster.gpus - GPUS_PER_REPLICA * splits[arm],
                best,
                probed,
            ]
        )
    return BenchResult(
        name="schedules",
        figures=figures,
        ratios={},
        samples={},
        columns=["schedule", "replicas", "trainer_gpus", "probe_throughput", "probes (R: tok/s)"],
        rows=rows,
        options=_options(cluster, splits, probes, root, seeds=0),
        notes=[
            f"{cluster.gpus} emulated H800 GPUs: the split search alone (--seeds 0), probes "
            "of seed 0 in the probes' order; run with --splits ARM=R to measure at these; "
            "no table or plots beside the JSON (nothing was measured at the splits)",
            *failed_notes(list(failed)),
        ],
        failed=list(failed),
    )


def _options(cluster, splits, probes, root, **more) -> dict:
    """What a result records of how it was made: cluster shape, scales, splits, every probe."""
    return {
        "gpus": cluster.gpus,
        "dilation": cluster.dilation,
        "length_scale": LENGTH_SCALE,
        "request_scale": REQUEST_SCALE,
        "splits": splits,
        "probes": {arm: {str(r): v for r, v in seen.items()} for arm, seen in probes.items()},
        "workload": WORKLOAD,
        "runs": str(root),
        **more,
    }


def _result(cluster, arms, results, splits, probes, reward_threshold, root, failed, locals_):
    from pipelines.bench import BenchResult, failed_notes

    if not any(results.values()):
        raise RuntimeError(
            "every measured run failed; nothing to report:\n" + "\n".join(failed_notes(failed))
        )
    thresholds = reward_thresholds(results, reward_threshold)
    for rs in results.values():
        for f in rs:
            f["ttr_threshold"] = thresholds[f.get("_seed")]
            f["ttr_s"] = time_to_reward(f["_policy"], f["ttr_threshold"])
            f["ttr_trained_s"] = time_to_reward(f["_trained"], f["ttr_threshold"])
    med = {  # (an arm whose every run failed: NaN throughout)
        arm: {
            k: _median_censored([f[k] for f in rs])
            if k in CENSORED
            else _median([f[k] for f in rs])
            for k in FIGURES
        }
        for arm, rs in results.items()
    }

    def ratio(a: str, b: str, key: str = "throughput") -> float | None:
        if a not in med or b not in med or not med[b][key]:
            return None
        value = med[a][key] / med[b][key]
        return None if math.isnan(value) else value

    ratios = {
        f"laminar_vs_{b}": ratio("laminar", b)
        for b in ("sync", "one_step", "stream", "partial_rollout")
    }
    ratios["laminar_repack_on_vs_off"] = ratio("laminar", "laminar_no_repack")
    ratios["ttr_laminar_vs_sync"] = ratio("sync", "laminar", "ttr_s")  # sync's time / Laminar's
    ratios["ttr_trained_laminar_vs_sync"] = ratio("sync", "laminar", "ttr_trained_s")
    ratios["gen_throughput_laminar_vs_sync"] = ratio("laminar", "sync", "gen_throughput")
    figures = {f"{arm}_{k}": v for arm, m in med.items() for k, v in m.items()}
    # (each seed's: reward_thresholds; their median for the plot and the table's note)
    figures["reward_threshold"] = float(np.median(list(thresholds.values())))
    locals_ = {**locals_, "reward_thresholds": {str(k): v for k, v in thresholds.items()}}
    samples = {f"{arm}_{k}": [f[k] for f in rs] for arm, rs in results.items() for k in FIGURES}
    for curve in ("policy", "trained"):  # [(modelled s, reward)] of every run
        samples |= {
            f"{arm}_{curve}_reward": [f[f"_{curve}"] for f in rs] for arm, rs in results.items()
        }
    result = BenchResult(
        name="schedules",
        figures=figures,
        ratios=ratios,
        samples=samples,
        columns=["schedule"] + TABLE,
        rows=[[arm] + [med[arm][c] for c in TABLE] for arm in arms],
        options=_options(cluster, splits, probes, root, **locals_),
        notes=[
            f"{cluster.gpus} emulated H800 GPUs (TP4 replicas; sync colocated on all); "
            f"modelled units of the full-size cluster; medians over {locals_['seeds']} seeds",
            "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None),
            "time to reward: the policy's reward (its rollouts', at its publication; "
            "ttr_trained_s: the trained batches', at their update), 2-point mean >= "
            + ", ".join(f"{v:.3f} (seed {k})" for k, v in sorted(thresholds.items(), key=str)),
            *(
                f"{arm}: {note}"
                for arm, rs in results.items()
                for f in rs
                for note in f.get("_notes", ())
            ),
            *failed_notes(failed),
        ],
        failed=failed,
    )
    result.extras = write_extras
    return result


# Times to reward: NaN in a run's sample means it never reached the threshold within the
# run, i.e. later than any run that did, not an unknown to leave out of the median.
CENSORED = ("ttr_s", "ttr_trained_s")


def _median_censored(values: list[float]) -> float:
    """The median of times to an event, NaN counted as "not within the run" (later than
    every finite time); NaN when the median run did not reach it, or there is no run.

    >>> _median_censored([600.0, float("nan"), 900.0]), _median_censored([600.0, float("nan")])
    (900.0, nan)
    """
    if not values:
        return math.nan
    med = float(np.median([math.inf if math.isnan(v) else v for v in values]))
    return med if math.isfinite(med) else math.nan


def _median(values: list[float]) -> float:
    """The median of the finite samples; NaN when there is none (no warning).

    >>> _median([3.0, float("nan"), 1.0]), _median([])
    (2.0, nan)
    """
    finite = [v for v in values if not math.isnan(v)]
    return float(np.median(finite)) if finite else math.nan


def write_extras(result, out: Path) -> list[Path]:
    """Beside ``out`` (the JSON): a markdown table and the plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    stem = out.with_suffix("")
    md = stem.with_suffix(".md")
    md.write_text(markdown(result))
    arms = [row[0] for row in result.rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    thr = [result.figures[f"{a}_throughput"] / 1e3 for a in arms]
    colours = {"laminar": "#1f77b4", "laminar_no_repack": "#aec7e8"}  # the baselines grey
    ax[0].bar(arms, thr, color=[colours.get(a, "#999") for a in arms])
    ax[0].set_ylabel("actor-update throughput (k tok/s)")
    ax[0].tick_params(axis="x", rotation=30)
    for a in arms:
        for i, curve in enumerate(result.samples[f"{a}_policy_reward"]):
            t, r = zip(*curve, strict=True) if curve else ((), ())
            ax[1].plot(t, r, lw=0.8, label=a if i == 0 else None)
    ax[1].axhline(result.figures["reward_threshold"], color="k", ls=":", lw=0.8)
    ax[1].set_xlabel("modelled time (s)")
    ax[1].set_ylabel("reward of each version's rollouts")
    ax[1].legend(fontsize=7)
    fig.suptitle(f"laminar bench schedules, {result.options['gpus']} emulated GPUs")
    fig.tight_layout()
    png = stem.parent / f"{stem.name}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [md, png]


def markdown(result) -> str:
    """The bench's table and ratios as markdown."""
    cols = result.columns
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in result.rows:
        cells = [row[0]] + [_md(v) for v in row[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {_md(v)} |" for k, v in result.ratios.items()]
    return "\n".join(lines) + "\n"


def _md(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)
