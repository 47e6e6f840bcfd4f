"""A data module rebuilt while a rollout keeps finished trajectories no store has yet:
the new partial-response pool is handed them as finished, so that a loss of the rollout
before the new buffer holds them rescores them (docs/faults.md, "Data-module loss")."""

from __future__ import annotations

import time

from factories import InProcess


def test_a_rebuilt_pool_gets_the_finished_trajectories_the_rollout_keeps(tiny_policy, small_config):
    """The data module is lost while r0 finishes responses (their rewards pending, no
    buffer to take them) and holds a lost rollout's finished trajectory to score. The
    rebuilt pool had only the unfinished ones registered: r0 lost before the new buffer
    received the rest, a take found nothing of them, and their groups (held by r0, not
    re-issued) were stuck. Now each is registered finished, with its tokens, and a take
    hands it out to be scored again."""
    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.engine import GenerationRequest, RequestState
    from laminar.partial import PartialCore, PartialResponsePool
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, InProcess(None))
    groups = [PromptGroup(f"p{g:08d}", g, (5, 6, 7), "x", 4, 0) for g in range(2)]
    rollout._add(groups)  # (no pool to register with: partial's calls are not made)
    rollout._data_lost = time.time()  # the data module does not answer
    rollout.partial = InProcess(PartialResponsePool())  # (the lost one's handle)
    finished = []
    for _ in range(200):  # (as the generation loop: logged, then submitted)
        out = rollout.engine.step()
        rollout._log_partial(out)
        if out:
            rollout._submit_rewards(out, score=False)
            finished += out
        if finished and rollout.engine.in_flight():
            break
    assert finished and rollout.engine.in_flight()
    # a lost rollout's finished trajectory, handed here to score (queued, not yet scored)
    other = PartialCore()
    g = PromptGroup("p00000009", 9, (5, 6, 7), "x", 1, 0)
    meta = {"group": g, "sample_idx": 0, "t_submit": time.time()}
    req = GenerationRequest("p00000009-000", g.prompt_tokens, rollout._params, meta)
    other.register("r9", 0, [RequestState(req, seed=1, t_start=time.time())])
    other.flush(
        "r9", {req.request_id: (0, [8, 9], [-0.5, -0.25], [0, 0])}, {req.request_id: ("eos", 2.0)}
    )
    rollout.rescore(other.take("r9"))

    pool = PartialResponsePool()
    unfinished = {st.request_id for st in rollout.engine.in_flight()}
    assert rollout._attach(None, None, InProcess(pool)) == len(unfinished)
    want = {o.request.request_id: o for o in finished}
    entries = pool.core.entries
    assert set(entries) == unfinished | set(want) | {req.request_id}
    for rid, out in want.items():
        e = entries[rid]
        assert e["owner"] == "r0" and e["finished"] == (out.finish_reason, out.t_finish)
        assert list(e["state"].tokens) == out.response_tokens.tolist()
    assert entries[req.request_id]["finished"] == ("eos", 2.0)
    assert list(entries[req.request_id]["state"].tokens) == [8, 9]
    # r0 lost before the new buffer holds them: its finished ones are scored elsewhere
    taken = {st.request_id: st for st in pool.core.take("r0")}
    rescored = {rid for rid, st in taken.items() if "finished" in st.request.meta}
    assert rescored == set(want) | {req.request_id}
    assert taken[req.request_id].request.meta["group"] is g  # (what the reward needs)
    # kept until stored: those the store has are let go, one still queued to score is not
    with rollout._unstored_lock:
        rollout._unstored.clear()
        rollout._prune_finished()
    assert set(rollout._finished_outputs) == {req.request_id}
