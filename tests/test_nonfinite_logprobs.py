"""A behavior logprob that is not finite on a trained token (an engine's NaN or -inf):
the trajectory is failed where it is built for reward, and its group discarded whole by
the buffer, as for a reward failure; it never reaches the trainer's loss."""

from __future__ import annotations

import logging
import math

import pytest
from factories import InProcess


class _Done:
    """A reward task already done, as a Dask future reads to the reward collector."""

    status = "finished"

    def __init__(self, value):
        self.value = value

    def add_done_callback(self, fn):
        fn(self)

    def result(self):
        return self.value


@pytest.mark.parametrize("bad", [math.nan, -math.inf], ids=["nan", "-inf"])
def test_a_nonfinite_behavior_logprob_fails_its_trajectory_and_the_buffer_discards_the_group(
    tiny_policy, small_config, tmp_path, caplog, bad
):
    """A real engine generates a group; one response's token 1 gets a behavior logprob
    ``bad``. It went to the buffer as a good trajectory and its group was trained: under
    correction=none the loss NaN with a finite gradient (the step applied, NaN metrics
    stored), under tis a NaN gradient (the whole batch skipped for one token), and -inf
    a loss of ~1e8 and the step taken. Now it is ``finish_reason="error"``, logged
    naming behavior_logprobs, the token, the rollout and the version, and the buffer
    discards the group whole and counts it, as it does a reward failure's."""
    import asyncio

    from laminar.buffer import ExperienceBuffer
    from laminar.config import with_overrides
    from laminar.prompt_pool import PromptPool
    from laminar.rewards import score_batch
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    prompts = PromptPool(cfg, str(tiny_policy))
    (group,) = asyncio.run(prompts.acquire(1, "r0", 0))
    buffer = ExperienceBuffer(str(tmp_path / "run"), prompts, cfg.buffer)
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    rollout.buffer = InProcess(buffer)
    # (the reward task, scored here: a Dask one runs score_batch on a rollout's worker)
    rollout._reward_task = lambda items: _Done(score_batch(cfg.task.reward, items))
    rollout._add([group])
    finished = []
    while rollout.engine.has_work():
        finished += rollout.engine.step()
    assert len(finished) == group.group_size and len(finished[0].response_tokens) > 1
    finished[0].logprobs[1] = bad
    with caplog.at_level(logging.WARNING, logger="laminar.rollout"):
        rollout._submit_rewards(finished)
    rollout._insert_scored(*rollout._to_score.get_nowait())

    failed = [t for t in buffer._records.values() if t.finish_reason == "error"]
    assert [t.uid for t in failed] == [finished[0].request.request_id]
    counts = buffer.core.counts
    assert (counts["groups_discarded"], counts["discarded"]) == (1, group.group_size)
    assert not buffer.core.ready and not buffer.core.partial
    assert rollout.counts["logprob_errors"] == 1
    assert rollout.counts["reward_errors"] == 0  # (not the reward's failure)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"behavior_logprobs[1] = {bad}" in said, said
    assert "rollout r0" in said and f"version {rollout.engine.version}" in said, said
    assert failed[0].uid in said and "discarded" in said, said
    asyncio.run(buffer.close())


def test_a_nonfinite_logprob_on_a_masked_token_fails_nothing(tiny_policy, small_config):
    """A token the loss does not train (loss mask 0: a tool's) may carry any logprob:
    the trainer never reads it (laminar.losses), so it fails nothing."""
    import numpy as np

    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    rollout._add([PromptGroup("p0", 0, (5, 6, 7), "x", 1, 0)])
    finished = []
    while rollout.engine.has_work():
        finished += rollout.engine.step()
    (out,) = finished
    out.logprobs[0] = np.nan
    rollout._submit_rewards(finished, score=False)
    (traj,), _, _ = rollout._to_score.get_nowait()
    assert traj.finish_reason == "error"  # a trained token: failed
    traj.finish_reason = out.finish_reason
    traj.loss_mask[0] = 0
    rollout._check_logprobs(traj, out)
    assert traj.finish_reason == out.finish_reason
