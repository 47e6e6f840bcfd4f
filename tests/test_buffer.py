"""The buffer core against a plain model of what it must do (hypothesis state machine)."""

import pytest
from factories import trajectory
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from laminar.buffer import BufferCore
from laminar.prompt_pool import PromptPoolCore
from laminar.tasks import Prompt


def traj(uid, group, size, idx=0, version=0, reason="eos", reward=1.0):
    return trajectory(
        uid,
        group,
        sample_idx=idx,
        group_size=size,
        behavior_version=version,
        finish_reason=reason,
        reward=reward,
    )


class BufferMachine(RuleBasedStateMachine):
    """Insert siblings in any order, sample, drain: compare with a list-based model."""

    def __init__(self):
        super().__init__()
        self.core = BufferCore()
        self.version = 0
        self.group_sizes: dict[str, int] = {}
        self.arrived: dict[str, list[str]] = {}
        self.errored: set[str] = set()
        self.completed_order: list[str] = []  # complete, non-error groups, FIFO
        self.left: dict[str, str] = {}  # uid -> status it left with
        self.next_group = 0

    @rule(size=st.integers(2, 4))
    def open_group(self, size):
        g = f"g{self.next_group}"
        self.next_group += 1
        self.group_sizes[g] = size
        self.arrived[g] = []

    @precondition(lambda self: any(len(v) < self.group_sizes[g] for g, v in self.arrived.items()))
    @rule(data=st.data(), error=st.booleans(), duplicate=st.booleans())
    def insert_sibling(self, data, error, duplicate):
        open_groups = sorted(g for g, v in self.arrived.items() if len(v) < self.group_sizes[g])
        g = data.draw(st.sampled_from(open_groups))
        idx = len(self.arrived[g])
        uid = f"{g}-{idx}"
        t = traj(uid, g, self.group_sizes[g], idx, self.version, "error" if error else "eos")
        batch = [t, traj(uid, g, self.group_sizes[g], idx)] if duplicate else [t]
        leaving = self.core.insert(batch, version=self.version, now=0.0)
        self.arrived[g].append(uid)
        if error:
            self.errored.add(g)
        if len(self.arrived[g]) == self.group_sizes[g]:
            if g in self.errored:
                assert sorted(x.uid for x in leaving) == sorted(self.arrived[g])
                assert all(x.status == "discarded" for x in leaving)
                self.left.update({x.uid: "discarded" for x in leaving})
            else:
                assert leaving == []
                self.completed_order.append(g)
        else:
            assert leaving == []

    @rule(n=st.integers(1, 3))
    def sample(self, n):
        out = self.core.sample(n, version=self.version, now=1.0)
        if len(self.completed_order) < n:
            assert out is None
            return
        expect = self.completed_order[:n]
        del self.completed_order[:n]
        assert out is not None
        assert [t.prompt_uid for t in out] == [
            g for g in expect for _ in range(self.group_sizes[g])
        ]
        for t in out:
            assert t.status == "consumed" and t.sample_version == self.version
            assert t.uid not in self.left
            self.left[t.uid] = "consumed"

    @rule()
    def publish(self):
        self.version += 1

    @invariant()
    def depth_counts_everything_not_left(self):
        inserted = sum(len(v) for v in self.arrived.values())
        assert self.core.depth == inserted - len(self.left)

    def teardown(self):
        for t in self.core.drain():
            assert t.uid not in self.left
            self.left[t.uid] = "buffered"
        inserted = [u for v in self.arrived.values() for u in v]
        assert sorted(self.left) == sorted(inserted)  # every trajectory left exactly once


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_finish_version_never_below_behavior_version():
    core = BufferCore()
    t = traj("a", "g", 2, version=3)
    core.insert([t], version=1, now=0.0)
    assert t.finish_version == 3 and t.t_insert == 0.0


def test_duplicates_are_counted_not_stored():
    core = BufferCore()
    core.insert([traj("a", "g", 2), traj("a", "g", 2)], version=0, now=0.0)
    assert core.depth == 1 and core.counts["duplicates"] == 1


def test_the_buffer_reads_its_oldest_trajectorys_age_by_its_own_clock():
    """The driver polls the buffer after every rollout (seconds on a loaded host) and on
    another host's clock: the age is the buffer's own reading, with when it read it."""
    import math
    import time

    core = BufferCore()
    assert math.isnan(core.stats()["oldest_age_s"])
    core.insert([traj("a", "g", 2)], version=0, now=time.time() - 5.0)
    stats = core.stats()
    assert 5.0 <= stats["oldest_age_s"] < 6.0
    assert stats["oldest_age_s"] == pytest.approx(stats["read_at"] - stats["oldest_t_insert"])


def group(name, size=2, version=0, rewards=None):
    rewards = rewards or [float(i) for i in range(size)]
    return [traj(f"{name}-{i}", name, size, i, version, reward=rewards[i]) for i in range(size)]


def test_oldest_version_sampler_takes_the_lowest_behavior_version_first():
    core = BufferCore("oldest_version")
    for name, v in (("a", 3), ("b", 1), ("c", 2)):
        core.insert(group(name, version=v), version=3, now=0.0)
    assert [t.prompt_uid for t in core.sample(2, version=3, now=1.0)][::2] == ["b", "c"]


def test_same_version_sampler_fills_a_batch_from_one_version():
    core = BufferCore("same_version", max_train_staleness=5)
    for name, v in (("a", 1), ("b", 2), ("c", 2), ("d", 1)):
        core.insert(group(name, version=v), version=2, now=0.0)
    first = core.sample(2, version=2, now=1.0)
    assert {t.behavior_version for t in first} == {1} and len(first) == 4
    core.insert(group("e", version=3), version=3, now=2.0)
    second = core.sample(2, version=3, now=3.0)
    assert {t.behavior_version for t in second} == {2}
    assert core.sample(1, version=3, now=4.0)[0].prompt_uid == "e"


@settings(max_examples=60, deadline=None)
@given(versions=st.lists(st.integers(0, 4), max_size=30), n=st.integers(1, 6))
def test_same_version_picks_the_oldest_version_with_a_batch_in_arrival_order(versions, n):
    """What the sampler takes: of the oldest version with ``n`` groups ready, the first
    ``n`` to have come (the reference: every group of each version, scanned in turn)."""
    core = BufferCore("same_version", max_train_staleness=10)
    for i, v in enumerate(versions):
        core.insert(group(f"g{i}", version=v), version=4, now=float(i))
    arrived = [(f"g{i}", v) for i, v in enumerate(versions)]
    want = next(
        (
            [u for u, w in arrived if w == v][:n]
            for v in sorted(set(versions))
            if versions.count(v) >= n
        ),
        None,
    )
    assert core._choose(n) == (want if len(versions) >= n else None)


def test_dynamic_sampling_filters_groups_without_signal():
    core = BufferCore(dynamic_sampling=True)
    left = core.insert(group("flat", rewards=[1.0, 1.0]), version=0, now=0.0)
    left += core.insert(group("ok", rewards=[0.0, 1.0]), version=0, now=0.0)
    assert [t.status for t in left] == ["filtered", "filtered"]
    assert core.counts["groups_filtered"] == 1 and len(core.ready) == 1


def test_dynamic_sampling_compares_rewards_as_the_store_holds_them():
    """A sibling held again from the store (a resume, a rebuild) has its reward as the
    store's float32 (0.1 reads 0.10000000149...): beside a fresh 0.1 its group looked
    like it had a signal and was trained."""
    import numpy as np

    core = BufferCore(dynamic_sampling=True)
    stored = traj("a0", "a", 2, 0, reward=float(np.float32(0.1)))
    core.restore([[stored]], stored={"a0"})
    left = core.insert([traj("a1", "a", 2, 1, reward=0.1)], version=0, now=0.0)
    assert [t.uid for t in left] == ["a0", "a1"] and core.counts["groups_filtered"] == 1
    left = core.insert(group("b", rewards=[0.1, 0.1 + 1e-6]), version=0, now=0.0)
    assert left == [] and list(core.ready) == ["b"]  # (a difference float32 holds counts)


@settings(max_examples=80, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["insert", "sample", "publish"]), st.integers(0, 3)),
        max_size=60,
    ),
    k=st.integers(0, 3),
    sampler=st.sampled_from(["fifo", "oldest_version", "same_version"]),
)
def test_no_consumed_trajectory_exceeds_max_train_staleness(events, k, sampler):
    """Any interleaving of arrivals (of any behavior version up to the current one),
    samples and publications: consumed trajectories have s_train <= k, stale groups are
    evicted with their status, and every trajectory leaves exactly once."""
    core = BufferCore(sampler, max_train_staleness=k)
    version, n, left, inserted = 0, 0, [], []
    for kind, x in events:
        if kind == "insert":
            g = group(f"g{n}", version=max(0, version - x))
            n += 1
            inserted += g
            left += core.insert(g, version=version, now=0.0)
        elif kind == "sample":
            left += core.evict_stale(version)
            left += core.sample(1 + x % 2, version=version, now=0.0) or []
        else:
            version += 1
            left += core.evict_stale(version)
    left += core.drain()
    assert sorted(t.uid for t in left) == sorted(t.uid for t in inserted)
    for t in left:
        if t.status == "consumed":
            assert t.sample_version - t.behavior_version <= k
        if t.status == "evicted":  # it was too stale when evicted, and versions only grow
            assert version - t.behavior_version > k
    assert core.counts["evicted"] == sum(t.status == "evicted" for t in left)


def test_a_restored_group_missing_siblings_completes_when_they_arrive():
    """A resumed run: whole groups are ready at once, a group missing siblings waits for
    the re-issued ones; stored uids are never admitted again."""
    core = BufferCore()
    whole = [traj("a0", "a", 2, 0), traj("a1", "a", 2, 1)]
    part = [traj("b1", "b", 3, 1)]
    core.restore([whole, part], stored={"a0", "a1", "b1", "old"})
    assert core.depth == 3 and list(core.ready) == ["a"]
    core.insert([traj("b1", "b", 3, 1), traj("old", "c", 1)], version=0, now=1.0)
    assert core.counts["duplicates"] == 2 and list(core.ready) == ["a"]
    core.insert([traj("b0", "b", 3, 0), traj("b2", "b", 3, 2)], version=0, now=2.0)
    batch = core.sample(2, version=0, now=3.0)
    assert [t.uid for t in batch] == ["a0", "a1", "b0", "b1", "b2"]


def _pool(n_prompts: int, max_outstanding: int):
    """A real prompt pool core of groups of 2 over ``n_prompts`` prompts."""
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(n_prompts)]
    return PromptPoolCore(prompts, group_size=2, max_outstanding=max_outstanding, seed=0)


def _buffer_config(**settings):
    """The ``buffer`` settings an ExperienceBuffer reads (the defaults, as overridden)."""
    import types

    base = dict(
        sampler="fifo",
        max_train_staleness=None,
        dynamic_sampling=False,
        flush_records=512,
        flush_interval_s=5.0,
    )
    return types.SimpleNamespace(**(base | settings))


class _Pool:
    """The prompt pool actor's async surface, over the real core."""

    def __init__(self, core):
        self.core = core

    async def release(self, prompt_uids, untrained=()):
        self.core.release(prompt_uids, tuple(untrained))

    async def hold_again(self, prompt_uids):
        self.core.hold_again(prompt_uids)

    async def version_published(self, version):
        self.core.version_published(version)

    async def room(self):
        return {"full": self.core.full(), "outstanding": len(self.core.outstanding)}


def test_same_version_never_waits_forever_on_versions_too_rare_to_fill_a_batch(tmp_path):
    """Every slot held by a complete group of a different version, none enough for a
    batch, and nothing in flight: the sampler used to return None for good (eviction
    waits for a publication, which waits for a batch). The oldest version's groups are
    now evicted, their slots go out again, and a batch forms."""
    import asyncio

    from laminar.buffer import ExperienceBuffer

    pool = _pool(20, max_outstanding=3)
    cfg = _buffer_config(sampler="same_version", max_train_staleness=5)

    def generate(n, version):
        return [
            traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reward=float(i))
            for g in pool.acquire(n, "r0", version)
            for i in range(2)
        ]

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        for version in range(3):  # (rollouts at three versions: one group each)
            await buf.insert(generate(1, version))
        assert pool.full() and len(pool.outstanding) == len(buf.core.ready) == 3
        assert await buf.sample(2, 2) is None  # no version holds two groups ...
        assert buf.core.counts["groups_stranded"] == 1  # ... so version 0's group left
        assert not pool.full() and len(pool.outstanding) == 2
        await buf.insert(generate(1, 2))  # its slot went to a group of version 2
        batch = await buf.sample(2, 2)
        assert {t.behavior_version for t in batch} == {2} and len(batch) == 4
        s = buf.core.stats()
        assert s["groups_evicted"] == 1 and s["evicted"] == 2
        await buf.close()

    asyncio.run(run())


def test_groups_held_again_for_a_restarted_trainer_count_against_back_pressure(tmp_path):
    """The groups of updates lost with the trainer are held again: until they leave
    again they are dispatched and not consumed, so the pool counts them outstanding (as
    a rebuilt data module's pool does) and hands out no more than the bound."""
    import asyncio

    from laminar.buffer import ExperienceBuffer

    pool = _pool(5, max_outstanding=2)
    cfg = _buffer_config()

    def generate(version):
        return _two_groups(pool, version)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        await buf.insert(generate(0))
        assert len(await buf.sample(2, 0)) == 4  # the update after checkpoint 0 ...
        await buf.version_published(1)
        await buf.insert(generate(1))  # (its room went to two new groups)
        back = await buf.trainer_restarted(0)  # ... is lost with the trainer
        assert back == {"readmitted": 4, "groups": 2, "consumed_unstored": {}}
        held = set(buf.core.ready)
        assert len(held) == 4 and pool.outstanding == held
        assert pool.acquire(2, "r0", 1) == []  # the bound holds
        for _ in range(2):
            await buf.sample(2, 1)
        assert pool.outstanding == set() and buf.core.depth == 0
        s = pool.stats()
        assert s["dispatched"] + s["held_again"] == s["released"] == 6
        await buf.close()

    asyncio.run(run())


def _two_groups(pool, version):
    """Two groups of two from ``pool`` at ``version``, rewards 0 and 1 (so none is
    filtered as flat)."""
    return [
        traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reward=float(i))
        for g in pool.acquire(2, "r0", version)
        for i in range(2)
    ]


def _conserved(counts, depth):
    """Every trajectory admitted, or held from a resumed run's store, has left once, with
    one status, or is held: the counters' conservation identity."""
    left = sum(counts[s] for s in ("consumed", "discarded", "evicted", "filtered"))
    return counts["inserted"] + counts.get("restored", 0) == left + depth


def test_a_restarted_trainers_lost_updates_take_their_consumption_back(tmp_path):
    """Held again for a restarted trainer, a trajectory stayed counted ``consumed`` and
    counted again when trained again: the counters said 8 consumed of 4 (the store 4),
    and inserted = consumed + discarded + evicted + filtered + depth stopped holding."""
    import asyncio

    from laminar.buffer import ExperienceBuffer
    from storage.trajectories import open_trajectories

    pool = _pool(5, max_outstanding=2)

    def generate(version):
        return _two_groups(pool, version)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config())
        c = buf.core.counts
        await buf.insert(generate(0))
        await buf.sample(2, 0)
        await buf.version_published(1)
        assert (c["consumed"], c["groups_consumed"]) == (4, 2)
        await buf.trainer_restarted(0)  # (the update at 0 is lost)
        assert (c["consumed"], c["groups_consumed"], c["taken_back"]) == (0, 0, 4)
        assert _conserved(c, buf.core.depth) and buf.core.depth == 4
        await buf.sample(2, 5)
        assert (c["consumed"], c["groups_consumed"]) == (4, 2)
        assert _conserved(c, buf.core.depth) and buf.core.depth == 0
        await buf.close()
        return c["consumed"]

    consumed = asyncio.run(run())
    assert consumed == (open_trajectories(tmp_path)["status"] == "consumed").sum()


def test_a_resumed_runs_held_trajectories_count_as_restored():
    core = BufferCore()
    core.restore([[traj("a0", "a", 2, 0), traj("a1", "a", 2, 1)]], stored={"a0", "a1"})
    core.insert([traj("b0", "b", 2, 0)], version=0, now=0.0)
    assert core.counts["restored"] == 2 and _conserved(core.counts, core.depth)
    core.sample(1, version=0, now=1.0)
    assert core.counts["consumed"] == 2 and _conserved(core.counts, core.depth)


def test_a_trajectory_held_again_does_not_age_while_it_was_out_of_the_buffer(tmp_path):
    """Consumed by an update lost with the trainer and held again, a trajectory's age
    counted from its ``t_insert``: the time it spent with the lost update (here 2 s) as
    if in the buffer, in the ``oldest_buffered_age_s`` gauge and in the store's
    ``buffer_age``. Its age is its time in the buffer: the ``buffered`` event that holds
    it again says when."""
    import asyncio
    import time

    from laminar.buffer import ExperienceBuffer
    from storage import open_run

    pool = _pool(5, max_outstanding=2)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config())
        await buf.insert(_two_groups(pool, 0))
        assert len(await buf.sample(2, 0)) == 4  # consumed at once by the update ...
        await buf.version_published(1)
        await asyncio.sleep(2.0)
        held_at = time.time()
        await buf.trainer_restarted(0)  # ... lost with the trainer 2 s later
        age = buf.core.stats()["oldest_age_s"]
        assert len(await buf.sample(2, 1)) == 4
        await buf.close()
        return held_at, age

    held_at, age = asyncio.run(run())
    assert age < 1.0  # (was over 2 s)
    ds = open_run(tmp_path)
    assert (ds["t_held"].values >= held_at).all()
    assert (ds.laminar.buffer_age().values < 1.0).all()  # (was over 2 s)


def test_a_resumed_runs_held_trajectories_age_by_their_time_in_the_buffer(tmp_path):
    """A resumed run's ``oldest_buffered_age_s`` read 12.8-13.5 s after the resume
    against at most 4.6 s before the loss: a trajectory consumed by an update lost with
    the run and held again aged from its ``t_insert``, the time between its consumption
    and the loss included (the driver leaves out the stop alone). Its age now counts
    from an origin that leaves that time out: the driver's reading is its time in the
    buffer before the loss, and then since the resume. One held across the stop keeps
    its ``t_insert``."""
    import asyncio
    import time

    from laminar.buffer import ExperienceBuffer
    from storage import open_run
    from storage.metrics import MetricsWriter
    from storage.resume import plan_resume
    from storage.trajectories import TrajectoryWriter

    t0 = time.time() - 200.0  # the lost run went from t0 to t0 + 20 s (its last row)
    nan = float("nan")

    def stored(uid, t_insert):
        g, i = uid.split("-")
        return trajectory(
            uid,
            g,
            sample_idx=int(i),
            reward=float(i),
            finish_version=0,
            status="buffered",
            sample_version=-1,
            t_sample=nan,
            t_submit=t0 + t_insert - 1,
            t_insert=t0 + t_insert,
        ).to_record()

    w = TrajectoryWriter(tmp_path)
    w.append([stored("a-0", 5.0), stored("a-1", 5.0), stored("b-0", 15.0), stored("b-1", 15.0)])
    # a: consumed at 13 s by the update after checkpoint 1, lost with the run
    w.append(
        [],
        [
            dict(uid=u, status="consumed", sample_version=1, t_sample=t0 + 13)
            for u in ("a-0", "a-1")
        ],
    )
    rows = [
        {"segment": 0, "elapsed_s": t, "wall_time": t0 + t, "version": 1} for t in range(0, 21, 5)
    ]
    MetricsWriter(tmp_path).append("cluster", rows)
    plan = plan_resume(tmp_path, 1)
    assert sorted(plan.readmit) == ["a-0", "a-1", "b-0", "b-1"]
    pool = _pool(5, max_outstanding=2)

    async def run():
        held_at = time.time()
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config(), resume=plan)
        now = time.time()
        stats = buf.core.stats()
        assert [t.uid for t in await buf.sample(1, 1)] == ["a-0", "a-1"]
        oldest = buf.core.stats()["oldest_t_insert"]  # (b's, a gone)
        await buf.close()
        return held_at, now, stats, oldest

    held_at, now, stats, oldest = asyncio.run(run())
    # a was in the buffer from 5 to 13 s: 8 s before the stop (from 20 s on) ...
    assert stats["oldest_t_insert"] == pytest.approx(t0 + 12.0, abs=now - held_at + 1e-3)
    # ... which the driver reads, leaving out the stop (from the last row to its start)
    driver = stats["oldest_age_s"] - (stats["read_at"] - (t0 + 20.0))
    assert driver == pytest.approx(8.0, abs=now - held_at + 1e-3)  # (was 15 s)
    assert oldest == pytest.approx(t0 + 15.0)  # (b: in the buffer up to the stop)
    ds = open_run(tmp_path)  # (the store says when a was held again)
    assert held_at <= ds["t_held"].values[0] <= now
    assert ds["held_s"].values.tolist() == pytest.approx([8.0, 8.0, 0.0, 0.0])
    age = ds.laminar.buffer_age()  # (a's, consumed again since)
    assert (age.values >= 8.0).all() and (age.values < 9.0).all()


def test_close_reports_what_the_buffer_held_as_it_closed(tmp_path):
    """summary.json's ``buffer.depth`` was always 0: close() drained the buffer (what it
    holds is stored as ``buffered``) before it read its stats. It reports what it held:
    its depth, groups and oldest trajectory's age, as the store says."""
    import asyncio

    from laminar.buffer import ExperienceBuffer
    from storage import open_run

    pool = _pool(5, max_outstanding=4)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config())
        await buf.insert(_two_groups(pool, 0) + [traj("p9-0", "p9", 2)])  # (p9: partial)
        assert len(await buf.sample(1, 0)) == 2
        return await buf.close()

    stats = asyncio.run(run())
    assert (stats["depth"], stats["ready_groups"], stats["partial_groups"]) == (3, 1, 1)
    assert stats["oldest_age_s"] >= 0 and stats["written"] == 5
    assert open_run(tmp_path).laminar.summary()["n_buffered"] == stats["depth"]


def _rebuilt_pool(plan) -> PromptPoolCore:
    """The prompt pool of a rebuilt data module (8 prompts, groups of 2), where ``plan``
    (:func:`storage.resume.plan_rebuild`) says the lost one stood."""
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(8)]
    return PromptPoolCore(
        prompts,
        group_size=2,
        max_outstanding=8,
        seed=0,
        start=plan.start,
        outstanding=tuple(plan.outstanding),
    )


def test_a_rebuilt_buffer_counts_each_group_consumed_once(tmp_path):
    """A rebuilt data module stores as consumed what the trainer consumed from the lost
    buffer before its store had it: those trajectories counted in ``consumed`` but their
    groups not in ``groups_consumed`` (2 groups of 3). A group with siblings both in the
    store and not counts once."""
    import asyncio

    from laminar.buffer import ExperienceBuffer
    from storage.resume import plan_rebuild

    lost_pool = _pool(8, max_outstanding=8)
    cfg = _buffer_config(flush_interval_s=1e9)

    def generate(pool, n):
        return [
            traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, 0, reward=float(i))
            for g in pool.acquire(n, "r0", 0)
            for i in range(2)
        ]

    consumed = {}

    async def lose():
        buf = ExperienceBuffer(str(tmp_path), _Pool(lost_pool), cfg)
        sent = generate(lost_pool, 2)  # p0, p1: stored
        await buf.insert(sent[:3], "r0")  # (p1-1 is not)
        await buf.sync()
        await buf.insert(sent[3:] + generate(lost_pool, 1), "r0")  # p1-1, p2: never stored
        for _ in range(3):
            batch = await buf.sample(1, 0)  # (their consumed events neither)
            consumed.update({t.uid: (t.sample_version, t.t_sample) for t in batch})
        assert buf.core.counts["groups_consumed"] == 3

    asyncio.run(lose())
    # sent again by their rollout (its copies: p1-1, p2)
    resent = [
        traj(f"p0000000{g}-{i}", f"p0000000{g}", 2, i, reward=float(i))
        for g, i in ((1, 1), (2, 0), (2, 1))
    ]
    plan = plan_rebuild(tmp_path, version=1, consumed=consumed, since=0, held_groups=set())
    assert len(plan.consumed_elsewhere) == 3
    pool = _rebuilt_pool(plan)

    async def rebuilt():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg, rebuild=plan)
        await buf.insert(resent, "r0")
        await buf.sync()
        c = buf.core.counts
        assert (c["consumed"], c["groups_consumed"]) == (6, 3)
        assert _conserved(c, buf.core.depth)
        await buf.close()

    asyncio.run(rebuilt())


def test_a_rebuilt_buffer_lets_the_pool_forget_what_its_store_already_had(tmp_path):
    """A rollout sends a rebuilt buffer again the trajectories it kept unstored; one the
    store already had (written just before the loss) is not stored twice, and the
    partial-response pool, which holds it finished (the rollout registered it with the
    rebuilt pool, docs/faults.md), must let it go too: it stayed there, held, and in the
    recovery log, to the end of the run."""
    import asyncio
    import time

    from laminar.buffer import ExperienceBuffer
    from laminar.engine import GenerationRequest, RequestState
    from laminar.partial import PartialResponsePool
    from storage.resume import plan_rebuild

    lost_pool = _pool(8, max_outstanding=8)
    cfg = _buffer_config(flush_interval_s=1e9)
    (g,) = lost_pool.acquire(1, "r0", 0)
    sent = [traj(f"{g.prompt_uid}-{i:03d}", g.prompt_uid, 2, i, 0) for i in range(2)]

    async def lose():
        buf = ExperienceBuffer(str(tmp_path), _Pool(lost_pool), cfg)
        await buf.insert(sent, "r0")
        await buf.sync()  # (stored; the answer that says so lost with the buffer)

    asyncio.run(lose())
    plan = plan_rebuild(tmp_path, version=0, consumed={}, since=0, held_groups={g.prompt_uid})
    partial = PartialResponsePool()
    for t in sent:  # registered finished with the rebuilt pool by its rollout
        meta = {"group": g, "sample_idx": t.sample_idx, "t_submit": time.time()}
        req = GenerationRequest(t.uid, g.prompt_tokens, None, meta)
        partial.core.register("r0", 0, [RequestState(req, seed=1, t_start=time.time())])
        partial.core.flush("r0", {t.uid: (0, [4, 5], [-0.5, -0.5], [0, 0])}, {t.uid: ("eos", 1.0)})
    pool = _rebuilt_pool(plan)

    async def rebuilt():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg, partial=partial, rebuild=plan)
        out = await buf.insert(sent, "r0")
        assert sorted(out["stored"]) == [t.uid for t in sent]
        assert not set(partial.core.entries) & {t.uid for t in sent}
        await buf.close()

    asyncio.run(rebuilt())


class DataPathMachine(RuleBasedStateMachine):
    """The prompt pool and the buffer core wired as ExperienceBuffer wires them (a group
    that leaves, with any status, is released; untrained unless consumed): rollouts that
    lag the trainer, siblings arriving in any order, duplicates, reward errors, groups
    without reward variance, updates skipped. Every group dispatched is outstanding until
    it leaves, exactly once, whole, within the bound; and the trainer never waits forever
    once the rollouts pull the newest version."""

    @initialize(
        sampler=st.sampled_from(["fifo", "oldest_version", "same_version"]),
        k=st.one_of(st.none(), st.integers(0, 3)),
        dynamic=st.booleans(),
        size=st.integers(2, 3),
        n=st.integers(1, 3),
        room=st.integers(0, 4),
        dispatch=st.sampled_from(["free", "eta"]),
        eta=st.integers(0, 2),
    )
    def setup(self, sampler, k, dynamic, size, n, room, dispatch, eta):
        if sampler == "same_version":
            k = 2 if k is None else k
            # the most groups that can wait without a version filling a batch
            room += (n - 1) * (k + 1) + 1 - n
        self.pool = rule_pool_of(size, n + room, dispatch, groups_per_step=n, eta=eta)
        self.core = BufferCore(sampler, max_train_staleness=k, dynamic_sampling=dynamic)
        self.k, self.n, self.size = k, n, size
        self.version = 0
        self.rollouts = {"r0": 0, "r1": 0}
        self.in_flight: list = []
        self.sent: dict[str, object] = {}
        self.left: dict[str, str] = {}  # uid -> status
        self.groups_left: set[str] = set()
        self.dispatched: set[str] = set()

    def _release(self, left):
        for t in left:
            assert t.uid not in self.left
            self.left[t.uid] = t.status
        uids = sorted({t.prompt_uid for t in left})
        assert not self.groups_left & set(uids)  # a group leaves once, whole
        for u in uids:
            assert len({t.status for t in left if t.prompt_uid == u}) == 1
        self.groups_left |= set(uids)
        trained = {t.prompt_uid for t in left if t.status == "consumed"}
        self.pool.release(uids, tuple(u for u in uids if u not in trained))

    def _acquire(self, r, want, flaws=None):
        v = self.rollouts[r]
        for g in self.pool.acquire(want, r, v, idle=True, now=0.0):
            self.dispatched.add(g.prompt_uid)
            for i in g.sample_indices:
                error, reward = flaws(i) if flaws else (False, float(i % 2))
                uid = f"{g.prompt_uid}-{i}"
                reason = "error" if error else "eos"
                self.in_flight.append(traj(uid, g.prompt_uid, g.group_size, i, v, reason, reward))

    @rule(r=st.sampled_from(["r0", "r1"]), want=st.integers(1, 3), data=st.data())
    def acquire(self, r, want, data):
        draw = data.draw
        self._acquire(
            r, want, lambda i: (draw(st.integers(0, 9)) == 0, draw(st.sampled_from([0.0, 1.0])))
        )

    @rule(r=st.sampled_from(["r0", "r1"]))
    def pull(self, r):
        self.rollouts[r] = self.version

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data, duplicate):
        t = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        batch = [t]
        if duplicate and self.sent:  # sent again after a repack or a recovery
            batch.append(self.sent[data.draw(st.sampled_from(sorted(self.sent)))])
        self.sent[t.uid] = t
        self._release(self.core.insert(batch, version=self.version, now=0.0))

    @rule(skip=st.booleans())
    def train(self, skip):
        if self._train():
            self._publish(skip)

    def _train(self) -> bool:
        evicted, batch = self.core.take(self.n, version=self.version, now=0.0)
        self._release(evicted)
        if batch is None:  # (as ExperienceBuffer.sample: versions stranded in every slot)
            full = self.pool.full() and len(self.pool.outstanding) <= len(self.core.ready)
            if self.core.sampler == "same_version" and self.core.ready and full:
                self._release(self.core.evict_stranded())
            return False
        self._release(batch)
        groups: dict[str, list[int]] = {}
        for t in batch:
            groups.setdefault(t.prompt_uid, []).append(t.sample_idx)
            assert self.k is None or t.sample_version - t.behavior_version <= self.k
        assert len(groups) == self.n
        assert all(sorted(s) == list(range(self.size)) for s in groups.values())
        return True

    def _publish(self, skip):
        if skip:  # a non-finite update: consumed, no version
            self.pool.update_skipped()
            return
        self.version += 1
        self.pool.version_published(self.version)
        self._release(self.core.evict_stale(self.version))

    @invariant()
    def every_group_is_out_until_it_leaves(self):
        assert len(self.pool.outstanding) <= self.pool.max_outstanding
        assert self.pool.outstanding == self.dispatched - self.groups_left
        held = {t.uid for g in self.core.ready.values() for t in g}
        held |= {t.uid for g in self.core.partial.values() for t in g.members}
        assert not held & set(self.left) and held | set(self.left) == set(self.sent)
        assert self.core.counts["inserted"] == len(self.sent)
        for status in ("consumed", "discarded", "evicted", "filtered"):
            assert self.core.counts[status] == sum(s == status for s in self.left.values())

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for _ in range(4):  # rollouts at the newest version: the trainer moves on
            self.rollouts = dict.fromkeys(self.rollouts, self.version)
            for _ in range(12):
                for r in self.rollouts:
                    self._acquire(r, 3)
                while self.in_flight:
                    t = self.in_flight.pop()
                    t.finish_reason, t.reward = "eos", float(t.sample_idx % 2)
                    self.sent[t.uid] = t
                    self._release(self.core.insert([t], version=self.version, now=0.0))
                if self._train():
                    break
            else:
                ready = [min(m.behavior_version for m in g) for g in self.core.ready.values()]
                raise AssertionError(f"the trainer waits forever: ready {ready}")
            self._publish(False)


def rule_pool_of(size, max_outstanding, dispatch, **rule):
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(5)]
    return PromptPoolCore(
        prompts, group_size=size, max_outstanding=max_outstanding, seed=0, dispatch=dispatch, **rule
    )


TestDataPath = DataPathMachine.TestCase
TestDataPath.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_a_trajectory_carries_one_version_per_response_token_or_none():
    """``token_versions`` is empty (one version) or one per response token, the oldest
    being the behavior version: misaligned, it would assign versions to the wrong
    tokens in the store and the audit."""
    import numpy as np
    import pytest

    mixed = traj("a", "g", 2, version=3)
    mixed.token_versions = np.array([3, 4], np.int32)
    mixed.__post_init__()  # sound
    for versions, behavior in (([3], 3), ([3, 4, 4], 3), ([4, 5], 3)):
        with pytest.raises(ValueError, match="token_versions"):
            trajectory(
                "a",
                "g",
                behavior_version=behavior,
                token_versions=np.array(versions, np.int32),
            )


def test_a_batch_the_disk_refused_is_written_with_the_next(tmp_path, monkeypatch):
    """A write that fails on the disk (ENOSPC, a lost mount) used to drop its records
    for good; they are kept and written, in order, once the store takes writes again."""
    import asyncio
    import errno

    from laminar.buffer import ExperienceBuffer
    from storage.trajectories import TrajectoryWriter, open_trajectories

    pool = _pool(5, max_outstanding=4)
    cfg = _buffer_config(flush_records=1)
    real, calls, disk = TrajectoryWriter.append, [], {"full": True}

    def full_until_freed(self, records, events=()):
        calls.append(len(records))
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, records, events)

    monkeypatch.setattr(TrajectoryWriter, "append", full_until_freed)

    def generate():
        return [
            traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i)
            for g in pool.acquire(1, "r0", 0)
            for i in range(2)
        ]

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        await buf.insert(generate())
        with pytest.raises(RuntimeError, match="No space left on device"):
            await buf.sync()
        await buf.insert(generate())  # (refused too, kept behind the first)
        with pytest.raises(RuntimeError, match="No space left on device"):
            await buf.sync()
        disk["full"] = False
        await buf.insert(generate())
        assert (await buf.sync())["written"] == 6  # (the refused batches first, then this one)
        await buf.close()

    asyncio.run(run())
    stored = open_trajectories(tmp_path)
    assert stored["uid"].tolist() == [
        f"{u}-{i}" for u in ("p00000000", "p00000001", "p00000002") for i in range(2)
    ]
    assert 6 in calls  # (one write carried every batch's records, in order)


def test_sampling_a_stale_group_refuses_the_whole_batch_and_loses_no_group():
    """Sampling without evicting first raises, and takes nothing: the batch's fresh
    group used to be popped and marked consumed before the stale one raised, and was
    neither returned nor held any more (a group lost, uncounted)."""
    core = BufferCore("fifo", max_train_staleness=1)
    core.insert(group("fresh", version=3), version=3, now=0.0)
    core.insert(group("old", version=1), version=2, now=0.0)  # fresh at 2, stale at 3
    with pytest.raises(RuntimeError, match="exceeds max_train_staleness"):
        core.sample(2, version=3, now=1.0)
    assert list(core.ready) == ["fresh", "old"] and core.depth == 4
    assert all(t.status == "buffered" for g in core.ready.values() for t in g)
    assert core.counts["consumed"] == 0
    assert [t.uid for t in core.evict_stale(3)] == ["old-0", "old-1"]
    assert [t.prompt_uid for t in core.sample(1, version=3, now=2.0)] == ["fresh"] * 2


@pytest.mark.parametrize("why", ["resume", "rebuild", "trainer_restart"])
def test_trajectories_held_again_come_back_with_their_exact_tokens(tmp_path, monkeypatch, why):
    """A resume, a rebuilt data module and a restarted trainer read every token array of
    the store (9.6 bytes a response token: 38 GB and two minutes at a million
    trajectories of 4k tokens) to hold a few groups again. They read the tokens of those
    alone, from a store of several chunks, and each comes back exact."""
    import asyncio

    import numpy as np

    from laminar.buffer import ExperienceBuffer
    from storage import trajectories as store
    from storage.resume import plan_rebuild, plan_resume

    rng = np.random.default_rng(7)
    written = {}
    for g in range(12):
        for i in range(2):
            n = int(rng.integers(1, 9000))  # (65,536 tokens a chunk: several chunks)
            version = int(rng.integers(0, 2))
            t = trajectory(
                f"p{g:08d}-{i:03d}",
                f"p{g:08d}",
                sample_idx=i,
                reward=float(i),
                behavior_version=version,
                finish_version=1,
                prompt=rng.integers(0, 2**31 - 1, int(rng.integers(1, 3000))),
                response=rng.integers(0, 2**31 - 1, n),
                behavior_logprobs=-rng.random(n, dtype=np.float32),
            )
            t.loss_mask = rng.integers(0, 2, n).astype(np.uint8)
            if g % 3:  # (the others: none)
                t.token_versions = (version + (np.arange(n) > n // 2)).astype(np.int32)
            written[t.uid] = t
    w = store.TrajectoryWriter(tmp_path)
    w.append([t.to_record() for t in written.values()])
    # p0-p3 trained by updates that stand; p4-p7 by updates after checkpoint 2, lost;
    # p8-p11 still buffered
    w.append(
        [],
        [
            dict(uid=u, status="consumed", sample_version=0 if u < "p00000004" else 2, t_sample=1.0)
            for u in written
            if u < "p00000008"
        ],
    )
    # held again: what updates after checkpoint 2 consumed, and (not a restarted
    # trainer: its buffer holds them still) what is buffered
    end = "p00000008" if why == "trainer_restart" else "q"
    held = [u for u in written if "p00000004" <= u < end]
    reads = []
    full_read = store.open_trajectories

    def spy(path, fields=None):
        reads.append(fields)
        return full_read(path, fields)

    monkeypatch.setattr(store, "open_trajectories", spy)
    plan = dict(
        resume=plan_resume(tmp_path, 2) if why == "resume" else None,
        rebuild=(
            plan_rebuild(tmp_path, version=2, consumed={}, since=2) if why == "rebuild" else None
        ),
    )
    reads.clear()

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool(12, 12)), _buffer_config(), **plan)
        if why == "trainer_restart":
            assert (await buf.trainer_restarted(2))["readmitted"] == len(held)
        out = [t for g in buf.core.ready.values() for t in g]
        await buf.close()
        return out

    back = asyncio.run(run())
    assert sorted(t.uid for t in back) == sorted(held)
    for t in back:
        for name in ("prompt_tokens", "response_tokens", "behavior_logprobs", "loss_mask"):
            want = getattr(written[t.uid], name)
            assert getattr(t, name).dtype == want.dtype and np.array_equal(getattr(t, name), want)
        assert np.array_equal(t.token_versions, written[t.uid].token_versions)
        assert len(t.token_versions) in (0, len(t.response_tokens))
    assert reads and None not in reads  # (every token array: never)


_uids = st.one_of(
    st.builds("p{:08d}-{:03d}".format, st.integers(0, 3), st.integers(0, 70)),
    st.builds("p{:08d}-{:03d}".format, st.integers(10**8 - 2, 10**8 + 2), st.integers(0, 1100)),
    st.text("p0123456789-\x00٣ x", max_size=15),
    st.builds(
        "{}{}".format,
        st.builds("p{:08d}-{:03d}".format, st.integers(0, 3), st.integers(0, 70)),
        st.sampled_from(["\x00", "\x00\x00", "0", "\n"]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.sampled_from(["add", "array", "set"]), st.lists(_uids, max_size=30)),
        max_size=5,
    ),
    probes=st.lists(_uids, max_size=30),
)
def test_the_set_of_uids_seen_is_exact_for_any_uid(batches, probes):
    """The buffer keeps every uid it saw for the whole run (~100 bytes each as strings:
    1 GB at 10 M trajectories): per prompt, a bitmask of its samples seen, for uids
    written ``p{n:08d}-{i:03d}``. It must hold exactly the uids a set would, whatever
    they are (others, "p1-0" or one ending in a NUL that numpy's string length leaves
    out, are kept as strings), added one by one or from a store's array."""
    import numpy as np

    from laminar.buffer import UidSet
    from storage.schema import STRING

    seen, want = UidSet(), set()
    for how, uids in batches:
        if how == "add":
            for u in uids:
                assert seen.add(u) == (u not in want)
                want.add(u)
        else:
            array = np.array(uids, dtype=STRING)
            seen.update(array if how == "array" else UidSet(array))
            want |= set(uids)
        assert len(seen) == len(want)
    for u in [*want, *probes]:
        assert (u in seen) == (u in want)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 5), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("restore"), st.integers(0, 5), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("sample"), st.integers(1, 2)),
        st.tuples(st.just("publish"), st.integers(1, 2)),
        st.tuples(st.just("stranded")),
        st.tuples(st.just("drain")),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, sampler=st.sampled_from(["fifo", "oldest_version", "same_version"]))
def test_the_depth_and_oldest_age_kept_as_trajectories_come_and_go_are_those_held(ops, sampler):
    """``depth`` (every insert's reply) and ``oldest_insert`` (every stats poll) were
    counted over every trajectory held at each read (0.24 ms and 6 ms at 4,096 groups);
    kept as trajectories come and go, they are what counting gives, through inserts,
    restores (an origin in place of ``t_insert``), samples, evictions and drains."""
    import math

    core = BufferCore(sampler, max_train_staleness=2)
    origin: dict[str, float] = {}
    version, now, n = 0, 0.0, 0
    for op, *args in ops:
        now += 1.0
        if op in ("insert", "restore"):
            group, size, late = f"p{args[0]:08d}", args[1] + 1, args[2]
            if op == "insert":
                n += 1  # (a new sample of the group each time: siblings come one by one)
                core.insert(
                    [traj(f"{group}-{n}", group, size, 0, version)], version=version, now=now
                )
            elif group not in core.ready and group not in core.partial:
                members = [traj(f"{group}-r{n}-{i}", group, size, i, version) for i in range(size)]
                n += 1
                for m in members:
                    m.t_insert = now - 10
                ages = {m.uid: now - 20 - late for m in members[:late]}
                origin |= ages
                core.restore([members], set(), "rebuild", ages)
        elif op == "sample":
            core.sample(args[0], version=version, now=now) if not any(
                core._too_stale(g, version) for g in core.ready.values()
            ) else core.evict_stale(version)
        elif op == "publish":
            version += args[0]
            core.evict_stale(version)
        elif op == "stranded":
            core.evict_stranded()
        else:
            core.drain()
        held = [m for g in core.ready.values() for m in g]
        held += [m for g in core.partial.values() for m in g.members]
        assert core.depth == len(held)
        want = min((origin.get(m.uid, m.t_insert) for m in held), default=math.nan)
        got = core.oldest_insert()
        assert got == want or (math.isnan(got) and math.isnan(want))


def test_a_core_told_the_restarts_counts_staleness_as_one_that_heard_them():
    """Restarts from checkpoint 10 after 19, from 10 again after 24 (the first restarted
    trainer wrote no checkpoint), from 25 after 30; the trainer at 31. A buffer rebuilt or
    resumed after them heard none (:meth:`BufferCore.trainer_restarted`) and counted by
    the numbers: the group of 25, on the trainer's lineage one update back, 6 stale
    (evicted at max_train_staleness 3), the one of 28, on a lost branch four updates
    away, 3 (trained), the one of 22, on an older lost branch, 9 for 5. Told the list
    at construction, it counts as one that heard each restart."""
    restarts = [(10, 19), (10, 24), (25, 30)]
    heard = BufferCore(max_train_staleness=3)
    for v, m in restarts:
        heard.trainer_restarted(v, m)
    told = BufferCore(max_train_staleness=3, restarts=restarts)
    unaware = BufferCore(max_train_staleness=3)
    pairs = [(t, b) for t in (30, 31, 34) for b in range(0, t + 1)]
    assert [told.lag(t, b) for t, b in pairs] == [heard.lag(t, b) for t, b in pairs]
    assert [told.lag(31, b) for b in (25, 28, 22, 10, 4)] == [1, 4, 5, 2, 8]
    assert [unaware.lag(31, b) for b in (25, 28, 22, 10, 4)] == [6, 3, 9, 21, 27]
    assert not told._too_stale(group("on", version=25), 31)
    assert told._too_stale(group("lost", version=28), 31)


def test_a_group_is_too_stale_when_any_member_is_along_a_restarted_lineage():
    """The trainer restarted from 10 and numbers its updates after 16. At 16 a group with
    a member generated by 10 (the restarted trainer's own weights: none behind) and one
    by 14 (on the lost branch: four behind) exceeds max_train_staleness 2. Judged by its
    oldest member's version, 10, it was trained, the member of 14 four versions stale."""
    core = BufferCore(max_train_staleness=2, restarts=[(10, 16)])
    members = [traj("g-0", "g", 2, 0, version=10), traj("g-1", "g", 2, 1, version=14)]
    left = core.insert(members, version=16, now=1.0)
    evicted, batch = core.take(1, version=16, now=2.0)
    assert batch is None and sorted(t.uid for t in left + evicted) == ["g-0", "g-1"]
    assert {t.status for t in left + evicted} == {"evicted"}
    assert max(core.lag(16, t.behavior_version) for t in members) == 4
