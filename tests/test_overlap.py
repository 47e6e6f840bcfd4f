"""Faults that overlap a restart within the run (docs/faults.md): the driver's fault
handling (pipelines/driver_faults.py, driver_polls.py) driven against stand-ins for
Dask's client, the core actors and the restarts, as in test_restart.py: a failed call
to the other core actor while one restart is in progress, a second loss, a replacement
rollout being created when the data module is lost."""

from __future__ import annotations

from concurrent.futures import Future

from test_restart import Answering, SchedulerClient

from laminar.config import RunConfig, with_overrides
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
    s._fenced, s._joining, s.rollout_relays = {}, None, {}
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
