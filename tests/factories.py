"""Test data: a trajectory with every contract field, overridable field by field."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import numpy as np

from laminar.contract import Trajectory


def trajectory(
    uid: str,
    prompt_uid: str,
    *,
    prompt=(1, 2, 3),
    response=(4, 5),
    behavior_logprobs=None,
    sample_idx: int = 0,
    group_size: int = 2,
    behavior_version: int = 0,
    finish_reason: str = "eos",
    **fields,
) -> Trajectory:
    """A buffered trajectory (times 0, reward 1) unless ``fields`` say otherwise."""
    response = np.asarray(response, dtype=np.int32)
    if behavior_logprobs is None:
        behavior_logprobs = np.full(len(response), -1.0, np.float32)
    base = dict(
        prompt_key=0,
        rollout_ids="r0",
        t_submit=0.0,
        t_start=0.0,
        t_finish=0.0,
        reward=1.0,
    )
    return Trajectory(
        uid=uid,
        prompt_uid=prompt_uid,
        sample_idx=sample_idx,
        group_size=group_size,
        prompt_tokens=np.asarray(prompt, dtype=np.int32),
        response_tokens=response,
        behavior_logprobs=np.asarray(behavior_logprobs, dtype=np.float32),
        loss_mask=np.ones(len(response), np.uint8),
        behavior_version=behavior_version,
        finish_reason=finish_reason,
        **(base | fields),
    )


def run_to_end(client, cfg, run_dir, overrides=(), timeout: float = 400):
    """Submit a run on ``client``, wait for it; returns ``(handle, summary)``."""
    import pipelines

    run = pipelines.submit(cfg, client, run_dir=run_dir, overrides=list(overrides))
    return run, run.wait(timeout=timeout)


class InProcess:
    """An actor's call convention (``handle.method(...)`` -> a future) in process: drives
    an actor class directly, without a cluster."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        def call(*args, **kwargs):
            future = concurrent.futures.Future()
            out = getattr(self.actor, name)(*args, **kwargs)
            future.set_result(asyncio.run(out) if asyncio.iscoroutine(out) else out)
            return future

        return call


@contextlib.contextmanager
def actor_thread_held(cls, *args):
    """An actor of ``cls`` on an in-process Dask cluster, its ``blocked()`` command
    running and holding the actor's one thread (its ``is_holding()``, async, says so):
    yields ``(actor, the command's future)``. For what must be answered on the event
    loop while a command waits on the actor thread."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        # (the creating future held to the end: dropped, the scheduler may release the key
        # and the worker its actor, the handle's own reference registered too late)
        made = client.submit(cls, *args, actor=True)
        actor = made.result()
        blocked = actor.blocked()
        deadline = time.monotonic() + 30
        while not actor.is_holding().result():  # (the command holds the actor thread)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield actor, blocked


def timed(
    u: str,
    finish: float,
    insert: float | None = None,
    sample: float | None = None,
    *,
    t0: float,
    version: int = 0,
    status: str | None = None,
    reward: float = 1.0,
    group: str | None = None,
    size: int = 1,
) -> dict:
    """A trajectory's record, finished at ``finish`` s after ``t0`` (epoch seconds),
    submitted 1 s before, inserted at ``insert`` (default: then), consumed at ``sample``
    (None: buffered, unless ``status`` says otherwise)."""
    insert = finish if insert is None else insert
    status = status or ("consumed" if sample is not None else "buffered")
    return trajectory(
        u,
        group or f"g{u}",
        group_size=size,
        behavior_version=version,
        finish_version=version,
        status=status,
        sample_version=version if status == "consumed" else -1,
        reward=reward,
        t_submit=t0 + finish - 1,
        t_start=t0 + finish - 1,
        t_finish=t0 + finish,
        t_insert=t0 + insert,
        t_sample=np.nan if sample is None else t0 + sample,
    ).to_record()
