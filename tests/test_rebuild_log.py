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
        await partial.close()

    asyncio.run(rebuild())
    back = replay_log(tmp_path).entries["p00000003-000"]
    assert (back["owner"], back["state"].tokens.tolist()) == ("r1", [5, 6])
    assert partial.log_counts["compactions"] == 1


def test_a_fresh_or_resumed_runs_pool_starts_the_log_over_at_once(tmp_path, monkeypatch):
    """Not a rebuild: the log is started over when the pool starts (a resume's plan has
    read it; the groups it re-issues are kept)."""
    _lost_pools_log(tmp_path)
    _start(monkeypatch, tmp_path, resume=ResumePlan(version=3))
    assert replay_log(tmp_path).entries == {}
    assert PartialResponsePool(run_dir=str(tmp_path))._log_held is False
