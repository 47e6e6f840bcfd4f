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
