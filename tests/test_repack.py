"""The repack planner: the paper's example and its rules as properties on random loads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.manager_repack import planner_loads
from laminar.repack import Move, RolloutLoad, apply, is_candidate, plan

C_MAX, MAX_BATCH = 0.9, 16


def draining(load: RolloutLoad, c_max: float, max_batch: int) -> bool:
    """The candidate rule of docs/repack.md, written out apart from the module's own
    ``is_candidate``, so that the property tests judge the planner against the rule and
    not against itself: some requests, fewer than ``max_batch``, and KV below ``c_max``
    and strictly below the previous check's (flat KV is not falling)."""
    return 0 < load.n_requests < max_batch and load.kv_used < c_max and load.kv_used < load.kv_prev


def test_the_papers_example():
    loads = [
        RolloutLoad("R1", 7, kv_used=0.12, kv_prev=0.30, n_requests=3),
        RolloutLoad("R2", 7, kv_used=0.18, kv_prev=0.35, n_requests=4),
        RolloutLoad("R3", 7, kv_used=0.25, kv_prev=0.50, n_requests=5),
    ]
    assert plan(loads, c_max=0.9, max_batch=16) == [Move("R1", "R3"), Move("R2", "R3")]


def test_versions_never_mix_and_rising_or_full_rollouts_stay():
    loads = [
        RolloutLoad("a", 1, 0.10, 0.20, 2),
        RolloutLoad("b", 2, 0.10, 0.20, 2),  # another version: no partner
        RolloutLoad("c", 1, 0.30, 0.10, 2),  # rising: new work is arriving
        RolloutLoad("d", 1, 0.85, 0.95, 15),  # too full to take 'a'
    ]
    assert plan(loads, c_max=C_MAX, max_batch=MAX_BATCH) == []


def test_flat_kv_is_not_falling():
    """A rollout whose KV has not moved since the previous check is not draining: the
    manager reports ``kv_prev = kv_used`` for a batch it sees for the first time, and
    ``<=`` in the rule would move every such batch at once."""
    flat = [RolloutLoad("a", 1, 0.1, 0.1, 2), RolloutLoad("b", 1, 0.2, 0.2, 2)]
    assert not any(is_candidate(load, C_MAX, MAX_BATCH) for load in flat)
    assert plan(flat, c_max=C_MAX, max_batch=MAX_BATCH) == []


def test_a_batch_seen_for_the_first_time_is_not_moved():
    """The manager's loads of two fresh batches (their first sighting) plan no move:
    only their next check can tell whether their KV falls."""
    prev: dict = {}
    fresh = {"version": 0, "in_batch": True, "held": False, "batch": 1}
    seen = {
        "r0": {**fresh, "kv_used": 0.1, "n_requests": 4},
        "r1": {**fresh, "kv_used": 0.2, "n_requests": 4},
    }
    loads = planner_loads(seen, prev)
    assert [(ld.kv_used, ld.kv_prev) for ld in loads] == [(0.1, 0.1), (0.2, 0.2)]
    assert plan(loads, c_max=C_MAX, max_batch=MAX_BATCH) == []
    later = {rid: {**ld, "kv_used": ld["kv_used"] / 2} for rid, ld in seen.items()}
    assert plan(planner_loads(later, prev), c_max=C_MAX, max_batch=MAX_BATCH) == [Move("r0", "r1")]


def test_a_held_rollout_is_not_planned_with():
    """A rollout held by a move (it exported, awaiting release or abort) is neither a
    source again nor a destination: its batch is on its way out."""
    prev = {"r0": (1, 0.4), "r1": (1, 0.4)}
    tail = {"version": 0, "in_batch": True, "batch": 1, "kv_used": 0.2, "n_requests": 2}
    loads = planner_loads({"r0": {**tail, "held": True}, "r1": {**tail, "held": False}}, prev)
    assert [ld.rollout_id for ld in loads] == ["r1"]


def test_duplicate_ids_are_refused():
    load = RolloutLoad("a", 1, 0.1, 0.2, 1)
    with pytest.raises(ValueError, match="unique"):
        plan([load, load], c_max=C_MAX, max_batch=MAX_BATCH)


@st.composite
def loads_strategy(draw):
    n = draw(st.integers(0, 24))
    versions = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        kv = draw(st.floats(0.0, 1.0))
        # (flat KV, a batch's first sighting, as often as not: random floats never tie)
        prev = kv if draw(st.booleans()) else draw(st.floats(0.0, 1.0))
        reqs = draw(st.integers(0, MAX_BATCH + 2))
        out.append(RolloutLoad(f"r{i}", draw(st.integers(0, versions - 1)), kv, prev, reqs))
    return out


@settings(max_examples=400, deadline=None)
@given(loads=loads_strategy(), c_max=st.floats(0.3, 1.0), max_batch=st.integers(2, 32))
def test_planner_rules_hold_on_random_loads(loads, c_max, max_batch):
    moves = plan(loads, c_max=c_max, max_batch=max_batch)
    by_id = {load.rollout_id: load for load in loads}
    sources = [m.source for m in moves]
    dests = {m.destination for m in moves}
    # every source moves wholly, once; no rollout is both a source and a destination
    assert len(sources) == len(set(sources))
    assert not set(sources) & dests
    for m in moves:
        s, d = by_id[m.source], by_id[m.destination]
        assert s.version == d.version  # never mixes versions
        assert draining(s, c_max, max_batch) and draining(d, c_max, max_batch)
    # never over c_max or max_batch after the moves (checked after each one in order)
    kv = {i: load.kv_used for i, load in by_id.items()}
    n = {i: load.n_requests for i, load in by_id.items()}
    for m in moves:
        kv[m.destination] += kv[m.source]
        n[m.destination] += n[m.source]
        kv[m.source], n[m.source] = 0.0, 0
        assert kv[m.destination] <= c_max + 1e-12 and n[m.destination] <= max_batch
    # within a version, sources are planned in ascending KV use
    for v in {load.version for load in loads}:
        used = [by_id[s].kv_used for s in sources if by_id[s].version == v]
        assert used == sorted(used)
    # idempotent on its own output
    assert plan(apply(loads, moves), c_max=c_max, max_batch=max_batch) == []


@settings(max_examples=200, deadline=None)
@given(loads=loads_strategy())
def test_each_source_goes_to_the_fullest_feasible_destination(loads):
    """Best fit: replaying the plan, no other destination available at that moment would
    have ended fuller while staying within the limits."""
    moves = plan(loads, c_max=C_MAX, max_batch=MAX_BATCH)
    by_id = {load.rollout_id: load for load in loads}
    kv = {i: load.kv_used for i, load in by_id.items()}
    n = {i: load.n_requests for i, load in by_id.items()}
    moved: set[str] = set()
    for m in moves:
        src = by_id[m.source]
        peers = [
            r.rollout_id
            for r in loads
            if r.version == src.version
            and draining(r, C_MAX, MAX_BATCH)
            and r.rollout_id not in moved | {m.source}
        ]
        feasible = [
            d for d in peers if kv[d] + kv[m.source] <= C_MAX and n[d] + n[m.source] <= MAX_BATCH
        ]
        assert kv[m.destination] + kv[m.source] == max(kv[d] + kv[m.source] for d in feasible)
        kv[m.destination] += kv[m.source]
        n[m.destination] += n[m.source]
        kv[m.source], n[m.source] = 0.0, 0
        moved.add(m.source)


@settings(max_examples=300, deadline=None)
@given(loads=loads_strategy(), c_max=st.floats(0.3, 1.0), max_batch=st.integers(2, 32))
def test_every_source_that_could_move_does(loads, c_max, max_batch):
    """Completeness (the other rules hold of a planner that moves nothing): replaying
    each version's candidates in ascending ``kv_used``, a candidate that has not received
    work and has a destination within the limits at its turn is the next move's source;
    one that has none, or received work, moves nowhere."""
    moves = plan(loads, c_max=c_max, max_batch=max_batch)
    for v in {load.version for load in loads}:
        group = sorted(
            (r for r in loads if r.version == v and draining(r, c_max, max_batch)),
            key=lambda r: (r.kv_used, r.rollout_id),
        )
        ids = {r.rollout_id for r in group}
        todo = [m for m in moves if m.source in ids]
        kv = {r.rollout_id: r.kv_used for r in group}
        n = {r.rollout_id: r.n_requests for r in group}
        received: set[str] = set()
        moved: set[str] = set()
        for r in group:
            s = r.rollout_id
            feasible = [
                d for d in ids - moved - {s} if kv[d] + kv[s] <= c_max and n[d] + n[s] <= max_batch
            ]
            if s in received or not feasible:
                assert not todo or todo[0].source != s
                continue
            assert todo and todo[0].source == s, f"{s} could move to {feasible}"
            d = todo.pop(0).destination
            kv[d], n[d], kv[s], n[s] = kv[d] + kv[s], n[d] + n[s], 0.0, 0
            moved.add(s)
            received.add(d)
        assert todo == []


# -- a rollout's mailbox: the manager's commands run on its generation thread ------------


def test_a_command_the_manager_gave_up_on_never_runs_later(tiny_policy, small_config):
    """A move command not served within the timeout is withdrawn: when the generation
    thread reaches its mailbox afterwards, it skips it (a move must not happen behind the
    manager's back, after it rolled the states back elsewhere)."""
    import threading

    from laminar.config import with_overrides
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["cluster.actor_timeout_s=0.2", "rollout.parity_every=0"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    busy = threading.Event()
    rollout._thread = threading.Thread(target=busy.wait, daemon=True)  # alive, never serving
    rollout._thread.start()
    ran = []
    with pytest.raises(TimeoutError, match="did not serve"):
        rollout._command(lambda: ran.append(1))
    served = []
    rollout._inbox.put((lambda: served.append(1), {"state": "pending"}, threading.Event()))
    rollout._serve()  # the generation thread's turn: the withdrawn command is skipped
    assert ran == [] and served == [1]
    busy.set()


def test_an_import_planned_against_a_batch_that_has_since_ended_is_refused(
    tiny_policy, small_config
):
    """The manager plans with each destination's batch as it last saw it. If that batch
    drained and a fresh one began before the import arrived, the planner never counted the
    fresh batch against ``max_batch``: the import is refused (the source takes its states
    back), while one into the planned batch, or with no batch named, goes in."""
    from laminar.config import with_overrides
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    rollout._in_batch, rollout._batch_seq = True, 3
    v = rollout.engine.version
    assert rollout._import(v, [], batch=2, sources=1) is False
    assert rollout._import(v + 1, [], batch=3, sources=1) is False  # another version
    assert rollout._import(v, [], batch=3, sources=1) is True
    assert rollout._import(v, [], batch=None, sources=1) is True


def test_an_import_past_the_planners_max_batch_is_refused_and_a_recovery_is_no_move(
    tiny_policy, small_config
):
    """A destination that took new groups since the plan (``rollout.top_up``: its batch
    number stays) would exceed ``max_batch`` with the planned import: refused. An import
    of a lost rollout's requests (``sources=0``) is not counted as a move taken in, nor
    its requests as moved ones (``requests_in`` adds up to the sources' ``requests_out``)."""
    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    src = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    dst = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None)
    src._add([PromptGroup("p00000000", 0, (5, 6, 7), "x", 4, 0)])
    dst._add([PromptGroup("p00000001", 1, (5, 6, 7), "x", 4, 0)])
    for r in (src, dst):
        r.engine.step()
        r._in_batch, r._batch_seq = True, 1
    states = src.engine.export(list(src.engine.request_ids()))
    v = dst.engine.version
    assert dst._import(v, states, batch=1, sources=1, max_requests=7) is False  # 4 + 4
    assert len(dst.engine.request_ids()) == 4 and dst.counts["moves_in"] == 0
    assert dst._import(v, states, batch=1, sources=0, max_requests=8) is True
    assert len(dst.engine.request_ids()) == 8
    assert dst.counts["moves_in"] == 0 and dst.counts["requests_in"] == 0


def test_an_import_past_c_max_is_refused_and_the_load_counts_waiting_requests(
    tiny_policy, small_config
):
    """The planner kept the merge within ``c_max`` with the loads it saw; both sides'
    contexts grew since, so the import checks it again against what the destination's
    requests will hold once admitted. The load the planner reads counts the waiting
    requests' contexts too (groups a top-up just took hold no KV yet, but will)."""
    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    src = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    dst = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None)
    src._add([PromptGroup("p00000000", 0, (5, 6, 7), "x", 4, 0)])
    dst._add([PromptGroup("p00000001", 1, (5, 6, 7), "x", 4, 0)])
    src.engine.step()
    dst._in_batch, dst._batch_seq = True, 1
    kv = dst.engine.kv_stats()
    assert (kv.used_tokens, kv.waiting, kv.waiting_tokens) == (0, 4, 12)  # not admitted yet
    dst._publish_load()
    assert dst.load()["kv_used"] == 12 / kv.capacity_tokens
    dst.engine.step()
    states = src.engine.export(list(src.engine.request_ids()))
    incoming = sum(st.context_len for st in states)  # 4 × (3 prompt + 1 sampled)
    held = dst.engine.kv_stats()
    after = (held.used_tokens + held.waiting_tokens + incoming) / held.capacity_tokens
    v = dst.engine.version
    assert dst._import(v, states, batch=1, sources=1, max_kv=after * 0.99) is False
    assert len(dst.engine.request_ids()) == 4 and dst.counts["moves_in"] == 0
    assert dst._import(v, states, batch=1, sources=1, max_kv=after) is True
    assert len(dst.engine.request_ids()) == 8 and dst.counts["moves_in"] == 1


# -- a move between two real rollouts, in this process -----------------------------------


def _decoding(rollout_id: str, cfg, policy, n: int, batch: int = 1):
    """A real rollout decoding a batch of ``n`` requests, its commands served by a
    thread of its own as its generation loop would serve them between steps."""
    import threading

    from laminar.engine import GenerationRequest
    from laminar.rollout import RolloutReplica

    rollout = RolloutReplica(rollout_id, cfg, str(policy), None, None, None)
    for i in range(n):
        rollout.engine.add_request(
            GenerationRequest(f"{rollout_id}-p{i}", (1, 2, 3), rollout._params, meta={})
        )
    rollout._in_batch, rollout._batch_seq = True, batch
    for _ in range(2):
        rollout.engine.step()
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if rollout._held:
                rollout._wait_while_held()  # (what its loop does once the batch is out)
            rollout._serve(0.01)

    rollout._thread = threading.Thread(target=serve, daemon=True)
    rollout._thread.start()
    return rollout, stop


class _Handle:
    """An actor handle to a rollout in this process: a call returns a future."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        from concurrent.futures import Future

        def call(*args, **kwargs):
            f = Future()
            try:
                f.set_result(getattr(self._obj, name)(*args, **kwargs))
            except Exception as e:  # noqa: BLE001
                f.set_exception(e)
            return f

        return call


class _LateAnswer(_Handle):
    """A destination whose import goes through but whose answer never comes back."""

    def __getattr__(self, name):
        call = super().__getattr__(name)
        if name != "import_for_move":
            return call

        def late(*args, **kwargs):
            from concurrent.futures import Future

            call(*args, **kwargs)
            return Future()  # (never done)

        return late


class _SlowLog:
    """A partial-response pool that does not answer a reassign (a busy data worker): the
    call's future never completes, and the manager's wait on it ends at its deadline.
    (Its signature is the pool's: with one argument fewer, the call raised a TypeError at
    once, and the deadline's wait was never reached.)"""

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def reassign(self, request_ids, rollout_id, moved_from=None):
        from concurrent.futures import Future

        self.asked.append((list(request_ids), rollout_id, moved_from))
        return Future()


@pytest.mark.parametrize(
    "dest_batch, late", [(1, False), (1, True), (2, False)], ids=["imported", "late", "refused"]
)
def test_a_move_leaves_every_request_in_exactly_one_engine(
    tiny_policy, small_config, dest_batch, late
):
    """Imported: the requests are the destination's, even when the partial log's reassign
    fails (undoing the import for it decoded them twice), or when the import's answer
    never comes (the manager asks the destination what it holds). Refused (the
    destination's planned batch has ended): the source takes them back, not counted as
    moved."""
    from laminar.config import with_overrides
    from laminar.manager import RolloutManager

    cfg = with_overrides(
        small_config,
        ["rollout.parity_every=0", "repack.interval_s=1", "cluster.actor_timeout_s=0.5"],
    )
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2, batch=dest_batch)
    try:
        before = {*src.engine.request_ids(), *dst.engine.request_ids()}
        to_dst = _LateAnswer(dst) if late else _Handle(dst)
        log = _SlowLog()
        manager = RolloutManager(
            cfg, {"r0": _Handle(src), "r1": to_dst}, master_relay=None, partial=log
        )
        manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2)}
        loads = {"r0": RolloutLoad("r0", 0, 0.1, 0.2, 3), "r1": RolloutLoad("r1", 0, 0.2, 0.3, 2)}
        (row,) = manager._execute([Move("r0", "r1")], loads)
        held = set(src.engine.request_ids()), set(dst.engine.request_ids())
        assert not held[0] & held[1] and held[0] | held[1] == before
        assert not src._held and src._exported is None
        if dest_batch == 1:
            assert row["ok"] and len(held[1]) == 5 and not held[0]
            assert [s.n_moves for s in src.engine.in_flight()] == []
            assert {s.n_moves for s in dst.engine.in_flight() if s.request_id.startswith("r0")} == {
                1
            }
            assert (src.counts["moves_out"], dst.counts["moves_in"]) == (1, 1)
            # (the reassign was asked, as the pool takes it, and timed out)
            assert [(len(ids), d, s) for ids, d, s in log.asked] == [(3, "r1", "r0")]
        else:
            assert not row["ok"] and len(held[0]) == 3
            assert {s.n_moves for s in src.engine.in_flight()} == {0}
            assert all(s.request.meta["rollout_path"] == [] for s in src.engine.in_flight())
            assert (src.counts["moves_out"], src.counts["moves_taken_back"]) == (0, 1)
            assert manager.counts["rolled_back"] == 1
            # the take-back's re-prefill is counted in tokens beside its time (its
            # requests' contexts then, no longer than they are now: they decode on)
            now = sum(s.context_len for s in src.engine.in_flight())
            assert 0 < src.counts["reprefill_tokens"] <= now
    finally:
        stop_src.set(), stop_dst.set()


def test_an_export_is_refused_when_the_batch_is_not_the_planned_one(tiny_policy, small_config):
    """The planner counted the source's batch as it was: a fresh batch begun since, or
    one that took new groups (top-up), would overfill its destination."""
    from laminar.config import with_overrides

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    src, stop = _decoding("r0", cfg, tiny_policy, 3, batch=4)
    try:
        assert src.export_for_move(batch=3) is None  # a batch after the planned one
        assert src.export_for_move(batch=4, max_requests=2) is None  # grew since
        assert len(src.engine.request_ids()) == 3 and not src._held
        assert len(src.export_for_move(batch=4, max_requests=3)["states"]) == 3
        assert src._held and not src.engine.request_ids()
        assert src.abort_export() == 3 and not src._held and len(src.engine.request_ids()) == 3
        assert src.abort_export() == 0  # nothing exported any more: a no-op
    finally:
        stop.set()


class _Withdrawn(_Handle):
    """A destination whose import is withdrawn unserved (its generation thread busy past
    the timeout): the call never runs, and its answer never comes."""

    def __getattr__(self, name):
        if name != "import_for_move":
            return super().__getattr__(name)
        from concurrent.futures import Future

        return lambda *args, **kwargs: Future()  # (never done)


def test_a_withdrawn_import_is_not_taken_for_an_earlier_one_of_the_same_requests(
    tiny_policy, small_config
):
    """r0 -> r1 moves requests S; r1 -> r0 moves them back on; a third round plans
    r0 -> r1 again, and r1's import is withdrawn (never runs). The manager asks r1
    whether it took them: answered by request ids, r1's record of its first import said
    yes, r0 was released and S was in no engine, its groups never complete. The
    question names the import now: r0 takes S back."""
    from laminar.config import with_overrides
    from laminar.manager import RolloutManager

    cfg = with_overrides(
        small_config,
        ["rollout.parity_every=0", "repack.interval_s=1", "cluster.actor_timeout_s=0.5"],
    )
    a, stop_a = _decoding("r0", cfg, tiny_policy, 3)
    b, stop_b = _decoding("r1", cfg, tiny_policy, 0)
    try:
        moved = set(a.engine.request_ids())
        manager = RolloutManager(cfg, {"r0": _Handle(a), "r1": _Handle(b)}, master_relay=None)

        def round_(src: str, dst: str):
            manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2)}
            loads = {
                "r0": RolloutLoad("r0", 0, 0.1, 0.2, len(a.engine.request_ids())),
                "r1": RolloutLoad("r1", 0, 0.2, 0.3, len(b.engine.request_ids())),
            }
            (row,) = manager._execute([Move(src, dst)], loads)
            return row

        assert round_("r0", "r1")["ok"] and set(b.engine.request_ids()) == moved
        assert round_("r1", "r0")["ok"] and set(a.engine.request_ids()) == moved
        manager.rollouts["r1"] = _Withdrawn(b)
        assert not round_("r0", "r1")["ok"]
        assert set(a.engine.request_ids()) == moved and not b.engine.request_ids()
        assert not a._held and a._exported is None
    finally:
        stop_a.set(), stop_b.set()


def test_a_late_release_or_abort_of_an_earlier_move_leaves_a_later_export_alone(
    tiny_policy, small_config
):
    """A release delayed past the hold limit (the source took its requests back itself
    and was exported from again) committed the later export whatever its move: were
    that import refused, the abort found nothing to take back and the requests were in
    no engine. A release or abort acts on the export of its own move only."""
    import time

    from laminar.config import with_overrides
    from laminar.rollout import HOLD_LIMIT_TIMEOUTS

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "cluster.actor_timeout_s=0.5"])
    src, stop = _decoding("r0", cfg, tiny_policy, 3)
    try:
        assert src.export_for_move(move="m1") is not None
        deadline = time.time() + HOLD_LIMIT_TIMEOUTS * 0.5 + 5
        while (src._held or not src.counts["holds_timed_out"]) and time.time() < deadline:
            time.sleep(0.05)
        assert not src._held and len(src.engine.request_ids()) == 3  # its hold ran out
        assert src.export_for_move(move="m2") is not None
        src.release(move="m1")  # (m1's release, delivered late)
        assert src._held and src._exported is not None
        assert src.abort_export(move="m1") == 0  # (m1's abort, delivered late)
        assert src._held
        assert src.abort_export(move="m2") == 3  # m2's import refused: taken back
        assert not src._held and len(src.engine.request_ids()) == 3
        assert src.export_for_move(move="m3") is not None
        src.release(move="m3")
        assert not src._held and src._exported is None and not src.engine.request_ids()
    finally:
        stop.set()


def test_an_export_is_refused_when_its_batch_took_in_more_since_the_plan(tiny_policy, small_config):
    """docs/repack.md: a source that took new groups since the plan (``rollout.top_up``)
    exports nothing, its destination's limits planned without them. Only a count above
    the planned ``n_requests`` was checked, and requests finishing meanwhile hid the new
    ones. The load carries ``taken_in`` (a top-up or an import since); the export
    names the planned one."""
    from concurrent.futures import Future

    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "rollout.top_up=true"])
    src = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    src._add([PromptGroup("p00000000", 0, (5, 6, 7), "x", 4, 0)])
    src.engine.step()
    src._in_batch, src._batch_seq = True, 1
    src._publish_load()
    planned = src.load()["taken_in"]

    class Pool:
        def top_up(self, room, rollout_id, version, ask):
            f = Future()
            f.set_result(([PromptGroup("p00000001", 1, (5, 6, 7), "x", 4, 0)], 0))
            return f

    src.pool = Pool()
    src._top_up()
    assert len(src.engine.request_ids()) == 8
    src._publish_load()
    assert src.load()["taken_in"] == planned + 1
    # (as if half had finished meanwhile: the count alone no longer tells)
    assert src._export_all(1, 8, taken_in=planned) is None
    assert len(src.engine.request_ids()) == 8 and not src._held
    other = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None)
    other._add([PromptGroup("p00000002", 2, (5, 6, 7), "x", 4, 0)])
    other.engine.step()
    states = other.engine.export(list(other.engine.request_ids()))
    assert src._import(0, states, 1, 1, move="in") is True  # an import counts too
    assert src._export_all(1, 12, taken_in=planned + 1) is None
    out = src._export_all(1, 12, taken_in=planned + 2)
    assert out is not None and len(out["states"]) == 12


def test_a_source_whose_data_link_is_flagged_lost_exports_nothing(tiny_policy, small_config):
    """The destination counts every exported token as in the partial-response log (the
    source's forced flush). A source flagged lost (a slow pool call timed out) skips
    that flush: the destination's flushes then started past the log's end, and the pool
    ignored them all as a gap, the finish and owner included (a loss of it re-decoded
    them from far behind, or never recovered them). It refuses the export now, also
    when the forced flush itself fails; once the pool answers again, the move goes
    through and the destination's flushes reach the log."""
    import time

    from factories import InProcess

    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.partial import PartialResponsePool
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "rollout.max_new_tokens=30"])
    pool = PartialResponsePool()
    src, dst = (
        RolloutReplica(r, cfg, str(tiny_policy), None, None, None, partial=InProcess(pool))
        for r in ("r0", "r1")
    )
    src._add([PromptGroup("p00000000", 0, (5, 6, 7), "x", 4, 0)])
    for _ in range(2):
        src.engine.step()
    src._log_partial(force=True)
    src._data_lost = time.time()  # a flush timed out: flagged lost (it is only slow)
    for _ in range(3):
        src.engine.step()
    src._in_batch, src._batch_seq = True, 1
    dst._in_batch, dst._batch_seq = True, 1
    assert src._export_all(1, None) is None
    assert len(src.engine.request_ids()) == 4 and not src._held

    class FailingFlush:  # (the pool answers everything but this flush)
        def __getattr__(self, name):
            if name == "flush":

                def flush(*a, **k):
                    raise TimeoutError("the partial-response pool did not answer")

                return flush
            return getattr(InProcess(pool), name)

    src._data_lost, src.partial = None, FailingFlush()
    assert src._export_all(1, None) is None and src._data_lost is not None
    assert len(src.engine.request_ids()) == 4 and not src._held

    src._data_lost, src.partial = None, InProcess(pool)  # the probe finds it answering
    out = src._export_all(1, None, move="m")
    assert out is not None
    assert dst._import(0, out["states"], 1, 1, move="m")
    src.release(move="m")
    finished = []
    while dst.engine.has_work():
        done = dst.engine.step()
        finished += done
        dst._log_partial(done, force=True)
    assert len(finished) == 4 and pool.core.counts["gaps"] == 0
    entries = pool.core.entries.values()
    assert all("finished" in e for e in entries) and {e["owner"] for e in entries} == {"r1"}


def test_a_source_nobody_releases_takes_its_requests_back(tiny_policy, small_config):
    """The manager that held the source was lost (or gave up on an export that still
    ran): after HOLD_LIMIT_TIMEOUTS actor timeouts the source takes its requests back
    instead of idling with them for the rest of the run."""
    import time

    from laminar.config import with_overrides
    from laminar.rollout import HOLD_LIMIT_TIMEOUTS

    # (0.5 s: the export waits that long for the decode loop to take it, a step of a
    # loaded host included; the hold limit is HOLD_LIMIT_TIMEOUTS of it)
    cfg = with_overrides(small_config, ["rollout.parity_every=0", "cluster.actor_timeout_s=0.5"])
    src, stop = _decoding("r0", cfg, tiny_policy, 3)
    try:
        assert src.export_for_move() is not None and src._held
        deadline = time.time() + HOLD_LIMIT_TIMEOUTS * 0.5 + 5
        # (the decode thread takes the requests back, then counts it: wait for both)
        while (src._held or not src.counts["holds_timed_out"]) and time.time() < deadline:
            time.sleep(0.05)
        assert not src._held and len(src.engine.request_ids()) == 3
        assert src.counts["holds_timed_out"] == 1
    finally:
        stop.set()


def test_a_recovered_batch_whose_import_answer_was_lost_is_not_adopted_twice(
    tiny_policy, small_config
):
    """Recovery imports a lost rollout's batch into a running batch of its version. If
    that import's answer never comes, the manager asks the destination whether it holds
    the batch before it tries another rollout or has one adopt it."""
    from laminar.config import with_overrides
    from laminar.manager import RolloutManager

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "cluster.actor_timeout_s=0.5"])
    lost, stop_lost = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2)
    try:
        batch = lost.export_for_move()["states"]  # (what the log would hand over)
        manager = RolloutManager(cfg, {"r1": _LateAnswer(dst)}, master_relay=None)
        loads = {"r1": {"in_batch": True, "held": False, "version": 0, "kv_used": 0.1}}
        assert manager._resume(0, batch, ["r1"], loads) == ("import", "r1")
        assert {s.request_id for s in batch} <= set(dst.engine.request_ids())
    finally:
        stop_lost.set(), stop_dst.set()
