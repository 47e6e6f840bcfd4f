"""The restart state machines of pipelines/restart.py driven step by step against a
stand-in for Dask's client (the scheduler's workers, cancellation) and creating futures
that the test settles: what a restart does when its new trainer cannot start."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ClusterError
from pipelines.restart import TrainerRestart, _Group


class SchedulerClient:
    """What the restart asks of Dask's client: the scheduler's workers (address ->
    resources in ``workers``) and the cancellation of creating futures."""

    def __init__(self, workers: dict[str, dict]) -> None:
        self.workers = workers
        self.cancelled: list = []
        self.scheduler = SimpleNamespace(identity=self._identity)

    def _identity(self, n_workers=-1):
        return {"workers": {a: {"resources": r} for a, r in self.workers.items()}}

    def sync(self, fn, *args, callback_timeout=None, **kwargs):
        return fn(*args, **kwargs)

    def cancel(self, futures, force=False):
        self.cancelled += futures


LOST, NEW = "tcp://trainer:1", "tcp://trainer:2"


def _restart(
    tmp_path, future: Future, timeout_s: float = 30
) -> tuple[TrainerRestart, SchedulerClient]:
    """A trainer restart whose new trainer (one rank) is being created on ``NEW`` by
    ``future``."""
    cfg = with_overrides(RunConfig(), [f"faults.trainer_restart_timeout_s={timeout_s}"])
    client = SchedulerClient({NEW: {"trainer": 1}})
    s = SimpleNamespace(
        cfg=cfg, client=client, run_dir=tmp_path, resume_hint=lambda: "resume it", actors={}
    )
    r = TrainerRestart(s, LOST, {"version": 7, "steps": 20})
    r.worker = NEW
    r.group = _Group(s, NEW, [])
    r.group.future = future
    return r, client


def test_a_new_trainer_that_fails_on_a_live_worker_fails_the_restart_with_its_error(tmp_path):
    """The new trainer's own error (a checkpoint it cannot load) with its worker alive is
    the run's error: it used to be logged, the only worker excluded, and the run failed
    trainer_restart_timeout_s later for "no `trainer` worker came back". The actors the
    group created (none started) are released: each had loaded a checkpoint, and stayed
    on its worker until the run ended (helper 183)."""
    future: Future = Future()
    future.set_exception(ValueError("cannot load checkpoints/version-000010"))
    rank: Future = Future()  # (another rank's, on the same worker: failed alike)
    rank.set_exception(ValueError("cannot load checkpoints/version-000010"))
    r, client = _restart(tmp_path, future)
    r.group.rank_futures, r.group.rank_workers = [rank], [NEW]
    with pytest.raises(ValueError, match="cannot load"):
        r.step()
    assert NEW not in r.exclude
    assert client.cancelled == [future, rank]


def test_a_new_trainer_whose_worker_is_lost_while_it_is_created_is_started_elsewhere(tmp_path):
    """The new worker dies while the trainer is created: its creating task, pinned to
    the gone address, never ends. The restart waited on it for ever (no timeout); it
    now goes back to waiting for a `trainer` worker, bounded by its timeout."""
    creating: Future = Future()  # never done: its worker goes
    r, client = _restart(tmp_path, creating)
    assert r.step() is None and r.group is not None  # slow to start: waited for
    del client.workers[NEW]
    assert r.step() is None
    assert r.group is None and r.worker is None and NEW in r.exclude
    assert client.cancelled == [creating]
    assert r.step() is None  # no worker yet: waits
    r.t_lost -= 31
    with pytest.raises(ClusterError, match="trainer_restart_timeout_s=30"):
        r.step()


class Rollout:
    """A rollout handle whose ``stats()`` answers ``stats`` (or raises it: lost)."""

    def __init__(self, stats) -> None:
        self.stats_answer = stats

    def stats(self) -> Future:
        return answered(self.stats_answer)


def answered(answer) -> Future:
    """A call's future, done: with ``answer``, or raising it (an exception)."""
    f: Future = Future()
    if isinstance(answer, BaseException):
        f.set_exception(answer)
    else:
        f.set_result(answer)
    return f


def test_a_core_restart_tried_again_never_numbers_after_an_older_version(tmp_path):
    """A core restart numbers the new trainer's updates after M, the newest version
    anything that outlived the lost trainer saw. Tried again (its new worker lost too),
    a rollout that alone had seen M may be lost meanwhile: the retry must not number
    after an older version, or M would name two sets of weights."""
    from pipelines.restart import CoreRestart

    rollout = Rollout({"version": 9})  # loaded version 9, which the driver never saw
    s = SimpleNamespace(
        cfg=RunConfig(),
        client=SchedulerClient({}),
        _published_fps={4: 1, 5: 2},
        _last_data_stats=({"version": 5}, {}),
        actors={"rollouts": [rollout]},
        tier=SimpleNamespace(handle=lambda rid: None),
    )
    r = CoreRestart(s, LOST, {"version": 5, "steps": 20}, {"lost": [], "chain": ["master"]})
    assert r._newest_published() == 9
    rollout.stats_answer = ConnectionError("its worker is gone")
    assert r._newest_published() == 9


def test_a_core_restart_numbers_after_the_published_version_not_the_learners(tmp_path):
    """One-step's learner is one version ahead of the newest publication between an
    update and the batch that publishes it. Lost in that window, with nothing else
    newer seen, M is the published version: M read the learner's, and the new trainer
    numbered its updates after a version no rollout or relay ever held."""
    from pipelines.restart import CoreRestart

    s = SimpleNamespace(
        cfg=RunConfig(),
        client=SchedulerClient({}),
        _published_fps={4: 1, 5: 2},
        _last_data_stats=({"version": 5}, {}),
        actors={"rollouts": [Rollout({"version": 5})]},
        tier=SimpleNamespace(handle=lambda rid: None),
    )
    last = {"version": 6, "published": 5, "steps": 20}
    r = CoreRestart(s, LOST, last, {"lost": [], "chain": ["master"]})
    assert r._newest_published() == 5
    assert r.stand_in["version"] == 6  # (what the driver reports meanwhile: the learner's)


def test_a_new_trainer_that_is_never_created_on_a_live_worker_fails_the_restart_in_time(
    tmp_path,
):
    """A new worker that hangs (stopped, deadlocked) while it creates the trainer stays
    on the scheduler's books: the restart waited on it for ever. It is bounded by
    faults.trainer_restart_timeout_s, and says so."""
    import time

    r, client = _restart(tmp_path, Future(), timeout_s=0.5)  # never done, its worker there
    assert r.step() is None and r.group is not None
    time.sleep(0.6)
    with pytest.raises(ClusterError, match=r"not created on tcp://trainer:2.*timeout_s=0.5"):
        r.step()


class Answering:
    """An actor handle whose every call answers ``answer`` (or raises it)."""

    _client = None

    def __init__(self, worker: str, answer) -> None:
        self._address, self.key, self.answer = worker, f"fake-{worker}", answer

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs) -> Future:
            return answered(self.answer)

        return call


def test_a_data_module_lost_while_the_trainer_restarts_fails_the_run_saying_so(tmp_path):
    """The data module's worker dies while a lost trainer restarts (data apart): the run
    cannot go on, and its error says what was lost and how to continue, at once (it was
    the buffer call's bare OSError, which the driver reported as the trainer's loss)."""
    import time

    r, client = _restart(tmp_path, Future())
    r.group = r.worker = None  # (the restart has its new worker, and begins)
    gone = OSError("Timed out trying to connect to tcp://data:1")
    r.s.actors = {"buffer": Answering("tcp://data:1", gone), "manager": Answering("x", {})}
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"buffer did not answer.*resume it") as e:
        r.step()
    assert e.value.__cause__ is gone
    assert time.monotonic() - t0 < 2


class DroppingClient(SchedulerClient):
    """A scheduler that drops ``worker`` from its books after ``after`` looks (a killed
    worker: its calls fail a moment before the scheduler hears of it)."""

    def __init__(self, workers: dict[str, dict], worker: str, after: int) -> None:
        super().__init__(workers)
        self.worker, self.after = worker, after

    def _identity(self, n_workers=-1):
        self.after -= 1
        if self.after < 0:
            self.workers.pop(self.worker, None)
        return super()._identity(n_workers)


def test_a_data_module_rebuild_whose_worker_dies_is_tried_again_once_the_scheduler_knows(
    tmp_path,
):
    """The new data worker dies during the rebuild; the failed call says so a moment
    before the scheduler drops it. That is a second loss to wait out (another worker),
    not the run's error: the rebuild failed the run if the scheduler still listed it."""
    from pipelines.restart import DataRestart

    new_data = "tcp://data:2"
    client = DroppingClient({new_data: {"data": 1}}, new_data, after=3)
    trainer = Answering("tcp://trainer:1", OSError("Timed out trying to connect"))
    s = SimpleNamespace(
        cfg=RunConfig(),
        client=client,
        run_dir=tmp_path,
        resume_hint=lambda: "resume it",
        actors={"rollouts": [], "trainer": trainer},
        rollout_workers={},
    )
    r = DataRestart(s, "tcp://data:1", {"lost": [], "chain": ["master"]})
    assert r.step() is False
    assert r.lost_worker == new_data  # (waits for another)
    assert r.step() is False  # none yet


def test_a_trainer_restarted_twice_from_the_same_checkpoint_makes_trainer_steps_updates():
    """trainer.steps=20, a checkpoint at version 5. Lost at version 7: the first new
    trainer loads version 5, skips 6-7 and ends at 22 (5 + 15 updates). Lost again at 12
    before it wrote a checkpoint: the second loads version 5 again and must end at
    12 + 15 = 27. Given the lost trainer's steps (22, its own skip counted), it ended at
    22 + 7 = 29: two updates more than the run was to make."""
    from pipelines.restart import _steps

    cfg = with_overrides(RunConfig(), ["trainer.steps=20"])
    first = {"time": 1.0, "after_version": 7, "checkpoint_version": 5}
    s = SimpleNamespace(cfg=cfg, trainer_restarts=[first], core_restarts=[])
    lost_trainers_steps = 20 + (7 - 5)
    second_skip = 12 - 5
    assert _steps(s, 5, {"time": 2.0}) + second_skip == 27
    assert lost_trainers_steps + second_skip == 29  # (what it was given before)
    # From a checkpoint the first new trainer wrote (version 10: 5 + updates 8-10, its
    # numbers after its skip): 12 lost at 12 -> ends at 12 + (20 - 8) = 24.
    assert _steps(s, 10, {"time": 2.0}) + (12 - 10) == 24
    # A chain: the second (lost at 12, from 5) wrote version 20 (5 + updates 13-20);
    # the first's skip is not in its lineage: lost at 22, it ends at 22 + 20 - 13 = 29.
    second = {"time": 2.0, "after_version": 12, "checkpoint_version": 5}
    s.core_restarts = [second]
    assert _steps(s, 20, {"time": 3.0}) + (22 - 20) == 29
    # (the first restart, from the warm start: nothing skipped before any checkpoint)
    assert _steps(SimpleNamespace(cfg=cfg, trainer_restarts=[], core_restarts=[]), 0, {}) == 20


def test_a_core_restart_after_the_final_checkpoint_waits_for_no_other_rank(tmp_path, monkeypatch):
    """The trainer (rank 0 of 2) and the data module were lost after the run's final
    checkpoint: only the data module is rebuilt, so the restart needs one worker with
    both roles, not one for each rank as well. It waited for a second `trainer` worker
    that nothing would use (and failed the run when none came)."""
    import json

    from pipelines import restart
    from pipelines.restart import CoreRestart

    ckpt = tmp_path / "checkpoints" / "version-000020"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 20, "skipped_versions": 0}))
    cfg = with_overrides(RunConfig(), ["trainer.steps=20", "trainer.ranks=2"])
    s = SimpleNamespace(
        cfg=cfg,
        client=SchedulerClient({NEW: {"trainer": 1, "data": 1}}),  # (one: no second rank)
        run_dir=tmp_path,
        resume_hint=lambda: "resume it",
        actors={"rollouts": []},
        trainer_restarts=[],
        core_restarts=[],
        _published_fps={20: 1},
        _last_data_stats=({"version": 20}, {}),
    )

    class Picked(Exception):
        pass

    def picked(s, worker, chain):  # (the next step needs a cluster: the pick is made)
        raise Picked(worker)

    monkeypatch.setattr(restart, "_new_master", picked)
    r = CoreRestart(s, LOST, {"version": 20, "steps": 20}, {"lost": [], "chain": ["master"]})
    with pytest.raises(Picked, match=NEW):
        r._begin()


def test_a_core_restart_numbers_after_a_checkpoint_newer_than_anything_seen_published(
    tmp_path, monkeypatch
):
    """The lost trainer published 6 and wrote its checkpoint 6 after the driver's last
    look, and nothing that outlived it (one relay on one host, the buffer on the lost
    worker, no rollout at 6 yet) saw 6: M read 5. A checkpoint's version was published
    before it was written, so M is at least 6; the record said ``lost_updates`` -1."""
    import json

    from pipelines import restart
    from pipelines.restart import CoreRestart

    ckpt = tmp_path / "checkpoints" / "version-000006"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 6, "skipped_versions": 0}))
    s = SimpleNamespace(
        cfg=with_overrides(RunConfig(), ["trainer.steps=20"]),
        client=SchedulerClient({NEW: {"trainer": 1, "data": 1}}),
        run_dir=tmp_path,
        resume_hint=lambda: "resume it",
        actors={"rollouts": [Rollout({"version": 5})]},
        tier=SimpleNamespace(handle=lambda rid: None),
        trainer_restarts=[],
        core_restarts=[],
        _published_fps={4: 1, 5: 2},
        _last_data_stats=({"version": 5}, {}),
    )

    class Picked(Exception):
        pass

    def picked(s, worker, chain):  # (the next step needs a cluster: M is chosen by now)
        raise Picked(worker)

    monkeypatch.setattr(restart, "_new_master", picked)
    r = CoreRestart(s, LOST, {"version": 5, "steps": 20}, {"lost": [], "chain": ["master"]})
    assert r._newest_published() == 5
    with pytest.raises(Picked):
        r._begin()
    assert r.after == 6


class Calls:
    """An actor handle whose call ``name`` answers ``answers[name]``."""

    _client = None

    def __init__(self, worker: str, **answers) -> None:
        self._address, self.key, self.answers = worker, f"fake-{worker}", answers

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: answered(self.answers[name])


class Built(Exception):
    """Raised by a stand-in where a restart starts an actor: what it was given."""


def _lineage_driver(tmp_path, **more) -> SimpleNamespace:
    """A driver resumed from a checkpoint that records the restart (2, 4), that restarted
    its trainer from 10 after 19, and from 30 after 30 (nothing lost: it branches
    nothing), and its trainer and data module together from 20 after 25, in that order
    (the records' times)."""
    from storage.resume import ResumePlan

    return SimpleNamespace(
        cfg=with_overrides(RunConfig(), ["trainer.steps=40"]),
        run_dir=tmp_path,
        resume_hint=lambda: "resume it",
        resume=ResumePlan(version=8, restarts=[(2, 4)]),
        trainer_restarts=[
            {"time": 1.0, "checkpoint_version": 10, "after_version": 19},
            {"time": 3.0, "checkpoint_version": 30, "after_version": 30},
        ],
        core_restarts=[{"time": 2.0, "checkpoint_version": 20, "after_version": 25}],
        _restart=None,
        policy_dir="policy",
        schedule=None,
        rollout_workers={},
        **more,
    )


EARLIER = [(2, 4), (10, 19), (20, 25)]  # (_lineage_driver's)


def _capture_data_module(monkeypatch) -> None:
    """The rebuild's plan is made without a store, and starting the data module raises
    :class:`Built` with the buffer's plan."""
    from pipelines import restart
    from storage.resume import RebuildPlan

    def plan(run_dir, *, version, **kwargs):
        return RebuildPlan(version=version)

    def start(*args, rebuild=None, **kwargs):
        raise Built(rebuild)

    monkeypatch.setattr(restart, "plan_rebuild", plan)
    monkeypatch.setattr("pipelines.driver.start_data_module", start)


def _checkpoint(tmp_path, version: int) -> None:
    import json

    ckpt = tmp_path / "checkpoints" / f"version-{version:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": version}))


def test_a_rebuilt_data_modules_buffer_is_told_every_trainer_restart_before_it(
    tmp_path, monkeypatch
):
    """A data module rebuilt after trainer restarts: its buffer heard none of them
    (the lost one did, ExperienceBuffer.trainer_restarted) and counted max_train_staleness
    by the version numbers. The rebuild plan hands it every restart that branched the
    numbers, in order: the resumed checkpoint's, then the run's."""
    from pipelines.restart import DataRestart

    _capture_data_module(monkeypatch)
    s = _lineage_driver(tmp_path, client=SchedulerClient({}), actors={"rollouts": []})
    r = DataRestart(s, "tcp://data:1", {"lost": [], "chain": ["master"]})
    with pytest.raises(Built) as built:
        r._rebuild("tcp://data:2", record={"version": 40, "consumed": {}, "since": 30})
    assert built.value.args[0].restarts == EARLIER


def test_a_core_restart_tells_its_rebuilt_buffer_and_its_trainer_of_its_own_restart(
    tmp_path, monkeypatch
):
    """The trainer and data module lost together at version 37 (checkpoint 35): the
    rebuilt buffer never hears the restart it is part of, nor the earlier ones. It is
    handed them all, its own (35, 37) last; so is the new trainer, which records them in
    its checkpoints for a resumed run."""
    from pipelines import restart
    from pipelines.restart import CoreRestart

    _checkpoint(tmp_path, 35)
    _capture_data_module(monkeypatch)
    monkeypatch.setattr(restart, "_new_master", lambda s, worker, chain: "master")
    s = _lineage_driver(
        tmp_path,
        client=SchedulerClient({NEW: {"trainer": 1, "data": 1}}),
        actors={"rollouts": []},
        tier=SimpleNamespace(handle=lambda rid: None),
        _published_fps={37: 1},
        _last_data_stats=({"version": 37}, {}),
    )
    r = CoreRestart(s, LOST, {"version": 37, "steps": 40}, {"lost": [], "chain": ["master"]})
    with pytest.raises(Built) as built:
        r._begin()
    assert built.value.args[0].restarts == [*EARLIER, (35, 37)]

    started: list[dict] = []

    def start_actor(client, cls, *args, **kwargs):
        started.append(kwargs)
        return Future()

    monkeypatch.setattr(restart, "start_actor", start_actor)
    monkeypatch.setattr(restart.DataRestart, "_rebuild", lambda self, *a, **k: None)
    s.actors["buffer"] = "buffer"  # (the rebuilt one's)
    r = CoreRestart(s, LOST, {"version": 37, "steps": 40}, {"lost": [], "chain": ["master"]})
    r._begin()
    assert started[-1]["restarts"] == [*EARLIER, (35, 37)]


def test_a_restarted_trainer_is_handed_every_restart_its_own_last(tmp_path, monkeypatch):
    """A trainer restarted from checkpoint 35 after 37 is handed the run's restarts, its
    own last (the buffer heard it: ExperienceBuffer.trainer_restarted), to record in its
    checkpoints; a restart still in progress of the driver's is its own, not another."""
    from pipelines import restart

    _checkpoint(tmp_path, 35)
    started: list[dict] = []

    def start_actor(client, cls, *args, **kwargs):
        started.append(kwargs)
        return Future()

    monkeypatch.setattr(restart, "start_actor", start_actor)
    monkeypatch.setattr(restart, "_new_master", lambda s, worker, chain: "master")
    unstored = {"p3-0": (30, 1.5)}  # (the buffer still waits to store it consumed)
    back = {"readmitted": 0, "groups": 0, "consumed_unstored": unstored}
    buffer = Calls("tcp://data:1", stats={"version": 37}, trainer_restarted=back)
    manager = Calls("tcp://data:1", stats={"chain": ["master"]}, replace_master=None)
    s = _lineage_driver(
        tmp_path,
        client=SchedulerClient({NEW: {"trainer": 1}}),
        actors={"buffer": buffer, "manager": manager},
    )
    r = s._restart = TrainerRestart(s, LOST, {"version": 37, "steps": 40})
    r.step()
    assert started[-1]["restarts"] == [*EARLIER, (35, 37)]
    assert started[-1]["consumed"] == unstored  # (the new trainer's record begins with it)
    r.group = None  # (tried again: its record has its point from the first try)
    r.step()
    assert started[-1]["restarts"] == [*EARLIER, (35, 37)]


class Recorder:
    """An actor handle that answers ``answers[name]`` (an exception: raised, as by a lost
    actor) and records every call, in order, in ``calls``."""

    _client = None

    def __init__(self, worker: str, calls: list, **answers) -> None:
        self._address, self.key, self.calls, self.answers = worker, f"fake-{worker}", calls, answers
        self._cls = object

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs) -> Future:
            self.calls.append((name, args))
            return answered(self.answers.get(name))

        return call


def test_a_rollout_lost_between_its_holdings_and_its_attach_has_its_trajectories_restored(
    tmp_path, monkeypatch
):
    """A data module rebuilt while r1 is lost: r1 says what it holds (its groups stay
    outstanding), then its worker dies before it is attached. Its unfinished
    trajectories were only in the lost pool's log, which the new pool starts over: they
    were gone for good and their groups outstanding for ever (the audit: "consumed groups
    incomplete"). They are restored from that log before the log starts over, as a
    silent rollout's are; the new manager recovers them."""
    from laminar import partial as partial_mod
    from pipelines import restart
    from pipelines.restart import DataRestart
    from storage.resume import RebuildPlan

    calls: list = []
    entries = {
        "p1-000": {"owner": "r1", "state": "r1's", "version": 3},
        "p0-000": {"owner": "r0", "state": "r0's", "version": 3},
        "p1-001": {"owner": "r1", "state": "r1's, stored", "version": 3},
    }
    monkeypatch.setattr(partial_mod, "replay_log", lambda run_dir: SimpleNamespace(entries=entries))
    stored = lambda run_dir, uids: [u for u in uids if u == "p1-001"]  # noqa: E731
    monkeypatch.setattr(restart, "_stored", stored)
    plan = lambda run_dir, *, version, **k: RebuildPlan(version)  # noqa: E731
    monkeypatch.setattr(restart, "plan_rebuild", plan)
    new = "tcp://data:2"
    partial = Recorder(new, calls)
    manager = Recorder(new, calls)
    monkeypatch.setattr(
        "pipelines.driver.start_data_module",
        lambda *a, **k: (Recorder(new, calls), partial, Recorder(new, calls)),
    )
    monkeypatch.setattr(restart, "submit_actor", lambda *a, **k: manager)
    r0 = Recorder("tcp://r:0", calls, data_holdings=["p0"], attach_data=1)
    r1 = Recorder("tcp://r:1", calls, data_holdings=["p1"], attach_data=OSError("gone"))
    s = SimpleNamespace(
        cfg=RunConfig(),
        client=SchedulerClient({"tcp://r:0": {}, "tcp://r:1": {}, new: {"data": 1}}),
        run_dir=tmp_path,
        policy_dir="policy",
        schedule=None,
        actors={"rollouts": [r0, r1], "trainer": Recorder("tcp://trainer:1", calls)},
        rollout_workers={"r0": "tcp://r:0", "r1": "tcp://r:1"},
        tier=SimpleNamespace(handle=lambda rid: rid, ids=["master"], workers=["tcp://t:1"]),
        core_workers={},
    )
    m = {"lost": {}, "chain": ["master"], "rollout_relays": {}}
    r = DataRestart(s, "tcp://data:1", m)
    r._rebuild(new, record={"version": 3, "consumed": {}, "since": 0}, restarts=[])
    restored = [args[0] for name, args in calls if name == "restore"]
    assert restored == [{"p1-000": entries["p1-000"]}]
    names = [name for name, _ in calls]
    assert names.index("restore") < names.index("open_log") < names.index("start")
    assert r.record["rollouts_unattached"] == ["r1"] and r.record["restored_from_log"] == 1


def test_a_replacement_started_with_the_lost_master_pulls_from_the_new_one():
    """A trainer restart hands its new master to the manager before the driver's tier
    has it: a rollout replacing a lost one in between was started with the lost
    master's handle. The manager, which had taken the new master already, left it so: it
    pulled from the lost master (unreachable) for the rest of the run, at version 0.
    It is pointed at the new master as it joins."""
    from test_manager import FakeRollout

    from laminar.manager import RolloutManager

    lost, new = FakeRollout(), FakeRollout()
    r0, r2 = FakeRollout(), FakeRollout()
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=0.5"])
    manager = RolloutManager(
        cfg, {"r0": r0}, lost, None, {"r0": "tcp://w0"}, rollout_relays={"r0": "master"}
    )
    manager._master_lost = 0.0
    manager.replace_master(new, "tcp://t2")
    manager._take_joining()
    assert r0.called("set_relay") == [("set_relay", (new,), {})]
    manager.add_rollout("r2", r2, "tcp://w2", "r1", "master")  # (made with `lost`)
    manager._take_joining()
    assert r2.called("set_relay") == [("set_relay", (new,), {})]
    assert manager.rollout_relays["r2"] == "master" and manager.replacements == {"r1": "r2"}


@pytest.mark.parametrize("rebuilt", [True, False], ids=["rebuilt", "not_yet_rebuilt"])
def test_an_abort_during_a_core_restart_closes_what_the_restart_made(rebuilt):
    """The run fails while a core restart is under way (its new trainer failed to start,
    say). The abort released nothing the restart had made: the created ranks (each had
    loaded a checkpoint) stayed on their workers, its new master relay ran on, and the
    rebuilt buffer and recovery log were never closed, so what they held unwritten (up to
    a flush interval of trajectories and log) was lost to the resume, because the books
    still named the lost data module's worker (helper 183). Not yet rebuilt, the lost
    data module is gone and nothing is closed."""
    from pipelines.driver_faults import FaultHandling

    calls: dict[str, list] = {k: [] for k in ("buffer", "partial", "master", "relay", "lost")}
    client = SchedulerClient({NEW: {"trainer": 1, "data": 1}})
    s = SimpleNamespace(client=client, cfg=RunConfig())
    group = _Group(s, NEW, [NEW])
    group.future, group.rank_futures = Future(), [Future()]  # (created, not started)
    restart = SimpleNamespace(
        group=group, master=Recorder(NEW, calls["master"]), rebuilt_on=NEW if rebuilt else None
    )
    driver = SimpleNamespace(
        client=client,
        cfg=RunConfig(),
        actors={
            "manager": None,
            "trainer": Recorder(LOST, calls["lost"]),
            "relays": [Recorder(NEW, calls["relay"])],
            "buffer": Recorder(NEW, calls["buffer"]),
            "partial": Recorder(NEW, calls["partial"]),
        },
        _live_rollouts=lambda: [],
        _restart=None,
        _data_restart=restart,
        _data_hung=None,
        _data_worker=lambda: LOST,  # (the books: the lost one's, until the restart ends)
    )
    FaultHandling._abort(driver)
    assert client.cancelled == [group.future, *group.rank_futures]
    assert calls["master"] == [("close", ())] and calls["relay"] == [("close", ())]
    assert calls["lost"] == []  # (its worker is gone: never called)
    closed = [("close", ())] if rebuilt else []
    assert calls["buffer"] == closed and calls["partial"] == closed
