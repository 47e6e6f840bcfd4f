"""task.reward_timeout_s cuts a reward call however it blocks (laminar/reward_process.py),
and reward tasks stay on rollout workers. (The reward functions and the rest of
score_batch's contract: tests/test_tasks.py and tests/test_damaged_inputs.py.)"""

from __future__ import annotations

import math
import sys
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
    import sys

    if response == "die":
        print("about to die", file=sys.stderr)  # (the error names where this went)
        os._exit(3)
    return float(response == answer)


class _Unprintable(Exception):
    """An exception whose ``__str__`` raises (a user's class, with a bug in it)."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


def unprintable(response: str, answer: str) -> float:
    """Raises :class:`_Unprintable` for the response ``bad``."""
    if response == "bad":
        raise _Unprintable
    return float(response == answer)


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in-task", "in-child"])
def test_a_reward_error_whose_message_raises_marks_its_item_by_its_type(timeout_s):
    """``str(error)`` raised out of the marking: without a timeout score_batch raised
    (the rollout's reward collector gave up); with one the child died of it and the
    item read "killed by SIGKILL". Now the item is marked with the error's type and
    the rest of the batch is scored."""
    items = [("1", "1", True), ("bad", "1", True), ("1", "1", True)]
    scores = score_batch("test_rewards:unprintable", items, 0, timeout_s)
    assert [s.reward for s in (scores[0], scores[2])] == [1.0, 1.0]
    assert math.isnan(scores[1].reward)
    assert scores[1].error == "reward test_rewards:unprintable raised _Unprintable"


def test_a_reward_module_whose_import_raises_an_unprintable_error_is_named(tmp_path, monkeypatch):
    """The same error raised as the reward's module is imported: a RewardError that
    names the type, not the RuntimeError of its ``__str__``."""
    from laminar.errors import RewardError

    (tmp_path / "laminar_test_unprintable.py").write_text(
        "class Unprintable(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no message')\n"
        "raise Unprintable\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for timeout_s in (None, 30.0):  # (imported here; imported in the child)
        with pytest.raises(RewardError, match=r"importing 'laminar_test_unprintable' raised Unp"):
            score_batch("laminar_test_unprintable:f", [("1", "1", True)], 0, timeout_s)


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
    # this process was never stalled: the regex run here would hold the GIL for the whole
    # match (1.9 s for 26 characters, tens of seconds for these 31); a loaded host's
    # descheduled ticker, a fork, a GC pause are well under 3 s
    assert len(ticks) > 10 and max(gaps) < 3.0


def test_a_call_that_ends_its_process_is_an_error_and_the_rest_are_scored():
    items = [("1", "1", True), ("die", "1", True), ("1", "1", True), ("x", "1", False)]
    t0 = time.monotonic()
    scores = score_batch("test_rewards:exits", items, truncated_reward=-1.0, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # (not waited out: 30 s)
    assert scores[0].reward == 1.0 and scores[2].reward == 1.0 and scores[3].reward == -1.0
    assert math.isnan(scores[1].reward)
    from laminar.reward_process import log_path

    assert scores[1].error == (
        "reward test_rewards:exits ended the process that scored it (exit code 3); its "
        f"output: {log_path()}; the calls after it go to a new one"
    )
    assert "about to die" in log_path().read_text()


def test_after_a_timed_out_call_the_next_batch_is_scored_normally():
    """The stuck child is killed, not handed the next batch (nor left spinning)."""
    stuck = [("a" * 30 + "c", "", True)]
    hung = score_batch("test_rewards:backtracks", stuck, timeout_s=0.5)
    assert "did not return within" in hung[0].error
    t0 = time.monotonic()
    scores = score_batch("test_rewards:backtracks", [("ab", "", True), ("b", "", True)], 0, 0.5)
    assert [s.reward for s in scores] == [1.0, 0.0]
    assert all(s.error is None for s in scores)
    # (a new child's start, on a loaded host; handed to the stuck one, the batch would
    # have timed out with an error, above)
    assert time.monotonic() - t0 < 30.0


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


def _no_idle_children() -> None:
    """End the idle children earlier tests left, so that the next batch starts one."""
    from laminar import reward_process

    with reward_process._idle_lock:
        idle = list(reward_process._idle)
        reward_process._idle.clear()
    for child in idle:
        child.end()


def _zombie(pid: int) -> bool:
    """Whether ``pid`` is a child of this process that has ended and not been reaped."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_after_a_burst_the_children_that_idle_out_are_reaped_while_one_goes_on():
    """Three batches at once leave three idle children; the last used is taken first, so
    under steady use one goes on and the others idle out (``IDLE_S``). Each that ends
    is reaped with the next batch, its socket closed: no zombie is left."""
    import os
    import signal

    from laminar import reward_process

    _no_idle_children()
    barrier = threading.Barrier(3)

    def batch() -> None:
        barrier.wait()
        score_batch("laminar.rewards:_slow", [("1", "1", True)] * 2, 0, 30.0)

    threads = [threading.Thread(target=batch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with reward_process._idle_lock:
        *gone, going_on = reward_process._idle
    assert len(gone) == 2
    for child in gone:  # (as if idle for IDLE_S: they exit)
        os.kill(child.proc.pid, signal.SIGKILL)
        try:
            os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOWAIT)  # (ended, not reaped)
        except ChildProcessError:
            pass  # (already reaped: the idle children's reaper thread got there first)
    for _ in range(5):
        scores = score_batch("exact_match", [("1", "1", True)], 0, 30.0)
        assert scores[0].error is None
    with reward_process._idle_lock:
        assert reward_process._idle == [going_on]
    for child in gone:
        assert not _zombie(child.proc.pid) and child.proc.returncode is not None
        assert child.conn.closed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_idle_child_is_ended_and_reaped_by_its_parent_without_another_batch(monkeypatch):
    """The child exited by itself after ``IDLE_S`` idle, but only the next batch reaped
    it: a worker that scored once (the warm start's) kept a zombie and its socket for
    the rest of the run. Now the parent ends it at ``IDLE_S``, and reaps it."""
    from laminar import reward_process

    _no_idle_children()
    monkeypatch.setattr(reward_process, "IDLE_S", 0.2)
    score_batch("exact_match", [("1", "1", True)], 0, 30.0)
    with reward_process._idle_lock:
        (child,) = reward_process._idle
    deadline = time.monotonic() + 10.0
    while child.how is None and time.monotonic() < deadline:  # (set once it is reaped)
        time.sleep(0.05)
    with reward_process._idle_lock:
        assert reward_process._idle == []
    assert child.conn.closed and child.how == "killed by SIGKILL"
    assert child.proc.returncode is not None and not _zombie(child.proc.pid)


# A child that ends at once (os._exit as it starts: before it has read anything)...
_ENDS_AT_ONCE = "import os\nos._exit(7)\n"
# ...and one that ends as it loads the function (it has read the batch).
_ENDS_LOADING = (
    "import os, sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "conn.recv(); conn.recv()\n"
    "os._exit(7)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("how", "said"),
    [
        pytest.param(
            "cannot start", "could not be started (tried twice; last: [Errno 24] ", id="spawn"
        ),
        pytest.param(
            "ends at once",
            "could not be started (tried twice; last: it ended as it started ",
            id="ends-at-once",
        ),
        pytest.param(
            "ends loading",
            "ended before it loaded it (tried twice; last: exit code 7); ",
            id="ends-loading",
        ),
    ],
)
def test_a_child_that_cannot_be_had_is_tried_twice_then_its_batch_is_marked(monkeypatch, how, said):
    """A child that cannot be started (``EMFILE``, ``ENOMEM``) or ends before it has
    loaded the function (the OOM killer): a second is started; where that fails too, the
    batch's items are marked reward errors. The task does not fail (its rollout would
    with it), and no process is left unreaped."""
    import errno
    import os
    import subprocess

    from laminar import reward_process

    _no_idle_children()
    started = []
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):
        if how == "cannot start":
            started.append(None)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        boot = _ENDS_AT_ONCE if how == "ends at once" else _ENDS_LOADING
        proc = real_popen([argv[0], "-c", boot, *argv[3:]], **kwargs)
        started.append(proc)
        if how == "ends at once":  # (ended before the worker sends it anything)
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    items = [("1", "1", True), ("x", "1", False), ("2", "1", True)]
    scores = score_batch("exact_match", items, truncated_reward=-1.0, timeout_s=30.0)
    assert len(started) == 2
    assert scores[1] == type(scores[1])(-1.0)  # (not called: truncated)
    for score in (scores[0], scores[2]):
        assert math.isnan(score.reward)
        assert score.error.startswith(
            f"reward exact_match was not called: the process that scores it {said}"
        ), score.error
    for proc in started:
        if proc is not None:
            assert proc.returncode is not None and not _zombie(proc.pid)
    assert reward_process._idle == []
    monkeypatch.undo()  # (and a child that starts scores again)
    assert score_batch("exact_match", items, 0, 30.0)[0] == type(scores[0])(1.0)


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
            assert text[0].error == (
                "reward _text returned '0.5' (a str); a reward returns one number a response"
            )
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


def test_with_a_timeout_a_reward_module_is_imported_in_the_child_only(tmp_path, monkeypatch):
    """With ``task.reward_timeout_s`` the calls are made in the child, but the worker
    imported the reward's module too (to pickle the function by reference): a heavy
    import (a model loaded, a service started) ran in every rollout worker for nothing,
    and a hang or crash in it was beyond the timeout's reach. Now the child resolves a
    ``module:function`` by its name; a reward that does not resolve fails the task with
    the same error as without a timeout."""
    import os

    from laminar.errors import RewardError

    marker = tmp_path / "imported_in"
    (tmp_path / "laminar_test_heavy_reward.py").write_text(
        "import os\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "def f(response, answer):\n"
        "    return float(response == answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    items = [("1", "1", True), ("2", "1", True)]
    scores = score_batch("laminar_test_heavy_reward:f", items, 0, 30.0)
    assert [(s.reward, s.error) for s in scores] == [(1.0, None), (0.0, None)]
    (pid,) = marker.read_text().split()
    assert int(pid) != os.getpid() and "laminar_test_heavy_reward" not in sys.modules
    for timeout_s in (None, 30.0):
        with pytest.raises(RewardError, match=r"^task.reward 'laminar_test_no_such:f' cannot be"):
            score_batch("laminar_test_no_such:f", items, 0, timeout_s)


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


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in-task", "in-child"])
def test_a_reward_error_names_the_functions_line_and_what_it_was_given(
    tmp_path, monkeypatch, timeout_s
):
    """A reward error said only ``raised IndexError: list index out of range``: not
    where in the user's function, nor on which response. It now carries the function's
    own innermost line (that of the user's file, not of a library it called: here
    json's decoder), and the response and answer (their reprs, cut at 80 characters);
    ``Score.said`` shows both, as the warning and ``last_reward_error`` do."""
    (tmp_path / "laminar_test_parse_reward.py").write_text(
        "import json\n"
        "def first(response, answer):\n"
        "    return float(response.split()[0] == answer)\n"
        "def parsed(response, answer):\n"
        "    return float(json.loads(response) == answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    file = tmp_path / "laminar_test_parse_reward.py"
    long = "7 " * 100
    items = [("", "146", True), ("146", "146", True), (long, "1", True)]
    empty, ok, _ = score_batch("laminar_test_parse_reward:first", items, 0, timeout_s)
    assert ok.error is None and ok.context is None
    assert empty.error == (
        "reward laminar_test_parse_reward:first raised IndexError: list index out of range"
    )
    assert empty.said == (f"{empty.error} (at {file}:3 in first; response '', answer '146')")
    (bad,) = score_batch("laminar_test_parse_reward:parsed", [(long, "1", True)], 0, timeout_s)
    assert bad.said.startswith("reward laminar_test_parse_reward:parsed raised JSONDecodeError")
    assert f"(at {file}:5 in parsed; response '{long[:79]}..., answer '1')" in bad.said


def test_a_call_cut_at_the_timeout_says_what_it_was_given():
    """A call that did not return within task.reward_timeout_s: which response hung."""
    (cut,) = score_batch("laminar.rewards:_hangs", [("hang", "1 2", True)], 0, 0.2)
    assert cut.said == (
        "reward laminar.rewards:_hangs did not return within task.reward_timeout_s=0.2 s "
        "(response 'hang', answer '1 2')"
    )


def chatty(response: str, answer: str) -> float:
    """Prints as it scores, to stdout and stderr (a reward being debugged)."""
    print("scoring", repr(response), "vs", repr(answer))
    print("to stderr", file=sys.stderr)
    return float(response == answer)


def test_what_a_reward_prints_goes_to_its_workers_file_not_the_console(capfd, caplog, monkeypatch):
    """A reward's print()s went to the worker's output, which a local cluster's workers
    share with `laminar run`'s console: 918 lines for a 4-step run, among the run's own.
    They go to a file, one a worker process; the first batch after the reward printed
    says where, once."""
    import logging

    from laminar import reward_process

    monkeypatch.setattr(reward_process, "_printed_said", [])
    path = reward_process.log_path()
    before = path.stat().st_size if path.exists() else 0
    items = [("1", "1", True), ("2", "1", True)]
    with caplog.at_level(logging.WARNING, logger="laminar.reward_process"):
        for _ in range(2):
            assert [s.reward for s in score_batch("test_rewards:chatty", items, 0, 30.0)] == [
                1.0,
                0.0,
            ]
    out, err = capfd.readouterr()
    assert "scoring" not in out + err and "to stderr" not in out + err
    written = path.read_text()[before:]
    assert written.count("scoring '1' vs '1'\n") == 2 and written.count("to stderr\n") == 4
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"task.reward 'test_rewards:chatty' prints: its stdout and stderr go to {path} on "
        f"{__import__('socket').gethostname()} (one file a worker process), not to the console"
    ]


def test_a_worker_whose_reward_printed_nothing_leaves_no_log_file(tmp_path):
    """Every worker that started a scoring process left an empty file under
    laminar-reward-logs: one a worker process a run, on every node. It is removed as the
    process exits when nothing was printed to it; one that holds output stays."""
    import os
    import subprocess
    from pathlib import Path

    code = (
        "import sys\n"
        "from laminar.reward_process import _log_file, log_path\n"
        "f = _log_file()\n"
        "f.write(sys.argv[1].encode())\n"
        "f.close()\n"
        "print(log_path())\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for printed in ("", "a reward's print\n"):
        out = subprocess.run(
            [sys.executable, "-c", code, printed],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        path = Path(out.stdout.strip())
        assert path.parent.parent == tmp_path
        assert path.exists() == bool(printed), (printed, path)
