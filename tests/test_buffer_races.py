"""The buffer's calls interleaved: while one awaits the prompt pool (an actor call, which
lets the worker's event loop run the buffer's other calls), another changes what the
buffer holds. What the first decided before its await must still hold after it.

The real ExperienceBuffer and prompt pool core, behind a pool surface whose chosen call
waits at a gate (:class:`_GatedPool`): each interleaving is reproduced exactly."""

import asyncio

from test_buffer import _buffer_config, _Pool, _pool, traj

from laminar.buffer import ExperienceBuffer


class _GatedPool(_Pool):
    """The prompt pool's async surface over the real core, whose next call named
    ``gated`` waits at ``gate`` before the pool has it (the request on its way):
    ``waiting`` is set when it does."""

    def __init__(self, core):
        super().__init__(core)
        self.gated: str | None = None
        self.waiting, self.gate = asyncio.Event(), asyncio.Event()
        self.untrained: list[str] = []  # every group released untrained, each time

    async def _pause(self, name):
        if self.gated == name:
            self.gated = None
            self.waiting.set()
            await self.gate.wait()

    async def release(self, prompt_uids, untrained=()):
        self.untrained += list(untrained)
        await self._pause("release")
        await super().release(prompt_uids, untrained)

    async def hold_again(self, prompt_uids):
        await self._pause("hold_again")
        await super().hold_again(prompt_uids)

    async def room(self):
        await self._pause("room")
        return await super().room()


def _group(pool, version, siblings=(0, 1)):
    """Samples ``siblings`` of a group of two the pool dispatches at ``version``
    (rewards 0 and 1: none is filtered as flat)."""
    [g] = pool.acquire(1, "r0", version)
    return [
        traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reward=float(i)) for i in siblings
    ]


async def _while_waiting(pool, call, then):
    """``call`` until the pool's gated call waits, ``then`` meanwhile, then its answer."""
    task = asyncio.create_task(call)
    await pool.waiting.wait()
    await then()
    pool.gate.set()
    return await task


def test_a_group_admitted_while_sample_awaits_the_pool_is_never_sampled_too_stale(tmp_path):
    """one_step: the trainer samples at its version, one ahead of the buffer's published
    one. A straggler admitted while the sample released the groups it evicted passed the
    check at the published version (5 - 4 = 1) and is too stale at the trainer's (6 - 4
    = 2): the sample raised "exceeds max_train_staleness; evict first", and the trainer
    failed with it. Eviction and sampling are one step now; the straggler is evicted by
    the next sample, and every evicted group is released untrained once."""
    pool = _pool(10, max_outstanding=10)
    cfg = _buffer_config(max_train_staleness=1)

    async def run():
        gated = _GatedPool(pool)
        buf = ExperienceBuffer(str(tmp_path), gated, cfg)
        await buf.version_published(5)  # the trainer holds 6, not yet published
        ok, old = _group(pool, 5), _group(pool, 4)
        await buf.insert(ok)
        await buf.insert(old)  # (5 - 4 = 1: admitted)
        late = _group(pool, 4)
        gated.gated = "release"
        batch = await _while_waiting(gated, buf.sample(2, 6), lambda: buf.insert(late))
        assert batch is None  # only "ok" is fresh enough at 6
        assert list(buf.core.ready) == [ok[0].prompt_uid, late[0].prompt_uid]
        assert await buf.sample(2, 6) is None  # ... and "late" leaves now
        assert list(buf.core.ready) == [ok[0].prompt_uid]
        assert sorted(gated.untrained) == sorted([old[0].prompt_uid, late[0].prompt_uid])
        assert pool.outstanding == {ok[0].prompt_uid}
        s = buf.core.stats()
        assert s["groups_evicted"] == 2 and s["evicted"] == 4 and s["groups_consumed"] == 0
        assert {t.status for t in old + late} == {"evicted"}
        await buf.insert(_group(pool, 5))
        batch = await buf.sample(2, 6)
        assert len(batch) == 4 and all(6 - t.behavior_version <= 1 for t in batch)
        assert pool.outstanding == set() and not buf.core.ready
        await buf.close()

    asyncio.run(run())


def test_same_version_evicts_no_batch_that_completed_while_the_pool_answered(tmp_path):
    """same_version, every slot taken and no version with a batch: the buffer asks the
    pool whether anything more can arrive. A group completing meanwhile (its last sibling
    in) makes a batch of the oldest version, which the stranded eviction, decided on
    what was held before, used to evict whole. The batch is sought again after the
    pool's answer, and sampled."""
    pool = _pool(10, max_outstanding=3)
    cfg = _buffer_config(sampler="same_version", max_train_staleness=5)

    async def run():
        gated = _GatedPool(pool)
        buf = ExperienceBuffer(str(tmp_path), gated, cfg)
        first, second, newer = _group(pool, 0), _group(pool, 0, (0,)), _group(pool, 1)
        for g in (first, second, newer):
            await buf.insert(g)
        assert pool.full() and len(buf.core.ready) == 2  # (second misses a sibling)
        last = [traj(second[0].uid[:-1] + "1", second[0].prompt_uid, 2, 1, 0, reward=1.0)]
        gated.gated = "room"
        batch = await _while_waiting(gated, buf.sample(2, 1), lambda: buf.insert(last))
        assert batch is not None, "the batch of version 0 was evicted as stranded"
        assert {t.prompt_uid for t in batch} == {first[0].prompt_uid, second[0].prompt_uid}
        s = buf.core.stats()
        assert s["groups_stranded"] == s["groups_evicted"] == 0 and s["groups_consumed"] == 2
        assert pool.outstanding == {newer[0].prompt_uid} and gated.untrained == []
        await buf.close()

    asyncio.run(run())


def test_groups_held_again_for_a_restarted_trainer_leave_once_the_pool_holds_them(tmp_path):
    """A restarted trainer's lost updates: their groups are held again, and the pool
    counts them out again. The buffer used to hold them first: a version published
    while the pool was being told evicted them and released them to a pool that did not
    count them out yet (a release it ignores), and then counted them out for good: their
    slots were never freed. The pool hears first now; the groups leave after."""
    pool = _pool(10, max_outstanding=4)
    cfg = _buffer_config(max_train_staleness=1)

    async def run():
        gated = _GatedPool(pool)
        buf = ExperienceBuffer(str(tmp_path), gated, cfg)
        lost = [_group(pool, 0), _group(pool, 0)]
        for g in lost:
            await buf.insert(g)
        assert len(await buf.sample(2, 0)) == 4  # the update after checkpoint 0, lost
        assert pool.outstanding == set()
        gated.gated = "hold_again"
        back = await _while_waiting(
            gated, buf.trainer_restarted(0), lambda: buf.version_published(2)
        )
        assert back == {"readmitted": 4, "groups": 2, "consumed_unstored": {}}
        assert await buf.sample(2, 2) is None  # too stale at 2: they leave
        s = buf.core.stats()
        assert s["groups_evicted"] == 2 and s["depth"] == 0
        assert sorted(gated.untrained) == sorted(g[0].prompt_uid for g in lost)
        assert pool.outstanding == set(), "slots held for groups the buffer no longer has"
        await buf.close()

    asyncio.run(run())


def _consumed_events(buf) -> list[str]:
    """The uids of every ``consumed`` leave the buffer hands its writer, as it does (the
    records of trajectories consumed before their own were written, then the events)."""
    out: list[str] = []
    append = buf.writer.append

    def spy(records, events=()):
        out.extend(r["uid"] for r in records if r["status"] == "consumed")
        out.extend(e["uid"] for e in events if e["status"] == "consumed")
        return append(records, events)

    buf.writer.append = spy
    return out


def test_a_sample_asked_again_under_its_id_gets_the_same_batch_sampled_once(tmp_path):
    """The trainer's call timed out (``cluster.actor_timeout_s``) while the buffer, having
    taken the batch, waited on the pool; the trainer found the buffer slow, not lost, and
    asked again. The second call took a second batch for the same update, and the first,
    recorded consumed at that version, was never trained. Asked again under the same
    request id, the buffer answers the same batch, its consumed events written once; a
    new id forgets it."""
    pool = _pool(10, max_outstanding=10)
    cfg = _buffer_config(flush_records=1)  # (every record written at once: leaves are events)

    async def run():
        gated = _GatedPool(pool)
        buf = ExperienceBuffer(str(tmp_path), gated, cfg)
        consumed = _consumed_events(buf)
        groups = [_group(pool, 0) for _ in range(4)]
        for g in groups:
            await buf.insert(g)
        gated.gated = "release"
        first = asyncio.create_task(buf.sample(2, 0, ("trainer", 0)))
        await gated.waiting.wait()  # taken; its answer is late: the trainer asks again
        again = await buf.sample(2, 0, ("trainer", 0))
        gated.gate.set()
        assert [t.uid for t in await first] == [t.uid for t in again]
        assert {t.prompt_uid for t in again} == {g[0].prompt_uid for g in groups[:2]}
        s = buf.core.stats()
        assert s["groups_consumed"] == 2 and s["ready_groups"] == 2
        assert await buf.sample(2, 0, ("trainer", 0)) is again  # (still: asked once more)
        second = await buf.sample(2, 0, ("trainer", 1))
        assert {t.prompt_uid for t in second} == {g[0].prompt_uid for g in groups[2:]}
        assert await buf.sample(2, 0, ("trainer", 0)) is None  # forgotten: nothing left
        assert pool.outstanding == set()
        await buf.sync()
        everything = [t.uid for g in groups for t in g]
        assert sorted(consumed) == sorted(everything), "a batch's sample recorded twice"
        await buf.close()

    asyncio.run(run())


class _FailingPool(_GatedPool):
    """Its next ``release`` raises (the pool's answer lost on the way) when ``fail``."""

    fail = False

    async def release(self, prompt_uids, untrained=()):
        if self.fail:
            self.fail = False
            raise ConnectionError("the pool's answer was lost")
        await super().release(prompt_uids, untrained)


def test_a_batch_whose_release_raised_is_the_answer_to_the_sample_asked_again(tmp_path):
    """Releasing a sampled batch's groups to the pool raised: the batch had left the
    buffer and never reached the trainer, which (the error one of a lost call) asked
    again and got another. The batch is the answer to the request asked again now, its
    sample recorded once, and its groups are released by the buffer's next call: their
    slots are not held for good."""
    pool = _pool(10, max_outstanding=10)
    cfg = _buffer_config(flush_records=1)

    async def run():
        failing = _FailingPool(pool)
        buf = ExperienceBuffer(str(tmp_path), failing, cfg)
        consumed = _consumed_events(buf)
        groups = [_group(pool, 0) for _ in range(3)]
        for g in groups:
            await buf.insert(g)
        failing.fail = True
        try:
            await buf.sample(2, 0, ("trainer", 0))
            raise AssertionError("the release did not raise")
        except ConnectionError:
            pass
        batch = await buf.sample(2, 0, ("trainer", 0))
        assert batch is not None, "the batch taken was lost"
        assert {t.prompt_uid for t in batch} == {g[0].prompt_uid for g in groups[:2]}
        assert buf.core.stats()["groups_consumed"] == 2
        assert pool.outstanding == {g[0].prompt_uid for g in groups}  # (not yet released)
        await buf.insert([])  # the next call that releases anything releases them too
        assert pool.outstanding == {groups[2][0].prompt_uid}
        await buf.sync()
        assert sorted(consumed) == sorted(t.uid for t in batch)
        await buf.close()

    asyncio.run(run())


def test_a_release_owed_is_made_before_a_restarted_trainer_holds_the_groups_again(tmp_path):
    """A batch whose release raised, then the trainer lost: the restarted trainer's
    buffer holds the batch again (counted out again by the pool). The release owed is
    made first: made after, it freed the slots of groups the buffer holds; and the lost
    trainer's batch is no answer to anyone's request now."""
    pool = _pool(10, max_outstanding=10)
    cfg = _buffer_config(flush_records=1)

    async def run():
        failing = _FailingPool(pool)
        buf = ExperienceBuffer(str(tmp_path), failing, cfg)
        groups = [_group(pool, 0) for _ in range(2)]
        for g in groups:
            await buf.insert(g)
        failing.fail = True
        try:
            await buf.sample(2, 0, ("lost", 0))
        except ConnectionError:
            pass
        assert await buf.trainer_restarted(0) == {
            "readmitted": 4,
            "groups": 2,
            "consumed_unstored": {},
        }
        await buf.insert([])
        assert pool.outstanding == {g[0].prompt_uid for g in groups}
        assert await buf.sample(2, 0, ("lost", 0)) is None  # (the lost trainer's: refused)
        assert await buf.sample(2, 0, ("new", 0)) is not None  # (held again: sampled anew)
        assert pool.outstanding == set()
        await buf.close()

    asyncio.run(run())


def test_a_lost_trainers_sample_waiting_on_the_pool_is_held_again_by_the_restart(tmp_path):
    """same_version: the lost trainer's sample waited on the pool (``room``, in
    ``_stranded``) while the trainer restarted from checkpoint 1. It used to go on after
    the restart had read the store: it took a batch, recorded consumed at the lost
    trainer's version, kept as the answer to the lost trainer's request, and nobody
    trained it (no restart or resume held it again once a newer checkpoint stood). The
    restart waits for it now and holds its batch again; and a call of the lost trainer
    after the restart takes nothing."""
    pool = _pool(20, max_outstanding=4)
    cfg = _buffer_config(sampler="same_version", max_train_staleness=5, flush_records=1)

    async def run():
        gated = _GatedPool(pool)
        buf = ExperienceBuffer(str(tmp_path), gated, cfg)
        await buf.insert(_group(pool, 0))
        await buf.insert(_group(pool, 1))
        gated.gated = "room"
        lost = asyncio.create_task(buf.sample(2, 1, ("lost", 7)))
        await gated.waiting.wait()  # the lost trainer's call waits on the pool
        restart = asyncio.create_task(buf.trainer_restarted(1, 1))
        await asyncio.sleep(0.05)
        assert not restart.done(), "the restart ran while the lost trainer's sample did"
        second = _group(pool, 1)
        await buf.insert(second)  # a second version-1 group: a batch exists now
        gated.gate.set()
        taken = await lost
        assert taken is not None and len(taken) == 4
        back = await restart
        assert back == {"readmitted": 4, "groups": 2, "consumed_unstored": {}}, (
            "the lost sample's batch not held again"
        )
        assert await buf.sample(2, 1, ("lost", 8)) is None  # the lost trainer: nothing
        batch = await buf.sample(2, 1, ("new", 0))
        assert sorted(t.uid for t in batch) == sorted(t.uid for t in taken)
        await buf.close()
        from storage.trajectories import open_trajectories

        a = open_trajectories(str(tmp_path))
        status = dict(zip(a["uid"].tolist(), a["status"].tolist(), strict=True))
        consumed = {u for u, s in status.items() if s == "consumed"}
        assert consumed == {t.uid for t in batch}

    asyncio.run(run())


def test_a_restarted_trainer_evicts_along_its_weights_lineage(tmp_path):
    """Checkpoint 10, the lost trainer at 19, max_train_staleness 1. The restarted
    trainer holds 10's weights under the number 19: a group generated by 10 (held again:
    the lost update at 10 consumed it) is on-policy for it, and one generated by the
    lost 19 is nine updates down a branch it does not descend from. By the numbers the
    first was evicted as 9 stale and the second trained at 0."""
    pool = _pool(20, max_outstanding=10)
    cfg = _buffer_config(max_train_staleness=1)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        await buf.version_published(10)
        ours = _group(pool, 10)
        await buf.insert(ours)
        assert len(await buf.sample(1, 10, ("lost", 0))) == 2  # the update at 10, lost
        await buf.version_published(19)
        back = await buf.trainer_restarted(10, 19)
        assert back["groups"] == 1
        branch = _group(pool, 19)  # a rollout still on the lost version 19
        await buf.insert(branch)
        batch = await buf.sample(1, 19, ("new", 0))
        assert [t.uid for t in batch] == [t.uid for t in ours]
        assert batch[0].sample_version == 19  # (s_train is recorded by the numbers)
        s = buf.core.stats()
        assert s["groups_evicted"] == 1 and s["depth"] == 0, "the lost branch's group trained"
        await buf.close()

    asyncio.run(run())


def test_a_rollouts_first_trajectories_are_reported_stored_to_it(tmp_path):
    """The writer thread reports each commit to the list of the rollout that sent it,
    and a rollout's list was made at the end of its first insert, after the flush: a
    commit made while that insert awaited the partial-response pool found no list, and
    the rollout was never told those trajectories were stored (it kept them, and sent
    them again to every rebuilt buffer). Here the pool's ``hold`` returns only once the
    writer has committed the insert's batch."""
    from laminar.partial import PartialResponsePool

    class _SlowPartial(PartialResponsePool):
        buf: ExperienceBuffer

        async def hold(self, uids):
            await asyncio.to_thread(self.buf._jobs.join)  # (committed meanwhile)
            await super().hold(uids)

    pool = _pool(4, max_outstanding=4)

    async def run():
        partial = _SlowPartial()
        buf = partial.buf = ExperienceBuffer(
            str(tmp_path), _Pool(pool), _buffer_config(flush_records=1), partial=partial
        )
        reported = []
        for _ in range(3):
            (group,) = pool.acquire(1, "r0", 0)
            t = traj(f"{group.prompt_uid}-0", group.prompt_uid, 2, 0)
            reported += (await buf.insert([t], "r0"))["stored"]
        await buf.sync()
        reported += (await buf.insert([], "r0"))["stored"]
        await buf.close()
        return reported

    assert asyncio.run(run()) == [f"p{g:08d}-0" for g in range(3)]
