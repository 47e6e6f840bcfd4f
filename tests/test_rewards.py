"""task.reward_timeout_s cuts a reward call however it blocks (laminar/reward_process.py),
and reward tasks stay on rollout workers. (The reward functions and the rest of
score_batch's contract: tests/test_tasks.py and tests/test_damaged_inputs.py.)"""

from __future__ import annotations

import math
import threading
import time

import pytest

from laminar.rewards import score_batch


def backtracks(response: str, answer: str) -> float:
    """A checker whose regular expression backtracks catastrophically on ``aaa…c``: the
    match runs in C, holding the GIL, for 2^len steps (tens of seconds for 30)."""
    import re

    return float(re.match(r"(a+)+b", response) is not None)


def exits(response: str, answer: str) -> float:
    """Ends its process (``os._exit(3)``: no exception to catch) for the response ``die``."""
    import os

    if response == "die":
        os._exit(3)
    return float(response == answer)


def test_a_call_that_holds_the_gil_is_cut_at_the_timeout_and_the_loop_goes_on():
    """Catastrophic backtracking holds the GIL: a thread that waited for it could not
    even wake up at the timeout (it came back, 1.9 s later for 26 characters, as a
    normal score), and every other thread of the worker — its event loop — stalled
    with it. In a child process it is killed at the timeout, this process runs on,
    and the calls after it are scored."""
    ticks, stop = [], threading.Event()

    def tick() -> None:  # (the worker's event loop, say)
        while not stop.wait(0.02):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    items = [("ab", "", True), ("a" * 30 + "c", "", True), ("aab", "", True)]
    t0 = time.monotonic()
    try:
        scores = score_batch("test_rewards:backtracks", items, timeout_s=0.5)
    finally:
        stop.set()
        ticker.join()
    took = time.monotonic() - t0
    assert scores[0].reward == 1.0 and scores[2].reward == 1.0
    assert math.isnan(scores[1].reward)
    assert scores[1].error == (
        "reward test_rewards:backtracks did not return within task.reward_timeout_s=0.5 s"
    )
    assert 0.5 <= took < 10.0  # (the match alone: tens of seconds)
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) > 10 and max(gaps) < 0.4  # this process was never stalled


def test_a_call_that_ends_its_process_is_an_error_and_the_rest_are_scored():
    items = [("1", "1", True), ("die", "1", True), ("1", "1", True), ("x", "1", False)]
    t0 = time.monotonic()
    scores = score_batch("test_rewards:exits", items, truncated_reward=-1.0, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # (not waited out: 30 s)
    assert scores[0].reward == 1.0 and scores[2].reward == 1.0 and scores[3].reward == -1.0
    assert math.isnan(scores[1].reward)
    assert scores[1].error == (
        "reward test_rewards:exits ended the process that scored it (exit code 3); the "
        "calls after it go to a new one"
    )


def test_after_a_timed_out_call_the_next_batch_is_scored_normally():
    """The stuck child is killed, not handed the next batch (nor left spinning)."""
    stuck = [("a" * 30 + "c", "", True)]
    hung = score_batch("test_rewards:backtracks", stuck, timeout_s=0.5)
    assert "did not return within" in hung[0].error
    t0 = time.monotonic()
    scores = score_batch("test_rewards:backtracks", [("ab", "", True), ("b", "", True)], 0, 0.5)
    assert [s.reward for s in scores] == [1.0, 0.0]
    assert all(s.error is None for s in scores)
    assert time.monotonic() - t0 < 5.0


def test_an_idle_child_that_is_gone_is_replaced_unseen():
    """One that exited while idle (after ``IDLE_S``, or killed): the next batch goes to a
    new child, with no call marked."""
    import os
    import signal

    from laminar import reward_process

    score_batch("exact_match", [("1", "1", True)], timeout_s=30.0)
    with reward_process._idle_lock:
        idle = [child.proc.pid for child in reward_process._idle]
    for pid in idle:  # (ours: started just now, by this test)
        os.kill(pid, signal.SIGKILL)
    scores = score_batch("exact_match", [("1", "1", True), ("2", "1", True)], 0, 30.0)
    assert [(s.reward, s.error) for s in scores] == [(1.0, None), (0.0, None)]


def test_in_the_child_errors_and_bad_values_are_reported_as_in_the_task():
    """A raise, a non-number: the same errors as without a timeout (made in the task)."""
    import laminar.rewards as r

    r.REWARDS["_text"] = lambda response, answer: "0.5"  # (made at run time: by value)
    try:
        for timeout_s in (None, 30.0):
            broken = score_batch("laminar.rewards:_broken", [("1", "1", True)], 0, timeout_s)
            text = score_batch("_text", [("1", "1", True)], 0, timeout_s)
            assert broken[0].error == (
                "reward laminar.rewards:_broken raised ZeroDivisionError: division by zero"
            )
            assert text[0].error == "reward _text returned '0.5'"
    finally:
        del r.REWARDS["_text"]


def test_a_users_module_loads_in_the_child_from_the_workers_path(tmp_path, monkeypatch):
    """A module found on a path the worker added (``Client.upload_file``, a plugin)
    after the child started is found there too."""
    score_batch("exact_match", [("1", "1", True)], timeout_s=30.0)  # (a child, started)
    (tmp_path / "laminar_test_child_reward.py").write_text(
        "import os\ndef pid(response, answer):\n    return float(os.getpid())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (score,) = score_batch("laminar_test_child_reward:pid", [("1", "1", True)], 0, 30.0)
    import os

    assert score.error is None and score.reward not in (0.0, float(os.getpid()))


def test_a_reward_the_child_cannot_load_fails_the_task_saying_so():
    """Neither picklable (it holds a lock) nor found by name in a fresh interpreter (it
    was put in REWARDS at run time): the child cannot load it."""
    import laminar.rewards as r
    from laminar.errors import RewardError

    class Locked:
        lock = None

        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, response, answer):
            return 1.0

    r.REWARDS["_locked"] = Locked()
    try:
        with pytest.raises(RewardError, match=r"'_locked' does not load in the process"):
            score_batch("_locked", [("1", "1", True)], timeout_s=30.0)
        assert score_batch("_locked", [("1", "1", True)])[0].reward == 1.0  # (here: it does)
    finally:
        del r.REWARDS["_locked"]


def test_reward_tasks_run_on_rollout_workers_only(monkeypatch):
    """Not beside the trainer and data module (data-trainer) nor on a relay: a heavy
    reward there competes with training."""
    import types

    import distributed

    from laminar.rollout_rewards import RewardsMixin

    submitted = {}

    class Client:
        def submit(self, fn, *args, **kwargs):
            submitted.update(kwargs, fn=fn, args=args)

    monkeypatch.setattr(distributed, "get_client", lambda: Client())
    task = types.SimpleNamespace(reward="exact_match", truncated_reward=0.0, reward_timeout_s=300.0)
    RewardsMixin._reward_task(types.SimpleNamespace(cfg=types.SimpleNamespace(task=task)), [])
    assert submitted["fn"] is score_batch and submitted["resources"] == {"rollout": 1}
