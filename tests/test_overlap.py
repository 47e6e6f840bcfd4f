"""Faults that overlap a restart within the run (docs/faults.md): the driver's fault
handling (pipelines/driver_faults.py, driver_polls.py) driven against stand-ins for
Dask's client, the core actors and the restarts, as in test_restart.py: a failed call
to the other core actor while one restart is in progress, a second loss, a replacement
rollout being created when the data module is lost."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from test_restart import Answering, SchedulerClient

from laminar.config import RunConfig, with_overrides
from laminar.errors import ClusterError
from pipelines import driver_faults
from pipelines.laminar import LaminarSchedule

T, D = "tcp://trainer:1", "tcp://data:1"


def driver(workers: dict[str, dict], fences: list) -> LaminarSchedule:
    """A driver, data module apart, at version 3, whose trainer and data module were on
    ``T`` and ``D``; the scheduler has ``workers``. A fence is recorded in ``fences``."""
    s = object.__new__(LaminarSchedule)
    s.cfg = with_overrides(RunConfig(), ["faults.heartbeat_timeout_s=1"])
    s.client = SchedulerClient(workers)
    s.run_dir = "/nonexistent"
    s.core_workers = {"trainer": T, "data module": D}
    s._fenced, s._joining, s.rollout_relays, s._own_errors = {}, None, {}, {}
    s._restart = s._data_restart = None
    s._data_suspect = s._trainer_suspect = s._group_suspect = None
    s._last_data_stats = ({"version": 3}, {})
    s._last_m_stats = {"lost": {}, "chain": ["master"]}
    s._last_t_stats = {"version": 3, "steps": 10, "done": False, "error": None, "wait_s": 0.0}
    s.restartable = s.data_restartable = True
    s._old_publications, s._master_publications = [], []
    s.resume_hint = lambda: "resume it"
    s._fence = lambda role, worker, silent, why="", bound="": fences.append((role, worker))
    return s


def never() -> Future:
    return Future()  # (a call its actor never answers: it times out)


class Silent(Answering):
    """An actor handle whose every call times out (hung, or its worker lost)."""

    def __init__(self, worker: str) -> None:
        super().__init__(worker, None)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: never()


def trainer_restart(s):
    """A trainer restart in progress, of the trainer lost on ``T``."""
    from pipelines.restart import TrainerRestart

    r = object.__new__(TrainerRestart)
    r.lost_worker, r.finished, r.stand_in, r.record = T, False, {}, {}
    r.step = lambda: None
    return r


def test_a_silent_data_module_while_the_trainer_restarts_is_fenced_not_restarted_over_it():
    """The trainer's worker is gone and its restart in progress (``core_workers`` still
    names it); the data module then does not answer. Its failed call found the lost
    trainer, took it for a new loss, skipped the data module's fence and began a second
    TrainerRestart over the first (which then crashed on an AttributeError). The data
    module is fenced (hung), and the restart in progress goes on."""
    fences: list = []
    s = driver({D: {"data": 1}}, fences)
    s._restart = first = trainer_restart(s)
    s.actors = {"buffer": Silent(D), "pool": Silent(D), "trainer": Answering(T, None)}
    s._data_stats()
    assert s._restart is first and s._data_restart is None
    assert fences == [("data module", D)]


def test_a_silent_trainer_while_the_data_module_is_rebuilt_is_fenced_not_restarted_over_it():
    """The same the other way round: the trainer's stats time out while a lost data
    module is rebuilt. The lost data module's worker made it a loss of the data module
    again, and a second rebuild replaced the first. The trainer is fenced."""
    from pipelines.restart import DataRestart

    fences: list = []
    s = driver({T: {"trainer": 1}}, fences)
    s._data_restart = first = object.__new__(DataRestart)
    first.lost_worker, first.record = D, {}
    s.actors = {"trainer": Silent(T), "trainer_ranks": []}
    s._trainer_stats()
    assert s._data_restart is first and s._restart is None
    assert fences == [("trainer", T)]


def test_a_second_core_loss_during_a_restart_fails_the_run_naming_both():
    """The data module's worker is lost too while the trainer restarts: one restart
    cannot be begun over another (each rebuilds from what the other restarts). The run
    fails saying what was lost, both, and how to continue."""
    s = driver({}, [])
    s._restart = trainer_restart(s)
    s.actors = {"trainer": Answering(T, None)}
    error = OSError("Timed out trying to connect to tcp://data:1")
    assert s._lost_core() == {"data module": D}
    with pytest.raises(
        ClusterError,
        match=r"lost the data module .*tcp://data:1.*while the "
        r"trainer lost on tcp://trainer:1 was being restarted.*resume it",
    ) as e:
        s._begin_restart(s._lost_core(), error)
    assert e.value.__cause__ is error
    assert s._lost_core(every=True) == {"trainer": T, "data module": D}


def test_a_replacement_being_created_when_the_data_module_is_lost_is_made_again(monkeypatch):
    """r1 was lost and its replacement r2 was being created, with the data module's
    pool, buffer and partial-response pool, when the data module's worker died. Bound
    after the rebuild, r2 took from and sent to the lost actors, and its loop failed
    (faults.data_restart_timeout_s). Its creation is cancelled when the rebuild begins,
    and a new one is made (same id) with the rebuilt module's actors."""
    monkeypatch.setattr(driver_faults.FaultHandling, "_check_group", lambda self: None)
    s = driver({T: {"trainer": 1}}, [])
    s.actors = {"trainer": Answering(T, None)}
    creating = never()
    s._joining = ("r2", "tcp://r:2", "r1", "master", creating)
    s.rollout_relays["r2"] = "master"
    assert s._begin_restart({"data module": D}, OSError("gone"))
    assert s._data_restart is not None and s._joining is None
    assert s.client.cancelled == [creating] and "r2" not in s.rollout_relays
