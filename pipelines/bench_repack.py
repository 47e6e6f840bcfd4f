"""``laminar bench repack``: Laminar with dynamic repack on vs off, same workload, same
emulated cluster, in one run.

The workload and the emulation are ``laminar bench schedules``'s (``docs/pacing.md``):
16 responses per prompt, response lengths with P99/median ≈ 10 that vary within a
group as well as between prompts, a hard cap; one real token stands for 256 modelled
ones and one real request for 8, so that a local batch of 32 real requests is the
paper's 256 per rollout, and a trajectory spans as many modelled decode steps as the
paper's do: a move's pause and re-prefill weigh on it as they would there. Replicas
are TP4 H800s serving a 7B model with a chunked-prefill engine; the trainer is paced on
the GPUs the replicas leave of the emulated cluster (default 8 replicas of 64 GPUs, the
paper's half split). Back-pressure is off, so that generation, not the trainer, is what
is measured; each arm stops after the same wall time and the arms alternate.

Figures per arm (medians over ``repeats`` pairs; modelled seconds of the full-size
cluster), over the steady part of each run — after the first ``warmup_share`` of it,
when the replicas' batches have drifted apart:

* generation throughput — response tokens decoded per second;
* mean KV utilisation — ``kv_used / kv_capacity`` over rollouts × polls, busy or not;
* repack overhead — the moves of the window (``moves``, committed; ``rolled_back``) and
  the pause they caused their sources' requests, from each export's hand-over to the
  source's release: summed over every move (``pause_sum_s``), as a share of the
  rollouts' time (``overhead_frac``: that sum over replicas × window), and a committed
  move's mean (``pause_per_move_s``);
* mean / max trajectory latency — ``t_finish − t_submit`` of the trajectories submitted
  in the window that ends a cap-length generation before the stop (none is cut short);
* decode step — a modelled decode step's mean time (ms) and requests (``decode_batch``):
  repack fills batches, and a fuller step reads more KV, which is why its mean latency
  rises (``docs/repack.md``);
* decode loop — the share of the rollouts' decode-loop time that no modelled step
  accounts for (``decode_unmodelled``, as bench schedules reports it), and the share by
  which paced steps ended past their deadlines (``overrun_share``), which stretches the
  emulated clock;
* replica-seconds freed (``freed_replica_s``, a sum over the window's committed moves)
  — for each, from its source's release to the last of its moved requests finishing
  elsewhere: the time the source would have spent on its stragglers.

Run it::

    laminar bench repack --out repack.json
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPLICAS = 8
GPUS = 64
# The schedules bench's (its workload and cluster); "32B" is the paper's repack
# experiment's model (§8.4), with its tighter KV.
MODEL = "7B"


def model_dilation(model: str, cluster_shape) -> float:
    """The dilation that keeps one real decode step of ``model`` as long on this machine
    as the schedules bench's 7B step (the real compute per wall second stays the same)."""
    from laminar.pacing import TimeModel
    from pipelines.bench_schedules import GPUS_PER_REPLICA

    context = 256 * 3400  # a full local batch at the workload's mean context
    base = TimeModel.named("H800", "7B", tp=GPUS_PER_REPLICA).decode_time(256, context)
    step = TimeModel.named("H800", model, tp=GPUS_PER_REPLICA).decode_time(256, context)
    return float(f"{cluster_shape.dilation * base / step:.4g}")


def model_overrides(model: str, cluster_shape) -> list[str]:
    """The replicas and trainer of ``model`` in place of the schedules bench's 7B: its
    KV capacity (in real tokens), :func:`model_dilation`, and a trainer slower per GPU
    in proportion to the parameters."""
    from laminar.pacing import MODELS

    params = MODELS[model].params / MODELS["7B"].params
    return [
        f"rollout.pacing.model={model}",
        f"rollout.kv_capacity_tokens={cluster_shape.kv_capacity(model)}",
        f"rollout.pacing.dilation={model_dilation(model, cluster_shape)}",
        f"trainer.pacing.tok_s_per_gpu={5000.0 / params:.4g}",
    ]


def arm_overrides(
    model: str, gpus: int, replicas: int, seed: int, overrides: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """Each arm's config overrides: the schedules bench's workload and cluster, without
    back-pressure; the user's ``overrides`` after, ``repack.*`` ones in the "on" arm
    alone (a ``repack`` key in the "off" arm's config would switch repack on there).

    >>> arms = arm_overrides("7B", 64, 8, 0, ("repack.max_batch=12", "seed=3"))
    >>> [o for o in arms["off"] if o.startswith(("repack", "seed"))]
    ['seed=0', 'seed=3']
    >>> [o for o in arms["on"] if o.startswith(("repack", "seed"))][-3:]
    ['repack.interval_s=0.625', 'seed=3', 'repack.max_batch=12']
    >>> [o for o in arms["on"] if o.startswith("rollout.top_up")]  # the paper's batches
    ['rollout.top_up=true', 'rollout.top_up=false']
    """
    from pipelines.bench_schedules import CONCURRENCY, GROUP_SIZE, REPACK_INTERVAL_S, Cluster

    cluster_shape = Cluster(gpus)
    scale = replace(cluster_shape.scale, dilation=model_dilation(model, cluster_shape))
    # generation is what repack changes: back-pressure must never idle a rollout here
    unbounded = ["buffer.max_outstanding_groups=1000000"]
    # one engine full per local batch: the paper's 256 per rollout (the schedules bench
    # tunes Laminar's to twice that)
    unbounded.append(f"rollout.groups_per_batch={CONCURRENCY // GROUP_SIZE}")
    # repack on the paper's draining batches: the schedules bench's Laminar tops up its
    # batches, which fills the same tails (docs/repack.md); --set rollout.top_up=true
    # measures repack over topping-up ones
    unbounded.append("rollout.top_up=false")
    unbounded += model_overrides(model, cluster_shape)
    mine = [o for o in overrides if o.split("=", 1)[0].split(".", 1)[0].strip() == "repack"]
    both = [o for o in overrides if o not in mine]
    arms = {
        arm: cluster_shape.overrides(name, replicas, steps=100000, seed=seed) + unbounded
        for arm, name in (("off", "laminar_no_repack"), ("on", "laminar"))
    }
    # The paper's 5 s in this dilation (another model's differs from the cluster's).
    arms["on"].append(f"repack.interval_s={scale.wall(REPACK_INTERVAL_S):.4g}")
    arms["off"] += both
    arms["on"] += both + mine
    return arms


def _arm(client, run_dir: Path, overrides: list[str], duration_s: float, scale, warmup) -> dict:
    import pipelines
    from laminar.errors import RunFailed
    from pipelines.bench import stop_on_interrupt
    from pipelines.bench_schedules_cluster import TINY_CONFIG

    run = pipelines.submit(TINY_CONFIG, client, run_dir=run_dir, overrides=overrides)
    deadline = None
    with stop_on_interrupt(lambda: run):  # (else the cluster closes under the live run)
        while True:
            p = run.progress()
            if deadline is None and p.get("phase") == "training":
                deadline = time.time() + duration_s
            if deadline is not None and time.time() >= deadline:
                run.stop()
                break
            if run.done():
                break
            time.sleep(0.2)
    # (an interrupt raises pipelines.api.RunInterrupted once the run stopped: the bench ends)
    summary = run.wait(timeout=600)
    if deadline is None or time.time() < deadline:  # ended before its window: no measurement
        raise RunFailed(
            f"run {str(run_dir)!r} ended {summary['reason']!r} before its {duration_s} s window",
            summary,
        )
    return _figures(run_dir, summary, scale, warmup)


STEP_COLUMNS = ("decode_s", "engine_steps", "engine_decode_tokens")


def _figures(run_dir: Path, summary: dict, scale, warmup: float) -> dict:
    """One arm's figures over its steady window (see the module docstring)."""
    from storage import open_run
    from storage.metrics import open_metrics, time_origin

    ds = open_run(run_dir)
    cl = open_metrics(run_dir, "cluster")
    elapsed = cl["time"].values
    t = elapsed + time_origin(cl)  # epoch seconds, as the trajectories' times
    tok = cl["response_tokens"].values
    i0 = int(np.searchsorted(t, t[0] + warmup * (t[-1] - t[0])))
    window = t[-1] - t[i0]
    gen = (tok[-1] - tok[i0]) / window  # real tokens per wall second
    t_submit, t_finish = ds["t_submit"].values, ds["t_finish"].values
    lat = t_finish - t_submit
    # Submitted early enough that even a cap-length generation finished before the stop.
    # Warmup 0 is the whole run: from its first submission, which can precede the first
    # poll. The stop is the last poll or the last finish, whichever is later. Then the
    # first submission always qualifies (the longest latency fits between it and the
    # stop), however long a loaded machine stretched it.
    since = t[i0] if i0 else -np.inf
    stop = max(t[-1], float(np.max(t_finish, initial=-np.inf)))
    late = stop - float(np.max(lat[t_submit >= since], initial=0.0))
    sel = (t_submit >= since) & (t_submit <= late)
    if not sel.any():
        raise RuntimeError(
            f"{run_dir}: no trajectory submitted in the steady window; raise --duration-s"
        )
    roll = open_metrics(run_dir, "rollouts")
    roll = roll.sel(time=roll["time"] >= elapsed[i0])
    util = (roll["kv_used"] / roll["kv_capacity"]).values
    # What a rollout's decode step cost and held over the window: repack fills batches
    # (more requests per step), and a fuller step reads more KV (it takes longer).
    d = {k: float((roll[k].isel(time=-1) - roll[k].isel(time=0)).sum()) for k in STEP_COLUMNS}
    steps = max(d["engine_steps"], 1.0)
    from pipelines.bench_schedules import admitted_decodes
    from pipelines.bench_schedules_figures import decode_loop_figures

    admitted = admitted_decodes(roll, scale)  # (time × rollout)
    # (NaN for a rollout that missed the window's first or last poll: skipped, as above)
    decoded = d["engine_decode_tokens"] + float(np.nansum(admitted[-1] - admitted[0]))
    out = {
        "gen_tok_s": scale.tokens * gen / scale.modelled(1.0),
        "kv_util_mean": float(np.nanmean(util)),
        "latency_mean_s": scale.modelled(float(lat[sel].mean())),
        "latency_max_s": scale.modelled(float(lat[sel].max())),
        "latency_trajectories": int(sel.sum()),
        "window_s": scale.modelled(window),
        # one modelled decode step (of the length_scale a real one stands for), in ms
        "step_ms": 1e3 * scale.modelled(d["decode_s"] / steps) / scale.length_scale,
        "decode_batch": scale.request_scale * decoded / steps,
        "trajectories": int(ds.sizes["trajectory"]),
        # real compute vs the modelled time: a run whose compute overran the model would
        # measure this machine, not the emulated cluster
        "overrun_steps": summary["engine"].get("overruns", 0),
        "compute_vs_modelled": (
            summary["engine"]["compute_s"] / summary["engine"]["modelled_s"]
            if summary["engine"].get("modelled_s")
            else float("nan")  # not paced
        ),
        **decode_loop_figures(summary),
        **pause_figures(np.zeros(0, bool), np.zeros(0), replicas=1, window_s=window, scale=scale),
        "freed_replica_s": 0.0,
    }
    rep = summary.get("repack")
    moved = rep and rep.get("moves", 0) + rep.get("rolled_back", 0)
    moves = open_metrics(run_dir, "repacks") if moved else None
    if moves is not None and moves.sizes.get("move"):
        # The steady window's rows (a move's time is its round's start, epoch seconds);
        # warmup 0: every row, those of rounds before the first poll too (``since``).
        steady = moves["time"].values >= since
        out.update(
            pause_figures(
                moves["ok"].values.astype(bool)[steady],
                moves["pause_s"].values[steady],
                replicas=max(len(summary["rollouts"]), 1),
                window_s=window,
                scale=scale,
            )
        )
        out["freed_replica_s"] = scale.modelled(_freed(ds, moves, since))
    return out


def pause_figures(ok, pause_s, *, replicas: int, window_s: float, scale) -> dict:
    """The window's moves (``ok``: committed, else rolled back) and the pause they caused
    their sources' requests (``pause_s``, each move's, wall seconds as the manager times
    them): ``pause_sum_s``, summed over every move (a rolled-back one paused its source
    too), and ``pause_per_move_s``, a committed move's mean, in modelled seconds;
    ``overhead_frac``, the sum's share of the rollouts' time over the window — a sum of
    replica-seconds, so the share divides by replicas × ``window_s`` (wall seconds).

    >>> from laminar.pacing import Scale
    >>> ok, pause = np.array([True, True, False]), np.array([0.5, 1.0, 0.5])
    >>> scale = Scale(dilation=32, length_scale=256)  # 8 modelled s a wall s
    >>> fig = pause_figures(ok, pause, replicas=4, window_s=50.0, scale=scale)
    >>> fig["moves"], fig["rolled_back"], fig["pause_sum_s"], fig["pause_per_move_s"]
    (2, 1, 16.0, 6.0)
    >>> fig["overhead_frac"]  # 2 replica-seconds of 4 replicas × 50 s
    0.01
    """
    ok, pause_s = np.asarray(ok, bool), np.asarray(pause_s, float)
    total = float(np.nansum(pause_s))
    return {
        "moves": int(ok.sum()),
        "rolled_back": int((~ok).sum()),
        "pause_sum_s": scale.modelled(total),
        "pause_per_move_s": scale.modelled(float(np.nanmean(pause_s[ok]))) if ok.any() else 0.0,
        "overhead_frac": total / (window_s * replicas) if window_s > 0 else 0.0,
    }


def _freed(ds, moves, since: float = -np.inf) -> float:
    """Σ over the committed moves of rounds from ``since`` on (epoch seconds) of (the last
    of its moved requests' finish − its source's release), 0 where they had all
    finished by then. (Stores from before the rows had ``t_released``: from the round's
    start, ``time``.)

    A move takes a source's requests, so a trajectory's hop ``src -> dst`` is the first
    committed move from ``src`` to ``dst`` after it reached ``src`` (submitted there, or
    moved there by its previous hop): a later move between the same two rollouts moves
    later requests, whose finish is not this move's. Every move is matched, those
    before ``since`` too: a trajectory's later hop is found after its earlier one."""
    if moves is None or not moves.sizes.get("move"):
        return 0.0
    ok = moves["ok"].values.astype(bool)
    freed_from = "t_released" if "t_released" in moves else "time"
    src, dst, t, t_free = (
        moves[k].values[ok] for k in ("source", "destination", "time", freed_from)
    )
    t_free = np.where(np.isfinite(t_free), t_free, t)  # (a resumed run's older rows)
    order = np.argsort(t, kind="stable")
    src, dst, t, t_free = src[order], dst[order], t[order], t_free[order]
    last = np.full(t.shape, -np.inf)  # per committed move: its moved requests' last finish
    for path, t_submit, t_finish in zip(
        ds["rollout_ids"].values, ds["t_submit"].values, ds["t_finish"].values, strict=True
    ):
        hops = path.split(",")
        arrived = t_submit
        for a, b in zip(hops, hops[1:], strict=False):
            i = np.flatnonzero((src == a) & (dst == b) & (t >= arrived) & (t <= t_finish))
            if not i.size:
                continue  # (not in the moves table: a row lost with the data module)
            last[i[0]] = max(last[i[0]], t_finish)
            arrived = t[i[0]]
    done = np.isfinite(last) & (t >= since)
    return float(np.maximum(last[done] - t_free[done], 0.0).sum())


def bench_repack(
    repeats: int = 3,
    duration_s: float = 90.0,
    replicas: int = REPLICAS,
    gpus: int = GPUS,
    warmup_share: float = 0.25,
    seed: int = 0,
    model: str = MODEL,
    runs_dir: str | None = None,
    overrides: tuple[str, ...] = (),
):
    """The repack bench; see the module docstring. ``duration_s``: wall seconds per
    arm, from its first update; ``warmup_share``: the share of each run left out of the
    figures. ``runs_dir``: keep the arms' run directories there (default: a temporary
    folder, removed at the end unless a run failed). ``overrides``: ``KEY=VALUE``
    settings applied to both arms after the bench's own (``laminar bench repack --set
    faults.recover=false``), except ``repack.*`` ones, which go to the "on" arm alone
    (:func:`arm_overrides`).
    Repack checks every 5 modelled seconds (the paper's) and after each
    publication."""
    from distributed import Client

    from laminar.cluster import local_cluster
    from laminar.errors import RunFailed
    from pipelines.bench import BenchResult, failed_notes, failed_run
    from pipelines.bench_schedules import Cluster

    cluster_shape = Cluster(gpus)
    scale = replace(cluster_shape.scale, dilation=model_dilation(model, cluster_shape))
    arms = arm_overrides(model, gpus, replicas, seed, overrides)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    by_rep: dict[tuple[str, int], dict] = {}  # (arm, pair) -> figures, for the pairs' ratios
    failed: list[dict] = []  # runs that failed: left out, listed; the bench goes on
    # Without --runs-dir the runs go to a temporary folder, removed at the end unless a
    # run failed: then it is kept (the failed runs' directories are what to look at).
    tmp = None if runs_dir else tempfile.mkdtemp(prefix="laminar-bench-repack-")
    root = Path(runs_dir or tmp)
    print(
        f"runs in {root}"
        + (" (removed at the end unless a run fails; --runs-dir keeps them)" if tmp else ""),
        flush=True,
    )
    with (
        local_cluster(replicas, memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        for rep in range(repeats):
            order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
            for arm in order:
                run_dir = root / f"{arm}-{rep}"
                try:
                    fig = _arm(client, run_dir, arms[arm], duration_s, scale, warmup_share)
                except RunFailed as e:
                    where = dict(arm=arm, replicas=replicas, run=f"#{rep}", run_dir=run_dir)
                    failed.append(failed_run(e, **where))
                    reason = failed[-1]["reason"]
                    print(f"  {arm} #{rep}: FAILED: {reason}; left out, the bench goes on")
                    continue
                results[arm].append(fig)
                by_rep[arm, rep] = fig
                print(
                    f"  {arm} #{rep}: " + json.dumps({k: round(v, 4) for k, v in fig.items()}),
                    flush=True,
                )
    kept = not tmp or bool(failed)
    if kept and tmp:
        print(f"kept the runs in {tmp}: a run failed (listed in the notes)", flush=True)
    elif not kept:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (results["on"] and results["off"]):
        raise RuntimeError(
            "an arm has no run that finished; nothing to compare:\n"
            + "\n".join(failed_notes(failed))
        )
    med = {
        arm: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for arm, rs in results.items()
    }
    figures = {f"{arm}_{k}": v for arm, m in med.items() for k, v in m.items()}
    ratios = {
        "gen_throughput_on_vs_off": med["on"]["gen_tok_s"] / med["off"]["gen_tok_s"],
        "mean_latency_on_vs_off": med["on"]["latency_mean_s"] / med["off"]["latency_mean_s"],
        "max_latency_on_vs_off": med["on"]["latency_max_s"] / med["off"]["latency_max_s"],
        "kv_util_on_vs_off": med["on"]["kv_util_mean"] / med["off"]["kv_util_mean"],
    }
    # Pair by pair too: the arms of one pair ran back to back, on the same machine state
    # (a pair with a failed arm is left out).
    both = [r for r in range(repeats) if ("on", r) in by_rep and ("off", r) in by_rep]
    for key, fig in (("gen_throughput", "gen_tok_s"), ("mean_latency", "latency_mean_s")):
        pairs = [by_rep["on", r][fig] / by_rep["off", r][fig] for r in both]
        ratios[f"{key}_on_vs_off_pairs_median"] = float(np.median(pairs)) if pairs else None
    cols = [
        "gen_tok_s",
        "kv_util_mean",
        "latency_mean_s",
        "latency_max_s",
        "step_ms",
        "decode_batch",
        "moves",
        "overhead_frac",
        "freed_replica_s",
        "latency_trajectories",
    ]
    return BenchResult(
        name="repack",
        figures=figures,
        ratios=ratios,
        # (every figure of every run, not the table's alone: pause_s, decode_unmodelled, ...)
        samples={f"{arm}_{k}": [r[k] for r in rs] for arm, rs in results.items() for k in rs[0]},
        columns=["repack"] + cols,
        rows=[[arm] + [med[arm][c] for c in cols] for arm in ("off", "on")],
        options={
            "repeats": repeats,
            "duration_s": duration_s,
            "replicas": replicas,
            "gpus": gpus,
            "warmup_share": warmup_share,
            "seed": seed,
            "model": model,
            "workload": arms["on"],
            "runs": str(root) if kept else None,  # (None: removed, no run failed)
        },
        notes=[
            "each arm runs the same paced workload for the same wall time; medians over "
            f"{repeats} alternating pairs; modelled units of the {gpus}-GPU cluster",
            *failed_notes(failed),
        ],
        failed=failed,
    )
