"""A run with every kind of event, for ``laminar report``: the figures of docs/analysis.md.

Four rollouts paced as TP4 H800 replicas of a 7B model, on a long-tailed counting task,
with dynamic repack on (its moves), weights through a chain of two relays (publications)
and one rollout worker SIGKILLed mid-run (a loss, its recovery and a replacement)::

    python examples/events_demo.py runs/events-demo
    laminar report runs/events-demo

About five minutes on a 2-core machine.
"""

from __future__ import annotations

import os
import signal
import sys
import time

OVERRIDES = [
    "task.num_prompts=2000",
    "task.median_len=6",
    "task.tail_ratio=10",
    "task.max_len=48",
    "sft.steps=20",
    "rollout.replicas=4",
    "rollout.group_size=8",
    "rollout.groups_per_batch=4",
    "rollout.max_new_tokens=60",
    "rollout.max_seq_len=120",
    "rollout.kv_capacity_tokens=1280",
    "rollout.pacing.dilation=20",
    "rollout.pacing.strict=false",
    "repack.interval_s=2",
    "relay.relays=2",
    "relay.keep_versions=5",  # the newest and one per rollout's batch (docs/faults.md)
    "buffer.max_outstanding_groups=24",
    "trainer.groups_per_step=4",
    "trainer.steps=40",
]
KILL_AT_VERSION = 15


def main(run_dir: str) -> None:
    from distributed import Client

    import pipelines
    from laminar.cluster import local_cluster, workers_with

    # 4 rollout workers, the data module with the trainer, 2 relays (laminar.cluster).
    with (
        local_cluster(4, relays=2, memory_limit="3GiB") as cluster,
        Client(cluster) as client,
    ):
        handle = pipelines.submit("configs/tiny.yaml", client, overrides=OVERRIDES, run_dir=run_dir)
        while handle.progress().get("version", 0) < KILL_AT_VERSION:
            if handle.done():
                break
            time.sleep(0.5)
        else:
            victim = workers_with(client, "rollout")[1]
            pid = next(iter(client.run(os.getpid, workers=[victim]).values()))
            print(f"killing the worker of r1 ({victim}, pid {pid})", flush=True)
            os.kill(pid, signal.SIGKILL)
        summary = handle.wait()
    print(summary["reason"], {k: summary["faults"][k] for k in ("lost", "replacements")})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/events-demo")
