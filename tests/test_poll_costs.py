"""What the driver's polls cost as the run grows: calls to many actors made at once,
under one wait (pipelines/driver_polls.py), against stand-in actors, no cluster."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from laminar.config import RunConfig
from pipelines.driver_polls import StatsPolling


class SlowRank:
    """A trainer rank whose ``stats()`` answers after ``delay`` s (``None``: never)."""

    def __init__(self, worker: str, delay: float | None, error: str | None = None):
        self._address, self.key = worker, f"fake-{worker}"
        self.delay, self.error = delay, error

    def stats(self) -> Future:
        f: Future = Future()
        if self.delay is not None:
            answer = {"error": self.error, "version": 3}
            threading.Timer(self.delay, f.set_result, [answer]).start()
        return f


def polling(ranks, core_timeout: float = 1.0):
    return SimpleNamespace(
        actors={"trainer_ranks": ranks},
        _restart=None,
        _data_restart=None,
        _fenced={},
        restartable=False,
        cfg=RunConfig(),
        _core_timeout=lambda: core_timeout,
    )


def test_the_trainer_ranks_are_asked_at_once_under_one_wait():
    """_trainer_errors asked each data-parallel rank in turn, waiting for its answer
    before asking the next (1.3 ms a rank on a quiet cluster, a slow one's whole delay
    each): the ranks are asked at once, and every answer in by one deadline counts —
    here six ranks 0.5 s slow, one failed, and two that never answer (lost or hung:
    left to the group's fencing) cost the poll one wait, not one each."""
    ranks = [SlowRank(f"tcp://rank{i}:1", 0.5) for i in range(6)]
    ranks[2].error = "rank 2 failed"
    ranks += [SlowRank("tcp://gone:1", None), SlowRank("tcp://stopped:1", None)]
    t0 = time.monotonic()
    out = StatsPolling._trainer_errors(polling(ranks), {"error": None})
    took = time.monotonic() - t0
    assert [r["error"] for r in out] == ["rank 2 failed"]
    # (at once: one wait of 1 s; one after another: 3 s of answers, then 1 s per silent
    # one, 5 s. The margin is for a loaded host.)
    assert took < 3.0, took
