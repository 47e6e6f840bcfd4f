"""A hung rollout or relay whose fence fails — its worker's restart fails (a process in
uninterruptible sleep, a nanny that does not answer), so the scheduler keeps the worker
and it is never found lost — with ``faults.recover`` on (docs/faults.md): past
``FENCE_WAIT_S`` it is given up as lost, its work resumed elsewhere from the
partial-response pool, no rollout placed on its worker, and what it may send should it
wake is dropped by the buffer as seen. A failed fence cannot be made on a real cluster
in a test's time (the scheduler drops a silent worker only after its worker-ttl,
minutes): stand-ins for the rollouts, the pool and the scheduler, as in test_manager.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from factories import trajectory
from test_manager import FakePool, FakeRollout, decoding, done, state

from laminar.buffer_core import BufferCore
from laminar.config import RunConfig, with_overrides
from laminar.manager import RolloutManager
from laminar.manager_recovery import FENCE_WAIT_S


class Pool(FakePool):
    """Records whose entries were taken; keeps versions for the relays."""

    def __init__(self, states=()):
        super().__init__(states)
        self.taken: list[str] = []
        self.relays = None

    def take(self, rollout_id, again=False):
        self.taken.append(rollout_id)
        return super().take(rollout_id, again)

    def set_relays(self, relays):
        self.relays = relays
        return done(None)

    def late(self):
        return done([])


def hang(manager, rid: str, age: float, kind: str = "rollout", worker: str = "tcp://w1"):
    """``rid`` declared hung ``age`` s ago, its fence's restart failed."""
    manager.hung[rid] = {
        "kind": kind,
        "time": time.time() - age,
        "silent_s": 4.0,
        "worker": worker,
        "restart": "TimeoutError()",
    }


def test_a_hung_rollout_whose_fence_fails_is_recovered_and_its_worker_left_alone():
    """Recovery on: while its fence may yet work the hung r1 stays hung, its work
    untouched; past FENCE_WAIT_S it is lost (``unfenced``), its pool entries are resumed
    on r0 (same version: imported), it is told to stop without waiting, and it is never
    recovered twice. Before, it stayed hung for the rest of the run: its work never
    resumed, its groups holding the back-pressure budget. Its worker stays out of use
    (the driver's stuck_workers) until the scheduler drops it (``gone_s``)."""
    from pipelines.driver_faults import stuck_workers

    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=0.5"])
    assert cfg.faults.recover
    workers = {"r0": "tcp://w0", "r1": "tcp://w1"}
    pool = Pool([state("g0-000"), state("g0-001")])
    r0 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    r1 = FakeRollout()
    manager = RolloutManager(cfg, {"r0": r0, "r1": r1}, None, pool, workers)
    scheduler = set(workers.values())
    manager._scheduler_workers = lambda: set(scheduler)
    hang(manager, "r1", FENCE_WAIT_S - 5)
    assert manager.detect() == [] and pool.taken == [] and not manager.lost
    assert stuck_workers(manager.stats()) == set()

    hang(manager, "r1", FENCE_WAIT_S + 1)
    assert manager.detect() == ["r1"]
    assert list(manager.lost) == ["r1"] and manager.hung["r1"]["unfenced"]
    assert pool.taken == ["r1"] and pool.owner == {"g0-000": "r0", "g0-001": "r0"}
    (row,) = manager.fault_rows
    assert (row["rollout"], row["destination"], row["how"], row["requests"]) == (
        "r1",
        "r0",
        "import",
        2,
    )
    assert r1.called("stop") == [("stop", (), {"timeout": 0.0})]
    assert manager.error is None and manager.stats()["recoveries"] == 1
    stats = manager.stats()
    assert stuck_workers(stats) == {"tcp://w1"} and "gone_s" not in stats["hung"]["r1"]

    assert manager.detect() == [] and pool.taken == ["r1"]  # (given up once)
    scheduler.discard("tcp://w1")  # stopped by hand at last
    assert manager.detect() == [] and pool.taken == ["r1"]
    assert manager.hung["r1"]["gone_s"] > FENCE_WAIT_S
    assert stuck_workers(manager.stats()) == set()


def test_a_hung_relay_whose_fence_fails_is_cut_out_of_the_chain():
    """A relay's failed fence is handled as its loss: cut out of the chain past
    FENCE_WAIT_S, its rollout pulling from the relay above, the pool keeping versions on
    the live relays; before, the chain kept it for good (with recovery on or off)."""
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=0.5"])
    master, relay = FakeRollout(rechain=lambda *a: done(0)), FakeRollout()
    r0 = FakeRollout()
    pool = Pool()
    manager = RolloutManager(
        cfg,
        {"r0": r0},
        master,
        pool,
        {"r0": "tcp://w0"},
        relays={"master": master, "relay1": relay},
        relay_workers={"master": "tcp://t", "relay1": "tcp://w1"},
        rollout_relays={"r0": "relay1"},
    )
    manager._scheduler_workers = lambda: {"tcp://t", "tcp://w0", "tcp://w1"}
    hang(manager, "relay1", FENCE_WAIT_S - 5, kind="relay")
    assert manager.detect() == [] and manager._chain() == ["master", "relay1"]
    hang(manager, "relay1", FENCE_WAIT_S + 1, kind="relay")
    assert manager.detect() == []  # (a relay: no rollout lost)
    assert manager._chain() == ["master"] and manager.hung["relay1"]["unfenced"]
    assert manager.rollout_relays["r0"] == "master" and r0.called("set_relay")
    assert pool.relays == [master] and "relay1" in manager.stats()["relays_lost"]
    assert not manager.lost and manager.error is None


def traj(uid: str, idx: int, rollout: str):
    return trajectory(uid, "g0", response=(5, 6, 7), sample_idx=idx, rollout_ids=rollout)


def test_what_a_given_up_rollout_sends_should_it_wake_is_dropped_as_seen():
    """The given-up rollout's process may wake and send the trajectories resumed
    elsewhere: same uids (same tokens: sampling is a function of the seed and the token
    index). Whichever copy comes first is admitted; the other is a duplicate, counted as
    such and nowhere else — the group completes once, nothing is counted twice."""
    core = BufferCore()
    resumed = [traj("g0-000", 0, "r0"), traj("g0-001", 1, "r0")]
    assert core.insert(resumed[:1], version=1, now=1.0) == []
    woke = [traj("g0-000", 0, "r1"), traj("g0-001", 1, "r1")]
    assert core.insert(woke, version=1, now=2.0) == []  # (its g0-001 came first)
    assert core.insert(resumed[1:], version=1, now=3.0) == []
    assert list(core.ready) == ["g0"] and core.depth == 2
    assert [t.rollout_ids for t in core.ready["g0"]] == ["r0", "r1"]
    c = core.counts
    assert (c["inserted"], c["duplicates"]) == (2, 2)
    out = core.sample(1, version=1, now=4.0)
    assert [t.uid for t in out] == ["g0-000", "g0-001"] and core.depth == 0
    assert core.insert(woke, version=2, now=5.0) == [] and core.counts["duplicates"] == 4
    assert core.depth == 0 and not core.partial and core.counts["consumed"] == 2


def test_replacements_are_not_placed_on_a_given_up_rollouts_worker(monkeypatch):
    """The scheduler still lists the stuck worker, which hosts no live rollout: before,
    it was the first free ``rollout`` worker and r1's replacement went onto the stuck
    process's worker. Now a replacement waits for another (none here), then goes there."""
    import pipelines.driver_faults as df

    cfg = with_overrides(RunConfig(), [])
    listed = ["tcp://w0", "tcp://w1"]
    started = []
    monkeypatch.setattr(df, "workers_with", lambda client, resource: list(listed))
    monkeypatch.setattr(df, "start_actor", lambda *a, worker, **k: started.append(worker) or 0)
    sched = SimpleNamespace(
        cfg=cfg,
        client=None,
        actors={"rollouts": [0, 1], "pool": 0, "buffer": 0, "partial": 0},
        _data_restart=None,
        _joining=None,
        rollout_workers={"r0": "tcp://w0", "r1": "tcp://w1"},
        tier=SimpleNamespace(ids=["master"], local_relay=lambda *a, **k: 0, handle=str),
        _taken={},
        rollout_relays={},
        policy_dir="p",
        run_dir=__import__("pathlib").Path("run"),
        schedule=None,
        _fence_in_pool=lambda m_stats: None,  # (tested apart below)
    )
    m_stats = {
        "lost": {"r1": 1.0},
        "replacements": {},
        "relays_lost": {},
        "hung": {"r1": {"kind": "rollout", "worker": "tcp://w1", "unfenced": True}},
    }
    df.FaultHandling._replace_lost(sched, m_stats)
    assert started == [] and sched._joining is None
    listed.append("tcp://w2")
    df.FaultHandling._replace_lost(sched, m_stats)
    assert started == ["tcp://w2"] and sched._joining[:3] == ("r2", "tcp://w2", "r1")


# -- the data module's fence (PartialCore.fence, PromptPool.fence) -----------------------


def _states(ids: list[str], version: int = 0) -> list:
    from laminar.engine import GenerationRequest, RequestState, SamplingParams

    return [
        RequestState(GenerationRequest(rid, (1, 2), SamplingParams(16)), seed=i, t_start=i)
        for i, rid in enumerate(ids)
    ]


def test_a_woken_given_up_rollout_cannot_take_its_entries_back():
    """The defect: r1, given up (its fence failed), has its entry taken and resumed on
    r2, which flushes on from the 4 tokens logged. r1's process wakes and flushes what it
    had (offset 2): before, that named r1 the owner again and cut the entry back to 3
    tokens, so r2's next flush (offset 6) was refused as a gap, and r2's loss later
    recovered nothing of it. Now r1's flush is ignored (counted), r2 stays the owner and
    its flushes go on; r2's loss recovers all of it."""
    from laminar.partial import PartialCore

    core = PartialCore()
    core.register("r1", 0, _states(["g0-000"]))
    core.flush("r1", {"g0-000": (0, [5, 6, 7, 8], [-1.0] * 4, [0] * 4)})
    (taken,) = core.take("r1")  # (the recovery: fences r1)
    assert core.fenced.keys() == {"r1"} and taken.tokens == [5, 6, 7, 8]
    core.reassign(["g0-000"], "r2")
    core.flush("r2", {"g0-000": (4, [9, 10], [-1.0] * 2, [0] * 2)})
    core.flush("r1", {"g0-000": (2, [7], [-1.0], [0])}, {"g0-000": ("eos", 1.0)})  # woke
    e = core.entries["g0-000"]
    assert e["owner"] == "r2" and list(e["state"].tokens) == [5, 6, 7, 8, 9, 10]
    assert "finished" not in e
    core.flush("r2", {"g0-000": (6, [11], [-1.0], [0])})
    c = core.stats()
    assert (c["fenced_flushes"], c["fenced_tokens"], c.get("gaps", 0)) == (1, 1, 0)
    assert c["fenced_rollouts"] == ["r1"] and c["fenced"] == 1
    (again,) = core.take("r2")  # r2 lost too: all of it resumes
    assert again.tokens == [5, 6, 7, 8, 9, 10, 11]
    assert again.request.meta["rollout_path"] == ["r1", "r2"]
    assert sorted(core.fenced) == ["r1", "r2"]


def test_what_a_given_up_rollout_registers_later_is_kept_for_the_manager_to_take():
    """A woken r1 took a group from the prompt pool before it saw its stop and registers
    it: those requests are new to the pool, kept (owned by r1) and named by late(), so
    the manager resumes them (its prompt group would otherwise hold the budget for
    good); a register of requests the pool has (resumed elsewhere) changes nothing."""
    from laminar.partial import PartialCore

    core = PartialCore()
    core.register("r1", 0, _states(["g0-000"]))
    core.take("r1")
    core.reassign(["g0-000"], "r0")
    assert core.late() == []
    core.register("r1", 0, _states(["g0-000", "g1-000", "g1-001"]))
    assert core.entries["g0-000"]["owner"] == "r0"
    assert {rid: e["owner"] for rid, e in core.entries.items()} == {
        "g0-000": "r0",
        "g1-000": "r1",
        "g1-001": "r1",
    }
    assert core.late() == ["r1"] and core.stats()["fenced_registers"] == 3
    core.flush("r1", {"g1-000": (0, [5], [-1.0], [0])})  # (ignored: resumed from 0)
    assert [st.request_id for st in core.take("r1")] == ["g1-000", "g1-001"]
    assert core.late() == [] and core.owned() == {"r0": (1, 0, 0), None: (2, 0, 0)}
    # A reassign to a rollout given up meanwhile: its entries, taken again.
    core.reassign(["g1-000", "g1-001"], "r1")
    assert core.late() == ["r1"] and core.stats()["fenced_reassigns"] == 1
    assert len(core.take("r1")) == 2
    # The pool's own restore (a rebuild's orphans) is not a rollout's register.
    core.restore({"g2-000": {"owner": "r1", "version": 0, "state": _states(["g2-000"])[0]}})
    assert core.entries["g2-000"]["owner"] == "r1" and core.late() == []


def test_a_fence_is_journaled_and_kept_by_a_pool_replayed_or_compacted(tmp_path):
    """The fence is an ``events`` row (no request, the rollout as owner): replayed, the
    pool ignores the rollout's flushes still; a compaction's snapshot keeps it; the
    entries replay as before (the row names no request)."""
    from laminar.partial import PartialCore, replay_log, write_records
    from storage.partial_log import PartialLogWriter, fenced_rollouts, log_entries

    core = PartialCore(journal=True)
    core.register("r1", 0, _states(["g0-000"]))
    core.flush("r1", {"g0-000": (0, [5, 6], [-1.0] * 2, [0] * 2)})
    core.fence("r1")
    core.fence("r1")  # (once)
    writer = PartialLogWriter(tmp_path)
    write_records(writer, core.drain_records())
    assert list(fenced_rollouts(tmp_path)) == ["r1"]
    assert log_entries(tmp_path)["g0-000"]["owner"] == "r1"
    back = replay_log(tmp_path)
    assert list(back.fenced) == ["r1"] and back.fenced["r1"] == core.fenced["r1"]
    back.flush("r1", {"g0-000": (2, [7], [-1.0], [0])})
    assert list(back.entries["g0-000"]["state"].tokens) == [5, 6]
    write_records(writer, core.snapshot_records(), compact=True)
    assert list(fenced_rollouts(tmp_path)) == ["r1"]
    assert list(replay_log(tmp_path).entries) == ["g0-000"]


def _pool(fenced=()):
    """A PromptPool actor without its tokenizer (the prompts encoded by hand)."""
    from laminar.prompt_pool import PromptPool, PromptPoolCore
    from laminar.prompts import prompt_order
    from laminar.tasks import Prompt

    pool = PromptPool.__new__(PromptPool)
    prompts = [Prompt(0, "n 2 >", "1 2")]
    pool.core = PromptPoolCore([(prompts[0], (1, 5))], group_size=4, max_outstanding=4, seed=0)
    pool.order = prompt_order(prompts, 0)  # (PromptPool.stats records it)
    pool._lease, pool._waiting, pool._ending = None, None, False
    pool.fenced, pool.n_refused = {}, 0
    return pool


def test_the_prompt_pool_refuses_a_fenced_rollout_which_ends_its_loop_once():
    """A rollout the manager gave up asks for groups when it wakes: refused with
    RolloutFenced, an error of the pool's own (not a lost data module: the rollout's
    loop ends on it, once, rather than waiting for a rebuild), also for a take waiting
    in the long poll when the fence comes. Others are served as before."""
    import asyncio

    from laminar.actors import is_lost
    from laminar.prompt_pool import RolloutFenced

    async def run():
        pool = _pool()
        assert len((await pool.take(2, "r0", 0))[0]) == 2
        assert len(await pool.acquire(2, "r1", 0)) == 2  # the budget is spent now
        waiting = asyncio.ensure_future(pool.take(1, "r1", 0, wait_s=5.0))
        await asyncio.sleep(0.05)
        await pool.fence("r1")
        try:
            await asyncio.wait_for(waiting, 1.0)
        except RolloutFenced as e:
            error = e
        for ask in (pool.acquire(1, "r1", 0), pool.top_up(1, "r1", 0), pool.take(1, "r1", 0)):
            try:
                await ask
                raise AssertionError("served")
            except RolloutFenced:
                pass
        await pool.release(["p00000000"])
        assert len(await pool.acquire(1, "r2", 0)) == 1
        return error, await pool.stats()

    error, stats = asyncio.run(run())
    assert "rollout r1 was given up as lost" in str(error) and not is_lost(error)
    assert (stats["fenced"], stats["refused_fenced"]) == (1, 4)
    assert stats["dispatched"] == 5  # (none to r1 after its fence)


def test_the_driver_fences_each_lost_rollout_in_the_prompt_pool_once_per_pool():
    """At each poll the driver fences in the prompt pool the rollouts the manager took
    as lost: once each; again in a rebuilt data module's pool; a call that fails is made
    again at the next poll."""
    from pipelines.driver_faults import FaultHandling

    class PoolHandle:
        def __init__(self, fail=False):
            self.fenced, self.fail = [], fail

        def fence(self, rid):
            if self.fail:
                raise OSError("no answer")
            self.fenced.append(rid)
            return done(None)

    class Driver(FaultHandling):
        cfg = RunConfig()

        def __init__(self, pool):
            self.actors = {"pool": pool}

    old = PoolHandle()
    d = Driver(old)
    d._fence_in_pool({"lost": {"r1": 1.0}})
    d._fence_in_pool({"lost": {"r1": 1.0, "r3": 2.0}})
    assert old.fenced == ["r1", "r3"]
    d.actors["pool"] = new = PoolHandle(fail=True)  # (rebuilt, slow to answer)
    d._fence_in_pool({"lost": {"r1": 1.0, "r3": 2.0}})
    new.fail = False
    d._fence_in_pool({"lost": {"r1": 1.0, "r3": 2.0}})
    assert new.fenced == ["r1", "r3"] and old.fenced == ["r1", "r3"]


class CorePool:
    """A real PartialCore behind the actor's interface (each call a done future)."""

    def __init__(self):
        from laminar.partial import PartialCore

        self.core = PartialCore()

    def __getattr__(self, name):
        method = getattr(self.core, name)
        return lambda *a, **k: done(method(*a, **k))

    def set_relays(self, relays):
        return done(None)


def test_the_manager_resumes_what_a_given_up_rollout_registered_after_its_recovery():
    """r1's fence fails and it is given up: its entry resumes on r0. It wakes, registers
    a group it took before it saw its stop, and flushes: the next detection round takes
    that group (late) and resumes it on r0 too, with no second row for the empty rounds,
    and r1's flushes never move what r0 decodes."""
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=0.5", "faults.fence_wait_s=3"])
    pool = CorePool()
    pool.core.register("r1", 0, _states(["g0-000"]))
    r0 = FakeRollout(decoding(version=0), import_for_move=lambda *a, **k: done(True))
    r1 = FakeRollout()
    workers = {"r0": "tcp://w0", "r1": "tcp://w1"}
    manager = RolloutManager(cfg, {"r0": r0, "r1": r1}, None, pool, workers)
    manager._scheduler_workers = lambda: set(workers.values())
    hang(manager, "r1", 2.0)
    assert manager.detect() == []  # (within faults.fence_wait_s)
    hang(manager, "r1", 3.5)
    assert manager.detect() == ["r1"] and pool.core.owned() == {"r0": (1, 0, 0)}
    assert manager.detect() == [] and len(manager.fault_rows) == 1
    pool.core.register("r1", 0, _states(["g1-000", "g1-001"]))  # it woke
    pool.core.flush("r1", {"g0-000": (0, [5], [-1.0], [0])})
    assert manager.detect() == []
    assert pool.core.owned() == {"r0": (3, 0, 0)} and pool.core.late() == []
    rows = [(r["rollout"], r["destination"], r["requests"]) for r in manager.fault_rows]
    assert rows == [("r1", "r0", 1), ("r1", "r0", 2)]
    assert manager.stats()["recoveries"] == 2
    manager.detect()
    assert len(manager.fault_rows) == 2


def test_the_driver_reissues_the_groups_of_a_lost_rollout_that_nothing_else_holds():
    """r1 was handed three groups and died: one it registered with the partial-response
    pool (its recovery resumes it), one the buffer holds a sample of (it leaves in
    time), one neither knows — handed to it just before it died, or in an answer it
    never got. At its fence the driver asks both and the pool hands that one out again,
    whole (same uid), to the next rollout that asks: without it, it held the back-pressure
    budget for good. Once: a poll whose question fails asks again at the next poll.
    Real PromptPool, PartialResponsePool and BufferCore."""
    import asyncio

    from factories import InProcess
    from test_prompt_pool import _states

    from laminar.partial import PartialResponsePool
    from pipelines.driver_faults import FaultHandling

    pool = _pool()
    mine = pool.core.acquire(3, "r1")
    other = pool.core.acquire(1, "r0")
    assert pool.core.acquire(1, "r2") == []  # (full)
    partial = PartialResponsePool()
    asyncio.run(partial.register("r1", 0, _states(mine[0])))
    buf = BufferCore()
    buf.insert(
        [trajectory(f"{mine[1].prompt_uid}-000", mine[1].prompt_uid, group_size=4)],
        version=0,
        now=1.0,
    )

    class BufferHandle:
        fail = True

        def groups(self):
            if self.fail:
                raise OSError("no answer")
            return done(sorted({*buf.ready, *buf.partial}))

    class Driver(FaultHandling):
        cfg = RunConfig()

        def __init__(self):
            self.actors = {"pool": InProcess(pool), "partial": InProcess(partial)}
            self.actors["buffer"] = BufferHandle()

    d = Driver()
    d._fence_in_pool({"lost": {"r1": 1.0}})  # the buffer does not answer: next poll
    assert "r1" in pool.fenced and pool.core.stats()["reissued_at_fence"] == 0
    d.actors["buffer"].fail = False
    d._fence_in_pool({"lost": {"r1": 1.0}})
    d._fence_in_pool({"lost": {"r1": 1.0}})  # (done: not again)
    assert pool.core.stats()["reissued_at_fence"] == 1
    assert pool.core.handed_to("r1") == []
    again = pool.core.acquire(2, "r2")
    assert again == [mine[2]]  # the same group, and nothing new: the budget is spent
    assert pool.core.handed_to("r2") == [mine[2].prompt_uid]
    assert pool.core.handed_to("r0") == [other[0].prompt_uid]


def test_a_manager_held_up_longer_than_the_heartbeat_timeout_declares_no_rollout_hung(
    monkeypatch,
):
    """The manager's own thread was held up for a minute (a call to a rollout lost and
    not yet detected waited out cluster.actor_timeout_s): nobody was asked for or read a
    heartbeat meanwhile, and every healthy rollout was declared hung at once, its worker
    restarted (every rollout lost: the run failed). That blind time is not counted; a
    rollout that really stops is still found, a timeout after it stopped, also by a
    manager whose every round is that slow."""
    from test_manager import never

    import laminar.manager_recovery as recovery

    clock = SimpleNamespace(now=0.0)
    clock.time = lambda: clock.now
    monkeypatch.setattr(recovery, "time", clock)
    cfg = with_overrides(RunConfig(), ["faults.heartbeat_timeout_s=60"])
    interval = recovery.heartbeat_interval(cfg.faults)
    stop_at = 200.0
    well = FakeRollout(heartbeat=lambda: done(0.01))
    stops = FakeRollout(heartbeat=lambda: done(0.01) if clock.now < stop_at else never())
    manager = RolloutManager(cfg, {"r0": well, "r1": stops}, None)
    manager._fence = lambda rid, worker: None
    round_s = cfg.faults.detect_interval_s
    while clock.now < 11.0:  # (an answer read at 10.5, the next question due at 15)
        manager.check_heartbeats()
        clock.now += round_s
    clock.now += 61.0  # held up, blind
    while clock.now < 150.0:
        manager.check_heartbeats()
        clock.now += round_s
    slow_round = interval + 2 * round_s  # (from now on every round is a gap)
    while clock.now < 400.0:
        manager.check_heartbeats()
        clock.now += slow_round
    assert set(manager.hung) == {"r1"}
    assert stop_at + 60 <= manager.hung["r1"]["time"] <= stop_at + 60 + 2 * slow_round


def test_a_new_master_is_handed_to_its_readers_within_seconds_each_call_watched(monkeypatch):
    """A new master (trainer restart) is handed to every reader, and the chain and the
    partial-response pool told. Each call waited cluster.actor_timeout_s on its own: a
    reader lost and not yet detected held the manager's thread a minute (then every
    heartbeat looked overdue). Each is now watched for its worker's loss (``actor``) and
    all share one deadline of at most 5 s."""
    from test_manager import never

    import laminar.manager as manager_mod

    waits: list[tuple[object, float]] = []

    def actor_result(actor, future, timeout):
        waits.append((actor, timeout))
        raise TimeoutError

    monkeypatch.setattr(manager_mod, "actor_result", actor_result)
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=60"])
    r0, r1 = FakeRollout(set_relay=lambda r: never()), FakeRollout(set_relay=lambda r: never())
    old, new = FakeRollout(), FakeRollout(rechain=lambda *a: never())
    pool = Pool()
    manager = RolloutManager(
        cfg,
        {"r0": r0, "r1": r1},
        old,
        pool,
        {"r0": "tcp://w0", "r1": "tcp://w1"},
        rollout_relays={"r0": "master", "r1": "master"},
    )
    manager._master_lost = 0.0
    manager.replace_master(new, "tcp://t2")
    manager._take_joining()
    assert {id(a) for a, _ in waits} == {id(r0), id(r1), id(new), id(pool)}
    assert all(0 < t <= 5.0 for _, t in waits)
    assert manager.masters[-1]["rollouts"] == []
