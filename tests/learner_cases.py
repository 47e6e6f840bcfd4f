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


def run_ranks(target, *args, world: int = 2, timeout: float = 240) -> list:
    """Run ``target(rank, port, *args)`` in ``world`` spawned processes (a gloo group
    on a free local port); their exit codes, once all have ended or ``timeout`` passed."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def rank_main(rank: int, port: int, world: int, policy: str, out: str) -> None:
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
    rank: int, port: int, world: int, policy: str, out: str, overrides: list[str]
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


def trainer_rank_case(rank: int, port: int, policy: str, out: str) -> None:
    """Two trainer ranks as the trainer runs them (laminar.trainer's group calls), rank 1
    a real :class:`~laminar.trainer.TrainerRank`: rank 0 broadcasts a batch whose rank-1
    shard has a token no embedding has, its update raises (the ranks agree on the
    failure), and it stops the group as the trainer does, broadcasting ``None``. Rank 0
    records how long that stop took; rank 1 its stats, then stays up (a Dask worker's
    process outlives its actor's thread) until rank 0 is done."""
    import json
    import os
    import time

    from laminar import trainer as tr

    torch.set_num_threads(1)
    # (the group's collective timeout is 5 × actor_timeout_s: 60 s)
    cfg = with_overrides(CFG, ["trainer.ranks=2", "cluster.actor_timeout_s=12"])
    init = f"tcp://127.0.0.1:{port}"
    if rank == 1:
        r = tr.TrainerRank(cfg, policy, 1, init)
        r._run()
        with open(f"{out}/rank1.json", "w") as f:
            json.dump(r.stats(), f)
        deadline = time.time() + 150
        while not os.path.exists(f"{out}/rank0.json") and time.time() < deadline:
            time.sleep(0.2)
        return
    import torch.distributed as dist

    # (the rendezvous store rank 0's worker serves: laminar.trainer_ranks.open_rendezvous)
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    learner = tr._learner(cfg, policy, rank=0)
    tr._join_group(cfg, init, rank=0)
    bad = batch(0)
    mine = set(learner.shard(bad))
    bad[min(set(range(len(bad))) - mine)].response_tokens[0] = 10**6  # (rank 1's row)
    tr._broadcast(bad)
    try:
        learner.update(bad)
        raised = None
    except Exception as e:  # noqa: BLE001 — recorded for the test to judge
        raised = type(e).__name__
    t0 = time.time()
    tr._broadcast(None)  # the trainer's stop (its _run's finally)
    tr._leave_group(learner)
    with open(f"{out}/rank0.json", "w") as f:
        json.dump({"raised": raised, "stop_s": time.time() - t0}, f)
    del store
