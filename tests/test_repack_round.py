"""A repack round between real rollouts in this process (``RolloutManager._execute``):
the limits the manager passes with each export and import, the rollouts' own refusals,
and what a failed or slow call leaves behind. Each test names the guarantee it pins; the
rollouts and their handles are those of ``tests/test_repack.py``."""

from __future__ import annotations

import pytest
from test_repack import _decoding, _Handle

from laminar.config import with_overrides
from laminar.manager import RolloutManager
from laminar.repack import Move, RolloutLoad

ROUND = ["rollout.parity_every=0", "repack.interval_s=1", "cluster.actor_timeout_s=0.5"]


def _manager(cfg, handles: dict) -> RolloutManager:
    """A manager that planned with each rollout's batch 1 (``_prev``, as ``check`` leaves
    it)."""
    manager = RolloutManager(cfg, handles, master_relay=None)
    manager._prev = {rid: (1, 0.1) for rid in handles}
    return manager


def _loads(planned: dict[str, int]) -> dict[str, RolloutLoad]:
    return {rid: RolloutLoad(rid, 0, 0.1, 0.2, n) for rid, n in planned.items()}


# -- the limits the round passes: the only live enforcement once the plan is made ------


def test_a_round_never_leaves_a_destination_past_max_batch(tiny_policy, small_config):
    """The planner saw r1 with 2 requests; it holds 6 now (a top-up since). r0's 4 would
    take it to 10, past ``max_batch`` (8): the import is refused and r0 takes its
    requests back. (Pins the import's ``max_requests=self.max_batch``.)"""
    cfg = with_overrides(small_config, [*ROUND, "repack.max_batch=8"])
    src, stop_src = _decoding("r0", cfg, tiny_policy, 4)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 6)
    try:
        manager = _manager(cfg, {"r0": _Handle(src), "r1": _Handle(dst)})
        assert manager.max_batch == 8
        (row,) = manager._execute([Move("r0", "r1")], _loads({"r0": 4, "r1": 2}))
        assert not row["ok"]
        assert len(dst.engine.request_ids()) == 6 and len(src.engine.request_ids()) == 4
    finally:
        stop_src.set(), stop_dst.set()


def test_a_round_never_leaves_a_destination_past_c_max(tiny_policy, small_config):
    """Both sides' contexts grew since the plan: with r0's requests r1 would pass
    ``repack.c_max`` of its KV, though it stays within ``max_batch``. The import is
    refused. (Pins the import's ``max_kv=self.rcfg.c_max``.)"""
    src, stop_src = _decoding("r0", small_config, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", small_config, tiny_policy, 2)
    try:
        kv = dst.engine.kv_stats()
        alone = (kv.used_tokens + kv.waiting_tokens) / kv.capacity_tokens
        incoming = sum(st.context_len for st in src.engine.in_flight()) / kv.capacity_tokens
        c_max = alone + incoming / 2  # room for r1's own, not for r0's on top
        cfg = with_overrides(small_config, [*ROUND, "repack.max_batch=16", f"repack.c_max={c_max}"])
        manager = _manager(cfg, {"r0": _Handle(src), "r1": _Handle(dst)})
        (row,) = manager._execute([Move("r0", "r1")], _loads({"r0": 3, "r1": 2}))
        assert not row["ok"]
        assert len(dst.engine.request_ids()) == 2 and len(src.engine.request_ids()) == 3
    finally:
        stop_src.set(), stop_dst.set()


def test_a_round_exports_only_the_batch_it_planned_with(tiny_policy, small_config):
    """r0 was planned while draining batch 1; it decodes a fresh batch 2 now: the round
    must not move the fresh batch, which no destination's limits counted. (Pins the
    export's ``batch=self._prev[s][0]``.)"""
    cfg = with_overrides(small_config, ROUND)
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3, batch=2)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2)
    try:
        manager = _manager(cfg, {"r0": _Handle(src), "r1": _Handle(dst)})
        assert manager._execute([Move("r0", "r1")], _loads({"r0": 3, "r1": 2})) == []
        assert manager.counts["skipped"] == 1 and not src._held
        assert len(src.engine.request_ids()) == 3 and len(dst.engine.request_ids()) == 2
    finally:
        stop_src.set(), stop_dst.set()


@pytest.mark.parametrize("grew", ["requests", "taken_in"])
def test_a_round_exports_nothing_from_a_source_that_grew_since_its_plan(
    tiny_policy, small_config, grew
):
    """The planner saw r0 with 2 requests (it holds 3), or with a ``taken_in`` before its
    latest top-up or import: its destination's limits were planned without the rest.
    (Pins the export's ``max_requests=loads[s].n_requests`` and ``taken_in``.)"""
    cfg = with_overrides(small_config, ROUND)
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2)
    try:
        manager = _manager(cfg, {"r0": _Handle(src), "r1": _Handle(dst)})
        if grew == "requests":
            loads, taken_in = _loads({"r0": 2, "r1": 2}), None
        else:
            loads, taken_in = _loads({"r0": 3, "r1": 2}), {"r0": src._taken_in - 1}
        assert manager._execute([Move("r0", "r1")], loads, taken_in) == []
        assert manager.counts["skipped"] == 1 and not src._held
        assert len(src.engine.request_ids()) == 3 and len(dst.engine.request_ids()) == 2
    finally:
        stop_src.set(), stop_dst.set()


# -- the rollouts' own refusals --------------------------------------------------------


def test_a_held_source_takes_no_import(tiny_policy, small_config):
    """A source held by a move (exported, awaiting its release or abort) refuses an
    import: its batch is on its way out, and what it took would be stranded there once
    released. (Pins the import's ``_held`` check.)"""
    cfg = with_overrides(small_config, ROUND)
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    other, stop_other = _decoding("r1", cfg, tiny_policy, 2)
    try:
        assert src.export_for_move(batch=1, move="m") is not None and src._held
        states = other.export_for_move(batch=1, move="n")["states"]
        assert src.import_for_move(0, states, batch=1, sources=1, move="i") is False
        assert not src.engine.request_ids() and src.counts["moves_in"] == 0
        assert other.abort_export(move="n") == 2 and src.abort_export(move="m") == 3
    finally:
        stop_src.set(), stop_other.set()


def test_a_stopping_rollout_takes_no_import(tiny_policy, small_config):
    """A rollout being stopped (the run ends, or it is replaced) refuses an import: its
    loop will not decode what it took. (Pins the import's ``_stop`` check.)"""
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ROUND)
    dst = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None)
    dst._in_batch, dst._batch_seq = True, 1
    v = dst.engine.version
    assert dst._import(v, [], batch=1, sources=1) is True  # (the same import, not stopping)
    dst._stop.set()
    assert dst._import(v, [], batch=1, sources=1) is False


def test_a_held_source_exports_nothing_more(tiny_policy, small_config):
    """A second export while the first move's is still held (a late or repeated command)
    must not replace the held requests: the first move's abort would then find nothing
    of its own to take back. (Pins the export's ``_held`` check.)"""
    from laminar.engine import GenerationRequest

    cfg = with_overrides(small_config, ROUND)
    src, stop = _decoding("r0", cfg, tiny_policy, 3)
    try:
        assert src.export_for_move(batch=1, move="m1") is not None
        # (a request in its engine meanwhile, so that there is something to export)
        src.engine.add_request(GenerationRequest("late", (1, 2, 3), src._params, meta={}))
        assert src.export_for_move(batch=1, move="m2") is None
        assert src.abort_export(move="m1") == 3
        assert len(src.engine.request_ids()) == 4 and not src._held
    finally:
        stop.set()


def test_a_rollout_between_batches_exports_nothing(tiny_policy, small_config):
    """Requests in an engine whose rollout is not decoding a batch (it has just ended
    one, or is loading weights) are no draining batch to move. (Pins the export's
    ``_in_batch`` check.)"""
    cfg = with_overrides(small_config, ROUND)
    src, stop = _decoding("r0", cfg, tiny_policy, 3)
    try:
        src._in_batch = False
        assert src.export_for_move(batch=1, move="m") is None
        assert len(src.engine.request_ids()) == 3 and not src._held
    finally:
        stop.set()


# -- what a failed or slow call leaves behind ------------------------------------------


def _failed(error: Exception):
    from concurrent.futures import Future

    f = Future()
    f.set_exception(error)
    return f


class _FailsOnce(_Handle):
    """A source whose first call of ``method`` fails in transit (a dropped connection):
    that call never reaches it."""

    def __init__(self, obj, method: str) -> None:
        super().__init__(obj)
        self.method, self.calls = method, 0

    def __getattr__(self, name):
        call = super().__getattr__(name)
        if name != self.method:
            return call

        def once(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                return _failed(OSError("connection reset"))
            return call(*args, **kwargs)

        return once


def test_a_release_that_failed_is_sent_again(tiny_policy, small_config):
    """The move went through, but its release never reached the source: not sent again,
    the source stayed held for the whole hold limit, then took its requests back while
    the destination decoded them too (the row said ok, ``moves_out`` went back down).
    The release is sent again: the requests are the destination's alone."""
    cfg = with_overrides(small_config, ROUND)
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2)
    try:
        to_src = _FailsOnce(src, "release")
        manager = _manager(cfg, {"r0": to_src, "r1": _Handle(dst)})
        (row,) = manager._execute([Move("r0", "r1")], _loads({"r0": 3, "r1": 2}))
        assert row["ok"] and to_src.calls == 2
        assert not src._held and src._exported is None and not src.engine.request_ids()
        assert len(dst.engine.request_ids()) == 5 and src.counts["moves_out"] == 1
    finally:
        stop_src.set(), stop_dst.set()


def test_an_abort_that_failed_is_sent_again(tiny_policy, small_config):
    """The destination refused (its planned batch ended), and the abort never reached
    the source: not sent again, the source sat idle, held, for the whole hold limit
    before taking its requests back itself. It is sent again."""
    cfg = with_overrides(small_config, ROUND)
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2, batch=2)
    try:
        to_src = _FailsOnce(src, "abort_export")
        manager = _manager(cfg, {"r0": to_src, "r1": _Handle(dst)})
        (row,) = manager._execute([Move("r0", "r1")], _loads({"r0": 3, "r1": 2}))
        assert not row["ok"] and to_src.calls == 2
        assert not src._held and len(src.engine.request_ids()) == 3
        assert src.counts["holds_timed_out"] == 0
    finally:
        stop_src.set(), stop_dst.set()


class _Recorded(_Handle):
    """A handle that notes each move call in ``events`` as (method, rollout id), in the
    order the manager made them; the calls ``hung`` names are never run nor answered
    (a destination whose generation thread is stuck)."""

    def __init__(self, obj, events: list, hung: tuple[str, ...] = ()) -> None:
        super().__init__(obj)
        self.events, self.hung = events, hung

    def __getattr__(self, name):
        call = super().__getattr__(name)

        def noted(*args, **kwargs):
            self.events.append((name, self._obj.rollout_id))
            if name in self.hung:
                from concurrent.futures import Future

                return Future()  # (never done)
            return call(*args, **kwargs)

        return noted


def test_a_hung_destination_holds_its_own_sources_alone(tiny_policy, small_config):
    """r0 -> r1 and r2 -> r3 in one round; r3's import never answers. r0 is released
    at r1's answer, before the manager has even given up on r3's import (it then asks
    r3 whether it went through), not after every destination's import and question:
    a hung destination held every source of its round. Each row's ``import_s`` is its
    own destination's (the round's import phase was copied onto every row)."""
    cfg = with_overrides(small_config, ROUND)
    events: list = []
    up = {r: _decoding(r, cfg, tiny_policy, n) for r, n in (("r0", 3), ("r1", 2), ("r2", 3))}
    up["r3"] = _decoding("r3", cfg, tiny_policy, 2)
    try:
        hung = {"r3": ("import_for_move",)}
        handles = {r: _Recorded(ro, events, hung.get(r, ())) for r, (ro, _) in up.items()}
        manager = _manager(cfg, handles)
        rows = manager._execute(
            [Move("r0", "r1"), Move("r2", "r3")],
            _loads({"r0": 3, "r1": 2, "r2": 3, "r3": 2}),
        )
        by_src = {r["source"]: r for r in rows}
        assert by_src["r0"]["ok"] and not by_src["r2"]["ok"]
        assert events.index(("release", "r0")) < events.index(("holds", "r3"))
        assert by_src["r0"]["t_released"] < by_src["r2"]["t_released"]
        assert by_src["r0"]["import_s"] < by_src["r2"]["import_s"]
        assert len(up["r2"][0].engine.request_ids()) == 3 and not up["r2"][0]._held
    finally:
        for _, stop in up.values():
            stop.set()


def test_a_round_returns_once_a_hung_destinations_move_is_taken_back(tiny_policy, small_config):
    """r3 answers neither its import nor the question whether it went through. The round
    returns only once r2 has taken its requests back (acknowledged): a round that left
    that to a thread of its own let loss detection recover a source whose requests the
    pool still named it the owner of while its destination might decode them too. r0 is
    released at r1's answer all the same."""
    cfg = with_overrides(small_config, ROUND)
    events: list = []
    up = {r: _decoding(r, cfg, tiny_policy, n) for r, n in (("r0", 3), ("r1", 2), ("r2", 3))}
    up["r3"] = _decoding("r3", cfg, tiny_policy, 2)
    try:
        hung = {"r3": ("import_for_move", "holds")}
        handles = {r: _Recorded(ro, events, hung.get(r, ())) for r, (ro, _) in up.items()}
        manager = _manager(cfg, handles)
        moves = [Move("r0", "r1"), Move("r2", "r3")]
        rows = manager._execute(moves, _loads({"r0": 3, "r1": 2, "r2": 3, "r3": 2}))
        events.append(("returned", None))
        by_src = {r["source"]: r for r in rows}
        assert by_src["r0"]["ok"] and not by_src["r2"]["ok"]
        assert events.index(("release", "r0")) < events.index(("holds", "r3"))
        assert events.index(("abort_export", "r2")) < events.index(("returned", None))
        assert len(up["r2"][0].engine.request_ids()) == 3 and not up["r2"][0]._held
    finally:
        for _, stop in up.values():
            stop.set()


class _SlowQuestion(_Handle):
    """A destination whose import goes through but whose answer is lost, and whose
    answer to the manager's question comes late: after three quarters of the two
    timeouts the manager waits for it."""

    def __init__(self, obj, after_s: float) -> None:
        super().__init__(obj)
        self.after_s = after_s

    def __getattr__(self, name):
        import threading
        from concurrent.futures import Future

        call = super().__getattr__(name)
        if name == "import_for_move":

            def lost(*args, **kwargs):
                call(*args, **kwargs)
                return Future()  # (never done)

            return lost
        if name == "holds":

            def slow(*args, **kwargs):
                f = Future()
                threading.Timer(
                    self.after_s, lambda: f.set_result(call(*args, **kwargs).result())
                ).start()
                return f

            return slow
        return call


def test_a_slow_but_answered_round_never_leaves_a_request_in_two_engines(tiny_policy, small_config):
    """Every wait of a move answered within its deadline: the import's answer lost
    (a timeout), the question's answer late but in time. The source's hold must outlast
    them all: with a hold of 2 timeouts it ran out first, the source took its requests
    back, and the release that came after found nothing to commit, the requests then in
    both engines. (Pins HOLD_LIMIT_TIMEOUTS against the manager's waits.)"""
    from laminar.repack import (
        EXPORT_WAIT_TIMEOUTS,
        HOLD_LIMIT_TIMEOUTS,
        IMPORT_WAIT_TIMEOUTS,
        QUESTION_WAIT_TIMEOUTS,
    )

    assert (
        HOLD_LIMIT_TIMEOUTS > EXPORT_WAIT_TIMEOUTS + IMPORT_WAIT_TIMEOUTS + QUESTION_WAIT_TIMEOUTS
    )
    timeout = 1.0
    cfg = with_overrides(
        small_config,
        ["rollout.parity_every=0", "repack.interval_s=1", f"cluster.actor_timeout_s={timeout}"],
    )
    src, stop_src = _decoding("r0", cfg, tiny_policy, 3)
    dst, stop_dst = _decoding("r1", cfg, tiny_policy, 2)
    try:
        before = {*src.engine.request_ids(), *dst.engine.request_ids()}
        late = 0.75 * QUESTION_WAIT_TIMEOUTS * timeout
        manager = _manager(cfg, {"r0": _Handle(src), "r1": _SlowQuestion(dst, late)})
        (row,) = manager._execute([Move("r0", "r1")], _loads({"r0": 3, "r1": 2}))
        held = set(src.engine.request_ids()), set(dst.engine.request_ids())
        assert row["ok"]
        assert not held[0] & held[1] and held[0] | held[1] == before
        assert src.counts["holds_timed_out"] == 0 and not src._held
    finally:
        stop_src.set(), stop_dst.set()
