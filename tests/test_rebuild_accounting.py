"""A data module rebuilt within the run counts each prompt group out until it leaves,
and no longer (storage.resume.plan_rebuild with the real buffer, store and pool core).

A rollout learns that the store has its trajectories from the reply to its *next*
insert, so at a loss it still lists the group it sent last, whether or not that group
has left the lost buffer since."""

import asyncio

import numpy as np
import pytest
from test_buffer import _buffer_config, _Pool, traj
from test_storage import record

from laminar.buffer import ExperienceBuffer
from laminar.prompt_pool import PromptPoolCore
from laminar.tasks import Prompt
from storage import TrajectoryWriter
from storage.resume import plan_rebuild
from storage.trajectories import open_trajectories

PROMPTS = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(8)]


def _pool(start=0, outstanding=()):
    """A pool core with room for one group (``free`` dispatch, the laminar schedule's):
    one group counted out for ever stops dispatch."""
    return PromptPoolCore(
        PROMPTS, group_size=2, max_outstanding=1, seed=0, start=start, outstanding=outstanding
    )


async def _at_its_insert(buf):
    pass  # (filtered or discarded as it completes)


async def _evicted(buf):
    await buf.version_published(1)  # max_train_staleness=0: the group is too stale


async def _consumed_before_the_checkpoint(buf):
    assert len(await buf.sample(1, 1)) == 2  # the checkpoint at version 2 trained it


@pytest.mark.parametrize(
    ("status", "settings", "rewards", "reason", "leave", "since"),
    [
        ("filtered", dict(dynamic_sampling=True), (1.0, 1.0), "eos", _at_its_insert, 0),
        ("discarded", {}, (0.0, 1.0), "error", _at_its_insert, 0),
        ("evicted", dict(max_train_staleness=0), (0.0, 1.0), "eos", _evicted, 0),
        ("consumed", {}, (0.0, 1.0), "eos", _consumed_before_the_checkpoint, 2),
    ],
    ids=["filtered", "discarded", "evicted", "consumed_before_the_checkpoint"],
)
def test_a_group_that_left_before_the_loss_is_not_counted_out_again(
    tmp_path, status, settings, rewards, reason, leave, since
):
    """The group left the lost buffer and its leave is committed; the rollout still
    holds it (no reply told it the store has it). What it sends the new buffer again is
    dropped as seen, so nothing leaves for that group again: counted out, it held its
    back-pressure slot for the rest of the run (with ``free`` dispatch, enough of them
    stop dispatch; ``same_version`` never evicts them)."""
    cfg = _buffer_config(flush_records=1, **settings)
    lost_pool = _pool()
    (group,) = lost_pool.acquire(1, "r0", 0)
    kept = [
        traj(f"{group.prompt_uid}-{i}", group.prompt_uid, 2, i, 0, reason, reward)
        for i, reward in enumerate(rewards)
    ]

    async def before_the_loss():
        buf = ExperienceBuffer(str(tmp_path), _Pool(lost_pool), cfg)
        assert (await buf.insert(kept, "r0"))["stored"] == []  # the rollout keeps them
        await leave(buf)
        await buf.sync()
        await buf.close()  # (nothing is pending: as if lost now)

    asyncio.run(before_the_loss())
    assert lost_pool.outstanding == set()
    assert open_trajectories(tmp_path)["status"].tolist() == [status, status]

    plan = plan_rebuild(
        tmp_path, version=2, consumed={}, since=since, held_groups={group.prompt_uid}
    )
    assert plan.outstanding == [] and plan.hold == [] and plan.start == 1
    pool = _pool(plan.start, tuple(plan.outstanding))

    async def after_the_rebuild():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg, rebuild=plan)
        ack = await buf.insert(kept, "r0")  # the rollout sends again what it kept
        assert sorted(ack["stored"]) == [t.uid for t in kept]  # it may forget them now
        assert buf.core.counts["duplicates"] == 2 and buf.core.depth == 0
        for v in range(2, 5):
            assert await buf.sample(1, v) is None
            await buf.version_published(v + 1)
        await buf.close()

    asyncio.run(after_the_rebuild())
    assert pool.outstanding == set()
    assert [g.prompt_uid for g in pool.acquire(1, "r0", 5)] == ["p00000001"]


def test_held_groups_that_may_still_leave_stay_counted_out(tmp_path):
    """Only a group the store has whole, none of it held again, has left for good.
    A held group stays out while any of it may still arrive or leave: in part in the
    store, held again (taken back from a batch the trainer never received), or not
    stored at all; a group the trainer consumed is out no more (its rollout's copy, if
    the store lacks it, is stored as consumed)."""

    def group(g, n=2, status="buffered", **kw):
        if status == "buffered":
            kw = {"sample_version": -1, "t_sample": np.nan} | kw
        return [
            record(2 * g + k, prompt_uid=f"p{g:08d}", status=status, uid=f"p{g:08d}-{k}", **kw)
            for k in range(n)
        ]

    TrajectoryWriter(tmp_path).append(
        group(0, status="filtered", sample_version=-1, t_sample=np.nan)  # left whole
        + group(1, n=1)  # one sibling buffered, the other with its rollout
        + group(2, status="consumed", sample_version=3)  # its reply died with the buffer
        + group(3, status="consumed", sample_version=3)  # the trainer has it
        + group(4, status="consumed", sample_version=1)  # trained into the checkpoint
    )
    consumed = {f"p00000003-{k}": (3, 9.0) for k in range(2)}
    consumed |= {f"p00000006-{k}": (3, 9.0) for k in range(2)}  # never stored
    held = {f"p{g:08d}" for g in (0, 1, 2, 3, 4, 5, 6)}  # 5: generating
    plan = plan_rebuild(tmp_path, version=4, consumed=consumed, since=2, held_groups=held)
    assert plan.hold == ["p00000001-0", "p00000002-0", "p00000002-1"]
    assert plan.outstanding == ["p00000001", "p00000002", "p00000005"]
    assert plan.start == 7


def test_a_rebuilt_prompt_pool_starts_at_the_trainers_newest_version(small_config, tiny_policy):
    """The rebuild hands the pool the trainer's newest version (``ResumePlan.version``,
    pipelines/restart.py). Started at the run's first version instead, until the next
    publication top_up handed groups to a rollout on an old version, and take told an
    idle rollout behind the trainer that it was current."""
    from laminar.prompt_pool import PromptPool
    from storage.resume import ResumePlan

    pool = PromptPool(
        small_config, str(tiny_policy), ResumePlan(version=5, readmit_groups=["p00000002"], start=3)
    )

    async def asks():
        return (
            await pool.top_up(1, "r0", 4),
            await pool.take(1, "r1", 4),
            await pool.top_up(1, "r0", 5),
        )

    behind, taken, current = asyncio.run(asks())
    assert behind == ([], 5)  # a batch of version 4 is not topped up: 5 is out
    assert taken[1] == 5  # (told to load version 5)
    assert [g.prompt_uid for g in current[0]] == ["p00000004"] and current[1] == 5
    assert pool.core.outstanding >= {"p00000002"}


def test_a_resumed_runs_groups_not_yet_reissued_are_dropped_or_reissued_whole(tmp_path):
    """A run resumed in place before 2026-12-06 re-issued the missing samples of its
    groups stored in part; one resumed at any time re-issues the groups only its
    recovery log knows, whole. When its data module is lost before a rollout took them,
    nothing else will complete them (they used to stay counted out for the rest of the
    run, each holding a back-pressure slot). The rebuilt pool re-issues the second whole;
    the first is dropped, not completed: its missing sample would be generated by the
    rollouts' weights now, its stored one by the lost run's, one GRPO group of two
    behavior policies (it was re-issued, and completed so)."""
    from test_partial_log import _states

    from laminar.partial import PartialCore
    from laminar.prompt_pool import PromptGroup
    from storage.partial_log import PartialLogWriter

    def sample(g, k, **kw):
        kw = {"sample_version": -1, "t_sample": np.nan} | kw
        uid = f"p{g:08d}-{k}"
        return record(2 * g + k, prompt_uid=f"p{g:08d}", uid=uid, status="buffered", **kw)

    TrajectoryWriter(tmp_path).append(
        [sample(1, 0)]  # its sibling 1 waits in the lost pool to be re-issued
        + [sample(2, 1)]  # its sibling 0 is generating on a rollout
        + [sample(3, 0), sample(3, 1)]  # whole
    )
    # Group 9: only the log knows it (its entries kept for the resume's re-issue).
    states = _states(["p00000009-0", "p00000009-1"], seed=0)
    group = PromptGroup("p00000009", 4, (1, 2, 3), "7", 2, 0, None)
    for state in states:
        state.request.meta["group"] = group
    core = PartialCore(journal=True)
    core.register("r0", 0, states)
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    plan = plan_rebuild(tmp_path, version=4, consumed={}, since=2, held_groups={"p00000002"})
    assert plan.reissue == {"p00000009": (4, 2, (0, 1))}
    assert plan.drop == ["p00000001-0"] and "p00000001-0" not in plan.hold
    assert plan.outstanding == ["p00000002", "p00000003", "p00000009"]
    assert plan.start == 10
    summary = plan.summary()
    assert (summary["reissued_groups"], summary["dropped_incomplete_groups"]) == (1, 1)

    async def rebuilt():
        pool = PromptPoolCore(
            PROMPTS, group_size=2, max_outstanding=8, seed=0, start=plan.start,
            outstanding=tuple(plan.outstanding), reissue=plan.reissue,
        )  # fmt: skip
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config(), rebuild=plan)
        assert "p00000001" not in buf.core.partial and buf.core.depth == 3
        await buf.close()

    asyncio.run(rebuilt())
    store = open_trajectories(tmp_path)
    status = dict(zip(store["uid"].tolist(), store["status"].tolist(), strict=True))
    assert status["p00000001-0"] == "dropped"


def test_a_rebuilt_buffer_counts_staleness_along_the_restarts_it_is_handed(tmp_path):
    """The trainer restarted from checkpoint 10 after the lost one published 19; the
    data module is lost later, at version 20. Its store holds a group generated by 10 (on
    the restarted trainer's lineage: one update back at 20) and one by the lost 15 (five
    updates down the lost branch: six). The rebuilt buffer heard no restart: by the
    numbers it evicted the first (10 stale) and kept the second (5) at
    max_train_staleness 5. With the restarts its plan hands it, the other way round."""
    from factories import trajectory

    def stored(g, i, version):
        t = trajectory(f"{g}-{i}", g, sample_idx=i, behavior_version=version)
        return t.to_record() | {"status": "buffered", "finish_version": version}

    TrajectoryWriter(tmp_path).append(
        [stored(g, i, v) for g, v in (("a", 10), ("b", 15)) for i in (0, 1)]
    )
    plan = plan_rebuild(tmp_path, version=20, consumed={}, since=10)
    assert sorted(plan.hold) == ["a-0", "a-1", "b-0", "b-1"]
    plan.restarts = [(10, 19)]  # (pipelines.restart.DataRestart: the run's restarts)
    cfg = _buffer_config(max_train_staleness=5)

    async def rebuilt():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool()), cfg, rebuild=plan)
        evicted = sorted(t.uid for t in buf.core.evict_stale(20))
        await buf.close()
        return evicted

    assert asyncio.run(rebuilt()) == ["b-0", "b-1"]


def _consumed_from_a_lost_buffer(tmp_path, version: int):
    """A group of two the trainer sampled at ``version`` from a buffer lost before its
    store had it: the buffer's config, the group, its trajectories and the trainer's
    record of them (uid -> sample version, time)."""
    cfg = _buffer_config(flush_interval_s=1e9)
    lost_pool = PromptPoolCore(PROMPTS, group_size=2, max_outstanding=8, seed=0)
    (g,) = lost_pool.acquire(1, "r0", version)
    sent = [
        traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reward=float(i)) for i in (0, 1)
    ]
    consumed = {}

    async def lose():
        buf = ExperienceBuffer(str(tmp_path), _Pool(lost_pool), cfg)
        await buf.insert(sent, "r0")  # (never stored: lost with the buffer)
        batch = await buf.sample(1, version)
        consumed.update({t.uid: (t.sample_version, t.t_sample) for t in batch})

    asyncio.run(lose())
    return cfg, g, sent, consumed


def test_a_restart_gives_back_what_a_lost_update_consumed_from_the_lost_buffer(tmp_path):
    """The trainer consumed a group at version 3 from a buffer lost before its store had
    it; the rebuilt buffer is to store each sibling consumed as its rollout sends it
    again. One arrives, then the trainer is lost and restarts from its checkpoint at 2
    (the update at 3 is lost), then the other arrives. The restart holds the first again
    and the second must be admitted as new, completing the group for the restarted
    trainer: stored consumed at 3 instead, the held sibling waited for it for ever, the
    store recorded training that never happened and the pool counted the group done."""
    cfg, g, sent, consumed = _consumed_from_a_lost_buffer(tmp_path, 3)
    plan = plan_rebuild(tmp_path, version=4, consumed=consumed, since=3, held_groups=set())
    assert sorted(plan.consumed_elsewhere) == [t.uid for t in sent]
    pool = PromptPoolCore(
        PROMPTS, group_size=2, max_outstanding=8, seed=0, start=plan.start,
        outstanding=tuple(plan.outstanding),
    )  # fmt: skip
    resent = [traj(t.uid, g.prompt_uid, 2, t.sample_idx, 3, reward=t.reward) for t in sent]

    async def rebuilt():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg, rebuild=plan)
        await buf.insert(resent[:1], "r0")
        back = await buf.trainer_restarted(2, 4)
        assert back == {"readmitted": 1, "groups": 1, "consumed_unstored": {}}
        assert pool.outstanding == {g.prompt_uid}  # out again until it leaves again
        await buf.insert(resent[1:], "r0")
        batch = await buf.sample(1, 5)  # the restarted trainer's first update
        assert sorted(t.uid for t in batch) == [t.uid for t in sent]
        await buf.close()

    asyncio.run(rebuilt())
    assert pool.outstanding == set()
    store = open_trajectories(tmp_path)
    assert store["status"].tolist() == ["consumed", "consumed"]
    assert store["sample_version"].tolist() == [5, 5]


def test_a_rebuilt_buffers_sync_names_what_it_still_waits_to_store_consumed(tmp_path):
    """The trainer drops from its record, at each checkpoint, what was sampled before it:
    the store has it, but for what the lost buffer never stored and its rollout has not
    sent again. sync() names those, for the trainer to keep; a second loss then rebuilds
    knowing they were consumed, and one sent again is stored consumed, not admitted as
    new (its group never complete for want of the sibling sent before)."""
    cfg, g, sent, consumed = _consumed_from_a_lost_buffer(tmp_path, 0)
    plan = plan_rebuild(tmp_path, version=1, consumed=consumed, since=0, held_groups=set())
    resent = [traj(t.uid, g.prompt_uid, 2, t.sample_idx, 0, reward=t.reward) for t in sent]
    kept = {}

    async def rebuilt_then_lost():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool(plan.start)), cfg, rebuild=plan)
        await buf.insert(resent[:1], "r0")
        synced = await buf.sync()  # the trainer's checkpoint at version 2
        assert synced["written"] == 1
        kept.update(synced["consumed_unstored"])

    asyncio.run(rebuilt_then_lost())
    assert kept == {sent[1].uid: consumed[sent[1].uid]}
    # the second rebuild, from the trainer's record past its checkpoint at 2
    record = {u: c for u, c in consumed.items() if c[0] >= 2} | kept
    again = plan_rebuild(tmp_path, version=2, consumed=record, since=2, held_groups=set())
    assert again.consumed_elsewhere == kept and again.outstanding == []

    async def rebuilt_again():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool(again.start)), cfg, rebuild=again)
        await buf.insert(resent[1:], "r0")
        assert buf.core.depth == 0 and (await buf.sync())["consumed_unstored"] == {}
        await buf.close()

    asyncio.run(rebuilt_again())
    assert open_trajectories(tmp_path)["status"].tolist() == ["consumed", "consumed"]


def test_a_restarted_trainer_keeps_what_its_buffer_still_waits_to_store_consumed(tmp_path):
    """A data module lost (the trainer had consumed a group from it, never stored), then
    the trainer lost (restarted from its checkpoint at 2, which trained the group; the
    lost one published up to 3), then the data module lost again before the new
    trainer's first checkpoint. The restart's answer names the group's siblings, which
    the restarted trainer keeps in its record (``Trainer(consumed=...)``, from its
    checkpoint's version): the second rebuild knows them consumed, and sent again they
    are stored consumed at 0. With the restarted trainer's record empty, they were
    admitted as new and trained again at 4 (helper 183's sequence)."""
    cfg, g, sent, consumed = _consumed_from_a_lost_buffer(tmp_path, 0)
    plan = plan_rebuild(tmp_path, version=1, consumed=consumed, since=0, held_groups=set())
    back = {}

    async def rebuilt_then_trainer_lost():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool(plan.start)), cfg, rebuild=plan)
        await buf.sync()  # the lost trainer's checkpoint at 2 (it trained the group)
        back.update(await buf.trainer_restarted(2, 3))
        await buf.close()

    asyncio.run(rebuilt_then_trainer_lost())
    assert back["consumed_unstored"] == consumed
    # the restarted trainer's record (Trainer.consumed_record) as the second rebuild reads it
    again = plan_rebuild(
        tmp_path, version=3, consumed=back["consumed_unstored"], since=2,
        held_groups={g.prompt_uid},
    )  # fmt: skip
    assert again.consumed_elsewhere == consumed and again.outstanding == []
    resent = [traj(t.uid, g.prompt_uid, 2, t.sample_idx, 0, reward=t.reward) for t in sent]

    async def rebuilt_again():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool(again.start)), cfg, rebuild=again)
        await buf.insert(resent, "r0")
        assert buf.core.depth == 0 and await buf.sample(1, 4) is None
        await buf.close()

    asyncio.run(rebuilt_again())
    store = open_trajectories(tmp_path)
    assert store["status"].tolist() == ["consumed", "consumed"]
    assert store["sample_version"].tolist() == [0, 0]
