from itertools import chain, repeat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.prompt_pool import PromptPoolCore
from laminar.tasks import Prompt


def rule_pool(dispatch: str, max_outstanding: int, **rule) -> PromptPoolCore:
    """A pool of 7 prompts in groups of 2 under a dispatch rule (``groups_per_step``,
    ``replicas``, ``lag``, ``eta``)."""
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(7)]
    return PromptPoolCore(
        prompts, group_size=2, max_outstanding=max_outstanding, seed=0, dispatch=dispatch, **rule
    )


def make_pool(max_outstanding=3, n=5):
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(n)]
    return PromptPoolCore(prompts, group_size=4, max_outstanding=max_outstanding, seed=0)


def test_back_pressure_bounds_outstanding_groups():
    pool = make_pool(max_outstanding=3)
    got = pool.acquire(10)
    assert len(got) == 3 and pool.acquire(1) == []
    pool.release([got[0].prompt_uid, "unknown"])
    assert len(pool.acquire(5)) == 1
    assert pool.stats() == {
        "dispatched": 4,
        "released": 1,
        "untrained": 0,
        "outstanding": 3,
        "reissued": 0,
        "reissued_at_fence": 0,
        "answered_again": 0,
        "held_again": 0,
        "queued": 0,
        "passed_over": 0,
        "epoch": 0,
        "batch": 0,
    }


@settings(max_examples=150, deadline=None)
@given(
    waiting=st.integers(1, 3),
    max_outstanding=st.integers(1, 6),
    freed=st.lists(st.integers(1, 3), min_size=12, max_size=40),
)
def test_a_rollout_that_loads_weights_between_asks_is_not_passed_over(
    waiting, max_outstanding, freed
):
    """Under back-pressure, ``waiting`` rollouts wait in the pool and ask the moment room
    frees; ``late`` asks only after them (it loads a version between its asks, like a
    replacement behind the trainer). Room goes in the order rollouts queued for it: every
    rollout is served within a few releases, and the bound holds."""
    pool = rule_pool("free", max_outstanding)
    out = [g.prompt_uid for g in pool.acquire(max_outstanding, "r0", idle=True, now=0.0)]
    served = {f"r{i}": 0 for i in range(waiting)} | {"late": 0}
    starved = dict.fromkeys(served, 0)  # releases since each was last served
    now = 1.0
    for k in freed:
        pool.release(out[:k])
        out = out[k:]
        for rid in [*served][:-1] + ["late"]:  # ``late`` always asks last
            got = pool.acquire(2, rid, idle=True, now=now)
            out += [g.prompt_uid for g in got]
            served[rid] += len(got)
            starved[rid] = 0 if got else starved[rid] + 1
            assert len(pool.outstanding) <= max_outstanding
        now += 1.0
        assert max(starved.values()) <= len(served) + 1, (starved, pool.stats())
    assert served["late"] > 0 or sum(freed) < 2 * len(served)


def test_a_queued_rollout_that_stops_asking_gives_up_its_place():
    pool = make_pool(max_outstanding=1)
    assert len(pool.acquire(1, "r0", idle=True, now=0.0)) == 1
    assert pool.acquire(1, "lost", idle=True, now=0.0) == []  # queued, then lost
    pool.release([g for g in pool.outstanding])
    assert pool.acquire(1, "r0", idle=True, now=1.0) == []  # room promised to "lost"
    assert len(pool.acquire(1, "r0", idle=True, now=10.0)) == 1  # "lost" stopped asking
    # A rollout that did not queue (a refill, not idle) does not jump the queue either.
    assert pool.acquire(1, "r1", idle=True, now=10.0) == []
    pool.release([g for g in pool.outstanding])
    assert pool.acquire(1, "r2", now=10.5) == []
    assert len(pool.acquire(1, "r1", idle=True, now=11.0)) == 1


def test_a_rollout_given_up_as_lost_leaves_the_queue_at_once():
    """Fenced (the driver gave it up), a queued rollout's place goes at once to the next
    in the queue, not after it would have stopped asking (QUEUE_EXPIRY_S); and the
    groups handed to it for its last ask are no longer served as that ask's answer."""
    pool = make_pool(max_outstanding=1)
    given = pool.acquire(1, "r0", idle=True, now=0.0, ask=1)
    assert len(given) == 1 and pool.answered("r0", 1) == given
    assert pool.acquire(1, "lost", idle=True, now=0.0) == []  # queued ahead of r1
    assert pool.acquire(1, "r1", idle=True, now=0.5) == []
    pool.release([g for g in pool.outstanding])
    assert pool.acquire(1, "r1", idle=True, now=1.0) == []  # room promised to "lost"
    pool.forget("lost")
    assert len(pool.acquire(1, "r1", idle=True, now=1.5)) == 1
    pool.forget("r0")
    assert pool.answered("r0", 1) is None


def test_groups_carry_prompt_and_unique_uids_across_epochs():
    pool = make_pool(max_outstanding=100, n=3)
    groups = pool.acquire(7)
    assert len({g.prompt_uid for g in groups}) == 7
    assert sorted(g.prompt_key for g in groups[:3]) == [0, 1, 2]  # each prompt once per epoch
    assert groups[-1].epoch == 2 and all(g.group_size == 4 for g in groups)


def test_a_resumed_pool_continues_the_prompt_order():
    from laminar.prompt_pool import PromptPoolCore
    from laminar.tasks import Prompt

    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i)) for i in range(5)]
    whole = PromptPoolCore(prompts, group_size=2, max_outstanding=100, seed=3)
    first = whole.acquire(12)
    resumed = PromptPoolCore(prompts, group_size=2, max_outstanding=100, seed=3, start=7)
    rest = resumed.acquire(5)
    assert [g.prompt_key for g in rest] == [g.prompt_key for g in first[7:]]
    assert [g.prompt_uid for g in rest] == [g.prompt_uid for g in first[7:]]
    assert [g.epoch for g in rest] == [g.epoch for g in first[7:]]


def test_a_resumed_pool_reissues_the_missing_samples_first():
    """Groups of the stopped run that lacked siblings: handed out again first, with only
    the missing sample indices, counted outstanding from the start (with those the
    buffer holds whole) and not against the new prompts' order."""
    import pytest

    from laminar.errors import DataError

    prompts = [(Prompt(i, f"n {i} >", f"a{i}"), (1, i)) for i in range(5)]
    pool = PromptPoolCore(
        prompts,
        group_size=4,
        max_outstanding=4,
        seed=3,
        start=7,
        outstanding=("p00000002", "p00000005", "p00000006"),
        reissue={"p00000005": (3, 4, (1, 3)), "p00000006": (0, 4, (2,))},
    )
    got = pool.acquire(1)
    assert [(g.prompt_uid, g.prompt_key, g.answer, g.sample_indices) for g in got] == [
        ("p00000005", 3, "a3", (1, 3))
    ]
    got = pool.acquire(5)  # the other re-issued one, then room for one new group
    assert [g.prompt_uid for g in got] == ["p00000006", "p00000007"]
    assert got[0].sample_indices == (2,) and got[1].sample_indices == (0, 1, 2, 3)
    assert pool.stats()["reissued"] == 2 and pool.stats()["outstanding"] == 4
    with pytest.raises(DataError, match="prompt 9, which the dataset no longer has"):
        PromptPoolCore(
            prompts, group_size=4, max_outstanding=4, seed=3, reissue={"p1": (9, 4, (0,))}
        )


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(1, 5),
    groups_per_step=st.integers(1, 9),
    lag=st.integers(0, 1),
    calls=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 12), st.booleans()), max_size=60),
)
def test_batches_go_out_whole_one_version_at_a_time(replicas, groups_per_step, lag, calls):
    """The sync-family rule: global batch b goes only to rollouts holding version b - lag,
    each rollout takes at most its part of its samples (⌈G·n/R⌉), and batch b + 1 starts
    only once batch b is out whole, each of its groups' samples once — whatever order
    rollouts come in and whatever they ask for."""
    pool = rule_pool(
        "batches", 1, groups_per_step=groups_per_step, replicas=replicas, lag=lag
    )  # not the rule here: the barrier bounds what is out
    size = pool.group_size
    share = -(-groups_per_step * size // replicas)
    versions = [0] * replicas
    taken: dict[tuple[int, int], int] = {}  # (batch, rollout) -> samples
    samples: dict[str, list[int]] = {}  # group -> its samples handed out
    batch_of: dict[str, int] = {}
    for r, ask, advance in calls:
        r %= replicas
        if advance and versions[r] < pool.batch:  # the rollout loads a newer version
            versions[r] += 1
        batch_before = pool.batch
        got = pool.acquire(ask, f"r{r}", versions[r])
        assert len(got) <= ask
        for g in got:
            b = batch_of.setdefault(g.prompt_uid, int(g.prompt_uid[1:]) // groups_per_step)
            assert b == batch_before and versions[r] >= b - lag
            taken[b, r] = taken.get((b, r), 0) + len(g.sample_indices)
            assert taken[b, r] <= share
            samples.setdefault(g.prompt_uid, []).extend(g.sample_indices)
        out = [u for u, b in batch_of.items() if b == batch_before]
        whole = all(sorted(samples[u]) == list(range(size)) for u in out)
        if pool.batch > batch_before:  # out whole: every group of it, each sample once
            assert len(out) == groups_per_step and whole
        assert all(len(idx) == len(set(idx)) for idx in samples.values())
    assert pool.stats()["dispatched"] == len(samples)


def test_a_barrier_batch_is_split_evenly_by_sample_not_by_whole_group():
    """64 groups of 16 on 10 rollouts: split by whole groups they went out as 7 × 9 and
    1 (the barrier waited for those with 7 while one idled), on 12 as 6 × 10, 4 and 0.
    Split by sample each rollout gets ⌈1024/R⌉ or ⌊1024/R⌋, and every group is whole
    across its pieces, each piece of one version."""
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(7)]
    for replicas, lag in ((10, 1), (12, 0)):
        pool = PromptPoolCore(
            prompts,
            group_size=16,
            max_outstanding=1,
            seed=0,
            dispatch="batches",
            groups_per_step=64,
            replicas=replicas,
            lag=lag,
        )
        for batch in range(2):
            got = [pool.acquire(64, f"r{r}", version=max(0, batch - lag)) for r in range(replicas)]
            sizes = [sum(len(g.sample_indices) for g in gs) for gs in got]
            assert sorted(sizes) == sorted(
                [1024 // replicas + (r < 1024 % replicas) for r in range(replicas)]
            ), sizes
            assert max(sizes) - min(sizes) == 1 and pool.batch == batch + 1
            samples: dict[str, list[int]] = {}
            for g in (g for gs in got for g in gs):
                samples.setdefault(g.prompt_uid, []).extend(g.sample_indices)
            assert len(samples) == 64
            assert all(sorted(s) == list(range(16)) for s in samples.values())


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 3),
    groups_per_step=st.integers(1, 5),
    events=st.lists(
        st.tuples(st.sampled_from(["acquire", "release", "publish"]), st.integers(1, 6)),
        max_size=60,
    ),
)
def test_eta_bounds_dispatch_by_the_trainer_version(eta, groups_per_step, events):
    """AReaL's rule: never more than (version + eta + 1) x groups_per_step groups out in
    all, and never more than max_outstanding at once."""
    pool = rule_pool("eta", 6, groups_per_step=groups_per_step, eta=eta)
    version, out = 0, []
    for kind, k in events:
        if kind == "acquire":
            out += [g.prompt_uid for g in pool.acquire(k, "r0", version)]
        elif kind == "release":
            pool.release(out[:k])
            out = out[k:]
        else:
            version += 1
            pool.version_published(version)
        assert pool.stats()["dispatched"] <= (version + eta + 1) * groups_per_step
        assert pool.stats()["outstanding"] <= 6
    # nothing holds dispatch back but the rules: with room, it hands out up to the bound
    pool.release(out)
    pool.acquire(1000, "r0", version)
    bound = (version + eta + 1) * groups_per_step
    assert pool.stats()["dispatched"] == min(bound, pool.stats()["released"] + 6)


@settings(max_examples=150, deadline=None)
@given(
    replicas=st.integers(1, 4),
    groups_per_step=st.integers(1, 6),
    lag=st.integers(0, 1),
    dropped=st.lists(st.booleans(), max_size=40),
    skipped=st.lists(st.booleans(), max_size=10),
)
def test_batches_make_up_for_groups_and_updates_that_train_nothing(
    replicas, groups_per_step, lag, dropped, skipped
):
    """A group that leaves untrained (filtered by dynamic sampling, discarded for a reward
    error, evicted as too stale) is replaced within its batch, and an update skipped as
    non-finite is trained again at the same version: the trainer never waits for a
    group the pool holds back, and every group it trains was generated within ``lag``."""
    pool = rule_pool("batches", 1, groups_per_step=groups_per_step, replicas=replicas, lag=lag)
    drops, skips = chain(dropped, repeat(False)), chain(skipped, repeat(False))
    version, ready = 0, []
    pieces: dict[str, int] = {}  # a group's samples in so far (the buffer's partial group)
    for _ in range(200):  # rounds: each rollout asks at the newest version, then the trainer
        if version == 6:
            break
        for r in range(replicas):
            for g in pool.acquire(groups_per_step, f"r{r}", version):
                pieces[g.prompt_uid] = pieces.get(g.prompt_uid, 0) + len(g.sample_indices)
                if pieces[g.prompt_uid] < g.group_size:
                    continue  # (complete once its other pieces are in)
                if next(drops):
                    pool.release([g.prompt_uid], untrained=(g.prompt_uid,))
                else:
                    ready.append((g.prompt_uid, version))
        if len(ready) < groups_per_step:
            continue
        batch, ready = ready[:groups_per_step], ready[groups_per_step:]
        assert all(0 <= version - made <= lag for _, made in batch), (version, batch)
        pool.release([uid for uid, _ in batch])
        if next(skips):
            pool.update_skipped()
        else:
            version += 1
            pool.version_published(version)
    assert version == 6, f"the trainer starved at version {version}: {pool.stats()}"


def test_eta_counts_from_the_version_the_asking_rollout_holds():
    """Between a publication and the interruption that loads it, a rollout still on the
    old version starts groups at that version: the bound is the old version's, or with
    eta=0 (on-policy) a group would train one version late."""
    pool = rule_pool("eta", 99, groups_per_step=2, eta=0)
    first = [g.prompt_uid for g in pool.acquire(9, "r0", version=0)]
    assert len(first) == 2
    pool.release(first)
    pool.version_published(1)
    assert pool.acquire(9, "r0", version=0) == []  # still on version 0: nothing more
    assert len(pool.acquire(9, "r0", version=1)) == 2  # loaded version 1: its share
    assert pool.stats()["dispatched"] == 4


def test_an_idle_rollout_on_an_old_version_does_not_hold_back_those_on_the_new_one():
    """eta: an idle rollout queued for room while the bound was reached, woken by the
    next publication before it loads it, asks on the old version and gets nothing. It
    used to queue again at the head and hold back every rollout that had loaded the new
    version (passed over) until it asked again or its place expired (QUEUE_EXPIRY_S)."""
    pool = rule_pool("eta", 99, groups_per_step=2, eta=0)
    first = [g.prompt_uid for g in pool.acquire(9, "r1", version=0, now=0.0)]
    assert len(first) == 2
    assert pool.acquire(9, "r0", version=0, idle=True, now=0.5) == []  # queued: bound
    pool.release(first)
    pool.version_published(1)
    assert pool.acquire(9, "r0", version=0, idle=True, now=1.0) == []  # must load 1 first
    assert len(pool.acquire(9, "r1", version=1, idle=True, now=1.1)) == 2
    assert pool.stats()["passed_over"] == 0


def test_eta_makes_up_for_groups_and_updates_that_train_nothing():
    """AReaL's bound counts the groups that can still feed an update."""
    pool = rule_pool("eta", 99, groups_per_step=2)
    first = [g.prompt_uid for g in pool.acquire(9)]
    assert len(first) == 2 and pool.acquire(9) == []
    pool.release(first[:1], untrained=first[:1])  # filtered: one more may go out
    second = [g.prompt_uid for g in pool.acquire(9)]
    assert len(second) == 1
    pool.release(first[1:] + second)  # a batch consumed, but the update was skipped
    pool.update_skipped()
    assert len(pool.acquire(9)) == 2
    assert pool.stats()["untrained"] == 1


def test_a_topping_up_batch_gets_groups_only_while_its_version_is_the_newest():
    """``rollout.top_up``: a draining batch of the newest version takes groups as a new
    batch would; one of an older version gets none (its rollout should drain and pull),
    and an idle rollout queued for room is served before any batch tops up."""
    pool = make_pool(max_outstanding=4)
    pool.version_published(2)
    assert pool.acquire(1, "r0", version=1, newest_only=True) == []
    got = pool.acquire(1, "r0", version=2, newest_only=True)
    got += pool.acquire(1, "r0", version=1)  # (a new batch of an old version is not held)
    got += pool.acquire(2, "r1", version=2)
    assert len(got) == 4
    assert pool.acquire(1, "r1", version=2, idle=True) == []  # full: r1 queues for room
    pool.release([got[0].prompt_uid])
    assert pool.acquire(1, "r0", version=2, newest_only=True) == []  # r1's turn
    assert len(pool.acquire(1, "r1", version=2, idle=True)) == 1
    assert pool.stats()["passed_over"] == 1


def test_a_barrier_batch_is_shared_among_the_rollouts_still_live():
    """Two rollouts share each global batch of 4 groups, 2 each; one is lost before it
    takes its part of batch 1 (and not replaced): told so, the pool hands the survivor
    the whole batch, where it would have waited for ever for the lost one's part; a
    replacement that joins shares the next batch again."""
    pool = rule_pool("batches", 1, groups_per_step=4, replicas=2)
    assert len(pool.acquire(4, "r0", 0)) == 2 and len(pool.acquire(4, "r1", 0)) == 2
    assert pool.batch == 1
    assert len(pool.acquire(4, "r0", 1)) == 2 and pool.acquire(4, "r0", 1) == []  # r1 lost
    pool.rollouts_live(1)
    assert len(pool.acquire(4, "r0", 1)) == 2 and pool.batch == 2  # batch 1 out whole
    pool.rollouts_live(2)  # a replacement joined
    assert len(pool.acquire(4, "r0", 2)) == 2 and len(pool.acquire(4, "r2", 2)) == 2
    assert pool.batch == 3


def test_ending_the_waits_returns_an_idle_rollouts_long_poll_at_once(small_config, tiny_policy):
    """At a run's stop the driver ends the pool's waits: an idle rollout's long poll
    (``take`` with a wait, back-pressured here) returns at once instead of holding its
    stop until the wait is out, and later takes do not wait; what a take gets is as
    before (nothing, here: every group the back-pressure allows is out)."""
    import asyncio

    from laminar.prompt_pool import PromptPool

    pool = PromptPool(small_config, str(tiny_policy))

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        assert await pool.acquire(small_config.buffer.max_outstanding_groups, "r0", 0)
        assert await pool.acquire(1, "r0", 0) == []  # back-pressured
        waiting = asyncio.ensure_future(pool.take(1, "r1", 0, wait_s=30.0))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # a long poll: it waits for groups
        t0 = loop.time()
        await pool.end_waits()
        # (past wait_s: the bound below, not this wait, is what a wait left alone fails)
        groups, version = await asyncio.wait_for(waiting, 35.0)
        ended = loop.time() - t0
        assert groups == [] and version == 0
        t0 = loop.time()
        assert await pool.take(1, "r1", 0, wait_s=30.0) == ([], 0)
        return ended, loop.time() - t0

    ended, later = asyncio.run(scenario())
    # (at once: 0.1 ms quiet, 0.1 s at load 10-15; the bug waits out wait_s, 30 s)
    assert ended < 10.0 and later < 10.0, (ended, later)


def test_after_a_skipped_update_a_rollout_behind_the_newest_version_gets_no_batch():
    """one_step (lag 1): an update skipped as non-finite lowers every batch's label by one,
    and with it the version a rollout needed to take one. A rollout still on the version
    before the newest (its pull late) was handed groups of the batch the newest generates:
    trained one version later than counted, at s_train 2, which one_step never has."""
    pool = rule_pool("batches", 1, groups_per_step=4, replicas=2, lag=1)
    for batch in range(2):  # batches 0 and 1 go out at version 0
        assert len(pool.acquire(2, "r0", 0)) == len(pool.acquire(2, "r1", 0)) == 2, batch
    pool.version_published(1)
    assert len(pool.acquire(2, "r0", 1)) == 2  # batch 2, by version 1
    pool.update_skipped()  # version 1's update: non-finite, nothing published
    assert pool.acquire(2, "r1", 0) == []  # r1 loads version 1 first
    assert len(pool.acquire(2, "r1", 1)) == 2


def test_a_pool_told_of_a_version_before_its_weights_moved_still_hands_out_batches():
    """A rebuilt (or restarted) pool hears of the trainer's newest version before any
    rollout can load its weights: gating every batch on that version would starve the
    trainer that waits for the batch before it publishes them."""
    pool = rule_pool("batches", 8, groups_per_step=4, replicas=2, lag=1)
    pool.version_published(5)
    assert len(pool.acquire(2, "r0", 4)) == 2


def test_a_pool_rebuilt_at_the_dispatch_lease_hands_out_no_uid_twice(
    small_config, tiny_policy, tmp_path
):
    """A rebuild that a rollout did not answer continues the prompt order at the lost
    pool's lease on disk (pipelines/restart.py). Groups that left untrained free room
    under back-pressure, so the lost pool may have handed out many more positions than
    are outstanding at its loss: here 3 × ``max_outstanding``, most released again.
    The lease covers each before it goes out, and a pool started there hands out none
    of them again; the lease is written once per ``max_outstanding`` groups, not per
    group."""
    import asyncio

    from laminar.lease import DispatchLease, read_lease
    from laminar.prompt_pool import PromptPool
    from storage.resume import ResumePlan

    cap = small_config.buffer.max_outstanding_groups
    pool = PromptPool(small_config, str(tiny_policy), run_dir=str(tmp_path))
    assert read_lease(tmp_path) is None  # (nothing out yet)

    async def hand_out() -> list[str]:
        uids = []
        for _ in range(3):  # fill the bound, then all leave untrained (filtered)
            groups = await pool.acquire(cap, "r0", 0)
            assert len(groups) == cap
            # every position handed out is below the lease already on disk
            assert int(groups[-1].prompt_uid[1:]) < read_lease(tmp_path)
            uids += [g.prompt_uid for g in groups]
            out = [g.prompt_uid for g in groups]
            await pool.release(out, untrained=tuple(out))
        return uids

    before = asyncio.run(hand_out())
    assert len(set(before)) == 3 * cap
    assert pool._lease.writes <= 3  # (one write per cap groups: ahead = cap)
    # The rebuild knows only the first group (the rest were in no log or store).
    lease = read_lease(tmp_path)
    rebuilt = PromptPool(
        small_config,
        str(tiny_policy),
        resume=ResumePlan(version=0, start=max(1, lease)),
        run_dir=str(tmp_path),
    )
    after = asyncio.run(rebuilt.acquire(cap, "r1", 0))
    assert after and not {g.prompt_uid for g in after} & set(before)
    # Its own lease continues past the old one.
    assert read_lease(tmp_path) > int(after[-1].prompt_uid[1:])
    with pytest.raises(ValueError, match="at least one position"):
        DispatchLease(tmp_path, ahead=0)


def test_a_lease_that_cannot_be_written_holds_dispatch_back_and_fails_no_rollout(
    small_config, tiny_policy, tmp_path
):
    """The run directory's disk full or gone: the pool hands out nothing (a position
    past the lease on disk could be handed out twice after a rebuild) and raises
    nothing (an OSError reads as a lost data module to the rollout that asked); once
    the lease can be written, dispatch goes on."""
    import asyncio

    from laminar.lease import LEASE_FILE, read_lease
    from laminar.prompt_pool import PromptPool

    pool = PromptPool(small_config, str(tiny_policy), run_dir=str(tmp_path))
    blocker = tmp_path / LEASE_FILE
    blocker.mkdir()  # (the lease's write fails: IsADirectoryError, an OSError)
    assert asyncio.run(pool.acquire(2, "r0", 0)) == []
    assert read_lease(tmp_path) is None and pool._lease.failing
    blocker.rmdir()
    groups = asyncio.run(pool.acquire(2, "r0", 0))
    assert len(groups) == 2 and read_lease(tmp_path) > 1 and not pool._lease.failing


def test_passed_over_counts_only_asks_that_room_was_held_back_from():
    """An ask made while another rollout is queued is passed over only where the
    dispatch rule would have given it a group: not while the pool is full (no room
    existed, for anyone)."""
    q = make_pool(max_outstanding=2, n=10)
    assert len(q.acquire(2, "r0", idle=True, now=0.0)) == 2  # r0 takes both slots
    assert q.acquire(2, "r1", idle=True, now=0.0) == []  # r1 queues: no room
    for t in range(5):  # r0 tops up while the pool is full
        assert q.acquire(1, "r0", now=0.1 + t * 0.1) == []
    assert q.stats()["passed_over"] == 0
    q.release([q.handed_to("r0")[0]])  # room for one: r1's, and r0 is held back from it
    assert q.acquire(1, "r0", now=1.0) == []
    assert q.stats()["passed_over"] == 1
    assert len(q.acquire(2, "r1", idle=True, now=1.1)) == 1


def test_an_ask_made_again_with_its_id_gets_the_groups_handed_out_for_it():
    """A rollout whose call timed out asks again with the same ask id: the groups the
    pool handed out for it, none new; a new id gets new groups. (As the buffer answers
    the trainer's sample request again.)"""
    pool = make_pool(max_outstanding=4, n=10)
    first = pool.acquire(2, "r0", ask=1)
    assert pool.acquire(2, "r0", ask=1) == first
    assert pool.acquire(3, "r0", ask=1, newest_only=True) == first  # (whichever call)
    assert pool.stats()["dispatched"] == 2 and pool.stats()["answered_again"] == 2
    assert pool.acquire(2, "r1", ask=1) != first  # (per rollout)
    assert pool.acquire(2, "r0", ask=2) == []  # full: r0's next ask gets none ...
    assert pool.acquire(2, "r0", ask=1) == first  # (kept until an ask that gets groups)
    pool.release([g.prompt_uid for g in first])
    second = pool.acquire(2, "r0", ask=3)
    assert {g.prompt_uid for g in second}.isdisjoint(g.prompt_uid for g in first)
    assert pool.acquire(2, "r0", ask=1) != first  # (that answer was received: forgotten)


def _states(group):
    """The requests of ``group`` as its rollout registers them."""
    from laminar.engine import GenerationRequest, RequestState, SamplingParams

    return [
        RequestState(
            GenerationRequest(
                f"{group.prompt_uid}-{i:03d}",
                group.prompt_tokens,
                SamplingParams(8),
                {"group": group},
            ),
            seed=i,
        )
        for i in group.sample_indices
    ]


@pytest.mark.parametrize("lost", ["killed before it registered", "answer lost"])
def test_groups_a_rollout_never_registered_do_not_hold_the_budget_for_good(lost):
    """helper 110's leak: a rollout asks for a local batch of 8 groups (max_outstanding
    32, groups of 16 per update); three times the groups never reach the partial-response
    pool — the rollout was killed between take and register, or the pool's answer never
    reached it. Before, those 24 groups were outstanding for good: 8 slots left, and the
    trainer waited for ever for a batch of 16. Now a killed rollout, fenced, has them
    re-issued (neither the partial pool nor the buffer knows them) and another rollout
    generates them; one that lost the answer asks again with the same id and gets them.
    Real PromptPoolCore, PartialResponsePool and BufferCore."""
    import asyncio

    from factories import trajectory

    from laminar.buffer_core import BufferCore
    from laminar.partial import PartialResponsePool

    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(1000)]
    pool = PromptPoolCore(prompts, group_size=2, max_outstanding=32, seed=0)
    partial, buf = PartialResponsePool(), BufferCore()
    version, fenced, ask = 0, 0, 0
    for step in range(200):
        now = float(step + 1)
        rid = f"r{step % 2}" if lost == "answer lost" else f"r{fenced}"
        ask += 1
        groups = pool.acquire(8, rid, version, idle=True, now=now, ask=ask)
        if step in (3, 9, 15) and groups:
            if lost == "answer lost":  # (slow, not lost: the same ask again)
                assert pool.acquire(8, rid, version, idle=True, now=now, ask=ask) == groups
            else:  # r<k> dies; the driver fences it (pipelines.driver_faults)
                known = {*asyncio.run(partial.groups()), *buf.known()}  # (as the driver)
                assert set(pool.reissue_stranded(rid, known)) == {g.prompt_uid for g in groups}
                fenced += 1
                continue
        for g in groups:
            asyncio.run(partial.register(rid, version, _states(g)))
        for g in groups:  # every sibling generated, and stored: the pool forgets them
            trajs = [
                trajectory(f"{g.prompt_uid}-{i:03d}", g.prompt_uid, sample_idx=i, group_size=2)
                for i in g.sample_indices
            ]
            buf.insert(trajs, version=version, now=now)
            asyncio.run(partial.forget([t.uid for t in trajs]))
        left, batch = buf.take(16, version=version, now=now)
        pool.release(
            sorted({t.prompt_uid for t in left}), untrained=tuple(t.prompt_uid for t in left)
        )
        if batch is not None:
            pool.release(sorted({t.prompt_uid for t in batch}))
            version += 1
    assert version >= 20, version  # (before: 6 versions, then stalled)
    assert len(pool.outstanding) < pool.max_outstanding
    stats = pool.stats()
    if lost == "answer lost":
        assert stats["answered_again"] == 3 and stats["reissued_at_fence"] == 0
    else:
        assert stats["reissued_at_fence"] == stats["reissued"] == 24
        assert not asyncio.run(partial.groups())  # (every one stored: none left behind)


def test_a_rollout_that_finds_the_data_module_slow_takes_the_groups_of_its_lost_answer(
    tiny_policy, small_config, monkeypatch
):
    """The rollout's take fails (the data module slow: no answer), yet the pool ran it and
    handed out two groups. When the data module answers its probe (slow, not lost), the
    rollout asks again with the same ask id and gets those two groups, none new; before,
    it went on without them and they were outstanding for good."""
    import asyncio
    import concurrent.futures

    from factories import InProcess

    from laminar import rollout_data
    from laminar.prompt_pool import PromptPool
    from laminar.rollout import RolloutReplica

    monkeypatch.setattr(rollout_data, "PROBE_S", 0.0)
    actor = PromptPool.__new__(PromptPool)
    actor.core = make_pool(max_outstanding=4, n=10)
    actor._lease, actor._waiting, actor._ending = None, None, False
    actor.fenced, actor.n_refused = {}, 0

    class SlowOnce:
        """The pool's handle: its first take runs, and its answer is lost."""

        slow = True

        def take(self, *args):
            future = concurrent.futures.Future()
            answer = asyncio.run(actor.take(*args))
            if self.slow:
                self.slow, self.lost = False, answer
                future.set_exception(ConnectionError("no answer"))  # (taken for lost)
            else:
                future.set_result(answer)
            return future

    class Buffer:
        def stats(self):
            return {}

    rollout = RolloutReplica("r0", small_config, str(tiny_policy), None, None, None)
    rollout.pool = handle = SlowOnce()
    rollout.buffer = InProcess(Buffer())
    groups, _ = rollout._take(2, 0.0)
    assert len(groups) == 2 and groups == handle.lost[0]
    stats = actor.core.stats()
    assert stats["dispatched"] == 2 and stats["answered_again"] == 1
    assert not rollout._ask_open and rollout._data_lost is None
    assert rollout._take(2, 0.0)[0] != groups  # (the next ask: a new id, new groups)


def test_a_new_run_from_a_checkpoint_continues_its_prompt_order_only_on_its_prompts(
    small_config, tiny_policy, tmp_path, caplog
):
    """``trainer.resume_from`` continues the prompt order where the checkpoint's run
    stood (``data_state.json``). ``laminar run --resume`` checks that the prompts are
    the same; a new run from a checkpoint applied the position to whatever prompts and
    seed it had. The checkpoint now records what its order was of: on other prompts (or
    another seed) the order starts from the first group, with a warning naming what
    differs; a checkpoint from before it recorded that continues as before, said so."""
    import asyncio
    import json
    import logging

    from laminar.config import with_overrides
    from laminar.prompt_pool import DATA_STATE, ORDER_KEY, PromptPool

    state = asyncio.run(PromptPool(small_config, str(tiny_policy)).stats())
    assert state[ORDER_KEY]["prompts"] == 200 and state[ORDER_KEY]["seed"] == small_config.seed
    ckpt = tmp_path / "checkpoints" / "version-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"version": 3}')
    (ckpt / DATA_STATE).write_text(json.dumps(state | {"dispatched": 5}))
    resumed = with_overrides(small_config, [f"trainer.resume_from={ckpt}"])

    def dispatched(cfg) -> int:
        return PromptPool(cfg, str(tiny_policy)).core.n_dispatched

    with caplog.at_level(logging.INFO, logger="laminar"):
        assert dispatched(resumed) == 5  # the same prompts and seed: where it stood
        assert not caplog.records
        seed = small_config.seed
        assert dispatched(with_overrides(resumed, [f"seed={seed + 1}"])) == 0
        (warned,) = caplog.records
        assert warned.levelno == logging.WARNING
        assert f"seed {seed}, now {seed + 1}" in warned.getMessage()
        assert "starts its prompt order from the first group, not after the 5" in (
            warned.getMessage()
        )
        caplog.clear()
        assert dispatched(with_overrides(resumed, ["task.num_prompts=300"])) == 0
        assert "200 prompts, now 300" in caplog.records[0].getMessage()
        caplog.clear()
        (ckpt / DATA_STATE).write_text('{"dispatched": 5}')  # (an older checkpoint)
        assert dispatched(with_overrides(resumed, [f"seed={seed + 1}"])) == 5
        (told,) = caplog.records
        assert told.levelno == logging.INFO and "records no fingerprint" in told.getMessage()
    from laminar.learner import CheckpointError

    (ckpt / DATA_STATE).write_text('{"dispatched": 5, "prompt_order": 7}')
    with pytest.raises(CheckpointError, match=r'damaged \(ValueError: "prompt_order" is 7'):
        dispatched(resumed)


def _barrier_pool(n_prompts: int, max_outstanding: int) -> PromptPoolCore:
    """A barrier schedule's pool: global batches of 3 groups of 4 on 2 rollouts, so one
    group of each batch goes out in two pieces."""
    prompts = [(Prompt(i, f"n {i} >", "x"), (1, i + 4)) for i in range(n_prompts)]
    return PromptPoolCore(
        prompts,
        group_size=4,
        max_outstanding=max_outstanding,
        seed=0,
        dispatch="batches",
        groups_per_step=3,
        replicas=2,
    )


def test_a_lost_rollouts_piece_of_a_split_group_goes_out_again_by_its_samples():
    """A barrier batch's group split between two rollouts: the lost one's piece, never
    registered, is found by the samples ``known`` names (the other rollout registered
    its own piece, so the group's uid alone read as known, and the barrier waited for
    the missing piece for ever); a piece whose samples are all known stays put."""
    pool = _barrier_pool(7, max_outstanding=1)
    r0 = [(g.prompt_uid, g.sample_indices) for g in pool.acquire(3, "r0")]
    r1 = [(g.prompt_uid, g.sample_indices) for g in pool.acquire(3, "r1")]
    assert r0 == [("p00000000", (0, 1, 2, 3)), ("p00000001", (0, 1))]
    assert r1 == [("p00000001", (2, 3)), ("p00000002", (0, 1, 2, 3))]
    assert pool.handed_to("r0") == ["p00000000", "p00000001"]
    assert pool.handed_to("r1") == ["p00000001", "p00000002"]
    # r0 registered its whole group, and was lost before it registered its piece
    known = {"p00000000", "p00000001-002", "p00000001-003", "p00000002"}
    assert pool.reissue_stranded("r0", known) == ["p00000001"]
    again = pool.acquire(3, "r2")
    assert [(g.prompt_uid, g.sample_indices) for g in again] == [("p00000001", (0, 1))]
    # r1's piece and group are all known: nothing goes out again at its loss
    known |= {"p00000001-000", "p00000001-001"}
    assert pool.reissue_stranded("r1", known) == []


def test_a_lost_rollouts_unregistered_piece_of_a_split_group_goes_out_again():
    """A barrier batch's group split between two rollouts: r0 is lost before it
    registered its piece, r1 registered the other. The driver's `known` (the partial-
    response pool's and the buffer's groups) named the group by its uid alone, so r0's
    piece read as known, was never handed out again, and the barrier waited for it for
    ever. Both now name their samples too, and only r0's piece goes out again; a group
    whose samples the buffer holds is not. Real PromptPoolCore, PartialResponsePool and
    BufferCore."""
    import asyncio

    from factories import trajectory

    from laminar.buffer_core import BufferCore
    from laminar.partial import PartialResponsePool

    pool = _barrier_pool(10, max_outstanding=8)
    r0 = pool.acquire(3, "r0", 0)
    r1 = pool.acquire(3, "r1", 0)
    split = {g.prompt_uid for g in r0} & {g.prompt_uid for g in r1}
    assert len(split) == 1, (r0, r1)  # (3 groups of 4 on 2 rollouts: 6 samples each)
    partial, buf = PartialResponsePool(), BufferCore()
    for g in r1:  # r1 registers its pieces; one of its whole groups is already held
        asyncio.run(partial.register("r1", 0, _states(g)))
        if g.prompt_uid not in split:
            trajs = [
                trajectory(f"{g.prompt_uid}-{i:03d}", g.prompt_uid, sample_idx=i, group_size=4)
                for i in g.sample_indices
            ]
            buf.insert(trajs, version=0, now=1.0)
            asyncio.run(partial.forget([t.uid for t in trajs]))
    known = {*asyncio.run(partial.groups()), *buf.known()}  # (as the driver asks)
    (piece,) = [g for g in r0 if g.prompt_uid in split]
    assert pool.reissue_stranded("r0", known) == sorted(g.prompt_uid for g in r0)
    again = pool.acquire(3, "r2", 0)
    assert {(g.prompt_uid, g.sample_indices) for g in again} == {
        (g.prompt_uid, g.sample_indices) for g in r0
    }
    assert piece.sample_indices != tuple(range(4))  # (its piece alone, not the group)
