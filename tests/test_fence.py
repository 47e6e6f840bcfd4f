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
