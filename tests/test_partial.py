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
    assert core.entries["b"]["state"].tokens == [4]
    assert "extra" not in core.entries["b"]["state"].request.meta
    assert core.owned() == {None: (2, 4, 1)}
    # ... except their path, so a second loss extends it.
    core.reassign(["a", "b"], "r1")
    again = {st.request_id: st for st in core.take("r1")}
    assert again["b"].request.meta["rollout_path"] == ["r0", "r1"]


def test_a_late_or_repeated_flush_overwrites_and_a_gap_is_refused():
    core = PartialCore()
    _register(core, "r0", 1, ["a"])
    core.flush("r0", {"a": (0, [1, 2], [0.0, 0.0], [1, 1])})
    core.flush("r0", {"a": (0, [1, 2, 3], [0.0, 0.0, 0.0], [1, 1, 1])})  # repeated
    assert core.entries["a"]["state"].tokens == [1, 2, 3]
    core.flush("r0", {"a": (5, [9], [0.0], [1])}, {"a": ("eos", 1.0)})  # a gap: not applied
    assert core.entries["a"]["state"].tokens == [1, 2, 3]
    assert core.versions() == [1] and core.stats()["gaps"] == 1
    core.forget(["a", "unknown"])
    assert core.stats()["entries"] == 0 and core.stats()["forgotten"] == 1
    core.flush("r0", {"a": (0, [1], [0.0], [1])})  # after the buffer has it: ignored
    assert core.stats()["entries"] == 0
