"""The learner's edge cases: a failing data-parallel rank, degenerate rows, masked tokens."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket

import pytest
import torch
from learner_cases import failing_rank_main


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.correction=decoupled", "trainer.mini_batches=2"]],
    ids=["in-the-step", "in-the-proximal-pass"],
)
def test_a_rank_that_fails_its_update_fails_every_rank_at_once(tiny_policy, tmp_path, overrides):
    """One rank's forward raises (in its part of the step, or in decoupled PPO's proximal
    pass before the steps): the other learns of it at once (an error that names the
    rank), not after the group's collective timeout (60 s here); no rank took a step, so
    the group trains on in step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=failing_rank_main, args=(r, 2, port, str(tiny_policy), str(tmp_path), overrides)
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1["raised"] == "IndexError"  # its own error, as it was
    assert r0["raised"] == "RankStepFailed", r0
    assert "rank 1" in r0["message"]
    assert r0["t"] - r1["t"] < 20  # (the group's timeout is 60 s)
    assert all(p.exitcode == 0 for p in procs)
    assert r0["version"] == r1["version"] == 1
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
