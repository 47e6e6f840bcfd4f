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
from pathlib import Path

from laminar.errors import ConfigError
from pipelines.bench_schedules_cluster import (
    ABLATION_OF,
    ARMS,
    GPUS_PER_REPLICA,
    TINY_CONFIG,
    Cluster,
    Probe,
)
from pipelines.bench_schedules_cluster import CONCURRENCY as CONCURRENCY
from pipelines.bench_schedules_cluster import GROUP_SIZE as GROUP_SIZE
from pipelines.bench_schedules_cluster import REPACK_INTERVAL_S as REPACK_INTERVAL_S
from pipelines.bench_schedules_cluster import search_split as search_split
from pipelines.bench_schedules_figures import admitted_decodes as admitted_decodes
from pipelines.bench_schedules_figures import arm_figures, run_steps
from pipelines.bench_schedules_figures import steady_updates as steady_updates
from pipelines.bench_schedules_report import FIGURES as FIGURES
from pipelines.bench_schedules_report import _result, _search_result

# (The names imported as themselves above are re-exported: ``laminar bench repack``, the
# tests and docs/benchmarks.md name them from here.)

# -- the bench -------------------------------------------------------------------------------


def ordered_arms(arms) -> tuple[str, ...]:
    """``--arms`` each once, in :data:`ARMS`' order, whatever order they were given in:
    an ablation then runs at the split searched for the schedule it ablates (given
    first, ``laminar_no_repack`` was searched alone), and an arm named twice is not run
    twice into the same run directories.

    >>> ordered_arms(["laminar_no_repack", "sync", "laminar", "sync"])
    ('sync', 'laminar', 'laminar_no_repack')
    """
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arms {unknown}; known: {list(ARMS)}")
    return tuple(a for a in ARMS if a in arms)


# The keys the bench sets for each run (Cluster.overrides), and the flags that set them:
# a --set of one would apply to every run after the bench's own, so that e.g. three
# "seeds" all ran seed 1.
PER_RUN = {
    "seed": "--seeds",
    "pipeline.schedule": "--arms",
    "rollout.replicas": "--splits (or the split search)",
    "trainer.pacing.gpus": "--gpus and --splits (the trainer has the GPUs the replicas leave)",
    "trainer.steps": "--warmup and --iterations",
    "rollout.pacing.dilation": "--gpus (the dilation grows with the cluster)",
}


def arm_set(arm: str, overrides) -> list[str]:
    """The ``--set`` overrides of ``arm``'s runs: all of them, but ``repack.*`` ones in the
    arms with repack on alone (a repack section switches repack on: in
    ``laminar_no_repack`` it would measure repack against itself; the other schedules
    refuse it).

    >>> arm_set("laminar_no_repack", ["repack.max_batch=12", "trainer.lr=1e-4"])
    ['trainer.lr=1e-4']
    >>> arm_set("laminar", ["repack.max_batch=12", "trainer.lr=1e-4"])
    ['repack.max_batch=12', 'trainer.lr=1e-4']
    """
    repack = ARMS[arm][1]
    return [
        o for o in overrides if repack or o.split("=", 1)[0].split(".", 1)[0].strip() != "repack"
    ]


def check_overrides(overrides) -> None:
    """Refuse a ``--set`` of a key the bench sets for each run, naming the flag that does.

    >>> check_overrides(["trainer.lr=1e-4", " seed = 1"])
    Traceback (most recent call last):
    ...
    laminar.errors.ConfigError: --set seed=1: the bench sets seed for each run; use --seeds
    """
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() in PER_RUN:
            raise ConfigError(
                f"--set {key.strip()}={value.strip()}: the bench sets {key.strip()} for each "
                f"run; use {PER_RUN[key.strip()]}"
            )


def check_splits(cluster: Cluster, splits: dict[str, int]) -> None:
    """Refuse a ``--splits`` value the emulated cluster cannot hold: a replica count from
    1 to one replica short of every GPU (the trainer has the rest), sync's (colocated)
    up to every GPU's.

    >>> check_splits(Cluster(64), {"laminar": 16})
    Traceback (most recent call last):
    ...
    laminar.errors.ConfigError: --splits laminar=16: at 64 GPUs give 1 to 15 replicas of 4 ...
    """
    for arm, r in splits.items():
        top = cluster.max_replicas if ARMS[arm][0] == "sync" else cluster.max_replicas - 1
        if not 1 <= r <= top:
            rest = "sync is colocated" if arm == "sync" else "the trainer has the rest"
            raise ConfigError(
                f"--splits {arm}={r}: at {cluster.gpus} GPUs give 1 to {top} replicas of "
                f"{GPUS_PER_REPLICA} GPUs ({rest})"
            )


def _run(client, run_dir: Path, overrides: list[str]) -> dict:
    """The summary of one bench run that ran all its steps. One that ended otherwise is
    no measurement: a stop raises :class:`~laminar.errors.RunFailed` (left out and listed
    as a failed run); an interrupt (:class:`pipelines.api.RunInterrupted`) ends the
    bench, exit 130."""
    import pipelines
    from laminar.errors import RunFailed

    run = pipelines.submit(TINY_CONFIG, client, run_dir=run_dir, overrides=overrides)
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
    probe_iterations: int = 4,
    arms: tuple[str, ...] = tuple(ARMS),
    splits: dict[str, int] | None = None,
    reward_threshold: float | None = None,
    runs_dir: str | None = None,
    overrides: tuple[str, ...] = (),
):
    """The schedules bench; see the module docstring.

    ``probe_warmup`` and ``probe_iterations``: the split search's probes, each of seed
    0, measuring ``probe_iterations`` updates after ``probe_warmup`` (4: with 2, a
    probe's figure was two intervals that vary by 7-10% within a run, more than
    neighbouring splits differ); the JSON records each probe's interval throughputs and
    their standard error, and the splits within that noise of the chosen one.
    ``splits`` fixes an arm's rollout replicas (skipping its search); ``overrides``
    (``--set``) go to every arm's config after the bench's own; ``reward_threshold``
    the time-to-reward threshold (default, per seed: ``TTR_FRACTION`` of the way from the
    base policy's reward to the lowest final reward of the runs compared, so that each
    reaches it: a ratio's two arms', the table's every arm's)."""
    from distributed import Client

    from laminar.cluster import local_cluster

    cluster = Cluster(gpus)
    if seeds < 0:
        raise ConfigError(f"--seeds {seeds}: give a count >= 0 (0 searches the splits only)")
    arms = ordered_arms(arms)
    splits = dict(splits or {})
    splits.setdefault("sync", cluster.max_replicas)  # colocated: every GPU generates
    searched = [a for a in arms if a not in splits and ABLATION_OF.get(a) not in {*splits, *arms}]
    if seeds == 0 and not (search and searched):
        raise ConfigError(
            "--seeds 0 runs the split search alone, but no arm's split is searched here "
            "(--splits fixes it, --no-search skips it): drop them, or give --seeds 1 or more"
        )
    check_splits(cluster, splits)
    check_overrides(overrides)
    # Every arm's config, with its --set: a bad split or field fails here, naming it, not
    # hours on, when the arm's turn comes after the others ran.
    from laminar.config import load_config

    for arm in arms:
        r = splits.get(arm, splits.get(ABLATION_OF.get(arm), cluster.balanced_replicas()))
        load_config(TINY_CONFIG, [*cluster.overrides(arm, r, 1, 0), *arm_set(arm, overrides)])
    probes: dict[str, dict[int, float]] = {}
    unsearched: dict[str, str] = {}  # arm -> why it has no split (its search failed)
    results: dict[str, list[dict]] = {a: [] for a in arms}
    failed: list[dict] = []  # runs that failed: left out of every figure, and listed
    root = Path(runs_dir or tempfile.mkdtemp(prefix="laminar-bench-schedules-"))
    root.mkdir(parents=True, exist_ok=True)
    # (said first: a bench stopped before its end is re-analysed from the runs it kept)
    print(
        f"runs kept in {root} (stopped before the end: laminar bench schedules --from-runs "
        f"--runs-dir {root})"
        + (
            "; a temporary folder, removed at the end unless a run fails (--runs-dir keeps them)"
            if runs_dir is None
            else ""
        ),
        flush=True,
    )
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
            arm_overrides = [
                *cluster.overrides(arm, replicas, steps, seed),
                *arm_set(arm, overrides),
            ]
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
            if arm not in splits and base in unsearched:  # (its base's search failed)
                unsearched[arm] = f"runs at {base}'s split, whose search failed"
                continue
            if arm in splits or not search:
                splits.setdefault(arm, cluster.balanced_replicas())
                continue
            steps = probe_warmup + probe_iterations

            def evaluate(r: int, arm=arm, steps=steps) -> float:
                fig = run(arm, r, steps, seed=0, tag="probe")
                if fig is None:
                    return -math.inf  # (never chosen)
                return Probe(fig["throughput"], fig["_interval_throughputs"])

            best, seen = search_split(
                evaluate, lo=1, hi=cluster.max_replicas - 1, start=cluster.balanced_replicas()
            )
            probes[arm] = seen
            if best is None:  # every probe failed: no split to measure it at
                unsearched[arm] = f"split search failed (every probe failed: R={sorted(seen)})"
                print(f"  {arm:<18} {unsearched[arm]}; not measured", flush=True)
                continue
            splits[arm] = best
        for seed in range(seeds):
            order = list(arms)[seed % len(arms) :] + list(arms)[: seed % len(arms)]
            for arm in order:
                if arm in unsearched:
                    continue
                fig = run(arm, splits[arm], warmup + iterations, seed, f"s{seed}")
                if fig is not None:
                    results[arm].append(fig)
    notes = [f"{arm}: {why}; not measured" for arm, why in unsearched.items()]
    if seeds == 0:
        result = _search_result(cluster, arms, splits, probes, root, failed)
        result.notes += notes
        return _tidy(result, root, runs_dir)
    result = _result(
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
    result.notes += notes
    return _tidy(result, root, runs_dir)


def _tidy(result, root: Path, runs_dir: str | None):
    """The result, its runs' temporary folder removed (``runs_dir`` not given) unless a
    run failed: it kept every run in /tmp (36 MB for two one-update runs; helper 189).
    A bench interrupted before this keeps them, for ``--from-runs``."""
    import shutil

    if runs_dir is None and not result.failed:
        shutil.rmtree(root, ignore_errors=True)
        result.options["runs"] = None
        result.notes.append(f"its runs' temporary folder ({root}) removed: --runs-dir keeps them")
    elif runs_dir is None:
        print(f"kept the runs in {root}: a run failed (listed in the notes)", flush=True)
    return result


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
            probes.setdefault(arm, {})[r] = Probe(fig["throughput"], fig["_interval_throughputs"])
        elif arm in results:
            results[arm].append(fig)
            splits[arm] = r
    if not any(results.values()):  # a search-only bench (--seeds 0), or one stopped in it
        if not probes:
            raise FileNotFoundError(f"{runs_dir}: no completed bench run to read")
        arms = [a for a in ARMS if a in probes]
        # (a failed probe is never the chosen split: an arm whose every probe failed has none)
        best = {
            a: max(seen, key=seen.__getitem__)
            for a, seen in probes.items()
            if any(math.isfinite(v) for v in seen.values())
        }
        return _search_result(cluster, arms, best, probes, root, failed)
    seeds = max(len(rs) for rs in results.values()) if results else 0
    locals_ = dict(seeds=seeds, warmup=warmup, probe_warmup=probe_warmup, reanalysed=str(root))
    return _result(cluster, arms, results, splits, probes, reward_threshold, root, failed, locals_)
