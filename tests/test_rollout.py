"""The rollout replica driven directly, without a cluster: its generation thread's
protocol (pause, data-module rebuild, adoption, weight pulls) and its reward collector."""

from __future__ import annotations

import pytest
from factories import InProcess, actor_thread_held


def _rollout(tiny_policy, small_config, overrides=(), relay=None):
    from laminar.config import with_overrides
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0", *overrides])
    return RolloutReplica("r0", cfg, str(tiny_policy), None, None, relay)


def _groups(n: int, group_size: int = 4):
    from laminar.contract import PromptGroup

    return [PromptGroup(f"p{g:08d}", g, (5, 6, 7), "x", group_size, 0) for g in range(n)]


def test_a_data_rebuild_during_a_pause_registers_the_paused_requests(tiny_policy, small_config):
    """Partial rollout: a publication paused the rollout (its unfinished requests wait
    outside the engine for the version), and the data module is rebuilt meanwhile (the
    trainer and data module lost together: the version comes only after the restart).
    The paused requests are this rollout's unfinished trajectories: the new
    partial-response pool must hold them, with their tokens, or a later loss of this
    rollout loses them (and the pool ignores their flushes once they resume)."""
    from laminar.partial import PartialResponsePool

    rollout = _rollout(tiny_policy, small_config)
    rollout._add(_groups(2))
    for _ in range(3):
        rollout.engine.step()
    unfinished = {st.request_id: list(st.tokens) for st in rollout.engine.in_flight()}
    assert unfinished and all(unfinished.values())
    assert rollout._pause(rollout.engine.version + 1) == len(unfinished)
    assert not rollout.engine.request_ids()  # held outside the engine
    pool = PartialResponsePool()
    assert rollout._attach(None, None, InProcess(pool)) == len(unfinished)
    entries = pool.core.entries
    # (the pool keeps tokens as arrays: laminar.partial)
    assert {rid: list(e["state"].tokens) for rid, e in entries.items()} == unfinished
    assert {e["owner"] for e in entries.values()} == {"r0"}
    assert rollout._logged == {rid: len(t) for rid, t in unfinished.items()}


class _Puller:
    """A rollout's puller whose answers are scripted: each call to ``newest`` or
    ``version`` takes the next one (an exception is raised)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.bytes = 0
        self.switches = 0
        self.on_progress = None

    def _next(self):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def newest(self, have_version, wait_s=0.0, wait_switch=True):
        return self._next()

    def version(self, version):
        return self._next()

    def versions(self):
        return [0]


def _weights(tiny_policy):
    from laminar.model import load_policy

    model, _ = load_policy(tiny_policy)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _paused(tiny_policy, small_config):
    """A rollout with a batch two steps in, paused for version 1 (partial rollout's
    interrupt), and the ids of the requests it holds."""
    rollout = _rollout(tiny_policy, small_config)
    rollout._add(_groups(1))
    for _ in range(2):
        rollout.engine.step()
    held = set(rollout.engine.request_ids())
    assert rollout._pause(1) == len(held)
    return rollout, held


def test_a_paused_rollout_whose_pull_fails_waits_on_instead_of_failing(tiny_policy, small_config):
    """Partial rollout: a rollout paused for a version pulls it from its relay. A pull
    that fails (a chunk failing its checksum; the relay lost and none switched in yet,
    as while the trainer and its master restart) is counted and tried again, as at a
    batch boundary: it used to end the generation loop, failing the run and stranding
    the paused requests."""
    from laminar.relay_client import RelayUnreachable
    from laminar.relay_core import RelayError

    rollout, held = _paused(tiny_policy, small_config)
    rollout.puller = _Puller(
        [
            RelayError("chunk 0 of version 1 failed its checksum on pull"),
            RelayUnreachable("the relay is lost and none replaced it in time"),
            None,  # (not there yet)
            (1, _weights(tiny_policy)),
        ]
    )
    rollout._resume_paused()
    assert rollout.engine.version == 1 and set(rollout.engine.request_ids()) == held
    assert rollout._paused is None
    assert (rollout.counts["pulls_failed"], rollout.counts["pulls_unreachable"]) == (1, 1)


def test_the_recomputation_after_an_interrupt_is_timed(tiny_policy, small_config):
    """Partial rollout: the requests a publication paused resume with their KV
    recomputed, in the first step after the load. That step's time is the interrupt's
    cost, beside ``recomputed_tokens``: it was counted nowhere (``_resume_paused`` never
    marked the step), so the schedule's recomputation looked free. It is not a move's
    re-prefill (``reprefill_s`` stays repack's and recovery's)."""
    import threading

    rollout, held = _paused(tiny_policy, small_config)
    rollout.puller = _Puller([(1, _weights(tiny_policy))])
    rollout._resume_paused()
    assert rollout.counts["recomputed_tokens"] > 0
    # One step, then stop: a command served after it (as a manager's would be) stops the
    # loop, so no response finishes and needs a reward (no cluster here).
    box = {"state": "pending"}
    rollout._inbox.put((rollout._stop.set, box, threading.Event()))
    rollout._decode()
    assert rollout.counts["decode_steps"] == 1 and set(rollout.engine.request_ids()) == held
    assert rollout.counts["recompute_s"] > 0
    assert rollout.counts["reprefill_s"] == 0.0


def _batch(tiny_policy, small_config, steps: int = 3):
    """A lost rollout's unfinished requests at version 0, as recovery hands them over."""
    other = _rollout(tiny_policy, small_config)
    other._add(_groups(1))
    for _ in range(steps):
        other.engine.step()
    return other.engine.export(list(other.engine.request_ids()))


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpoint", "drop"])
def test_an_adopted_batch_whose_relay_pull_fails_loads_the_checkpoint_or_drops(
    tiny_policy, small_config, tmp_path, checkpointed
):
    """A rollout adopting a lost rollout's batch loads that batch's version. If the relay
    cannot give it (lost, or a chunk failing its checksum), the checkpoint on disk is
    the next place to look, and with none there the trajectories are dropped, as when
    no relay keeps the version. The failed pull used to end the generation loop,
    failing the run and stranding the adopted trajectories."""
    from safetensors.torch import save_file

    from laminar.relay_client import RelayUnreachable

    weights = _weights(tiny_policy)
    if checkpointed:
        (tmp_path / "version-000000").mkdir()
        save_file(weights, tmp_path / "version-000000" / "model.safetensors")
    states = _batch(tiny_policy, small_config)
    tokens = {st.request_id: list(st.tokens) for st in states}
    rollout = _rollout(tiny_policy, small_config)
    rollout.checkpoints_dir = str(tmp_path)
    rollout.engine.load_weights(weights, 2)  # the adopting rollout is at version 2
    rollout.puller = _Puller([RelayUnreachable("the relay is lost and none replaced it in time")])
    rollout.adopt(0, states)
    rollout._take_adopted()
    resumed = {st.request_id: list(st.tokens) for st in rollout.engine.in_flight()}
    if checkpointed:
        assert rollout.engine.version == 0 and resumed == tokens
        assert rollout.counts["dropped_requests"] == 0
    else:
        assert rollout.engine.version == 2 and not resumed
        assert rollout.counts["dropped_requests"] == len(tokens)
    assert rollout.counts["pulls_unreachable"] == 1


def test_an_adopted_batch_whose_version_is_gone_drops_its_group_not_mixes_versions(
    tiny_policy, small_config, tmp_path
):
    """A lost rollout's group: two siblings finished (in the buffer, sampled by version
    0), two unfinished, adopted by a rollout at version 2 with no copy of version 0 left
    (no relay keeps it, no checkpoint). They used to restart at version 2, their tokens
    dropped, so the group reached the trainer with two behavior versions (GRPO's
    advantages compare one policy's samples; the barrier schedules' audit flags it).
    Now the group is discarded whole, counted, every member of version 0, its prompt
    released as untrained (the pool makes it up); the partial-response pool has the
    dropped ones as finished, so their version is no longer kept for them."""
    import asyncio

    from laminar.buffer import ExperienceBuffer
    from laminar.partial import PartialResponsePool
    from laminar.prompt_pool import PromptPool
    from laminar.relay_core import VersionUnavailable
    from laminar.rollout import _finished

    prompts = PromptPool(small_config, str(tiny_policy))
    (group,) = asyncio.run(prompts.acquire(1, "r9", 0))
    buffer = ExperienceBuffer(str(tmp_path / "run"), prompts, small_config.buffer)
    partial = PartialResponsePool()
    lost = _rollout(tiny_policy, small_config)  # the lost rollout, at version 0
    lost.buffer, lost.partial = InProcess(buffer), InProcess(partial)
    lost._add([group])
    for _ in range(3):
        lost.engine.step()
    states = lost.engine.export(list(lost.engine.request_ids()))
    assert len(states) == group.group_size and all(st.tokens for st in states)
    done, unfinished = states[:2], states[2:]
    # The finished siblings reached the buffer (as the lost rollout's reward collector
    # sent them) ...
    siblings = [_finished(st, "length", 1.0) for st in done]
    lost._submit_rewards(siblings, score=False)
    lost._insert_scored(*lost._to_score.get_nowait())
    # ... and the unfinished ones come back from the partial-response pool, logged.
    partial.core.flush(
        "r0",
        {st.request_id: (0, st.tokens, st.logprobs, st.token_versions) for st in states},
        {st.request_id: ("length", 1.0) for st in done},
    )
    partial.core.hold([st.request_id for st in done])
    taken = {st.request_id: st for st in partial.core.take("r0")}
    adopted = [taken[st.request_id] for st in unfinished]
    assert set(taken) == {st.request_id for st in unfinished}
    partial.core.reassign(list(taken), "r1")

    rollout = _rollout(tiny_policy, small_config)
    rollout.rollout_id = "r1"
    rollout.pool, rollout.buffer, rollout.partial = prompts, InProcess(buffer), InProcess(partial)
    rollout.engine.load_weights(_weights(tiny_policy), 2)
    rollout.puller = _Puller([VersionUnavailable("no relay keeps version 0")])
    rollout.adopt(0, adopted)
    rollout._take_adopted()

    assert not rollout.engine.request_ids(), "restarted at version 2"
    assert rollout.engine.version == 2
    c = rollout.counts
    assert (c["dropped_requests"], c["dropped_groups"], c["adopted_requests"]) == (2, 1, 0)
    assert {partial.core.entries[st.request_id].get("finished", ("",))[0] for st in adopted} == {
        "error"
    }
    assert 0 not in partial.core.versions()
    while not rollout._to_score.empty():
        rollout._insert_scored(*rollout._to_score.get_nowait())
    counts = buffer.core.counts
    assert (counts["groups_discarded"], counts["discarded"]) == (1, group.group_size)
    assert not buffer.core.partial and not buffer.core.ready
    records = list(buffer._records.values())
    assert {t.behavior_version for t in records} == {0}
    assert [len(t.response_tokens) for t in records if t.uid in taken] == [
        len(st.tokens) for st in adopted
    ]
    assert prompts.core.stats()["untrained"] == 1 and not prompts.core.outstanding
    asyncio.run(buffer.close())


class _Serving:
    """The rollout's commands served by a thread of its own, as its generation loop
    serves them between steps (the test steps the engine itself, in between)."""

    def __init__(self, rollout):
        import threading

        self.rollout, self.stop = rollout, threading.Event()
        rollout._thread = threading.Thread(target=self._serve, daemon=True)
        rollout._thread.start()

    def _serve(self):
        while not self.stop.is_set():
            self.rollout._serve(0.01)

    def __enter__(self):
        return self.rollout

    def __exit__(self, *exc):
        self.stop.set()
        self.rollout._thread.join()


def test_an_import_whose_requests_finished_since_still_counts_as_held(tiny_policy, small_config):
    """The manager asks a destination whose import it got no answer to whether that
    import (its token) went through; if not, the source takes them back (or recovery
    hands them to another rollout). Repack moves a batch's tail, responses near their
    end: one may finish on the destination before the question is served. The import
    went through all the same: answering no made the requests decode twice, on both
    rollouts."""
    states = _batch(tiny_policy, small_config, steps=3)
    ids = [st.request_id for st in states]
    dst = _rollout(tiny_policy, small_config)
    dst._in_batch, dst._batch_seq = True, 1
    with _Serving(dst):
        assert dst.import_for_move(0, states, batch=1, move="m1") is True
        for _ in range(200):  # decode until one of them has finished here
            dst.engine.step()
            if not set(ids) <= set(dst.engine.request_ids()):
                break
        assert set(dst.engine.request_ids()) < set(ids)
        assert dst.holds("m1") is True
        assert dst.holds("m2") is False  # (an import that never ran here)
        assert _rollout(tiny_policy, small_config)._holds("m1") is False  # (imported nothing)


def test_an_import_is_not_held_because_an_earlier_one_of_the_same_requests_was(
    tiny_policy, small_config
):
    """``holds`` answered by request ids: a rollout that imported requests and then
    moved them on (a later round made it a source) still answered yes for them, from
    its record of imports. A third move bringing them back, whose import was withdrawn
    (it never ran), then read as done: the source was released and the requests were in
    no engine, their groups never complete. It answers for the import (its token) now."""
    states = _batch(tiny_policy, small_config, steps=3)
    ids = [st.request_id for st in states]
    dst = _rollout(tiny_policy, small_config)
    dst._in_batch, dst._batch_seq = True, 1
    assert dst._import(0, states, 1, 1, move="in-1") is True
    out = dst._export_all(1, None, move="out-2")  # a source in a later round
    assert {st.request_id for st in out["states"]} == set(ids)
    dst.release(move="out-2")
    assert not dst.engine.request_ids() and not dst._held
    # The move bringing them back: its import withdrawn, never run here.
    assert dst._holds("in-3") is False
    assert dst._holds("in-1") is True  # (that one did run)


def test_a_reward_value_that_fails_to_convert_marks_the_trajectory():
    """A reward function's value that raises as it is turned into a number (a lazy value
    whose ``__float__`` fails, a tensor on a device that cannot be read) marks that
    trajectory, as a raise in the function does; it used to fail the whole scoring task,
    and with it the rollout's reward collector and the run."""
    import math

    import laminar.rewards as r
    from laminar.rewards import score_batch

    class Lazy:
        def __float__(self):
            raise ZeroDivisionError("division by zero")

        def __repr__(self):
            raise RuntimeError("no repr either")

    r.REWARDS["_lazy"] = lambda response, answer: Lazy()
    try:
        scores = score_batch("_lazy", [("a", "a", True), ("a", "a", False)])
    finally:
        del r.REWARDS["_lazy"]
    assert math.isnan(scores[0].reward) and scores[0].error.startswith("reward _lazy returned")
    assert scores[1].reward == 0.0 and scores[1].error is None


def test_a_rollout_waiting_for_its_first_version_serves_commands_and_outlives_a_lost_relay(
    tiny_policy, small_config
):
    """Before its first batch a rollout waits until its relay holds a version (a
    replacement started while the trainer and its master restart waits a while). It
    serves the manager's commands meanwhile — a data-module rebuild asks every rollout
    what it holds, and attaches it — and a relay lost for longer than relay.timeout_s
    is asked again, not the end of its generation loop."""
    import threading
    import time

    from laminar.relay_client import RelayUnreachable

    # (A rollout that does not serve commands while it waits fails data_holdings with a
    # TimeoutError once the command is withdrawn, after cluster.actor_timeout_s: 5 s, so
    # that a loaded host's late thread switch is not taken for that. The wait loop serves
    # every 0.02 s, and the call returns in a few ms on an idle host.)
    rollout = _rollout(tiny_policy, small_config, ["cluster.actor_timeout_s=5"])
    answers = [[], RelayUnreachable("the relay is lost and none replaced it in time")]
    ready = threading.Event()

    class Puller(_Puller):
        def versions(self):
            if answers:
                answer = answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return answer
            time.sleep(0.01)  # (a short long-poll)
            return [0] if ready.is_set() else []

    rollout.puller = Puller([None])
    rollout._thread = threading.Thread(target=rollout._maybe_load_weights, daemon=True)
    rollout._thread.start()
    try:
        t0 = time.time()
        assert rollout.data_holdings() == []
        assert time.time() - t0 < 5  # (served, not withdrawn: within the timeout)
    finally:
        ready.set()
        rollout._thread.join(10)
    assert not rollout._thread.is_alive() and rollout._synced
    assert rollout.counts["pulls_unreachable"] == 1


def test_a_paused_rollout_refuses_an_import(tiny_policy, small_config):
    """Partial rollout: a publication paused the rollout while its batch was decoding
    (served between two steps, the batch not yet left). A recovery's import served
    right after it must be refused: taken in, those requests would decode on with the
    old weights past the interrupt, holding the pause (and this rollout's own paused
    requests) until they drained."""
    states = _batch(tiny_policy, small_config)
    rollout = _rollout(tiny_policy, small_config)
    rollout._add(_groups(1))
    rollout.engine.step()
    rollout._in_batch, rollout._batch_seq = True, 1
    assert rollout._pause(1) > 0
    assert rollout._import(0, states, batch=None, sources=1) is False
    assert not rollout.engine.request_ids()


def test_a_lost_rollouts_response_goes_on_at_the_newest_version_under_partial_rollout(
    tiny_policy, small_config
):
    """Partial rollout: an interrupt moved a response on from version 0 to 1, so it
    holds tokens of both. Its rollout lost, the partial-response pool hands it out to
    resume at 1 (its newest token's version, not its batch's 0), and asks the relays to
    keep 1 for it. A rollout at version 2 that adopts it goes on at 2, mid-batch, its KV
    recomputed, loading nothing. It used to load version 0 for it and refuse the import
    (the newer tokens): the adopting rollout failed, and the run with it."""
    from laminar.partial import PartialCore
    from laminar.schedule import ScheduleSpec

    lost, held = _paused(tiny_policy, small_config)  # 2 tokens of version 0
    lost.puller = _Puller([(1, _weights(tiny_policy))])
    lost._resume_paused()
    for _ in range(2):
        lost.engine.step()
    states = lost.engine.export(sorted(held), moved=False)
    assert all(list(st.token_versions) == [0, 0, 1, 1] for st in states)
    core = PartialCore()
    core.register("r0", 0, states)
    assert core.versions() == [1]
    taken = core.take("r0")
    assert {
        (s.request.meta["behavior_version"], s.request.meta["resume_version"]) for s in taken
    } == {(0, 1)}

    spec = ScheduleSpec(
        "partial_rollout", dispatch="eta", eta=1, weights="global", interrupt=True, refill=True
    )
    from laminar.config import with_overrides
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0"])
    adopter = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None, spec=spec)
    adopter._load_version(2, _weights(tiny_policy))
    from laminar.contract import PromptGroup

    adopter._add([PromptGroup("p00000009", 9, (5, 6, 7), "x", 2, 0)])  # (its own batch)
    loads = adopter.counts["weight_loads"]
    adopter.adopt(1, taken)
    adopter._adopt_now()
    assert held <= set(adopter.engine.request_ids())
    assert adopter.engine.version == 2 and adopter.counts["weight_loads"] == loads
    adopter.engine.step()
    for st in adopter.engine.in_flight():
        if st.request_id in held:
            assert list(st.token_versions) == [0, 0, 1, 1, 2]


class _Cancelled:
    """A reward task the cluster cancelled as it closed, as the collector reads it."""

    status = "finished"

    def add_done_callback(self, fn):
        fn(self)

    def result(self):
        from concurrent.futures import CancelledError

        raise CancelledError("the client closed")


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "running"])
def test_a_reward_collector_failing_under_a_stopped_rollout_is_said_in_a_line(
    tiny_policy, small_config, caplog, stopped
):
    """As a failed run's cluster closes under its stopped rollouts, their reward tasks
    are cancelled: each collector printed a screen of traceback at ERROR, after the
    run's own error. A stopped rollout's says it in one INFO line; a running one's
    failure stays an ERROR with its traceback (and fails the rollout, as before)."""
    import logging

    from laminar.rollout import RolloutReplica

    rollout = RolloutReplica("r0", small_config, str(tiny_policy), None, None, None)
    if stopped:
        rollout._stop.set()
    rollout._to_score.put(([], [("item",)], _Cancelled()))
    rollout._to_score.put(None)
    with caplog.at_level(logging.INFO, logger="laminar.rollout"):
        rollout._collect_loop()
    assert rollout.error is not None and rollout._abandon.is_set()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    if stopped:
        assert not errors
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "r0: stopped; its reward collector gave up (CancelledError" in said, said
    else:
        assert "Traceback" in errors[0].getMessage()


def test_a_relay_load_holds_the_modelled_copy_once_per_version_on_every_path(
    tiny_policy, small_config
):
    """``rollout.pacing.pull_s``: a version loaded at a batch boundary and one loaded
    while waiting for the version the prompt pool said is published are each held for
    the modelled host-to-device copy, once per version. The wait used to load without
    the hold, and the next boundary, finding nothing newer, charged nothing: a rollout
    told of a version early got its weights for free."""
    from laminar.config import with_overrides

    rollout = _rollout(tiny_policy, small_config)
    rollout.cfg = with_overrides(rollout.cfg, ["rollout.pacing.pull_s=2.5"])
    held: list[float] = []
    rollout._serve_for = lambda s: held.append(s)  # (the hold, not waited here)
    rollout._serve = lambda *a: None
    rollout._synced = True
    weights = _weights(tiny_policy)
    rollout.puller = _Puller([(1, weights), None, (2, weights), None])
    rollout._wait_for_version(1, wait_s=30.0)  # told of version 1: loads it waiting
    rollout._maybe_load_weights()  # the boundary after: nothing newer
    rollout._maybe_load_weights()  # a boundary that loads version 2
    rollout._maybe_load_weights()  # nothing newer
    assert rollout.engine.version == 2 and rollout.counts["weight_loads"] == 2
    assert len(held) == 2 and all(0 < s <= 2.5 for s in held), held


def test_an_interrupt_counts_as_recomputed_only_the_requests_that_held_kv(
    tiny_policy, small_config
):
    """Partial rollout: an interrupt exports every request, the running ones and those
    still waiting for admission. Resumed, only the running ones (their tokens so far)
    recompute KV; a waiting one prefills once, as it would have anyway. Its prompt was
    counted in ``recomputed_tokens`` too, overstating the interrupt's cost."""
    rollout = _rollout(tiny_policy, small_config, ["rollout.max_concurrency=4"])
    rollout._add(_groups(3))  # 12 requests, 4 running
    for _ in range(2):
        rollout.engine.step()
    assert rollout._pause(1) == 12
    states = rollout._paused_states()
    ran = [st for st in states if st.tokens]
    assert 0 < len(ran) < len(states)
    rollout.puller = _Puller([(1, _weights(tiny_policy))])
    rollout._resume_paused()
    assert rollout.counts["recomputed_tokens"] == sum(st.context_len for st in ran)


def test_a_rollout_waits_for_a_rebuilt_data_module_as_long_as_the_driver_may_take(monkeypatch):
    """A rollout gave up on a lost data module faults.data_restart_timeout_s after its
    own first failed call, failing the run, while the driver, which counts that time
    from when it begins the rebuild (after finding the module silent and fencing its
    worker), was still within it. It now waits FaultsConfig.data_wait(): here 150 s
    since the loss is within it, and a module that answers again is taken back."""
    import time
    from concurrent.futures import Future
    from types import SimpleNamespace

    import laminar.rollout_data as rollout_data
    from laminar.config import RunConfig

    monkeypatch.setattr(rollout_data, "PROBE_S", 0.0)
    answered = Future()
    answered.set_result({})
    r = SimpleNamespace(
        cfg=RunConfig(),
        rollout_id="r0",
        _data_epoch=0,
        _data_lost=time.time() - 150.0,  # (data_restart_timeout_s is 120)
        _stop=SimpleNamespace(is_set=lambda: False),
        buffer=SimpleNamespace(stats=lambda: answered, key="buffer", _address="tcp://d"),
    )
    rollout_data.DataLinkMixin._await_data(r, 0, serve=False)
    assert r._data_lost is None  # (it answers: slow, not lost)
    assert RunConfig().faults.data_wait()[0] == 240.0


class _Beating:
    """A rollout's heartbeat (RolloutReplica's own) on a Dask actor, with a generation
    thread that is alive and one command that holds the actor thread until released, as
    a manager command (a pause, a move) does while it waits for the generation thread."""

    def __init__(self) -> None:
        import threading
        import time

        from laminar.rollout import RolloutReplica

        type(self).heartbeat = RolloutReplica.heartbeat
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._release.wait, daemon=True)
        self._thread.start()
        self._beat = time.time()
        self.holding = False

    def blocked(self) -> bool:
        self.holding = True
        return self._release.wait(60)

    async def is_holding(self) -> bool:
        return self.holding

    async def release(self) -> None:
        self._release.set()


def test_a_rollouts_heartbeat_is_answered_while_a_command_holds_its_actor_thread():
    """The actor's plain methods share one thread: a heartbeat queued behind a command
    that waits for the generation thread went unanswered as long as the command waited
    (up to cluster.actor_timeout_s), and a rollout making progress could be declared
    hung. Served on the event loop, it answers at once."""
    with actor_thread_held(_Beating) as (rollout, blocked):
        try:
            age = rollout.heartbeat().result(timeout=20)  # (queued: after the command's 60 s)
        finally:
            rollout.release().result()
        assert age is not None and age >= 0
        assert blocked.result(timeout=60) is True
