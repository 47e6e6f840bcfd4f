"""The rollout manager's decisions, driven with small stand-ins for rollouts, the
partial-response pool and the master relay: no cluster, no engine."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.manager import RolloutManager
from laminar.repack import Move, RolloutLoad


def done(value=None) -> Future:
    f = Future()
    f.set_result(value)
    return f


def failed(error: Exception) -> Future:
    f = Future()
    f.set_exception(error)
    return f


def never() -> Future:
    return Future()  # (an answer that never comes)


def state(request_id: str, version: int = 0, n_tokens: int = 3):
    """What the partial-response pool's ``take`` hands back, as far as the manager reads it."""
    meta = {"behavior_version": version, "resume_version": version, "t_flush": time.time()}
    return SimpleNamespace(
        request_id=request_id, request=SimpleNamespace(meta=meta), tokens=[0] * n_tokens
    )


class FakeRollout:
    """A rollout as the manager sees it: each call returns a future. ``answers`` maps a
    method name to a function returning that call's future (default: done, ``None``)."""

    def __init__(self, load: dict | None = None, **answers):
        self._load = load or {}
        self.answers = answers
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name in self.answers:
                return self.answers[name](*args, **kwargs)
            if name == "load":
                return done(dict(self._load))
            return done(None)

        return call

    def called(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class FakePool:
    """The partial-response pool: ``take`` hands back ``states``; reassigns are kept."""

    def __init__(self, states=(), reassign=None):
        self.states = list(states)
        self.owner: dict[str, str] = {}
        self._reassign = reassign

    def take(self, rollout_id, again=False):
        out, self.states = self.states, []
        return done(out)

    def reassign(self, request_ids, rollout_id, moved_from=None):
        if self._reassign is not None:
            return self._reassign(request_ids, rollout_id)
        self.owner.update(dict.fromkeys(request_ids, rollout_id))
        self.moved_from = moved_from
        return done(None)


def decoding(version: int = 0, kv: float = 0.2, n: int = 2, batch: int = 1) -> dict:
    return {
        "version": version,
        "kv_used": kv,
        "n_requests": n,
        "in_batch": True,
        "held": False,
        "batch": batch,
    }


def idle(version: int = 0) -> dict:
    return {**decoding(version, 0.0, 0), "in_batch": False}


@pytest.fixture
def cfg() -> RunConfig:
    return with_overrides(RunConfig(), ["cluster.actor_timeout_s=0.5", "repack.interval_s=1"])


# -- recovery ------------------------------------------------------------------------------


def test_a_recovery_whose_adoption_call_fails_does_not_stop_the_manager(cfg):
    """No rollout decodes the lost one's version, so the least loaded adopts its batch.
    That call may fail (its worker lost meanwhile, not yet detected) or go unanswered (a
    busy actor thread: it may still run). Either way the batch is that rollout's: the
    pool names it the owner, so that its own loss, if it is lost, recovers the batch from
    it. Before, the failure escaped the manager's loop and failed the whole run."""
    pool = FakePool([state("g0-000"), state("g0-001")])
    r1 = FakeRollout(idle(), adopt=lambda *a: failed(TimeoutError("no answer")))
    r2 = FakeRollout(decoding(version=1, n=5))
    manager = RolloutManager(cfg, {"r0": FakeRollout(), "r1": r1, "r2": r2}, None, partial=pool)
    manager.lost["r0"] = time.time()
    (row,) = manager.recover("r0")
    assert (row["how"], row["destination"], row["requests"]) == ("adopt", "r1", 2)
    assert len(r1.called("adopt")) == 1 and not r2.called("adopt")
    assert pool.owner == {"g0-000": "r1", "g0-001": "r1"}


def test_a_take_the_pool_did_not_answer_is_asked_again_and_gets_its_entries(cfg):
    """The pool's take may have run though no answer came (a slow data worker): its
    entries are then ownerless. Asked again (``again=True``), the pool hands them out
    again; before, the recovery failed the run, the trajectories left with no owner."""
    asked = []

    class SlowPool(FakePool):
        def take(self, rollout_id, again=False):
            asked.append(again)
            return never() if len(asked) == 1 else done([state("g0-000")])

    pool = SlowPool()
    r1 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {"r0": FakeRollout(), "r1": r1}, None, partial=pool)
    manager.lost["r0"] = time.time()
    (row,) = manager.recover("r0")
    assert asked == [False, True] and (row["how"], row["requests"]) == ("import", 1)


def test_a_recovery_whose_reassign_goes_unanswered_does_not_stop_the_manager(cfg):
    """The batch went in; the pool is slow to record its new owner (the destination's
    next flush names it): logged, not a failed run."""
    pool = FakePool([state("g0-000")], reassign=lambda ids, d: failed(TimeoutError("slow")))
    r1 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {"r0": FakeRollout(), "r1": r1}, None, partial=pool)
    manager.lost["r0"] = time.time()
    (row,) = manager.recover("r0")
    assert (row["how"], row["destination"]) == ("import", "r1")


def test_a_rollout_declared_hung_takes_no_recovered_batch_and_no_move(cfg):
    """A hung rollout's actor thread may still answer ``load()`` (its generation loop is
    what stopped): until its fence drops it, it must not be handed a lost rollout's batch
    (which would wait out the fence and then be recovered a second time) nor planned
    into a repack move. Here the hung r1 is the least KV-loaded rollout of the version."""
    pool = FakePool([state("g0-000")])
    r1 = FakeRollout(decoding(kv=0.05), import_for_move=lambda *a, **k: done(True))
    r2 = FakeRollout(decoding(kv=0.30), import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {"r0": FakeRollout(), "r1": r1, "r2": r2}, None, partial=pool)
    manager.hung["r1"] = {"kind": "rollout", "time": time.time()}
    manager.lost["r0"] = time.time()
    (row,) = manager.recover("r0")
    assert row["destination"] == "r2" and not r1.called("import_for_move")
    assert "r1" not in manager._loads()  # (the planner's input)


# -- repack moves --------------------------------------------------------------------------


def exported(states, version: int = 0) -> dict:
    return {
        "version": version,
        "states": states,
        "tokens": sum(len(st.tokens) for st in states),
        "context_tokens": 10 * len(states),
        "export_s": 0.0,
    }


def test_a_moves_pause_ends_at_its_sources_release_not_at_the_pools_answer(cfg):
    """The ``repacks`` table's ``pause_s`` ends at its source's release (docs/repack.md):
    the pool is told of the new owners after the releases, and a slow pool holds no
    source, so it adds nothing to the pause."""
    states = [state("g0-000"), state("g0-001")]
    src = FakeRollout(export_for_move=lambda **k: done(exported(states)))
    dst = FakeRollout(import_for_move=lambda *a, **k: done(True))
    pool = FakePool(reassign=lambda ids, d: never())
    manager = RolloutManager(cfg, {"r0": src, "r1": dst}, None, partial=pool)
    manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2)}
    loads = {"r0": RolloutLoad("r0", 0, 0.1, 0.2, 2), "r1": RolloutLoad("r1", 0, 0.2, 0.3, 2)}
    t0 = time.time()
    (row,) = manager._execute([Move("r0", "r1")], loads)
    assert time.time() - t0 >= cfg.cluster.actor_timeout_s  # (it waited for the pool)
    assert row["ok"] and len(src.called("release")) == 1
    assert row["pause_s"] < cfg.cluster.actor_timeout_s / 2


def test_a_committed_move_tells_the_pool_its_source(cfg):
    """The pool adds the move to the requests' history (PartialCore.reassign): a later
    recovery of them must count it and keep the source on their path."""
    states = [state("g0-000"), state("g0-001")]
    src = FakeRollout(export_for_move=lambda **k: done(exported(states)))
    dst = FakeRollout(import_for_move=lambda *a, **k: done(True))
    pool = FakePool()
    manager = RolloutManager(cfg, {"r0": src, "r1": dst}, None, partial=pool)
    manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2)}
    loads = {"r0": RolloutLoad("r0", 0, 0.1, 0.2, 2), "r1": RolloutLoad("r1", 0, 0.2, 0.3, 2)}
    (row,) = manager._execute([Move("r0", "r1")], loads)
    assert row["ok"] and pool.owner == {"g0-000": "r1", "g0-001": "r1"}
    assert pool.moved_from == "r0"


def test_a_round_names_each_move_and_the_batch_it_planned_with(cfg, monkeypatch):
    """Each export, release and abort names its move (a late call of another move is
    ignored), each import a token of its own, which the question to a destination that
    did not answer names; an export names the ``taken_in`` of the load planned with."""
    import laminar.manager_repack as repack_mod

    states = [state("g0-000"), state("g0-001")]
    src = FakeRollout(
        {**decoding(kv=0.1), "taken_in": 7}, export_for_move=lambda **k: done(exported(states))
    )
    dst = FakeRollout({**decoding(kv=0.3), "taken_in": 2}, import_for_move=lambda *a, **k: never())
    monkeypatch.setattr(repack_mod, "plan", lambda *a, **k: [Move("r0", "r1")])
    manager = RolloutManager(cfg, {"r0": src, "r1": dst}, None)
    (row,) = manager.check()
    assert not row["ok"]  # (the import never answered; the question neither)
    (export,) = src.called("export_for_move")
    assert export[2]["taken_in"] == 7
    (imp,) = dst.called("import_for_move")
    (question,) = dst.called("holds")
    assert question[1] == (imp[2]["move"],)
    assert imp[2]["move"] != export[2]["move"]
    (abort,) = src.called("abort_export")
    assert abort[2] == {"move": export[2]["move"]} and not src.called("release")


def test_a_source_lost_while_its_round_is_open_is_not_recovered_from_its_moved_requests(cfg):
    """r0's worker is lost while the manager asks r1 whether the import it did not answer
    went through (r1 answers yes, late). The round returns only once that is decided and
    the pool names r1 the moved requests' owner: the loss detected after it recovers none
    of them. (A round settling in the background returned before; the loss detected
    meanwhile recovered them from r0, still their owner in the pool, into r2, while r1
    decoded them too: two owners flushing one request.)"""
    import threading

    states = [state("g0-000"), state("g0-001")]
    alive = {"tcp://a", "tcp://b", "tcp://c"}

    class OwnedPool(FakePool):  # (take hands out only its rollout's entries, as the pool)
        def take(self, rollout_id, again=False):
            mine = [st for st in self.states if self.owner.get(st.request_id) == rollout_id]
            self.states = [st for st in self.states if st not in mine]
            return done(mine)

    def late_yes(move):
        alive.discard("tcp://a")  # (r0's worker lost while the question is open)
        answer = Future()
        threading.Timer(0.6, answer.set_result, (True,)).start()  # (within its 2 timeouts)
        return answer

    pool = OwnedPool(states=states)
    pool.owner = dict.fromkeys(["g0-000", "g0-001"], "r0")
    src = FakeRollout(decoding(kv=0.1), export_for_move=lambda **k: done(exported(states)))
    dst = FakeRollout(decoding(kv=0.3), import_for_move=lambda *a, **k: never(), holds=late_yes)
    other = FakeRollout(decoding(kv=0.3), import_for_move=lambda *a, **k: done(True))
    workers = {"r0": "tcp://a", "r1": "tcp://b", "r2": "tcp://c"}
    rollouts = {"r0": src, "r1": dst, "r2": other}
    manager = RolloutManager(cfg, rollouts, None, partial=pool, workers=workers)
    manager._scheduler_workers = lambda: set(alive)
    manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2), "r2": (1, 0.2)}
    loads = {"r0": RolloutLoad("r0", 0, 0.1, 0.2, 2), "r1": RolloutLoad("r1", 0, 0.2, 0.3, 2)}
    rows = manager._execute([Move("r0", "r1")], loads)
    assert manager.detect() == ["r0"]  # (the manager's thread, as its loop does)
    assert not other.called("import_for_move") and not other.called("adopt")
    assert len(dst.called("import_for_move")) == 1  # (the move's alone)
    assert pool.owner == {"g0-000": "r1", "g0-001": "r1"}
    (row,) = rows
    assert row["ok"]


def test_a_moves_pause_runs_from_its_exports_hand_over_not_from_the_rounds_start(cfg):
    """A paced source withholds its export until its step's deadline and decodes the
    requests until then (d119e55): their pause starts at the hand-over the export
    reports (``handed_at``), where ``pause_s`` counted from the round's start, that wait
    included. The round's span is ``round_s``; a hand-over time off the manager's clock
    (another host's) is kept within the round's start and the export's answer."""
    import threading

    def move(handed_at):
        """A round of one move whose export answers 0.2 s late, handed over then."""
        states = [state("g0-000"), state("g0-001")]
        handed: list[float] = []

        def export(**kwargs):
            future = Future()

            def hand_over():
                handed.append(time.time())
                at = handed_at(handed[0])
                future.set_result(exported(states) | ({} if at is None else {"handed_at": at}))

            threading.Timer(0.2, hand_over).start()
            return future

        src = FakeRollout(export_for_move=export)
        dst = FakeRollout(import_for_move=lambda *a, **k: done(True))
        manager = RolloutManager(cfg, {"r0": src, "r1": dst}, None)
        manager._prev = {"r0": (1, 0.1), "r1": (1, 0.2)}
        loads = {"r0": RolloutLoad("r0", 0, 0.1, 0.2, 2), "r1": RolloutLoad("r1", 0, 0.2, 0.3, 2)}
        (row,) = manager._execute([Move("r0", "r1")], loads)
        assert row["ok"] and row["time"] <= row["t_handed"] <= row["t_released"]
        assert row["round_s"] == pytest.approx(row["t_released"] - row["time"])
        assert row["pause_s"] == pytest.approx(row["t_released"] - row["t_handed"])
        return row, handed[0]

    row, handed = move(lambda t: t)
    assert row["t_handed"] == handed
    assert row["round_s"] - row["pause_s"] >= 0.19  # the withheld wait: not a pause
    row, _ = move(lambda t: t - 1000.0)  # a clock far behind: from the round's start
    assert row["t_handed"] == row["time"] and row["pause_s"] == pytest.approx(row["round_s"])
    row, handed = move(lambda t: None)  # (a rollout that does not say): its answer's time
    assert row["t_handed"] >= handed and row["round_s"] - row["pause_s"] >= 0.19


def test_an_export_not_answered_is_counted_apart_from_one_with_nothing_to_move(cfg):
    """``skipped`` counted both an export answered ``None`` (the planned batch drained or
    changed: nothing to move) and one the manager got no answer to (aborted, as it may
    yet run): the latter is ``exports_unanswered``, and carries over a take-over."""
    src_a = FakeRollout(export_for_move=lambda **k: never())
    src_b = FakeRollout(export_for_move=lambda **k: done(None))
    dst = FakeRollout(import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {"a": src_a, "b": src_b, "d": dst}, None)
    manager._prev = {"a": (1, 0.1), "b": (1, 0.1), "d": (1, 0.2)}
    loads = {r: RolloutLoad(r, 0, 0.1, 0.2, 2) for r in ("a", "b")}
    assert manager._execute([Move("a", "d"), Move("b", "d")], loads) == []
    assert len(src_a.called("abort_export")) == 1 and not src_b.called("abort_export")
    stats = manager.stats()
    assert stats["skipped"] == 1 and stats["exports_unanswered"] == 1
    after = RolloutManager(cfg, {}, None)
    after.take_over(stats, {}, {})
    assert after.stats()["exports_unanswered"] == 1 and after.stats()["skipped"] == 1


# -- the manager's loop --------------------------------------------------------------------


def test_the_publication_check_does_not_wait_on_a_lost_master(cfg):
    """With the trainer (and the master relay in its process) lost, a call to the master
    never answers (distributed waits for the actor's creating task): asked every loop
    iteration, it held the loop a whole actor timeout each time, so loss detection,
    heartbeats and repack ran once a timeout until a restarted trainer's master came."""
    cfg = with_overrides(cfg, ["cluster.actor_timeout_s=3", "repack.on_publish=true"])
    master = FakeRollout(newest=lambda *a: never())
    manager = RolloutManager(cfg, {}, master)
    manager._master_lost = time.time()  # (detect() found its worker gone)
    t0 = time.time()
    assert manager._published() is False
    assert time.time() - t0 < 1.0


def test_a_replacement_that_does_not_answer_while_joining_does_not_stop_the_manager(cfg):
    """A replacement rollout whose relay was lost while it started is pointed at the head
    of the chain. Its worker may be lost already (detect() then finds it), or slow: the
    call's failure is logged, not raised out of the manager's loop (which failed the run)."""
    manager = RolloutManager(cfg, {}, FakeRollout(), relays={"master": FakeRollout()})
    manager.relays_lost["relay1"] = {"time": time.time()}
    joining = FakeRollout(set_relay=lambda *a: failed(TimeoutError("no answer")))
    manager.add_rollout("r3", joining, "tcp://w3", replaces="r1", relay_id="relay1")
    manager._take_joining()
    assert manager.replacements == {"r1": "r3"} and manager.rollout_relays["r3"] == "master"
    assert manager.workers["r3"] == "tcp://w3"


def test_a_new_master_is_taken_when_the_pool_does_not_answer(cfg):
    """A restarted trainer's master heads the chain even if the partial-response pool is
    slow to hear of it (recorded in the restart's errors, not raised)."""
    pool = FakePool()
    pool.set_relays = lambda relays: failed(TimeoutError("slow"))
    manager = RolloutManager(cfg, {}, FakeRollout(), partial=pool)
    manager._master_lost = time.time()
    new = FakeRollout(rechain=lambda *a: done(0))
    manager.replace_master(new, "tcp://w9")
    manager._take_joining()
    assert manager.master is new and manager._master_lost is None
    (restart,) = manager.masters
    assert any("set_relays" in e for e in restart["errors"])


def test_a_detection_round_the_scheduler_does_not_answer_is_skipped(cfg):
    """detect() asks the scheduler which workers it has. A failed ask (a scheduler busy or
    reconnecting) says nothing about the rollouts: the round is skipped, no rollout is
    marked lost, and the manager's loop goes on (an exception ended it: a failed run)."""

    def no_answer():
        raise OSError("timed out asking the scheduler")

    r0 = FakeRollout(decoding())
    manager = RolloutManager(cfg, {"r0": r0}, None, partial=FakePool(), workers={"r0": "tcp://w0"})
    manager._scheduler_workers = no_answer
    assert manager.detect() == [] and manager.lost == {}


def test_a_global_pause_leaves_a_silent_rollout_to_loss_detection_within_the_trainers_wait():
    """Partial rollout pauses every rollout before each publication; the trainer waits for
    the manager's pause_all as long as cluster.actor_timeout_s, counted before the call
    reached it. The manager waited as long on each rollout: one slow to answer (a long
    weight load) timed the trainer out first and failed the run. It now gives each half
    the timeout, and does not ask a rollout already declared hung."""
    import asyncio

    async def silent(version):
        await asyncio.sleep(3600)

    async def paused(version):
        return 2

    # (8 s, not 1: half of it is 4 s by design, the whole 8 s at the least for a manager
    # that waits the whole timeout on the slow rollout. The bound, 6.5 s, leaves a
    # loaded host's event loop 2.5 s; with 1 s the design's 0.5 s had 0.3 s to spare,
    # with 4 s 1.5 s.)
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=8"])
    quick, slow, hung = FakeRollout(pause=paused), FakeRollout(pause=silent), FakeRollout()
    manager = RolloutManager(cfg, {"r0": quick, "r1": slow, "r2": hung}, None)
    manager.hung["r2"] = {"time": time.time()}
    t0 = time.monotonic()
    got = asyncio.run(manager.pause_all(4))
    assert time.monotonic() - t0 < 6.5  # (half the timeout, not the whole)
    assert got == {"paused": 1, "requests": 2}
    assert hung.called("pause") == [] and len(slow.called("pause")) == 1


# -- stats and rows ------------------------------------------------------------------------


def move_row(i: int) -> dict:
    return {
        "time": float(i),
        "source": "r0",
        "destination": "r1",
        "version": 0,
        "ok": i % 3 != 0,
        "requests": 2 + i % 4,
        "tokens": 100 + i,
        "context_tokens": 50 + 2 * i,
        "export_s": 0.0,
        "import_s": 0.0,
        "pause_s": 0.25 + 0.5 * (i % 2),
        "round_moves": 2,
    }


def test_stats_totals_hold_after_the_driver_fetched_and_the_manager_dropped_the_rows(
    cfg, monkeypatch
):
    """stats() (asked every driver poll) summed every move row, and the rows were kept
    for the whole run: a second a poll, 0.7 GB, after a million moves. The totals are now
    kept as moves happen and a row goes once the driver has fetched it (get_rows(start),
    start being what it holds): the totals still equal what all the rows said, the
    driver's copy is every row once, and a manager rebuilt with the data module
    (take_over) carries them on."""
    import laminar.manager_repack as repack_mod

    manager = RolloutManager(cfg, {}, None)
    rounds = iter([[move_row(i) for i in range(k, k + 4)] for k in range(0, 40, 4)])
    monkeypatch.setattr(repack_mod, "plan", lambda *a, **k: [Move("r0", "r1")])
    monkeypatch.setattr(manager, "_execute", lambda moves, loads, taken_in=None: next(rounds))
    fetched: list[dict] = []
    for n in range(10):
        manager.check()
        if n % 3 == 0:  # the driver's flush: from the count it stored
            fetched += manager.get_rows(len(fetched))
    fetched += manager.get_rows(len(fetched))
    every = [move_row(i) for i in range(40)]
    assert fetched == every
    manager.get_rows(len(fetched))  # (the next flush finds none)
    assert manager.rows == []  # every fetched row dropped: memory does not grow
    ok = [r for r in every if r["ok"]]
    stats = manager.stats()
    assert stats["requests_moved"] == sum(r["requests"] for r in ok)
    assert stats["tokens_moved"] == sum(r["tokens"] for r in ok)
    assert stats["reprefill_tokens"] == sum(r["context_tokens"] for r in ok)
    assert stats["pause_s"] == pytest.approx(sum(r["pause_s"] for r in every))
    # A fetch whose answer the driver did not get is asked again from the same count.
    rounds = iter([[move_row(40), move_row(41)]])
    manager.check()
    assert manager.get_rows(40) == manager.get_rows(40) == [move_row(40), move_row(41)]
    # Rebuilt with the data module: the new manager goes on from the last stats.
    after = RolloutManager(cfg, {}, None)
    after.take_over(manager.stats(), {}, {})
    assert after.stats()["requests_moved"] == manager.stats()["requests_moved"]
    assert after.stats()["pause_s"] == pytest.approx(manager.stats()["pause_s"])


def test_recoveries_are_counted_as_they_happen(cfg):
    """The recovery totals of stats() equal what the fault rows say."""
    pool = FakePool([state("g0-000"), state("g0-001"), state("g1-000", version=1)])
    r1 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    manager = RolloutManager(cfg, {"r0": FakeRollout(), "r1": r1}, None, partial=pool)
    manager.lost["r0"] = time.time()
    rows = manager.recover("r0")
    rows += manager.recover("r0")  # (nothing left: a row of none)
    stats = manager.stats()
    assert stats["recoveries"] == len(rows) == 3
    assert stats["recovered_requests"] == sum(r["requests"] for r in rows) == 3
    assert manager.get_fault_rows() == rows


# -- heartbeats ----------------------------------------------------------------------------


def test_heartbeats_are_asked_a_tenth_of_the_timeout_apart_and_hangs_found_on_time(
    cfg, monkeypatch
):
    """Every detection round (faults.detect_interval_s, 0.5 s) asked every rollout for its
    heartbeat, about a millisecond of the manager's thread each: 0.2 s a round at R = 256.
    Each is now asked every heartbeat_interval (a tenth of the timeout, 5 s at most) and
    a hang is still found within a round of the timeout (plus one interval when it
    stopped answering just after an answer), never before it: one that stops answering,
    one whose generation loop stops while its actor answers, one that stays well."""
    import laminar.manager_recovery as recovery

    clock = SimpleNamespace(now=0.0)
    clock.time = lambda: clock.now
    monkeypatch.setattr(recovery, "time", clock)
    cfg = with_overrides(cfg, ["faults.heartbeat_timeout_s=60"])
    interval = recovery.heartbeat_interval(cfg.faults)
    assert interval == 5.0

    def answers_until(t_stop):  # then never again (SIGSTOP)
        return lambda: done(0.01) if clock.now < t_stop else never()

    stuck_loop = lambda: done(max(0.0, clock.now - 40.0))  # noqa: E731 — loop stops at 40 s
    well = FakeRollout(heartbeat=lambda: done(0.01))
    silent = FakeRollout(heartbeat=answers_until(30.2))
    stuck = FakeRollout(heartbeat=stuck_loop)
    manager = RolloutManager(cfg, {"r0": well, "r1": silent, "r2": stuck}, None)
    manager._fence = lambda rid, worker: None
    round_s = cfg.faults.detect_interval_s
    while clock.now < 200.0:
        manager.check_heartbeats()
        clock.now += round_s
    assert set(manager.hung) == {"r1", "r2"}
    # r1's last answer came at 30 s; the question after it (35 s) never came back
    assert 30.2 + 60 <= manager.hung["r1"]["time"] <= 30.2 + 60 + interval + round_s
    # r2 answered throughout, its age telling the loop stopped at 40 s
    assert 40 + 60 <= manager.hung["r2"]["time"] <= 40 + 60 + 2 * round_s
    assert len(well.called("heartbeat")) <= 200 / interval + 1  # (was 400: every round)


def test_a_rebuilt_manager_fences_the_lost_rollouts_in_the_new_pool(cfg):
    """take_over runs in an actor call on the data worker, where the new partial-response
    pool lives too: there distributed hands back the pool's async method itself (an
    actor calling an actor on its own worker, in its actor thread), so `fence` returned
    a coroutine nobody awaited ("'coroutine' object has no attribute 'result'") and a
    rollout given up while it lived was never fenced in the rebuilt pool. The stand-in
    answers as distributed does, by the calling thread."""
    from distributed.worker import thread_state

    fenced: list[str] = []

    class Pool:
        def fence(self, rollout_id):
            if getattr(thread_state, "actor", False):  # (the actor's own thread)

                async def later():
                    fenced.append(rollout_id)

                return later()
            fenced.append(rollout_id)
            return done(None)

    before = RolloutManager(cfg, {}, None)
    before.lost.update({"r1": 1.0, "r2": 2.0})
    manager = RolloutManager(cfg, {}, None, partial=Pool())
    thread_state.actor = True  # (as in the actor call distributed makes)
    try:
        manager.take_over(before.stats(), {}, {})
    finally:
        del thread_state.actor
    assert sorted(fenced) == ["r1", "r2"]


def test_an_answer_already_in_is_read_with_the_actor_timeout(cfg):
    """A round read a call whose answer was in (``_ready``) with what was left of its
    window, 0.1 s at the least: on a loaded host the client's loop took longer to hand
    it over, and an export, import or release that had answered was taken for failed
    (three releases sent again in a 9-minute `laminar bench repack`)."""

    class HandedOverSlowly:  # (done, but its result takes the client's loop a while)
        def done(self) -> bool:
            return True

        def result(self, timeout=None):
            if timeout is None or timeout < 0.4:
                raise TimeoutError(f"timed out after {timeout} s.")
            return "released"

    manager = RolloutManager(cfg, {}, None)
    assert manager._answer("repack: r0 release", HandedOverSlowly()) == (True, "released")
