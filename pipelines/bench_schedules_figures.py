"""The figures of one ``laminar bench schedules`` run, read from its stores: throughput,
idle shares, staleness, buffer, waste, the reward curves and the length shape
(:func:`arm_figures`), and the time to reward across runs (:func:`time_to_reward`,
:func:`reward_thresholds`).

Apart from the bench because measuring a finished run is its own concern: it reads a run
directory and knows nothing of how the runs were started, so a bench's kept runs can be
measured again (:func:`pipelines.bench_schedules.reanalyse`) and ``laminar bench repack``
shares its rollout accounting (:func:`admitted_decodes`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipelines.bench_schedules_cluster import ARMS, TTR_FRACTION


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
    if measured.sum() < 1:  # (a --from-runs --warmup longer than the runs kept)
        from laminar.errors import ConfigError

        n = int(version.max()) if version.size else 0
        raise ConfigError(
            f"--warmup {warmup}: {str(run_dir)!r} has {n} measured updates, none after the "
            f"warm-up; give --warmup {max(n - 1, 0)} or less"
        )
    tokens = ups["tokens"].values[measured].sum()
    interval = ups["interval_s"].values[measured].sum()
    t_end = ups["time"].values[measured][-1]
    t_begin = t_end - interval
    out: dict[str, float] = {
        # prompt + response tokens of a global batch / time between adjacent updates
        "throughput": tokens * scale_tok / modelled(interval),
        "iteration_s": modelled(interval / measured.sum()),
        # each measured interval's own (a probe's spread: Probe, noise_band)
        "_interval_throughputs": [
            float(t * scale_tok / modelled(i))
            for t, i in zip(
                ups["tokens"].values[measured], ups["interval_s"].values[measured], strict=True
            )
        ],
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
    out.update(decode_loop_figures(summary))
    decode_s = sum(r.get("decode_s", 0.0) for r in summary["rollouts"])
    top_up_s = [r["top_up_s"] for r in summary["rollouts"] if "top_up_s" in r]
    out["top_up_share"] = sum(top_up_s) / decode_s if top_up_s and decode_s else math.nan
    out.update(trainer_paced(summary))
    out["audit_ok"] = float(audit_run(run_dir).ok)
    out["moves"] = (summary.get("repack") or {}).get("moves", 0)
    out["replicas"] = cfg.rollout.replicas
    out["trainer_gpus"] = cfg.trainer.pacing.gpus if cfg.trainer.pacing else math.nan
    return out


# The trainer's paced holds that model its compute: a whole update's, and stream's
# per-mini-batch ones (its compute is held mini-batch by mini-batch as groups arrive, and
# its ``update`` entry holds only what follows the last one).
TRAINER_COMPUTE_HOLDS = ("update", "mini_batch")


def trainer_paced(summary: dict) -> dict[str, float]:
    """``trainer_compute_vs_modelled`` and ``trainer_overruns`` over the trainer's compute
    holds (:data:`TRAINER_COMPUTE_HOLDS`). Read from ``update`` alone, stream's read
    ~5e-5 and its mini-batch overruns were never counted.

    >>> trainer_paced({"trainer_pacing": {
    ...     "update": {"compute_s": 0.0, "modelled_s": 1.0, "overruns": 0},
    ...     "mini_batch": {"compute_s": 6.0, "modelled_s": 7.0, "overruns": 2},
    ...     "publish": {"compute_s": 9.0, "modelled_s": 1.0, "overruns": 1}}})
    {'trainer_compute_vs_modelled': 0.75, 'trainer_overruns': 2}
    """
    paced = summary.get("trainer_pacing") or {}
    holds = [paced[k] for k in TRAINER_COMPUTE_HOLDS if k in paced]
    modelled = sum(h.get("modelled_s", 0.0) for h in holds)
    return {
        "trainer_compute_vs_modelled": (
            sum(h.get("compute_s", 0.0) for h in holds) / modelled if modelled else math.nan
        ),
        "trainer_overruns": sum(h.get("overruns", 0) for h in holds),
    }


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
    return crossing(curve, threshold)[0]


def crossing(curve: list[tuple[float, float]], threshold: float) -> tuple[float, float, float]:
    """:func:`time_to_reward`, with how far the crossing cleared the threshold: the
    two-point mean there less the threshold (``cleared``, >= 0), and the threshold less
    the highest two-point mean before it (``short``, > 0; NaN at the first point). A
    threshold moved by less than either gives the same time: the smaller is what the
    time to reward is known to. NaN throughout where the curve never reaches it.

    >>> [round(x, 3) for x in crossing([(0, 0.5), (10, 0.6), (20, 0.8), (30, 0.9)], 0.69)]
    [20, 0.01, 0.09]
    >>> [round(x, 3) for x in crossing([(0, 0.5), (10, 0.68), (20, 0.6), (30, 0.8)], 0.69)]
    [30, 0.01, 0.01]
    """
    means = [
        float(np.mean([r for _, r in curve[max(1, i - 1) : i + 1]]))  # (never the base's)
        for i in range(1, len(curve))
    ]
    for i, m in enumerate(means, start=1):
        if m >= threshold:
            short = threshold - max(means[: i - 1]) if i > 1 else math.nan
            return curve[i][0], m - threshold, short
    return math.nan, math.nan, math.nan


def reward_thresholds(results: dict[str, list[dict]], given: float | None, arms=None) -> dict:
    """Each seed's time-to-reward threshold (``given``: one for all), from the runs of
    ``arms`` alone (default: every arm's). Three quarters (``TTR_FRACTION``) of the way
    from the seed's base reward (the median over those runs' version 0) to the lowest
    final reward of those runs: every one of them reaches it, late enough that the first
    iterations do not decide it. Per seed, because a seed's prompts set its base: on the
    64-GPU workload the bases of two seeds differ by 0.02 against a rise of 0.03, and
    one threshold for all lay below one seed's base. A time-to-reward ratio takes the
    threshold of the two arms it compares (:func:`pair_times_to_reward`): from every
    arm's, it moved with the arms run beside them.

    >>> runs = {"a": [{"_seed": 0, "reward_first": 0.8, "reward_last": 0.9},
    ...               {"_seed": 1, "reward_first": 0.6, "reward_last": 0.7}]}
    >>> {k: round(v, 3) for k, v in reward_thresholds(runs, None).items()}
    {0: 0.875, 1: 0.675}
    """
    if arms is not None:
        results = {a: results.get(a, []) for a in arms}
    seeds = {f.get("_seed") for rs in results.values() for f in rs}
    if given is not None:
        return dict.fromkeys(seeds, given)
    out = {}
    for seed in seeds:
        runs = [f for rs in results.values() for f in rs if f.get("_seed") == seed]
        base = float(np.median([f["reward_first"] for f in runs]))
        out[seed] = base + TTR_FRACTION * (min(f["reward_last"] for f in runs) - base)
    return out


def pair_times_to_reward(
    results: dict[str, list[dict]], a: str, b: str, curve: str, given: float | None
) -> dict:
    """The times to reward of arms ``a`` and ``b`` for the ratio between them: each seed's
    threshold from their runs alone (:func:`reward_thresholds`; ``given`` wins), so an
    arm run beside them, whose final reward may be the seed's lowest, moves neither.
    ``curve``: ``"_policy"`` or ``"_trained"``. Returns the thresholds per seed, and per
    arm each run's ``(seed, time, cleared, short)`` (:func:`crossing`).

    >>> def run(seed, first, last, curve):
    ...     return {"_seed": seed, "reward_first": first, "reward_last": last, "_policy": curve}
    >>> res = {"sync": [run(0, 0.5, 0.9, [(0, 0.5), (10, 0.7), (20, 0.9)])],
    ...        "laminar": [run(0, 0.5, 0.9, [(0, 0.5), (5, 0.8), (10, 0.9)])],
    ...        "stream": [run(0, 0.5, 0.6, [(0, 0.5), (5, 0.6), (10, 0.6)])]}
    >>> pair = pair_times_to_reward(res, "sync", "laminar", "_policy", None)
    >>> pair["thresholds"], [t for _, t, _, _ in pair["sync"]]
    ({0: 0.8}, [20])
    """
    thresholds = reward_thresholds(results, given, arms=(a, b))
    out: dict = {"thresholds": thresholds}
    for arm in (a, b):
        out[arm] = [
            (f.get("_seed"), *crossing(f[curve], thresholds[f.get("_seed")]))
            for f in results.get(arm, [])
        ]
    return out


def decode_loop_figures(summary: dict) -> dict:
    """What the rollouts' decode loops (``decode_s``, wall) spent besides modelled steps,
    as both benches report it: ``decode_unmodelled``, the share no paced step
    accounts for (the work between steps — finished responses handed on, the partial
    log, pool calls, commands served — and overruns); ``overrun_share``, the share by
    which paced steps ended past their deadlines (``engine_overrun_s``: compute over the
    model, or a command served in a step's wait past it) — time the emulation stretched,
    that a GPU run would not have spent. NaN when not paced.

    >>> rollouts = [{"decode_s": 5.0, "engine_overrun_s": 0.4}, {"decode_s": 3.0}]
    >>> decode_loop_figures({"engine": {"modelled_s": 6.0}, "rollouts": rollouts})
    {'decode_unmodelled': 0.25, 'overrun_share': 0.05}
    """
    rollouts = summary["rollouts"]
    decode_s = sum(r.get("decode_s", 0.0) for r in rollouts)
    modelled_s = summary["engine"].get("modelled_s")
    if not (modelled_s and decode_s > 0):
        return {"decode_unmodelled": float("nan"), "overrun_share": float("nan")}
    overrun_s = sum(r.get("engine_overrun_s", 0.0) for r in rollouts)
    return {
        "decode_unmodelled": 1 - modelled_s / decode_s,
        "overrun_share": overrun_s / decode_s,
    }
