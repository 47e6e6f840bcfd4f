"""The run driver (pipelines/driver.py) against fake actors, no cluster: what it does
when an actor never answers, or its worker is gone, while it polls and while it stops
the run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ClusterError
from pipelines import driver, driver_faults, driver_metrics, driver_polls, restart
from pipelines.laminar import LaminarSchedule

# (restart and the driver's parts imported above, not lazily while a test patches them:
# so that they hold the real functions)

HANG = object()  # a call that never answers (its actor's worker is gone, or hung)


class _Hung(Future):
    """A call's future that never answers, recording each wait on it (``waited``: the
    ``timeout`` handed to ``result``): what a test asserts of the waits, not the wall
    time they took, which a loaded host stretches."""

    def __init__(self, waited: list) -> None:
        super().__init__()
        self.waited = waited

    def result(self, timeout=None):
        self.waited.append(timeout)
        return super().result(timeout)


class FakeActor:
    """An actor handle whose calls answer at once from ``answers`` (name -> value, a
    function of the call's arguments, or an error to raise), or never (:data:`HANG`);
    ``calls`` records the names called, in order, and ``waited`` the timeouts of the
    waits on its calls that never answer."""

    def __init__(self, worker: str, calls: list, **answers) -> None:
        self._address, self.key = worker, f"fake-{worker}"
        self._answers, self._calls = answers, calls
        self.waited: list = []

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs) -> Future:
            self._calls.append(f"{self._address}.{name}")
            answer = self._answers.get(name)
            if answer is HANG:
                return _Hung(self.waited)
            f: Future = Future()
            if isinstance(answer, BaseException):
                f.set_exception(answer)
            else:
                f.set_result(answer(*args, **kwargs) if callable(answer) else answer)
            return f

        return call


def test_answers_waits_once_for_all_calls_not_once_per_call():
    """Three rollouts that do not answer (SIGSTOPped, or lost and not yet detected) hold
    a poll up by one timeout, not one per rollout."""
    calls: list = []
    hung = [FakeActor(f"w{i}", calls, stats=HANG) for i in range(3)]
    fine = FakeActor("w3", calls, stats={"rollout_id": "r3"})
    out = driver._answers([lambda r=r: r.stats() for r in [*hung, fine]], timeout=0.5)
    assert out == [{"rollout_id": "r3"}]
    # By design one timeout and 0.1 s for each later hung call (never 0 past the
    # deadline): 0.7 s. One wait per call, the bug, waits 3 x 0.5 = 1.5 s. (The waits
    # handed out, not the wall time: a loaded host's late wake-ups only shorten them.)
    waits = [t for h in hung for t in h.waited]
    assert len(waits) == 3 and sum(waits) <= 0.5 + 2 * 0.1 + 1e-6, waits


# -- a whole run's end, on fake actors ---------------------------------------------------

WORKERS = {"data": "tcp://data:1", "trainer": "tcp://trainer:1", "r0": "tcp://r0:1"}


def _trainer_stats(done: bool = True) -> dict:
    return {
        "version": 3,
        "steps": 3,
        "done": done,
        "error": None,
        "wait_s": 0.0,
        "silent_s": 0.0,
        "last": None,
        "checkpoint": None,
        "skipped_steps": 0,
        "skipped_updates": [],
        "weights_checksum": 0,
        "paced": None,
    }


BUFFER = {
    "depth": 0,
    "oldest_t_insert": float("nan"),
    "ready_groups": 0,
    "partial_groups": 0,
    "inserted": 0,
    "consumed": 0,
    "discarded": 0,
    "evicted": 0,
    "filtered": 0,
    "version": 3,
}
MANAGER = {
    "error": None,
    "lost": {},
    "replacements": {},
    "relays_lost": {},
    "hung": {},
    "chain": ["master"],
    "masters_replaced": [],
    "rollout_relays": {"r0": "master"},
}
RELAY = {
    k: [] if k in ("publications", "kept", "versions") else 0
    for k in (*driver_metrics.RELAY_FIGURES, "publications")
}
ROLLOUT = {"rollout_id": "r0", "response_tokens": 0, "error": None, "version": 3}
ROLLOUT_END = {**ROLLOUT, "weight_wait_s": 0.0, "weight_loads": 0}


def fake_run(tmp_path, monkeypatch, live: set[str], **hang) -> tuple[LaminarSchedule, list]:
    """A driver whose actors were set up as :meth:`Schedule.setup` leaves them (data
    module and trainer apart, one rollout), the scheduler knowing the workers ``live``;
    ``hang``: role -> the names of its calls that never answer."""
    cfg = with_overrides(
        RunConfig(),
        ["metrics.poll_s=0.05", "cluster.actor_timeout_s=3", "faults.heartbeat_timeout_s=3"],
    )
    workers = lambda client=None, timeout=None: {w: {} for w in live}  # noqa: E731
    monkeypatch.setattr(driver_faults, "scheduler_workers", workers)
    monkeypatch.setattr(restart, "scheduler_workers", workers)
    monkeypatch.setattr("laminar.cluster.scheduler_workers", workers)
    monkeypatch.setattr("laminar.cluster.LOST_POLL_S", 0.1)
    calls: list = []

    def actor(role: str, worker: str, **answers) -> FakeActor:
        answers |= {name: HANG for name in hang.get(role, ())}
        return FakeActor(worker, calls, **answers)

    s = LaminarSchedule(cfg, None, tmp_path)
    d, t = WORKERS["data"], WORKERS["trainer"]
    s.actors = {
        "manager": actor(
            "manager",
            d,
            stats=MANAGER,
            get_lost={},
            stop=MANAGER,
            get_rows=[],
            get_fault_rows=[],
            start=None,
        ),
        "partial": actor("partial", d, close={}, stats={}),
        "pool": actor("pool", d, stats={"outstanding": 0, "dispatched": 0}),
        "buffer": actor("buffer", d, stats=BUFFER, close=BUFFER),
        "trainer": actor(
            "trainer",
            t,
            start=None,
            stats=_trainer_stats(),
            stop=_trainer_stats(),
            get_history=[],
            get_fingerprints={},
        ),
        "trainer_ranks": [],
        "rollouts": [actor("rollout", WORKERS["r0"], start=None, stats=ROLLOUT, stop=ROLLOUT_END)],
        "relays": [actor("relay", t, stats=RELAY, close=None, publications_since=lambda since: [])],
    }
    s.core_workers = {"trainer": t, "data module": d}
    s.rollout_workers = {"r0": WORKERS["r0"]}
    s.relay_info, s.policy_dir, s._joining = {"chain": ["master"]}, "policy", None
    s._laminar = True
    s.restartable = s.data_restartable = False  # (a rebuild needs a cluster)
    s.trainer_restarts, s.data_restarts, s.core_restarts = [], [], []
    s._restart = s._data_restart = None
    s._fenced, s._own_errors = {}, {}
    s._data_suspect = s._trainer_suspect = s._group_suspect = None
    s._last_data_stats = s._last_m_stats = s._last_t_stats = None
    s._published_fps, s._old_publications, s._master_publications = {}, [], []
    s._updates_before, s._master_gone = 0, False
    return s, calls


def run_in_thread(s, timeout: float = 30.0):
    """``s.run`` in a thread: its result or error, or ``"hung"``."""
    return in_thread(lambda: s.run(lambda p: None, lambda: False), timeout)


def in_thread(call, timeout: float):
    """``call()`` in a thread: ``{"result": ...}`` or ``{"error": ...}``, or ``"hung"``
    when it has not returned within ``timeout``."""
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = call()
        except Exception as e:  # noqa: BLE001 — what the test looks at
            out["error"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout)
    return "hung" if th.is_alive() else out


def test_a_data_module_lost_during_the_final_stop_fails_the_run_and_stops_the_rest(
    tmp_path, monkeypatch
):
    """The data module's worker dies as the run stops: the manager's stop never answers
    (a call in flight to a lost actor waits for ever). The driver does not hang: the
    run fails, saying what was lost, and its rollouts and trainer are stopped (the
    manager stops first, so the trainer was not yet: it trained on, or waited for the
    lost buffer for minutes, a released actor's thread going on)."""
    live = {WORKERS["trainer"], WORKERS["r0"]}  # (the data worker is gone)
    s, calls = fake_run(tmp_path, monkeypatch, live, manager=["stop"])
    stops: list[dict] = []
    s.actors["trainer"]._answers["stop"] = lambda **kw: stops.append(kw) or _trainer_stats()
    out = run_in_thread(s)
    assert out != "hung", "the driver waited for ever on the lost data module"
    assert isinstance(out.get("error"), ClusterError), out
    assert "data module" in str(out["error"])
    assert f"{WORKERS['r0']}.stop" in calls  # nothing generates on
    # nor trains on, nor checkpoints after the driver gave up
    assert [kw.get("checkpoint") for kw in stops] == [False], stops


def test_a_trainer_lost_during_the_final_stop_still_flushes_the_store(tmp_path, monkeypatch):
    """The trainer's worker dies while it stops (its final checkpoint is lost): the
    driver does not hang, and the buffer and the partial-response pool are still closed,
    so the trajectory store and the recovery log keep their last batch for the resume."""
    live = {WORKERS["data"], WORKERS["r0"]}
    s, calls = fake_run(tmp_path, monkeypatch, live, trainer=["stop"])
    out = run_in_thread(s)
    assert out != "hung", "the driver waited for ever on the lost trainer"
    assert isinstance(out.get("error"), ClusterError), out
    assert "trainer" in str(out["error"])
    assert f"{WORKERS['data']}.close" in calls, calls
    assert calls.count(f"{WORKERS['data']}.close") == 2  # the buffer, then the pool


@pytest.mark.parametrize("role", ["buffer", "pool"])
def test_a_data_module_hung_during_the_final_stop_does_not_hang_the_driver(
    tmp_path, monkeypatch, role
):
    """The data module stops answering (SIGSTOP: its worker stays on the scheduler's
    books) once the rollouts have stopped: the driver gives up after its timeout."""
    live = set(WORKERS.values())
    hang = {"buffer": ["close"], "pool": ["stats"]}[role]
    s, calls = fake_run(tmp_path, monkeypatch, live, **{role: hang})
    s.cfg = with_overrides(s.cfg, ["cluster.actor_timeout_s=1"])  # (each wait costs one)
    out = run_in_thread(s)
    assert out != "hung", "the driver waited for ever on the hung data module"
    assert "error" in out, out


@pytest.mark.parametrize("role", ["trainer", "buffer"])
def test_calls_failing_as_if_lost_with_the_worker_still_there_fail_the_run(
    tmp_path, monkeypatch, role
):
    """A trainer (or data module) whose every call fails as a lost actor's would (a cut
    connection) while the scheduler still has its worker is tried again for
    DATA_SUSPECT_S, then fails the run: with restarts on, it used to be waited on for
    ever (nothing lost to restart, nothing failed)."""
    monkeypatch.setattr(driver_polls, "DATA_SUSPECT_S", 0.3)
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s.restartable = s.data_restartable = True
    s.actors[role]._answers["stats"] = ConnectionError("connection reset")
    if role == "buffer":  # (a run that polled it once already)
        s._last_data_stats = (BUFFER, {"outstanding": 0, "dispatched": 0})
    if role == "buffer":  # (the trainer runs on, waiting for its batches)
        s.actors["trainer"]._answers["stats"] = _trainer_stats(done=False)
    out = run_in_thread(s, timeout=20.0)
    assert out != "hung", "the driver waited for ever on an actor that fails every call"
    assert "error" in out, out


def test_a_rollout_that_fails_to_start_leaves_nothing_generating(tmp_path, monkeypatch):
    """The second rollout's start fails (its worker went): the run fails, and the trainer
    and the rollout started before it are stopped (a released actor's threads go on)."""
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    r0 = s.actors["rollouts"][0]
    r1 = FakeActor("tcp://r1:1", calls, start=ConnectionError("gone"), stop=ROLLOUT_END)
    s.actors["rollouts"].append(r1)
    s.rollout_workers["r1"] = r1._address
    out = run_in_thread(s, timeout=20.0)
    assert out != "hung"
    assert isinstance(out.get("error"), ConnectionError), out
    assert f"{r0._address}.stop" in calls, calls
    assert f"{WORKERS['trainer']}.stop" in calls, calls


def test_a_trainer_slow_to_hand_its_fingerprints_is_not_fenced(tmp_path, monkeypatch):
    """With ``relay.audit_weights`` and restarts on, the driver asks the trainer for its
    published fingerprints every poll. A slow answer there, after its stats answered, is
    no silence: the poll goes on (they are asked again next time); it used to fence (kill)
    a healthy trainer's worker after 5 s."""
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()), trainer=["get_fingerprints"])
    s.cfg = with_overrides(s.cfg, ["relay.audit_weights=true", "cluster.actor_timeout_s=0.3"])
    s.restartable = True
    fenced = []
    monkeypatch.setattr(s, "_fence", lambda *a, **k: fenced.append(a))
    stats = s._trainer_stats()
    assert stats["version"] == 3 and not fenced and s._restart is None
    assert f"{WORKERS['trainer']}.get_fingerprints" in calls


def test_the_stop_waits_for_a_trainer_still_writing_its_last_checkpoint(tmp_path, monkeypatch):
    """The trainer's stop returns after 60 s with its thread still in a long final update
    or checkpoint (a big model): the driver waits while it shows progress, and records
    the checkpoint it ends with (the data position goes there), not the older one."""
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    ckpt = tmp_path / "checkpoints" / "version-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"version": 3}')  # (the version it holds)
    stopped = []
    writing = {**_trainer_stats(done=False), "silent_s": 0.0, "checkpoint": None}

    def stats():
        if not stopped:
            return _trainer_stats()
        stopped.append(1)
        return writing if len(stopped) < 4 else {**_trainer_stats(), "checkpoint": str(ckpt)}

    trainer = s.actors["trainer"]
    trainer._answers["stats"] = stats
    trainer._answers["stop"] = lambda: stopped.append(1) or writing
    out = run_in_thread(s)
    assert out != "hung" and "result" in out, out
    assert (ckpt / "data_state.json").exists()
    assert len(stopped) >= 4


def test_a_trainer_lost_again_as_its_restart_ends_is_left_to_the_next_poll(tmp_path, monkeypatch):
    """The restarted trainer's worker dies just as the driver takes it into its books:
    its first stats call fails. That is the next poll's loss to detect (and restart
    again), not an error out of the restart that fails the run."""
    from types import SimpleNamespace

    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s.tier = SimpleNamespace(relays=[None], workers=[None])
    s._trainer_wait, s._n_updates = (0.0, 0.0), 0
    s._last_t_stats = _trainer_stats(done=False)
    new = FakeActor("tcp://trainer:2", calls, stats=ConnectionError("gone"))
    r = SimpleNamespace(ranks=[], master="master", worker="tcp://trainer:2")
    r.group = SimpleNamespace(rank_workers=[])
    s._trainer_back(r, "trainer", new)
    assert s.actors["trainer"] is new and s.core_workers["trainer"] == "tcp://trainer:2"
    assert s._last_t_stats["wait_s"] == 0.0  # (the lost one's stand-in, its wait counted)


def test_a_silent_rollout_holds_up_one_poll_not_every_poll(tmp_path, monkeypatch):
    """A rollout that stops answering (hung, or lost and not yet declared) costs the
    polls one wait: its unanswered call is kept and read when it comes, not made again
    (and waited on again) at every poll until the manager declares it."""
    monkeypatch.setattr(driver_polls, "ROLLOUT_STATS_WAIT_S", 0.5)
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    silent = FakeActor("tcp://r1:1", calls, stats=HANG)
    s.actors["rollouts"].append(silent)
    polls = [s._rollout_stats() for _ in range(4)]
    assert polls == [[ROLLOUT]] * 4
    assert len(silent.waited) == 1 and silent.waited[0] <= 0.5, silent.waited  # not four
    assert calls.count("tcp://r1:1.stats") == 1
    assert calls.count("tcp://r0:1.stats") == 4
    # its answer, when it comes, is read at the next poll; then it is called again
    s._r_pending[silent.key].set_result({**ROLLOUT, "rollout_id": "r1"})
    assert [r["rollout_id"] for r in s._rollout_stats()] == ["r0", "r1"]
    s._rollout_stats()
    assert calls.count("tcp://r1:1.stats") == 2


def test_a_barrier_schedule_tells_the_pool_how_many_rollouts_share_its_batches(
    tmp_path, monkeypatch
):
    """Sync's batches are handed out in parts, one per rollout: when the manager finds a
    rollout lost (or hung), the pool is told once how many still generate, and again
    when that changes; Laminar's pool has no parts to tell of."""
    from pipelines.sync import SyncSchedule

    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    told: list[int] = []
    s.actors["pool"]._answers["rollouts_live"] = told.append
    s.actors["rollouts"].append(FakeActor("tcp://r1:1", calls, stats=ROLLOUT))
    s._share_batches(MANAGER)  # (Laminar: nothing)
    assert told == []
    s.schedule = SyncSchedule.spec(s.cfg)
    for lost, hung in [({}, {}), ({}, {}), ({"r1": 1.0}, {}), ({"r1": 1.0}, {}), ({}, {"r0": {}})]:
        s._share_batches({**MANAGER, "lost": lost, "hung": hung})
    assert told == [2, 1]  # (r1 lost, then r0 hung instead: still one)
    s.actors["rollouts"].append(FakeActor("tcp://r2:1", calls, stats=ROLLOUT))
    s._share_batches({**MANAGER, "lost": {"r1": 1.0}, "hung": {}})  # r2 replaced it
    assert told == [2, 1, 2]


def test_a_replacement_whose_worker_is_lost_as_it_starts_is_given_up(tmp_path, monkeypatch):
    """The actor a replacement rollout is created as, on a worker lost meanwhile, never
    comes (its task is pinned to the gone address): the driver drops it, so a later
    poll can start another, where it used to wait on it for the rest of the run."""
    s, _ = fake_run(tmp_path, monkeypatch, {WORKERS["data"], WORKERS["trainer"]})
    s._joining = ("r1", "tcp://gone:1", "r0", "master", Future())
    s._replace_lost({**MANAGER, "lost": {"r0": 1.0}})
    assert s._joining is None
    s._joining = ("r1", WORKERS["data"], "r0", "master", Future())  # still on the books
    s._replace_lost({**MANAGER, "lost": {"r0": 1.0}})
    assert s._joining is not None and s._joining[1] == WORKERS["data"]


def test_a_trainer_and_data_module_lost_at_once_are_both_named(tmp_path, monkeypatch):
    """The trainer's and the data module's workers (apart) die together as the run
    stops: the error names both, with their workers. It named the first alone, and the
    user took the other for fine."""
    s, calls = fake_run(tmp_path, monkeypatch, {WORKERS["r0"]}, manager=["stop"])
    out = run_in_thread(s)
    assert out != "hung" and isinstance(out.get("error"), ClusterError), out
    said = str(out["error"])
    assert f"the trainer (worker {WORKERS['trainer']} is gone" in said, said
    assert f"the data module (worker {WORKERS['data']} is gone" in said, said
    assert f"{WORKERS['r0']}.stop" in calls  # nothing generates on


def test_records_that_cannot_be_opened_stop_the_started_actors(tmp_path, monkeypatch):
    """Reading a resumed run's earlier starts (its metrics, summary.json) comes after
    the actors started: an error there (a summary.json of an odd shape) failed the run
    with the trainer, rollouts and manager left running."""
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))

    def odd(t_start):
        raise KeyError("segment")

    s._origin = odd
    out = run_in_thread(s)
    assert out != "hung" and isinstance(out.get("error"), KeyError), out
    for stopped in ("trainer", "r0", "data"):  # (the manager is on the data worker)
        assert f"{WORKERS[stopped]}.stop" in calls, (stopped, calls)


def test_a_data_module_lost_after_the_trainer_finished_fails_naming_its_final_checkpoint(
    tmp_path, monkeypatch
):
    """The trainer made every update and is gone from the books (``_trainer_finished``);
    the data module is lost before the run's stop. Nothing is left to restart it for:
    the run fails saying the training finished and where its final checkpoint is (no
    restart is begun, which would start a trainer with nothing to train)."""
    s, _ = fake_run(tmp_path, monkeypatch, {WORKERS["trainer"], WORKERS["r0"]})
    s.actors["trainer"] = None
    s._last_t_stats = {"checkpoint": "run/checkpoints/version-000003"}
    s.restartable = s.data_restartable = True
    with pytest.raises(ClusterError, match="after the trainer had made every update") as e:
        s._begin_restart({"data module": WORKERS["data"]}, RuntimeError("buffer gone"))
    assert "version-000003" in str(e.value) and s._data_restart is None
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.slow
def test_a_data_worker_that_hangs_as_the_data_module_is_created_fails_it_in_time(tmp_path):
    """The data worker hangs (SIGSTOP: the scheduler keeps it on its books for minutes)
    as the data module's actors are created, at a run's start or a rebuild: creating
    them waited for ever. It gives up after faults.data_restart_timeout_s, saying what
    hung, where, and what to do."""
    import os
    import signal

    from distributed import Client

    from laminar.cluster import role_cluster, workers_with

    cfg = with_overrides(RunConfig(), ["faults.data_restart_timeout_s=2"])
    spec = LaminarSchedule.spec(cfg)
    with (
        role_cluster({"data": {"data": 1}}, name="data-hangs") as cluster,
        Client(cluster) as client,
    ):
        (w,) = workers_with(client, "data")
        pid = client.run(os.getpid, workers=[w])[w]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            start = lambda: driver.start_data_module(client, cfg, "policy", tmp_path, spec, w)  # noqa: E731
            out = in_thread(start, timeout=30)
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
    assert out != "hung", "creating the data module waited on the hung worker"
    assert isinstance(out.get("error"), ClusterError), out
    said = str(out["error"])
    assert f"PromptPool was not created on {w}: that worker sent the scheduler nothing" in said
    assert "faults.data_restart_timeout_s=2 s" in said
    assert "may hang" in said and "start it again" in said, said  # (no checkpoint yet)
    assert took < 10, took


@pytest.mark.slow
def test_a_data_module_slow_to_create_on_a_live_worker_is_waited_for():
    """The bound on creating the data module is the worker's silence, not the time the
    constructors take: a live worker beats on while one runs (a prompt file of millions
    to tokenize), and is waited for past faults.data_restart_timeout_s."""
    from distributed import Client

    from laminar.cluster import bind_actor, role_cluster, start_actor, workers_with

    class SlowToStart:  # (defined here: pickled by value, as workers cannot import tests)
        def __init__(self, seconds):
            import time

            time.sleep(seconds)

    with (
        role_cluster({"data": {"data": 1}}, name="data-slow") as cluster,
        Client(cluster) as client,
    ):
        (w,) = workers_with(client, "data")
        future = start_actor(client, SlowToStart, 5.0, worker=w, resource="data")
        t0 = time.monotonic()
        assert bind_actor(client, SlowToStart, w, future, silent_s=2.0) is not None
        assert time.monotonic() - t0 > 3.0 and future.done()


def test_the_stop_records_the_data_position_only_in_the_last_versions_checkpoint(tmp_path):
    """At the stop the driver writes where the prompt order stood into the trainer's
    final checkpoint. When that one was not written (the store could not commit), the
    newest is an older one: writing the stop's position there made a run from it skip
    the prompts dispatched since, which its weights never trained. Its own position
    stays; the write into the right one goes aside and is renamed into place."""
    import json

    from laminar.prompt_pool import data_position
    from pipelines.driver import record_data_position

    ckpt = tmp_path / "version-000003"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 3}))
    (ckpt / "data_state.json").write_text(json.dumps({"dispatched": 10}))
    assert not record_data_position(str(ckpt), 4, {"dispatched": 20})
    assert data_position(str(ckpt)) == 10
    assert not record_data_position(None, 4, {"dispatched": 20})
    assert not record_data_position(str(tmp_path), 4, {"dispatched": 20})  # (no checkpoint)
    assert record_data_position(str(ckpt), 3, {"dispatched": 20})
    assert data_position(str(ckpt)) == 20
    assert sorted(p.name for p in ckpt.iterdir()) == ["data_state.json", "trainer_state.json"]


def test_a_resumed_runs_buffer_age_leaves_out_the_time_it_was_stopped(tmp_path, monkeypatch):
    """A resume holds the stored buffered trajectories again with their t_insert: the
    cluster table's oldest_buffered_age_s counted the hours the run was stopped (the
    accessor's buffer_age subtracts pauses_s; the gauge did not)."""
    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    MetricsWriter(tmp_path).append(  # the first start: 100 s, then stopped for an hour
        "cluster",
        [{"segment": 0, "elapsed_s": t, "wall_time": t0 + t, "version": 2} for t in (0.0, 100.0)],
    )
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s.resume, s._carry = object(), {"cluster": {}, "rollouts": {}}
    s._rows, s._trainer_wait = {"cluster": [], "rollouts": []}, (0.0, 0.0)
    t_start = t0 + 3700.0
    assert s._origin(t_start) == t0 and s._segment == 1
    stats = {"depth": 1, "ready_groups": 0, "partial_groups": 1, "inserted": 1, "consumed": 0}
    stats |= {"discarded": 0, "evicted": 2, "filtered": 1}
    now = t_start + 10.0
    pool = {"outstanding": 1, "dispatched": 1}
    # inserted 30 s before the stop: 40 s in the buffer, not 3,640
    s._record(
        3710.0, now, {"version": 2, "wait_s": 0.0}, {**stats, "oldest_age_s": 3640.0}, pool, [], 0
    )
    # inserted in this start: untouched
    s._record(
        3710.0, now, {"version": 2, "wait_s": 0.0}, {**stats, "oldest_age_s": 5.0}, pool, [], 0
    )
    # empty: NaN stays NaN
    s._record(
        3710.0,
        now,
        {"version": 2, "wait_s": 0.0},
        {**stats, "oldest_age_s": float("nan")},
        pool,
        [],
        0,
    )
    ages = [r["oldest_buffered_age_s"] for r in s._rows["cluster"]]
    assert ages[:2] == [pytest.approx(40.0), 5.0] and ages[2] != ages[2]
    # (and the buffer's evictions and filtering, over time, beside its discards)
    assert s._rows["cluster"][0]["evicted"] == 2 and s._rows["cluster"][0]["filtered"] == 1


def test_a_cluster_row_is_stamped_at_the_buffers_reading_unless_it_is_an_old_one(
    tmp_path, monkeypatch
):
    """A row is stamped when the buffer was read (its read_at), and the poll's rollouts
    rows with it; a reading the buffer did not give this poll (a silent data module: the
    driver's last one again) is stamped at the poll's end, not at its old time again
    (every such row stood at one time)."""
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s._rows, s._trainer_wait = {"cluster": [], "rollouts": []}, (0.0, 0.0)
    s._carry = {"cluster": {}, "rollouts": {}}
    t0 = 1.8e9
    stats = {"depth": 0, "ready_groups": 0, "partial_groups": 0, "inserted": 4, "consumed": 0}
    stats |= {"discarded": 0, "evicted": 0, "filtered": 0, "oldest_age_s": float("nan")}
    stats["read_at"] = t0 + 9.5
    pool, trainer = {"outstanding": 1, "dispatched": 1}, {"version": 2, "wait_s": 0.0}
    rollout = [{"rollout_id": "r0"}]
    s._record(10.0, t0 + 10.0, trainer, stats, pool, rollout, 0)  # (read 0.5 s before)
    s._record(11.0, t0 + 11.0, trainer, stats, pool, rollout, 0)  # (the same reading)
    s._record(12.0, t0 + 12.0, trainer, {**stats, "read_at": t0 + 11.8}, pool, rollout, 0)
    rows = s._rows["cluster"]
    assert [r["wall_time"] for r in rows] == [t0 + 9.5, t0 + 11.0, t0 + 11.8]
    assert [r["elapsed_s"] for r in rows] == [9.5, 11.0, pytest.approx(11.8)]
    assert [r["elapsed_s"] for r in s._rows["rollouts"]] == [r["elapsed_s"] for r in rows]


def test_rows_only_the_trainer_and_manager_hold_outlive_a_lost_data_module(tmp_path, monkeypatch):
    """The trainer's history, the manager's recoveries and the master relay's
    publications are copied every poll and written when the run fails: a data module
    lost before the driver's first 5 s flush (restarts off) used to take them all, so
    ``laminar audit`` found no ``faults`` table and skipped its recovery check, and a
    lost run's ``publications`` held nothing of its start."""
    from storage.metrics import open_metrics

    live = set(WORKERS.values())
    s, calls = fake_run(tmp_path, monkeypatch, live)
    history = [{"version": v, "time": 1.0e9 + v, "loss": 0.1 * v} for v in (1, 2)]
    fault = {"time": 1.0e9, "rollout": "r1", "destination": "r0", "how": "import"}
    fault |= {"version": 1, "requests": 3, "tokens_recovered": 5, "recovery_s": 0.1}
    pubs = [
        {"version": 0, "t_publish": time.time(), "stall_s": 0.01, "broadcast_s": 0.02},
        {"version": 1, "t_publish": time.time(), "stall_s": 0.01, "broadcast_s": float("nan")},
    ]
    s.actors["trainer"]._answers |= {
        "stats": _trainer_stats(done=False) | {"version": 1},
        "get_history": lambda start: history[start:],
    }
    s.actors["manager"]._answers["get_fault_rows"] = lambda start: [fault][start:]
    s.actors["relays"][0]._answers["publications_since"] = lambda since: pubs[since:]
    polls = []

    def buffer_stats():
        polls.append(1)
        if len(polls) > 4:  # its worker dies
            live.discard(WORKERS["data"])
            raise ConnectionError("gone")
        return BUFFER

    s.actors["buffer"]._answers["stats"] = buffer_stats
    out = run_in_thread(s)
    assert out != "hung" and isinstance(out.get("error"), ClusterError), out
    assert "data module" in str(out["error"])
    assert open_metrics(tmp_path, "updates")["version"].values.tolist() == [1, 2]
    faults = open_metrics(tmp_path, "faults")
    assert faults["rollout"].values.tolist() == ["r1"]
    assert faults["segment"].values.tolist() == [0]  # (the start that lost it)
    # (each version once, the one whose broadcast had not completed included)
    assert open_metrics(tmp_path, "publications")["version"].values.tolist() == [0, 1]
    # asked incrementally: the history from the rows copied on, not all of it each poll
    assert calls.count(f"{WORKERS['trainer']}.get_history") > 1


def test_a_resumed_runs_summary_carries_the_earlier_starts_faults(tmp_path, monkeypatch):
    """The resumed start's ``faults`` (what summary.json holds, rewritten by each start)
    carries the earlier starts' losses under ``earlier``: they read as none after a
    resume, beside the faults table's recoveries of every start."""
    import json
    from types import SimpleNamespace

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    MetricsWriter(tmp_path).append(
        "cluster",
        [{"segment": 0, "elapsed_s": t, "wall_time": t0 + t, "version": 2} for t in (0.0, 9.0)],
    )
    lost = {"lost": {"r1": t0 + 3}, "replacements": {"r1": "r2"}, "recoveries": 1}
    summary = {"reason": "stopped", "segments": 1, "faults": lost | {"recovered_requests": 4}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s.resume = SimpleNamespace(version=2, summary=lambda: {"version": 2})
    out = run_in_thread(s)
    assert "result" in out, out
    faults = out["result"]["faults"]
    assert faults["lost"] == {}  # (this start's)
    assert faults["earlier"] == [{"segment": 0, **lost, "recovered_requests": 4}]


def test_progress_counts_the_updates_asked_for_not_the_skipped_version_numbers(
    tmp_path, monkeypatch
):
    """A trainer restarted within the run skips the lost one's version numbers: with
    trainer.steps=14 the run ends at version 16. progress() said steps 16 (the
    quickstart's bar, over trainer.steps, ran past its end at version 16 of 14): it
    says the updates made of the 14 asked for, and the version beside them."""
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s.cfg = with_overrides(s.cfg, ["trainer.steps=14"])
    # (a restart after the lost trainer published 6 from the checkpoint at 4: 2 skipped)
    restarted = {"version": 16, "steps": 16, "skipped_versions": 2}
    s.actors["trainer"]._answers["stats"] = _trainer_stats() | restarted
    s.actors["trainer"]._answers["stop"] = _trainer_stats() | restarted
    seen: list[dict] = []
    out = in_thread(lambda: s.run(seen.append, lambda: False), 30.0)
    assert "result" in out, out
    p = seen[-1]
    assert (p["updates"], p["steps"]) == (14, 14)
    assert (p["version"], p["last_version"]) == (16, 16)


def test_a_core_restart_numbers_after_a_version_only_the_copied_publication_records_saw(
    tmp_path, monkeypatch
):
    """A poll reads the buffer's and the trainer's stats first (version 3) and copies the
    master's publication records last: the trainer had published 4 between, and its
    worker (with the data module) was killed before the next poll, no rollout having
    loaded 4 (one relay on one host: none downstream). M was read from everything but
    those records: 3. The new trainer then published 4 again — two sets of weights
    under one number, and two rows of 4 in ``publications`` ([0, 1, 2, 3, 4, 4, 5, ...],
    test_faults' one-worker restart, once in a suite run)."""
    t = WORKERS["trainer"]
    s, calls = fake_run(tmp_path, monkeypatch, set(WORKERS.values()) - {t})
    s.restartable = True
    s.core_workers = {"trainer and data module": t}
    s._n_pubs = 0

    def records(versions) -> list[dict]:
        now = time.time()
        return [
            {"version": v, "t_publish": now, "stall_s": 0.01, "broadcast_s": 0.02} for v in versions
        ]

    lost = records(range(5))  # (the lost master's: 0 .. 4)
    s.actors["relays"][0]._answers["publications_since"] = lambda since: lost[since:]
    # The poll: the buffer and the trainer said 3, its fingerprints went up to 3 ...
    s._last_data_stats = (BUFFER, {"outstanding": 0, "dispatched": 0})
    s._last_t_stats = _trainer_stats(done=False)
    s._published_fps = {v: v for v in range(4)}
    s._last_m_stats = MANAGER
    # ... and the master's records, copied last, hold 4; a flush writes them
    s._keep_publications()
    written = s._settled_publications(final=False)
    assert [p["version"] for p in written] == [0, 1, 2, 3, 4]
    # The shared worker is lost before the next poll: a core restart.
    assert s._begin_restart({"trainer and data module": t}, ConnectionError("gone"))
    r = s._data_restart
    assert isinstance(r, restart.CoreRestart) and s._old_publications == lost
    after = r._newest_published()  # (the rollout still holds 3)
    assert after == 4
    # The new trainer numbers its updates after M, on its new master.
    new = records([after + 1, after + 2])
    master = FakeActor("tcp://trainer:2", calls, publications_since=lambda since: new[since:])
    s.actors["relays"][0], s._data_restart = master, None
    s._last_t_stats = _trainer_stats(done=False) | {"version": after + 2}
    s._keep_publications()
    written += s._settled_publications(final=True)
    versions = [p["version"] for p in written]
    assert versions == sorted(set(versions)) == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("made", "reason"), [(3, "completed"), (2, "stopped")])
def test_a_stop_as_the_last_update_is_made_ends_a_completed_run(
    tmp_path, monkeypatch, made, reason
):
    """Ctrl-C during the last update: the trainer's stop finishes it, and the run reached
    trainer.steps, yet it was labelled "stopped" (`versions 8 (stopped)`), and a wrapper
    that resumes stopped runs then hit "nothing left to train". The stop's reason stands
    only when updates are still owed."""
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    trainer = s.actors["trainer"]
    trainer._answers["stats"] = {**_trainer_stats(done=False), "version": 2}
    trainer._answers["stop"] = {**_trainer_stats(), "version": made}
    out = in_thread(lambda: s.run(lambda p: None, lambda: True), 30.0)
    assert out != "hung" and "result" in out, out
    assert out["result"]["reason"] == reason


@pytest.mark.parametrize(("made", "completed"), [(3, True), (2, False)])
def test_a_walltime_stop_as_the_last_update_is_made_ends_a_completed_run(
    tmp_path, monkeypatch, made, completed
):
    """The walltime's stop in order, as Ctrl-C's: reached trainer.steps, the run is
    completed (it exited 124, and the documented `while [ $? -eq 124 ]` loop's resume
    then hit 'nothing left to train', exit 2)."""
    from storage.audit import WALLTIME_REASON

    class Due:  # (the WalltimeWatch of a Slurm job at its margin)
        def start(self):
            return self

        def due(self):
            return "Slurm job 7 (driver) reaches its walltime in 290 s"

        def stop_in(self):
            return 290.0

        def close(self):
            pass

    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s._walltime = Due()
    trainer = s.actors["trainer"]
    trainer._answers["stats"] = {**_trainer_stats(done=False), "version": 2}
    trainer._answers["stop"] = {**_trainer_stats(), "version": made}
    out = in_thread(lambda: s.run(lambda p: None, lambda: False), 30.0)
    assert out != "hung" and "result" in out, out
    said = out["result"]["reason"]
    assert said == "completed" if completed else said.startswith(WALLTIME_REASON), said


def test_a_resumed_runs_progress_counts_what_left_untrained_in_every_start(tmp_path, monkeypatch):
    """The progress line's trajectories are the run's (the earlier starts' carried), and
    so now is what left untrained: evicted, filtered and discarded were this start's
    alone, so 'untrained' read low against 'trajectories' after a resume."""
    s, _ = fake_run(tmp_path, monkeypatch, set(WORKERS.values()))
    s._carry["cluster"] = {"inserted": 100, "evicted": 7, "filtered": 3, "discarded": 1}
    s.actors["buffer"]._answers["stats"] = {**BUFFER, "inserted": 10, "evicted": 2}
    seen: list[dict] = []
    out = in_thread(lambda: s.run(seen.append, lambda: True), 30.0)
    assert out != "hung", out
    shown = [p for p in seen if "evicted" in p][-1]
    assert shown["trajectories"] == 110
    assert (shown["evicted"], shown["filtered"], shown["discarded"]) == (9, 3, 1)
