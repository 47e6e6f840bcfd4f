"""``laminar bench soak``: a long run with a random worker SIGKILLed every minute.

A local cluster of worker processes (the data module with the trainer, three rollouts
paced as GPU replicas) runs the tiny task for ``duration_s``; every ``kill_every_s`` one
worker, chosen at random among all of them, is SIGKILLed, and Dask's nanny restarts its
process. A lost rollout is recovered inside the run (its trajectories resume elsewhere,
a new rollout replaces it); a lost trainer/data worker is restarted within the run
(both at once: :class:`pipelines.restart.CoreRestart`). With ``--resume-lost``
(``faults.restart_trainer=false``) it fails the run instead, and the soak does what an
operator's supervisor would: ``pipelines.resume`` from the newest checkpoint
(``trainer.checkpoint_every``), once the worker is back. At the end the run is stopped
and audited from its stores (``storage.audit``); memory is sampled from every process.
With ``--data-apart`` the data module has a worker of its own: a killed trainer is
restarted and a killed data module rebuilt within the run, each alone.

Figures: kills (by role), rollout recoveries, detection, recovery and replacement times,
the tokens the log kept and the bound on those regenerated, trainer-loss downtime,
trajectories dropped by resumes, the audit, and memory: the driver's growth and the
worst growth rate of any worker process that lived at least half the soak. Ratios:
throughput (response tokens finished per minute) of the last minute over the first, and
the driver's RSS at the end over after the first minute.

Run it::

    laminar bench soak --out soak.json                  # 10 minutes
    laminar bench soak --duration-s 120 --kill-every-s 30
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np

from laminar.errors import ConfigError
from pipelines.bench import BenchResult, stop_on_interrupt

REPLICAS = 3
WORKLOAD = [  # the fault tests' small task (its warm start is cached), epoch after epoch
    "task.num_prompts=200",
    "task.max_len=24",
    "sft.steps=20",
    "rollout.group_size=4",
    "rollout.groups_per_batch=4",
    "trainer.groups_per_step=4",
    "rollout.replicas=3",
    "rollout.max_new_tokens=40",
    "rollout.max_seq_len=70",
    "trainer.steps=1000000",  # the soak ends it
    "trainer.checkpoint_every=10",
    "trainer.keep_checkpoints=3",  # (an hour's soak wrote hundreds, every one kept)
    "relay.keep_versions=4",  # the newest + one per rollout's batch (docs/faults.md)
    "buffer.max_outstanding_groups=16",
    "cluster.actor_timeout_s=10",
    "relay.timeout_s=10",
    # GPU-shaped generation (TP4 H800s serving a 7B model, times x15; docs/pacing.md):
    # generation-bound, as RL post-training is, so a kill usually finds a batch decoding.
    "rollout.pacing.dilation=15",
    "rollout.pacing.strict=false",
]
SAMPLE_S = 10.0  # memory samples


def _rss(dask_worker=None) -> tuple[int, int]:
    import psutil

    p = psutil.Process()
    return p.pid, p.memory_info().rss


def _wait_training(handle, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        p = handle.progress()
        if p.get("phase") == "training":
            return
        if handle.done():
            handle.wait()  # raises what ended it
            raise RuntimeError("the run ended before training")
        time.sleep(0.2)
    raise TimeoutError(f"no training after {timeout} s")


def bench_soak(
    duration_s: float = 600.0,
    kill_every_s: float = 60.0,
    seed: int = 0,
    run_dir: str | None = None,
    data_apart: bool = False,
    resume: bool = False,
) -> BenchResult:
    """``data_apart``: the data module has a worker of its own, so a killed trainer is
    restarted, and a killed data module rebuilt, each alone within the run
    (docs/faults.md). ``resume``: a killed trainer fails the run, and the soak resumes it
    (the data module with the trainer: ``data_apart`` off)."""
    if resume and data_apart:
        raise ConfigError("soak: --resume-lost applies to the shared layout, not --data-apart")
    import psutil
    from distributed import Client

    import pipelines
    from laminar.cluster import local_cluster, scheduler_workers, workers_with
    from laminar.errors import LaminarError
    from pipelines.bench_schedules_cluster import TINY_CONFIG
    from storage import open_run
    from storage.audit import audit_run
    from storage.metrics import open_metrics

    rng = random.Random(seed)
    run = Path(run_dir or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    me = psutil.Process()
    kills: list[dict] = []
    memory: list[tuple[float, str, int, int]] = []  # (t, worker name, pid, rss)
    driver_rss: list[tuple[float, int]] = []
    resumes: list[dict] = []
    workload = [*WORKLOAD, *(["cluster.data_apart=true"] if data_apart else [])]
    workload += ["faults.restart_trainer=false"] if resume else []
    with (
        local_cluster(REPLICAS, memory_limit="3GiB", data_apart=data_apart) as cluster,
        Client(cluster) as client,
    ):
        handle = pipelines.submit(TINY_CONFIG, client, overrides=workload, run_dir=run)
        # (an interrupt stops the run in order: else the cluster closes under it)
        with stop_on_interrupt(lambda: handle):
            _wait_training(handle)
            t0 = time.time()
            next_kill, next_sample = t0 + kill_every_s, t0
            while time.time() - t0 < duration_s:
                now = time.time()
                if now >= next_sample:
                    info = scheduler_workers(client)
                    names = {a: w["name"] for a, w in info.items()}
                    for addr, (pid, rss) in client.run(_rss).items():
                        memory.append((now - t0, str(names.get(addr, addr)), pid, rss))
                    driver_rss.append((now - t0, me.memory_info().rss))
                    next_sample = now + SAMPLE_S
                if now >= next_kill:
                    victims = workers_with(client, "rollout") + workers_with(client, "trainer")
                    if data_apart:
                        victims += workers_with(client, "data")
                    victim = rng.choice(victims)
                    role = next(
                        r
                        for r in ("trainer", "data", "rollout")
                        if victim in workers_with(client, r)
                    )
                    rid = next(
                        (r for r, w in handle._schedule.rollout_workers.items() if w == victim),
                        None,
                    )
                    pid = client.run(os.getpid, workers=[victim])[victim]
                    t_kill = time.time()
                    os.kill(pid, signal.SIGKILL)
                    kill = {"t": t_kill - t0, "role": role, "rollout": rid}
                    kill["_n"] = len(handle._schedule.rollout_workers)
                    kills.append(kill)
                    if role in ("trainer", "data") and not resume:  # restarted within the run
                        kill.pop("_n")
                    elif role == "trainer":  # the run fails; resume it as a supervisor would
                        kill.pop("_n")
                        try:
                            handle.wait(timeout=120)
                        except LaminarError as e:
                            kill["error"] = str(e).split(";")[0]
                        handle = pipelines.resume(run, client)  # waits for the worker back
                        _wait_training(handle)
                        kill["downtime_s"] = time.time() - t_kill
                        resumes.append(handle._schedule.resume.summary())
                    next_kill = time.time() + kill_every_s
                for k in kills:  # a replacement rollout started: how long after the kill
                    if k.get("_n") and len(handle._schedule.rollout_workers) > k["_n"]:
                        del k["_n"]
                        k["replaced_s"] = time.time() - t0 - k["t"]
                if handle.done():  # a failure the soak did not cause: raise it
                    ended = handle.wait()
                    raise RuntimeError(
                        f"the run ended ({ended['reason']}) {time.time() - t0:.0f} s into a "
                        f"{duration_s:.0f} s soak"
                    )
                time.sleep(0.2)
        # The soak's end: before the stop, its flush and the cluster's shutdown, in which
        # nothing more finishes (taken after them, the last minute held that time, and
        # read its throughput low).
        t_end = time.time() - t0
        handle.stop()
        summary = handle.wait(timeout=300)
    restarts = (summary.get("faults") or {}).get("trainer_restarts", [])
    rebuilds = (summary.get("faults") or {}).get("data_restarts", [])
    if not data_apart:  # (the trainer and data module together)
        restarts = (summary.get("faults") or {}).get("core_restarts", [])
    for k in kills:  # each in-run restart: from the kill to the new trainer (data module)
        if k["role"] == "trainer" and not resume:
            after = [r for r in restarts if r["time"] >= t0 + k["t"] - 1.0]
            if after:
                k["downtime_s"] = after[0]["time"] + after[0]["restart_s"] - (t0 + k["t"])
                k["lost_updates"] = after[0]["lost_updates"]
                k["readmitted"] = after[0].get("readmitted", after[0].get("held_again"))
        if k["role"] == "data":
            after = [r for r in rebuilds if r["time"] >= t0 + k["t"] - 1.0]
            if after:
                k["downtime_s"] = after[0]["time"] + after[0]["restart_s"] - (t0 + k["t"])
                k["held_again"] = after[0]["held_again"]
                k["registered"] = after[0]["registered"]

    # Rollout recoveries, from the faults table of every segment.
    try:
        faults = open_metrics(run, "faults")
        rows = faults.to_dataframe()
    except (FileNotFoundError, KeyError):
        rows = None
    for k in kills:
        if k["role"] != "rollout" or rows is None:
            continue
        mine = rows[(rows["rollout"] == k["rollout"]) & (rows["time"] >= t0 + k["t"] - 1)]
        if len(mine):
            k["detected_s"] = float(mine["time"].min() - (t0 + k["t"]))
            k["recovery_s"] = float(mine["recovery_s"].max())
            k["requests"] = int(mine["requests"].sum())
            k["tokens_kept"] = int(mine["tokens_recovered"].sum())
    flush_tokens = 16  # faults.flush_tokens (default): at most this many regenerated
    report = audit_run(run)
    ds = open_run(run)

    # Memory: the driver, and each worker process that lived at least half the soak.
    d = np.array(driver_rss, dtype=float)
    after_1min = d[d[:, 0] >= 60][:, 1] if (d[:, 0] >= 60).any() else d[:, 1]
    # Per worker process that lived at least half the soak: RSS from its first minute on
    # (imports and warm-up excluded), as a growth rate and as start -> end.
    slopes, spans = {}, {}
    for name in {m[1] for m in memory}:
        for pid in {m[2] for m in memory if m[1] == name}:
            s = np.array([(t, rss) for t, n, p, rss in memory if n == name and p == pid])
            if len(s) >= 3 and s[-1, 0] - s[0, 0] >= duration_s / 2:
                tail = s[s[:, 0] >= s[0, 0] + 60] if (s[:, 0] >= s[0, 0] + 60).sum() >= 2 else s
                slope = np.polyfit(tail[:, 0] / 60, tail[:, 1] / 2**20, 1)[0]
                slopes[f"{name}#{pid}"] = float(slope)
                spans[f"{name}#{pid}"] = (float(tail[0, 1] / 2**20), float(tail[-1, 1] / 2**20))
    longest = max(
        spans, key=lambda k: sum(m[2] == int(k.split("#")[1]) for m in memory), default=None
    )

    # Throughput per minute, from the store (every segment).
    t_fin = ds["t_finish"].values
    tokens = ds["response_len"].values
    first, last = first_and_last_minute(t_fin, tokens, t0, t0 + t_end)

    rk = [k for k in kills if k["role"] == "rollout" and "recovery_s" in k]
    tk = [k for k in kills if k["role"] == "trainer"]
    dk = [k for k in kills if k["role"] == "data"]
    figures = {
        "duration_s": t_end,
        "kills": len(kills),
        "kills_rollout": sum(k["role"] == "rollout" for k in kills),
        "kills_trainer": len(tk),
        "rollout_recoveries": len(rk),
        "detected_s_mean": _mean([k["detected_s"] for k in rk]),
        "detected_s_max": _max([k["detected_s"] for k in rk]),
        "recovery_s_mean": _mean([k["recovery_s"] for k in rk]),
        "recovery_s_max": _max([k["recovery_s"] for k in rk]),
        "recovered_requests": sum(k["requests"] for k in rk),
        "tokens_kept": sum(k["tokens_kept"] for k in rk),
        "tokens_regenerated_bound": sum(k["requests"] for k in rk) * flush_tokens,
        "replacements": sum("replaced_s" in k for k in rk),
        "replaced_s_mean": _mean([k["replaced_s"] for k in rk if "replaced_s" in k]),
        "trainer_restarts_in_run": len(restarts),
        "trainer_downtime_s_mean": _mean([k["downtime_s"] for k in tk if "downtime_s" in k]),
        "trainer_downtime_s_max": _max([k["downtime_s"] for k in tk if "downtime_s" in k]),
        "kills_data": len(dk),
        "data_rebuilds_in_run": len(rebuilds),
        "data_downtime_s_mean": _mean([k["downtime_s"] for k in dk if "downtime_s" in k]),
        "data_downtime_s_max": _max([k["downtime_s"] for k in dk if "downtime_s" in k]),
        "resent": sum(r.get("resent", 0) for r in summary.get("rollouts", [])),
        "trajectories": int(ds.sizes["trajectory"]),
        "consumed": int((ds["status"].values == "consumed").sum()),
        "dropped_by_resumes": int((ds["status"].values == "dropped").sum()),
        "versions": summary["versions"],
        "audit_clean": float(report.ok),
        "driver_rss_mb_start": float(after_1min[0] / 2**20),
        "driver_rss_mb_end": float(d[-1, 1] / 2**20),
        "worker_rss_growth_mb_per_min_max": max(slopes.values(), default=None),
        "longest_worker_rss_mb_start": spans[longest][0] if longest else None,
        "longest_worker_rss_mb_end": spans[longest][1] if longest else None,
    }
    ratios = {
        "tokens_per_min_last_over_first": float(last / first) if first else None,
        "driver_rss_end_over_after_1min": float(d[-1, 1] / after_1min[0]),
    }
    for k in kills:
        k.pop("_n", None)  # never replaced (the run ended, or the trainer went first)
    columns = [
        "t_s",
        "role",
        "rollout",
        "detected_s",
        "recovery_s",
        "requests",
        "replaced_s",
        "downtime_s",
    ]
    return BenchResult(
        name="soak",
        figures=figures,
        ratios=ratios,
        samples={
            "kills": kills,
            "resumes": resumes,
            "worker_rss_growth_mb_per_min": slopes,
            "worker_rss_mb_first_minute_on": spans,
            "longest_worker": longest,
            "driver_rss": driver_rss,
            "memory": [(t, n, p, rss / 2**20) for t, n, p, rss in memory],
        },
        columns=columns,
        rows=[[k.get(c if c != "t_s" else "t") for c in columns] for k in kills],
        options={
            "duration_s": duration_s,
            "kill_every_s": kill_every_s,
            "seed": seed,
            "replicas": REPLICAS,
            "workload": workload,
            "data_apart": data_apart,
            "resume": resume,
        },
        notes=[
            f"run directory {run} (laminar audit {run}: {'CLEAN' if report.ok else 'PROBLEMS'})",
            *report.problems,
        ],
    )


def first_and_last_minute(t_finish, tokens, start: float, end: float) -> tuple[float, float]:
    """Response tokens finished in the soak's first minute and in its last, ``end`` the
    soak's end (before its stop: nothing finishes after it).

    >>> t = np.array([10.0, 50.0, 100.0, 170.0, 175.0])
    >>> first_and_last_minute(t, np.array([1, 2, 4, 8, 16]), 0.0, 180.0)
    (3.0, 24.0)
    """
    t_finish, tokens = np.asarray(t_finish), np.asarray(tokens)
    first = tokens[(t_finish >= start) & (t_finish < start + 60)].sum()
    last = tokens[(t_finish >= end - 60) & (t_finish < end)].sum()
    return float(first), float(last)


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _max(xs: list[float]) -> float | None:
    return float(np.max(xs)) if xs else None
