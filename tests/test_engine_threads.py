"""An engine read from another thread while it steps.

A rollout's ``stats()`` runs on its actor thread and reads ``kv_stats()`` while the
generation thread steps the engine, which takes requests off its waiting queue
(``popleft``) and puts preempted or imported ones back (``extendleft``). A reader that
iterated the queue itself, with Python code run between items, raised
``RuntimeError: deque mutated during iteration``, and the driver's poll took the rollout
for lost.

The interleaving is forced, not left to the scheduler: a waiting state's ``context_len``
(which ``kv_stats`` reads per waiting request) stops the reader thread part-way through
and lets the engine step before it goes on.
"""

import threading

import pytest
import test_engine_torch

from laminar.engine import GenerationRequest, RequestState, SamplingParams

# the tiny policy's engine, as tests/test_engine_torch.py builds it (a fixture, a function)
policy, build = test_engine_torch.policy, test_engine_torch.build

WAIT_S = 30.0  # (a guard against a hang, never reached when the test works)


class _Pausing(RequestState):
    """A state whose ``context_len`` or ``request_id``, read on the ``reader`` thread, waits
    there until the main thread says go: the reader is then part-way through the queue."""

    reader: threading.Thread | None = None
    inside = threading.Event()
    go = threading.Event()

    @classmethod
    def _pause(cls) -> None:
        if threading.current_thread() is cls.reader and not cls.go.is_set():
            cls.inside.set()
            assert cls.go.wait(WAIT_S)

    @property
    def context_len(self) -> int:
        self._pause()
        return len(self.request.prompt_tokens) + len(self.tokens)

    @property
    def request_id(self) -> str:
        self._pause()
        return self.request.request_id


def _pausing_state(rid: str) -> _Pausing:
    return _Pausing(GenerationRequest(rid, (3, 4, 5), SamplingParams(4, seed=1)), seed=1)


@pytest.mark.parametrize("read", ["kv_stats", "request_ids"])
def test_reading_the_engine_while_a_step_takes_from_its_queue(policy, read):
    eng = build(policy, max_batch=4, max_seq_len=32)
    eng.import_([_pausing_state("a"), _pausing_state("b")])  # waiting: a, b
    result, errors = {}, []

    def reader():
        try:
            result["value"] = getattr(eng, read)()
        except Exception as e:  # noqa: BLE001 — the failure under test, re-raised below
            errors.append(e)
        finally:
            _Pausing.inside.set()  # (a read that never pauses must not hang the test)

    _Pausing.inside.clear()
    _Pausing.go.clear()
    t = threading.Thread(target=reader)
    _Pausing.reader = t
    try:
        t.start()
        assert _Pausing.inside.wait(WAIT_S)
        eng.step()  # admits a and b: popleft from the queue the reader is part-way through
    finally:
        _Pausing.go.set()
        t.join(WAIT_S)
        _Pausing.reader = None
    assert not errors, errors
    if read == "kv_stats":
        # (a snapshot: the queue as it was when the reader took it, whatever the step did;
        # its states are the engine's own, each a token longer by now)
        assert result["value"].waiting == 2 and result["value"].waiting_tokens == 2 * (3 + 1)
    else:
        assert result["value"] == ["a", "b"]
    assert eng.kv_stats().running == 2 and eng.kv_stats().waiting == 0
