"""A poll's actor call that fails with the actor's own error (a bug, a full disk), not
a loss, OWN_ERRORS_TO_FAIL polls in a row fails the run (stopped in order,
pipelines.driver.Schedule.run): it was taken for a loss and swallowed at every poll, its
stats or rows never read again. Once, it is logged and asked again; a loss is still the
polls' to judge. The driver against stand-ins, as in test_overlap.py."""

from __future__ import annotations

import pytest
from test_overlap import D, T, driver
from test_restart import Answering

from pipelines.driver_faults import OWN_ERRORS_TO_FAIL

R = "tcp://rollout:1"


def test_the_managers_own_error_fails_the_run_and_its_loss_does_not():
    """manager.stats() raising its own error went to _data_silent, which acts only on
    a timeout: ignored at every poll for the rest of the run."""
    s = driver({T: {"trainer": 1}, D: {"data": 1}}, [])
    bug = Answering(D, ValueError("a bug in stats()"))
    s.actors = {"manager": bug}
    for _ in range(OWN_ERRORS_TO_FAIL - 1):  # (once or twice: logged, asked again)
        assert s._manager_stats() is None
    s.actors = {"manager": Answering(D, {"lost": {}})}
    assert s._manager_stats() == {"lost": {}}  # (answered: its run of errors is over)
    s.actors = {"manager": bug}
    for _ in range(OWN_ERRORS_TO_FAIL - 1):
        assert s._manager_stats() is None
    with pytest.raises(ValueError, match="a bug"):
        s._manager_stats()
    s.actors = {"manager": Answering(D, OSError("Timed out trying to connect"))}
    for _ in range(OWN_ERRORS_TO_FAIL):
        assert s._manager_stats() is None  # (lost: the next poll finds it so, and rebuilds)


def test_a_rollouts_own_error_in_its_stats_fails_the_run_and_its_loss_does_not():
    """A rollout's stats() raising its own error left it out of every poll (its
    tokens, rewards and errors never seen) as if lost, while the manager saw it live."""
    from distributed.comm.core import CommClosedError

    s = driver({T: {"trainer": 1}, D: {"data": 1}, R: {"rollout": 1}}, [])
    lost = Answering(R, CommClosedError("in <TCP (closed)>"))
    s.actors = {"manager": None, "rollouts": [lost]}
    s._r_pending = {}
    assert s._rollout_stats() == []
    s.actors["rollouts"] = [lost, Answering(R, KeyError("response_tokens"))]
    for _ in range(OWN_ERRORS_TO_FAIL - 1):
        assert s._rollout_stats() == []
    with pytest.raises(KeyError, match="response_tokens"):
        s._rollout_stats()


def test_the_trainers_own_error_in_its_update_rows_fails_the_run():
    """The trainer's get_history() raising its own error: its update rows were never
    copied again (the metrics' `updates` table ended there, silently)."""
    s = driver({T: {"trainer": 1}, D: {"data": 1}}, [])
    s.actors = {"trainer": Answering(T, TypeError("a bug in get_history()")), "manager": None}
    s._rows, s._n_updates = {}, 0
    s._keep_publications = lambda: None  # (the master's records: not this test's)
    for _ in range(OWN_ERRORS_TO_FAIL - 1):
        s._copy_rows(manager_answered=False)
    with pytest.raises(TypeError, match="a bug"):
        s._copy_rows(manager_answered=False)
    s.actors["trainer"] = Answering(T, ConnectionError("lost"))
    s._copy_rows(manager_answered=False)  # (lost or slow: the polls judge which)
    assert s._rows == {"updates": []}


def _lost_core_error(overrides: list[str], lost_role: str) -> str:
    """The error of a run whose ``lost_role``'s worker is gone (the driver of
    test_overlap, data module apart unless the role is both), found by a call that
    failed with a RuntimeError, under ``overrides``."""
    from test_overlap import driver

    from laminar.config import with_overrides
    from laminar.errors import ClusterError

    # (the scheduler has lost the role's worker: the trainer's stays when only the data
    # module is lost)
    s = driver({T: {"trainer": 1}} if lost_role == "data module" else {}, [])
    s.cfg = with_overrides(s.cfg, overrides)
    s._laminar = True
    if lost_role == "trainer and data module":
        s.core_workers = {lost_role: T}
    s.actors = {"manager": None, "trainer": None, "relays": [], "rollouts": []}
    s.actors |= {"buffer": None, "partial": None}
    error = RuntimeError("actor call to 'PromptPool-a667' failed:\n  stream closed " + "x" * 300)
    with pytest.raises(ClusterError) as failed:
        s._fail_on_lost_core(error)
    assert failed.value.__cause__ is error
    return str(failed.value)


def test_a_lost_core_says_why_it_was_gone_and_names_only_the_setting_that_is_off():
    """r4 of the reviewer's runs (restart_trainer off, the shared worker SIGKILLed) read
    `(worker … is gone: RuntimeError); the run cannot continue (faults.restart_trainer or
    faults.restart_data is off)`: the cause dropped, and a setting named that was on."""
    said = _lost_core_error(["faults.restart_trainer=false"], "trainer and data module")
    assert (
        f"lost the trainer and data module (worker {T} is gone: the scheduler no longer "
        "has it; the call that found it: RuntimeError: \"actor call to 'PromptPool-a667' "
        "failed: stream closed xxx"
    ) in said
    assert "x" * 100 + '…"); the run cannot continue (faults.restart_trainer is off); ' in said
    assert "restart_data" not in said
    # The data module apart, rebuilt from the partial-response pool: both settings it needs
    said = _lost_core_error(["faults.restart_data=false", "faults.recover=false"], "data module")
    assert said.startswith(f"lost the data module (worker {D} is gone: the scheduler no")
    assert "(faults.restart_data and faults.recover are off: a data module is rebuilt" in said
    assert "restart_trainer" not in said
