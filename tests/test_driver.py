"""The run driver (pipelines/driver.py) against fake actors, no cluster: what it does
when an actor never answers, or its worker is gone, while it polls and while it stops
the run."""

from __future__ import annotations

import time
from concurrent.futures import Future

from pipelines import driver

HANG = object()  # a call that never answers (its actor's worker is gone, or hung)


class FakeActor:
    """An actor handle whose calls answer at once from ``answers`` (name -> value, or a
    function of the call's arguments), or never (:data:`HANG`); ``calls`` records the
    names called, in order."""

    def __init__(self, worker: str, calls: list, **answers) -> None:
        self._address, self.key = worker, f"fake-{worker}"
        self._answers, self._calls = answers, calls

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs) -> Future:
            self._calls.append(f"{self._address}.{name}")
            f: Future = Future()
            answer = self._answers.get(name)
            if answer is HANG:
                return f
            f.set_result(answer(*args, **kwargs) if callable(answer) else answer)
            return f

        return call


def test_answers_waits_once_for_all_calls_not_once_per_call():
    """Three rollouts that do not answer (SIGSTOPped, or lost and not yet detected) hold
    a poll up by one timeout, not one per rollout."""
    calls: list = []
    hung = [FakeActor(f"w{i}", calls, stats=HANG) for i in range(3)]
    fine = FakeActor("w3", calls, stats={"rollout_id": "r3"})
    t0 = time.monotonic()
    out = driver._answers([lambda r=r: r.stats() for r in [*hung, fine]], timeout=0.5)
    took = time.monotonic() - t0
    assert out == [{"rollout_id": "r3"}]
    assert took < 0.9, took
