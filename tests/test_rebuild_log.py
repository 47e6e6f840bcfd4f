"""The lost partial-response pool's log across a data module's rebuild: a real
``partial.zarr`` and real pools (laminar.partial.PartialResponsePool), the data module
started by pipelines.data_module.start_data_module with its actors made in process."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from laminar.config import RunConfig
from laminar.contract import PromptGroup
from laminar.engine import GenerationRequest, RequestState, SamplingParams
from laminar.partial import PartialCore, PartialResponsePool, replay_log
from storage.partial_log import PartialLogWriter
from storage.resume import ResumePlan


def _lost_pools_log(run_dir) -> None:
    """The log the lost pool left: r1's unfinished p00000003-000, two tokens in."""
    core = PartialCore(journal=True)
    group = PromptGroup("p00000003", 3, (1, 2), "4", 2, 0)
    req = GenerationRequest("p00000003-000", (1, 2), SamplingParams(8), {"group": group})
    core.register("r1", 3, [RequestState(req, seed=7)])
    core.flush("r1", {"p00000003-000": (0, [5, 6], [-0.5, -0.25], [3, 3])})
    PartialLogWriter(run_dir).append(**core.drain_journal())


def _start(monkeypatch, run_dir, **plans):
    """start_data_module, its actors made in process (the prompt pool and the buffer
    stand-ins): the partial-response pool it starts."""
    import pipelines.data_module as dm

    monkeypatch.setattr(dm, "start_actor", lambda client, cls, *args, **kw: cls(*args))
    monkeypatch.setattr(dm, "bind_actor", lambda client, cls, worker, made, **kw: made)
    monkeypatch.setattr(dm, "PromptPool", lambda *args: SimpleNamespace(name="pool"))
    monkeypatch.setattr(dm, "ExperienceBuffer", lambda *args: SimpleNamespace(name="buffer"))
    _, partial, _ = dm.start_data_module(
        None, RunConfig(), "policy", run_dir, SimpleNamespace(name="laminar"), "w", **plans
    )
    return partial


def test_a_rebuilds_new_pool_leaves_the_lost_pools_log_until_it_has_the_entries(
    tmp_path, monkeypatch
):
    """A data module rebuilt on W1, whose worker dies before the rebuild ends (its buffer
    or manager not yet made), is rebuilt again on W2, which reads the lost rollouts'
    unfinished trajectories from the lost pool's log. W1's new pool must not have started
    that log over (with none of them: nothing was restored or registered yet), or W2's
    rebuild finds none and they are lost; the same for a resume after the driver dies
    there. Once the rebuild has restored them, the new pool's log names them."""
    _lost_pools_log(tmp_path)
    order, plan = ResumePlan(version=3), ResumePlan(version=3)
    _start(monkeypatch, tmp_path, order=order, rebuild=plan)  # (W1's; then W1 dies)
    orphans = replay_log(tmp_path).entries  # (what W2's rebuild reads)
    assert list(orphans) == ["p00000003-000"]
    partial = _start(monkeypatch, tmp_path, order=order, rebuild=plan)  # W2's

    async def rebuild() -> None:
        await partial.set_relays([])
        await partial.restore(orphans)
        assert list(replay_log(tmp_path).entries) == ["p00000003-000"]  # (not yet written)
        await partial.open_log()  # (restored and registered: the log started over)
        for _ in range(200):  # (in the background: the rebuild does not wait for it)
            if partial.log_counts["compactions"]:
                break
            await asyncio.sleep(0.05)
        back = replay_log(tmp_path).entries["p00000003-000"]
        assert (back["owner"], back["state"].tokens.tolist()) == ("r1", [5, 6])
        await partial.close()

    asyncio.run(rebuild())
    assert partial.log_counts["compactions"] == 1
    assert list(replay_log(tmp_path).entries) == ["p00000003-000"]


def test_a_fresh_or_resumed_runs_pool_starts_the_log_over_at_once(tmp_path, monkeypatch):
    """Not a rebuild: the log is started over when the pool starts (a resume's plan has
    read it; the groups it re-issues are kept)."""
    _lost_pools_log(tmp_path)
    _start(monkeypatch, tmp_path, resume=ResumePlan(version=3))
    assert replay_log(tmp_path).entries == {}
    assert PartialResponsePool(run_dir=str(tmp_path))._log_held is False


def test_a_rebuild_resumes_what_the_lost_manager_had_taken_or_found_lost(tmp_path):
    """A repack moved group g0's unfinished samples from r0 to r1 (r0 keeps g0's finished
    one, not yet stored: it says it holds g0, which is not re-issued). r1 is lost: the
    lost manager took its entries (ownerless in the log) and was lost with the data
    module before it resumed them anywhere. r2 was found lost too, its take not logged.
    The rebuild restores both rollouts' entries (the ownerless ones owned by r1 again, its
    take undone) and the new manager, which takes r1 and r2 over as lost and so never
    finds them lost, takes them once more and resumes them on r0. Before, entries were
    restored only for rollouts lost or silent at the rebuild, and g0's samples (and r2's
    g1) were nowhere, their groups outstanding for good. Real log and pool logic; the
    manager's rollouts are stand-ins (tests/test_fence.py)."""
    from test_fence import CorePool
    from test_manager import FakeRollout, decoding, done

    from laminar.manager import RolloutManager
    from pipelines.restart import _orphans

    lost = PartialCore(journal=True)
    states = [
        RequestState(GenerationRequest(rid, (1, 2), SamplingParams(16)), seed=i, t_start=i)
        for i, rid in enumerate(["g0-001", "g0-002", "g1-000"])
    ]
    lost.register("r0", 0, states[:2])
    lost.reassign(["g0-001", "g0-002"], "r1", moved_from="r0")  # (the repack)
    lost.register("r2", 0, states[2:])
    lost.flush("r1", {"g0-001": (0, [5, 6], [-1.0, -1.0], [0, 0])})
    assert len(lost.take("r1")) == 2  # (the lost manager's recovery, cut short)
    PartialLogWriter(tmp_path).append(**lost.drain_journal())

    # the rebuild: r0 said what it holds; the lost manager had found r1 and r2 lost
    cfg = RunConfig()
    last = RolloutManager(cfg, {}, None, CorePool(), {}).stats()
    last["lost"] = {"r1": 1.0, "r2": 1.0}
    orphans = _orphans(replay_log(tmp_path).entries, set(last["lost"]))  # (none gone, silent)
    assert sorted(orphans) == ["g0-001", "g0-002", "g1-000"]
    pool = CorePool()
    r0 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {}, None, pool, {})
    manager.take_over(last, {"r0": r0}, {"r0": "tcp://w0"})
    pool.core.restore(orphans)
    manager._scheduler_workers = lambda: {"tcp://w0"}
    assert manager.detect() == []
    assert pool.core.owned() == {"r0": (3, 2, 0)} and pool.core.late() == []
    g0 = pool.core.entries["g0-001"]["state"]
    assert (g0.request.meta["rollout_path"], g0.n_moves) == (["r0", "r1"], 2)  # (moved once)
    assert sorted((r["rollout"], r["requests"]) for r in manager.fault_rows) == [
        ("r1", 2),
        ("r2", 1),
    ]
