"""The partial-response pool's logic (laminar.partial.PartialCore), without a cluster."""

from __future__ import annotations

from laminar.engine import GenerationRequest, RequestState, SamplingParams
from laminar.partial import PartialCore


def _register(core: PartialCore, owner: str, version: int, ids: list[str]) -> None:
    states = [
        RequestState(GenerationRequest(rid, (1, 2, 3), SamplingParams(16)), seed=i, t_start=i)
        for i, rid in enumerate(ids)
    ]
    core.register(owner, version, states)


def test_only_unfinished_entries_keep_their_version():
    """A rollout owns the finished (reward in flight) trajectories of its last batch and
    the unfinished ones of its current batch: only the current version must be kept."""
    core = PartialCore()
    _register(core, "r0", 3, ["a", "b"])
    assert core.versions() == [3]
    core.flush("r0", {"a": (0, [5, 6], [-1.0, -2.0], [3, 3])})
    core.flush("r0", {"a": (2, [7], [-3.0], [3]), "b": (0, [8], [-1.0], [3])}, {"a": ("eos", 1.0)})
    assert core.versions() == [3]  # b still decodes
    core.flush("r0", {"b": (1, [9], [-1.5], [3])}, {"b": ("length", 2.0)})
    assert core.versions() == []
    _register(core, "r0", 5, ["c"])
    assert core.versions() == [5]
    assert core.owned() == {"r0": (3, 5, 2)}
    assert core.stats()["finished"] == 2


def test_a_lost_rollouts_entries_say_how_to_recover_them():
    core = PartialCore()
    _register(core, "r0", 3, ["a", "b"])
    core.flush("r0", {"a": (0, [5, 6], [-1.0, -2.0], [3, 3]), "b": (0, [4], [-1.0], [3])})
    core.flush("r0", {"a": (2, [7], [-3.0], [3])}, {"a": ("stop", 9.0)})
    taken = {st.request_id: st for st in core.take("r0")}
    a, b = taken["a"], taken["b"]
    assert a.tokens == [5, 6, 7] and a.logprobs == [-1.0, -2.0, -3.0]
    assert a.request.meta["finished"] == ("stop", 9.0)
    assert "finished" not in b.request.meta
    assert b.request.meta["behavior_version"] == 3 and b.request.meta["recovered_tokens"] == 1
    assert a.n_moves == b.n_moves == 1
    # The copies are the recovery's: the pool's own entries are not changed by them ...
    b.tokens.append(99)
    b.request.meta["extra"] = 1
    assert list(core.entries["b"]["state"].tokens) == [4]
    assert "extra" not in core.entries["b"]["state"].request.meta
    assert core.owned() == {None: (2, 4, 1)}
    # ... except their path, so a second loss extends it.
    core.reassign(["a", "b"], "r1")
    again = {st.request_id: st for st in core.take("r1")}
    assert again["b"].request.meta["rollout_path"] == ["r0", "r1"]
    assert again["b"].n_moves == 2  # (each loss a move: the count stayed at 1)


def test_a_recovery_after_a_repack_move_keeps_the_move_in_its_history(tmp_path):
    """Repack moved the request r0 -> r1 (the exported copy gained the move and r0 on its
    path), then r1 was lost: the pool's copy had neither, so the stored trajectory said 1
    migration and a path without r0. The pool, and its log, now keep the move."""
    from laminar.partial import replay_log
    from storage.partial_log import PartialLogWriter

    core = PartialCore(journal=True)
    _register(core, "r0", 3, ["a"])
    core.flush("r0", {"a": (0, [5], [-1.0], [3])})
    core.reassign(["a"], "r1", moved_from="r0")  # (the manager, once the move committed)
    core.flush("r1", {"a": (1, [6], [-1.0], [3])})
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    logged = replay_log(tmp_path).entries["a"]["state"]  # (what a rebuilt pool reads)
    assert logged.n_moves == 1 and logged.request.meta["rollout_path"] == ["r0"]
    (taken,) = core.take("r1")  # r1 lost: its recovery is one move more
    assert taken.n_moves == 2 and taken.request.meta["rollout_path"] == ["r0", "r1"]


def test_a_late_or_repeated_flush_overwrites_and_a_gap_is_refused():
    core = PartialCore()
    _register(core, "r0", 1, ["a"])
    core.flush("r0", {"a": (0, [1, 2], [0.0, 0.0], [1, 1])})
    core.flush("r0", {"a": (0, [1, 2, 3], [0.0, 0.0, 0.0], [1, 1, 1])})  # repeated
    assert core.entries["a"]["state"].tokens.tolist() == [1, 2, 3]
    core.flush("r0", {"a": (5, [9], [0.0], [1])}, {"a": ("eos", 1.0)})  # a gap: not applied
    assert core.entries["a"]["state"].tokens.tolist() == [1, 2, 3]
    assert core.versions() == [1] and core.stats()["gaps"] == 1
    core.forget(["a", "unknown"])
    assert core.stats()["entries"] == 0 and core.stats()["forgotten"] == 1
    core.flush("r0", {"a": (0, [1], [0.0], [1])})  # after the buffer has it: ignored
    assert core.stats()["entries"] == 0


def test_a_rollout_registers_its_unfinished_trajectories_with_a_rebuilt_pool(
    tiny_policy, small_config
):
    """A data module rebuilt after a loss (docs/faults.md): the rollout hands the new
    partial-response pool every unfinished trajectory with the tokens it has, so that a
    later loss of this rollout resumes them from there, and queues its kept trajectories
    for the new buffer. (The actor is called in process, as Dask would call it.)"""

    from factories import InProcess

    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.partial import PartialResponsePool
    from laminar.rollout import _RESEND, RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    groups = [PromptGroup(f"p{g:08d}", g, (5, 6, 7), "x", 4, 0) for g in range(2)]
    rollout._add(groups)
    for _ in range(3):
        rollout.engine.step()
    unfinished = {st.request_id: list(st.tokens) for st in rollout.engine.in_flight()}
    assert unfinished and all(unfinished.values())
    pool = PartialResponsePool()
    assert rollout._attach(None, None, InProcess(pool)) == len(unfinished)
    entries = pool.core.entries
    assert {rid: e["state"].tokens.tolist() for rid, e in entries.items()} == unfinished
    assert {e["owner"] for e in entries.values()} == {"r0"}
    assert {e["version"] for e in entries.values()} == {rollout.engine.version}
    # copies: the engine decoding on does not change what the pool holds
    rollout.engine.step()
    assert {rid: e["state"].tokens.tolist() for rid, e in entries.items()} == unfinished
    assert rollout._logged == {rid: len(t) for rid, t in unfinished.items()}
    assert rollout._data_epoch == 1 and rollout._data_lost is None
    assert rollout._to_score.get_nowait() is _RESEND  # kept trajectories go out again
    assert sorted(rollout._holdings()) == [g.prompt_uid for g in groups]


def test_a_take_asked_again_hands_out_what_the_first_took_and_nothing_reassigned():
    """A take whose answer was lost (the manager timed out) left its entries ownerless;
    ``again=True`` hands them out once more (their path not extended twice). Entries
    reassigned since, or taken from another rollout, are not handed out again."""
    core = PartialCore()
    _register(core, "r0", 0, ["a", "b"])
    _register(core, "r1", 0, ["c"])
    first = core.take("r0")
    assert sorted(st.request_id for st in first) == ["a", "b"]
    assert core.take("r0") == []  # (not again: nothing of r0's is left)
    again = core.take("r0", again=True)
    assert sorted(st.request_id for st in again) == ["a", "b"]
    assert [st.request.meta["rollout_path"] for st in again] == [["r0"], ["r0"]]
    core.reassign(["a"], "r2")
    assert [st.request_id for st in core.take("r0", again=True)] == ["b"]
    core.take("r1")
    assert [st.request_id for st in core.take("r0", again=True)] == ["b"]


def test_a_relay_added_to_the_chain_is_told_the_versions_in_use_at_once():
    """A relay that replaces a lost one (a new master, a relay of a rebuilt chain) keeps
    nothing yet: the pool tells it the versions its entries need when it joins, not only
    at the next change of them, or it may evict a version a recovery must resume at."""
    import asyncio

    from laminar.partial import PartialResponsePool
    from laminar.relay import Relay

    async def run() -> tuple[set[int], set[int]]:
        pool = PartialResponsePool()
        kept, joined = Relay("r0"), Relay("r1")
        await pool.set_relays([kept])
        await pool.register(
            "r0", 3, [RequestState(GenerationRequest("a", (1,), SamplingParams(4)), 0)]
        )
        await pool.set_relays([kept, joined])  # (the versions in use did not change)
        await kept.close()
        await joined.close()
        return kept.core.retained, joined.core.retained

    assert asyncio.run(run()) == ({3}, {3})
