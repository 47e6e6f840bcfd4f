"""Shared by the learner tests and the rank processes they spawn.

A spawned process imports its target by module name; this module is importable as
``learner_cases`` (pytest puts ``tests/`` on the path, and spawn passes the path on),
whereas a test module's name depends on how pytest was started.
"""

from __future__ import annotations

import numpy as np
import torch
from factories import trajectory

from laminar.config import RunConfig, with_overrides
from laminar.contract import Trajectory
from laminar.learner import Learner, torch_all_reduce

CFG = with_overrides(
    RunConfig(), ["trainer.lr=1e-3", "trainer.micro_batch_tokens=96", "trainer.steps=10"]
)


def batch(step: int, groups: int = 4, size: int = 4, nan: bool = False) -> list[Trajectory]:
    """A deterministic global batch of complete groups with varied lengths and rewards."""
    rng = np.random.default_rng(step)
    out = []
    for g in range(groups):
        prompt = rng.integers(5, 60, size=int(rng.integers(2, 6))).astype(np.int32)
        for i in range(size):
            n = int(rng.integers(1, 12))
            out.append(
                trajectory(
                    f"s{step}g{g}-{i}",
                    f"s{step}g{g}",
                    prompt=prompt,
                    response=rng.integers(5, 60, size=n),
                    behavior_logprobs=-rng.uniform(3, 6, size=n),
                    sample_idx=i,
                    group_size=size,
                    prompt_key=g,
                    reward=float("nan") if nan else float(rng.integers(0, 2)),
                )
            )
    return out


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def rank_main(rank: int, world: int, port: int, policy: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        learner = Learner(CFG, policy, rank=rank, world_size=world, all_reduce=torch_all_reduce)
        for s in range(3):
            learner.update(batch(s))
        torch.save(weights(learner), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def failing_rank_main(
    rank: int, world: int, port: int, policy: str, out: str, overrides: list[str]
) -> None:
    """Under ``CFG`` with ``overrides``, rank 1 is given a token no embedding has on a row
    of its own shard (its forward raises); each rank records what its update raised and
    when, then both train one more batch (a group that agreed on the failure is still in
    step) and save their weights."""
    import datetime
    import json
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        cfg = with_overrides(CFG, overrides)
        learner = Learner(cfg, policy, rank=rank, world_size=world, all_reduce=torch_all_reduce)
        bad = batch(0)
        if rank == 1:
            bad[learner.shard(bad)[0]].response_tokens[0] = 10**6
        outcome = {"rank": rank}
        try:
            learner.update(bad)
            outcome["raised"] = None
        except Exception as e:  # noqa: BLE001 — recorded for the test to judge
            outcome.update(raised=type(e).__name__, message=str(e))
        outcome["t"] = time.time()
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(outcome, f)
        learner.update(batch(1))
        outcome["version"] = learner.version
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(outcome, f)
        torch.save(weights(learner), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
