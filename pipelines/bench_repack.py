"""``laminar bench repack``: Laminar with dynamic repack on vs off, same workload, same
emulated cluster, in one run.

The workload has the paper's shape: 16 responses per prompt, answer lengths with
P99/median ≈ 10 and a hard cap, paced replicas (TP4 H800s serving a 7B model, times
dilated so that this machine's real compute stays below the model) each decoding a local
batch of 64 requests (the paper's 256 per rollout, scaled to the tiny model's cache).
Each run is stopped after the same wall time; generation is the bottleneck (the trainer
is fast next to paced generation, back-pressure generous), as in the paper's setting.

Figures per arm (medians over ``repeats`` pairs, arms alternating):

* generation throughput — response tokens decoded per second;
* mean KV utilisation — ``kv_used / kv_capacity`` over rollouts × polls, busy or not;
* repack overhead — the pause moves caused, per second of run, and per move;
* mean / max trajectory latency — ``t_finish − t_submit`` of finished trajectories;
* replica-seconds freed — for each move, from the move to the last of its moved
  requests finishing elsewhere: the time the source would have spent on its stragglers.

Run it::

    laminar bench repack --out repack.json
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

REPLICAS = 8
WORKLOAD = [
    "task.num_prompts=4000",
    "task.median_len=6",
    "task.tail_ratio=10",
    "task.max_len=64",
    "rollout.group_size=16",
    "rollout.groups_per_batch=4",
    "rollout.max_new_tokens=80",
    "rollout.max_seq_len=160",
    # KV of one replica, scaled to the tiny model: a fresh local batch of 64 fills about
    # 40% of it, its long tail can fill it (kv utilisation and c_max then mean something).
    "rollout.kv_capacity_tokens=1536",
    "rollout.parity_every=0",
    "rollout.pacing.accelerator=H800",
    "rollout.pacing.model=7B",
    "rollout.pacing.tp=4",
    "rollout.pacing.strict=false",
    # generation is what repack changes: back-pressure must never idle a rollout here
    "buffer.max_outstanding_groups=1000000",
    "trainer.groups_per_step=8",
    "trainer.steps=100000",
]


def _arm(client, run_dir: Path, overrides: list[str], duration_s: float) -> dict:
    import pipelines

    run = pipelines.submit("configs/tiny.yaml", client, run_dir=run_dir, overrides=overrides)
    deadline = None
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
    summary = run.wait(timeout=600)
    return _figures(run_dir, summary)


def _figures(run_dir: Path, summary: dict) -> dict:
    from storage import open_run
    from storage.metrics import open_metrics

    ds = open_run(run_dir)
    wall = summary["rl_wall_s"]
    tokens = sum(r["response_tokens"] for r in summary["rollouts"])
    lat = ds["t_finish"].values - ds["t_submit"].values
    roll = open_metrics(run_dir, "rollouts")
    util = (roll["kv_used"] / roll["kv_capacity"]).values
    out = {
        "gen_tok_s": tokens / wall,
        "kv_util_mean": float(np.nanmean(util)),
        "latency_mean_s": float(lat.mean()),
        "latency_max_s": float(lat.max()),
        "wall_s": wall,
        "trajectories": int(ds.sizes["trajectory"]),
        # real compute vs the modelled time: a run whose compute overran the model would
        # measure this machine, not the emulated cluster
        "overrun_steps": summary["engine"].get("overruns", 0),
        "compute_vs_modelled": summary["engine"]["compute_s"] / summary["engine"]["modelled_s"],
        "moves": 0,
        "pause_s": 0.0,
        "overhead_frac": 0.0,
        "freed_replica_s": 0.0,
    }
    rep = summary.get("repack")
    if rep:
        out.update(moves=rep["moves"], pause_s=rep["pause_s"], overhead_frac=rep["pause_s"] / wall)
        out["freed_replica_s"] = _freed(
            ds, open_metrics(run_dir, "repacks") if rep["moves"] else None
        )
    return out


def _freed(ds, moves) -> float:
    """Σ over moves of (last moved request's finish − move time)."""
    if moves is None or not moves.sizes.get("move"):
        return 0.0
    paths = [p.split(",") for p in ds["rollout_ids"].values]
    finish = ds["t_finish"].values
    total = 0.0
    for i in range(moves.sizes["move"]):
        if not bool(moves["ok"].values[i]):
            continue
        src, dst, t = (
            moves["source"].values[i],
            moves["destination"].values[i],
            moves["time"].values[i],
        )
        done = [
            finish[k]
            for k, p in enumerate(paths)
            if finish[k] > t and any(a == src and b == dst for a, b in zip(p, p[1:], strict=False))
        ]
        if done:
            total += max(done) - t
    return total


def bench_repack(
    repeats: int = 3,
    duration_s: float = 60.0,
    replicas: int = REPLICAS,
    dilation: float = 40.0,
    interval_s: float = 1.0,
    prefill: str = "additive",
):
    """The repack bench; see the module docstring.

    ``interval_s`` (wall seconds): 1 s is about 8 paced decode steps, a tenth of the
    longest generation here. The paper's 5 s is about 1% of its longest generations but
    150 decode steps; no single scaling keeps both with lengths cut 200× for CPU
    (docs/repack.md has the measured sensitivity)."""
    from distributed import Client

    from laminar.cluster import local_cluster
    from pipelines.bench import BenchResult

    common = WORKLOAD + [
        f"rollout.replicas={replicas}",
        f"rollout.pacing.dilation={dilation}",
        f"rollout.pacing.prefill={prefill}",
    ]
    arms = {"off": [], "on": [f"repack.interval_s={interval_s}"]}
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with (
        tempfile.TemporaryDirectory(prefix="laminar-bench-repack-") as tmp,
        local_cluster(replicas, memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        root = Path(tmp)  # the arms' run directories (~90 MB), removed at the end
        for rep in range(repeats):
            order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
            for arm in order:
                fig = _arm(client, root / f"{arm}-{rep}", common + arms[arm], duration_s)
                results[arm].append(fig)
                print(
                    f"  {arm} #{rep}: " + json.dumps({k: round(v, 4) for k, v in fig.items()}),
                    flush=True,
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
    cols = [
        "gen_tok_s",
        "kv_util_mean",
        "latency_mean_s",
        "latency_max_s",
        "moves",
        "overhead_frac",
        "freed_replica_s",
        "trajectories",
    ]
    return BenchResult(
        name="repack",
        figures=figures,
        ratios=ratios,
        samples={f"{arm}_{k}": [r[k] for r in rs] for arm, rs in results.items() for k in cols},
        columns=["repack"] + cols,
        rows=[[arm] + [med[arm][c] for c in cols] for arm in ("off", "on")],
        options={
            "repeats": repeats,
            "duration_s": duration_s,
            "replicas": replicas,
            "dilation": dilation,
            "interval_s": interval_s,
            "prefill": prefill,
            "workload": common,
            "runs": str(root),
        },
        notes=[
            "each arm runs the same paced workload for the same wall time; medians over "
            f"{repeats} alternating pairs; run directories under {root}",
        ],
    )
