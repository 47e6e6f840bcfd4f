"""Shared fixtures: a tiny policy folder, a private warm-start cache, a real multi-process
Dask cluster with role resources, and a small run config for end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Small enough for CI on 2 cores, big enough to exercise every actor and the store.
SMALL_RUN = [
    "task.num_prompts=200",
    "task.max_len=24",
    "sft.steps=20",
    "rollout.group_size=4",
    "rollout.groups_per_batch=4",
    "rollout.max_new_tokens=30",
    "rollout.max_seq_len=60",
    "buffer.max_outstanding_groups=8",
    "trainer.groups_per_step=4",
    "trainer.steps=4",
]


@pytest.fixture(scope="session", autouse=True)
def laminar_cache(tmp_path_factory) -> Path:
    """Keep warm-start results of the test session out of the user's cache."""
    path = tmp_path_factory.mktemp("laminar-cache")
    os.environ["LAMINAR_CACHE"] = str(path)
    # One intra-op thread in the test process, as in every worker: on a shared 2-core
    # machine a second OpenMP thread is often descheduled, and each op then waits for it.
    import torch

    torch.set_num_threads(int(os.environ.get("LAMINAR_TEST_THREADS", "1")))
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    return path


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    from laminar.model import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy"), seed=0)


@pytest.fixture(scope="session")
def cluster_client():
    """A real cluster of worker processes (data+trainer, 2 rollouts) and a client."""
    from distributed import Client

    from laminar.cluster import local_cluster

    with local_cluster(2, memory_limit="3GiB") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture
def small_config():
    from laminar.config import RunConfig, with_overrides

    return with_overrides(RunConfig(), SMALL_RUN)


@pytest.fixture
def no_cluster(monkeypatch):
    """A run that got past its pre-start checks would start a cluster: fail instead."""

    def refuse(*a, **k):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr("laminar.deploy.open_cluster", refuse)
