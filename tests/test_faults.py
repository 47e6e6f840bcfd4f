"""Faults on real worker processes, killed with SIGKILL mid-generation.

Each test ends with an audit from the stores alone: the data contract holds, every
trajectory a lost rollout had started finished elsewhere with one behavior version, and
its group is whole.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import SMALL_RUN
from runs import check_store

from storage.metrics import open_metrics

pytestmark = pytest.mark.slow


def kill_worker(client, address: str) -> float:
    """SIGKILL the process of the worker at ``address``; when it was sent."""
    pid = client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def wait_for(handle, predicate, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        p = handle.progress()
        if predicate(p):
            return p
        assert not handle.done(), handle.wait()
        time.sleep(0.2)
    raise TimeoutError(f"no progress matched within {timeout} s: {p}")


def test_a_killed_rollout_loses_no_trajectory(tmp_path):
    from distributed import Client

    import pipelines
    from laminar.cluster import local_cluster, workers_with

    run_dir = tmp_path / "run"
    overrides = [
        *SMALL_RUN,
        "rollout.replicas=3",
        "rollout.max_new_tokens=40",
        "rollout.max_seq_len=70",
        "trainer.steps=8",
        "faults.flush_tokens=4",
        "relay.keep_versions=10",  # every version a batch may still decode (see docs/faults.md)
    ]
    with local_cluster(3, memory_limit="3GiB") as cluster, Client(cluster) as client:
        handle = pipelines.submit("configs/tiny.yaml", client, overrides=overrides, run_dir=run_dir)
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 2)
        # Mid-generation: once r1's batch has logged some tokens.
        partial = handle._schedule.actors["partial"]
        deadline = time.time() + 60
        while partial.owned().result().get("r1", (0, 0))[1] < 8 and time.time() < deadline:
            time.sleep(0.02)
        victim = workers_with(client, "rollout")[1]  # r1: rollouts are placed in this order
        t_kill = kill_worker(client, victim)
        summary = handle.wait()
    assert summary["reason"] == "completed", summary["reason"]
    faults = summary["faults"]
    assert list(faults["lost"]) == ["r1"]
    detection_s = faults["lost"]["r1"] - t_kill
    assert 0 <= detection_s < 5, detection_s

    ds = check_store(run_dir, moved=True)
    rows = open_metrics(run_dir, "faults")
    recovered = int(rows["requests"].sum())
    assert recovered == faults["recovered_requests"] and recovered > 0
    assert set(rows["destination"].values) <= {"r0", "r2"}
    # Every trajectory r1 had started finished on a healthy rollout: nothing lost.
    paths = ds["rollout_ids"].values
    via_r1 = np.array([p.startswith("r1,") or ",r1," in p for p in paths])
    assert via_r1.sum() == recovered
    assert (ds["n_migrations"].values[via_r1] >= 1).all()
    # Resumed at most one flush interval behind: the log held all but <= 4 tokens of
    # each (at most `flush_tokens` unlogged when it died), so it regenerated <= 4.
    assert summary["faults"]["partial"]["entries"] <= 3 * 4 * 4  # what the stop left
    assert float(rows["recovery_s"].max()) < 10
    # Resumed at the version that sampled them (the relay kept it): none started over.
    assert sum(r.get("restarted_requests", 0) for r in summary["rollouts"]) == 0
    assert int(rows["tokens_recovered"].sum()) > 0
