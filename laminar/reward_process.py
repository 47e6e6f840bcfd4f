"""Reward calls in a child process that can be killed: how ``task.reward_timeout_s`` cuts
a call however it blocks.

A thread cannot be stopped, and a call stuck in C code that holds the GIL (catastrophic
backtracking of a regular expression in an answer checker) does not even let the thread
that waits for it run: the worker's event loop, and any actor on that worker, would stall
with it. So :func:`laminar.rewards.score_batch` with a timeout makes its calls in a child
process, one per batch in flight, kept between batches; it waits for each answer on a
socket, without the GIL. A call past the timeout: the child, and whatever it started, is
killed, the call marked, and the rest of the batch goes to a new child. A child that
dies (``os._exit``, a segfault, the OOM killer) marks the call it was making. Where no
child can be had (one cannot be started, or ends before it has loaded the function,
twice), the batch's calls are marked, not the task failed: only a reward that a running
child cannot load fails it.

The child is a fresh interpreter, started with :mod:`subprocess`: Dask's worker
processes are daemonic, and :mod:`multiprocessing` refuses them children; a fork of a
worker (its threads, a CUDA context, gigabytes mapped) per batch would be neither safe
nor cheap. Each batch brings the worker's ``sys.path`` (a module ``Client.upload_file``
sent is found there too) and the function: a ``module:function`` by its name (imported
in the child only: not in the worker, where its import would run for nothing), one
registered at run time by cloudpickle. Nothing else of the
worker is there: no ``distributed.get_worker()``, no worker plugin's or preload's state,
and a model the reward loads is loaded once per child. ``task.reward_timeout_s: null``
calls the reward in the task's thread instead, on the worker, without a cut-off.

What the reward prints (the child's stdout and stderr) goes to a file, one a worker
process (:func:`log_path`), not to the worker's output, which a local cluster's workers
share with ``laminar run``'s console; the first time it grows, a warning names it.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from laminar.errors import RewardError

logger = logging.getLogger(__name__)

# The folder, under the temporary one, of what rewards print (log_path()).
LOG_FOLDER = "laminar-reward-logs"

# How long a new child may take to start and load the reward function (its imports: a
# math verifier's can take seconds) before the batch fails; ``timeout_s`` if longer.
LOAD_S = 120.0

# A child idle this long is ended by its parent (read when it is next checked): a worker
# that scored once (the warm start's evaluation, on the trainer's worker) keeps no process
# (34 MiB) for the rest of the run, nor a zombie of one.
IDLE_S = 600.0
# A child idle IDLE_S plus this long exits by itself, should its parent not have ended it.
IDLE_MARGIN_S = 60.0

# The child's first lines: its parent's sys.path before anything of laminar is imported.
_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from laminar.reward_process import serve\n"
    "serve(conn, int(sys.argv[2]))\n"
)


def log_path() -> Path:
    """Where the scoring processes of this worker write what the reward prints (its
    stdout and stderr): one file a worker process, under the temporary folder. It went
    to the worker's own output, which a local cluster's workers share with `laminar
    run`'s console: a reward's print()s, hundreds of lines a run, among the run's."""
    return Path(tempfile.gettempdir()) / LOG_FOLDER / f"{socket.gethostname()}-{os.getpid()}.log"


def _log_file():
    """:func:`log_path` opened to append (the child's stdout and stderr); ``None``
    (they go where the worker's do) where it cannot be."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "ab")  # noqa: SIM115 — handed to the child, closed here after
    except OSError:
        return None
    if not _cleanup_registered:  # (a reward that never printed leaves no empty file)
        import atexit

        atexit.register(_remove_if_empty, path)
        _cleanup_registered.append(True)
    return log


def _remove_if_empty(path: Path) -> None:
    """At this process's exit: :func:`log_path` removed if nothing was printed to it."""
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


_cleanup_registered: list[bool] = []  # (in this process)


class _Child:
    """A scoring process and the parent's end of its socket."""

    def __init__(self) -> None:
        """Start one. Raises ``OSError`` (or ``SubprocessError``) where it cannot be
        started, or ends at once: nothing of it is left then, no socket nor zombie."""
        ours, theirs = socket.socketpair()
        log = _log_file()
        try:
            argv = [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid())]
            # (started from a thread that lives as long as this process: the child's
            # parent-death signal follows the thread that started it, see _die_with())
            self.proc = (
                _starter()
                .submit(
                    subprocess.Popen,
                    argv,
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=None if log is None else subprocess.STDOUT,
                    # (each line in the file as it is printed, not at 8 KiB or the exit)
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,  # (its own group: killed with what it started)
                )
                .result()
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            if log is not None:
                log.close()
        self.conn = Connection(ours.detach())
        self.how: str | None = None  # (once ended)
        self.idle_since = 0.0  # (time.monotonic(), when last parked idle)
        try:
            self.conn.send(list(sys.path))
        except OSError as e:  # (it ended at once: reaped here)
            raise OSError(f"it ended as it started ({self.end()}){_output_at()}") from e
        except BaseException:
            self.end()
            raise

    def end(self) -> str:
        """Kill the child and whatever it started (its process group; the child is not
        reaped yet, so its id is still the group's), reap it, and say how it ended."""
        if self.how is None:
            if self.proc.returncode is None:  # (reaped, its id may be another's now)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.conn.close()
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (stuck in the kernel: reaped later)
                self.how = "killed, and not yet ended"
                return self.how
            if code >= 0:
                self.how = f"exit code {code}"
            else:
                try:
                    self.how = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    self.how = f"killed by signal {-code}"
        return self.how


def _output_at() -> str:
    """Where what the scoring processes printed went, for an error about one that
    ended (its traceback, a native library's abort message), when anything was."""
    try:
        return f"; its output: {log_path()}" if log_path().stat().st_size > 0 else ""
    except OSError:
        return ""


def _say_printed(reward_name: str) -> None:
    """Warn, once a worker process, that the reward has printed, and where that went
    (:func:`log_path`)."""
    if _printed_said:
        return
    try:
        printed = log_path().stat().st_size > 0
    except OSError:
        return
    if printed:
        _printed_said.append(True)
        logger.warning(
            "task.reward %r prints: its stdout and stderr go to %s on %s (one file a "
            "worker process), not to the console",
            reward_name,
            log_path(),
            socket.gethostname(),
        )


_printed_said: list[bool] = []  # (said in this process)
_idle: list[_Child] = []
_idle_lock = threading.Lock()
_idle_changed = threading.Condition(_idle_lock)  # (a child parked: the reaper looks again)
_starter_pool: list[ThreadPoolExecutor] = []
_reaper_of: list[int] = []  # (the process whose reaper thread runs: none after a fork)


def _park(child: _Child) -> None:
    """Keep ``child`` idle for the next batch; the reaper ends it after ``IDLE_S`` unused."""
    with _idle_lock:
        child.idle_since = time.monotonic()
        _idle.append(child)
        if _reaper_of != [os.getpid()]:
            _reaper_of[:] = [os.getpid()]
            threading.Thread(target=_reap, name="laminar-reward-reaper", daemon=True).start()
        _idle_changed.notify()


def _reap() -> None:
    """End each idle child once it has been idle ``IDLE_S``, or has ended (killed): reaped,
    its socket closed. The child would exit by itself, but only its parent can reap it:
    a worker that scored once and not again kept a zombie, and its socket, for the rest
    of the run (:func:`_take` reaps those it finds, only as the worker next scores)."""
    while True:
        with _idle_lock:
            now = time.monotonic()
            idle_s = IDLE_S
            done = [c for c in _idle if now - c.idle_since >= idle_s or c.proc.poll() is not None]
            for child in done:
                _idle.remove(child)
            if not done:
                due = [c.idle_since + idle_s - now for c in _idle]
                _idle_changed.wait(min(due, default=None))
        for child in done:  # (outside the lock: a child stuck in the kernel takes 10 s)
            child.end()


def _starter() -> ThreadPoolExecutor:
    with _idle_lock:
        if not _starter_pool:
            _starter_pool.append(ThreadPoolExecutor(1, thread_name_prefix="laminar-reward-start"))
        return _starter_pool[0]


def _take() -> tuple[_Child, bool]:
    """The idle child used last (``False``), or a new one (``True``); raises what
    :class:`_Child` does.

    Every idle child that has ended (after ``IDLE_S`` unused, or killed) is reaped here
    and its socket closed, not only the one taken: the last used is taken first, so
    after a burst of batches the others idle out while it goes on, and would stay
    zombies."""
    with _idle_lock:
        for child in [c for c in _idle if c.proc.poll() is not None]:
            _idle.remove(child)
            child.end()
        if _idle:
            return _idle.pop(), False
    return _Child(), True


def _poll(conn: Connection, timeout_s: float) -> bool:
    """``conn.poll(timeout_s)``, for any timeout (poll(2) takes at most ~24 days)."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(min(max(deadline - time.monotonic(), 0.0), 86400.0)):
        if time.monotonic() >= deadline:
            return False
    return True


def _pickled(fn) -> bytes | None:
    """``fn`` for the child; ``None`` where it does not pickle (the child then resolves
    the reward by its name)."""
    try:
        import cloudpickle

        return cloudpickle.dumps(fn)
    except Exception:  # noqa: BLE001 — a user's callable object may hold anything
        return None


def scores_in_child(
    reward_name: str, fn, calls: Sequence[tuple[str, str]], timeout_s: float
) -> Iterator:
    """A :class:`~laminar.rewards.Score` for each call of ``fn`` on ``calls``, in
    order, each made in a child process and waited for up to ``timeout_s``; ``fn``
    ``None``: the child resolves ``reward_name`` itself (a ``module:function``, not
    imported here)."""
    from laminar.rewards import TIMED_OUT, Score, call_context

    blob = None if fn is None else _pickled(fn)
    i = 0
    while i < len(calls):
        child = _load(reward_name, blob, calls[i:], timeout_s, by_name=fn is None)
        if isinstance(child, str):  # (no process to score them: each is marked)
            for _ in calls[i:]:
                yield Score(math.nan, f"reward {reward_name} was not called: {child}")
            return
        healthy = False
        try:
            while i < len(calls):
                if not _poll(child.conn, timeout_s):
                    yield Score(
                        math.nan,
                        f"reward {reward_name} {TIMED_OUT}={timeout_s:g} s",
                        call_context(calls[i]),
                    )
                    i += 1
                    break
                try:
                    score = child.conn.recv()
                except (EOFError, OSError):
                    yield Score(
                        math.nan,
                        f"reward {reward_name} ended the process that scored it "
                        f"({child.end()}){_output_at()}; the calls after it go to a new one",
                        call_context(calls[i]),
                    )
                    i += 1
                    break
                yield score
                i += 1
            else:
                healthy = True
        finally:  # (cut: killed; a generator closed early, too, may have calls out)
            if healthy:
                _park(child)
            else:
                child.end()
            _say_printed(reward_name)  # (a reward that printed, then crashed or hung, too)


def _load(
    reward_name: str, blob: bytes | None, calls, timeout_s: float, by_name: bool = False
) -> _Child | str:
    """A child that holds ``calls`` and has loaded the function, ready to answer them;
    or, where none could be had, why (the calls are then marked, not the task failed).

    An idle child found ended is replaced, unseen. A new one that cannot be started
    (``ENOMEM``, ``EMFILE``) or ends before it has loaded the function (killed by the
    OOM killer, say) is tried once more; one that has not loaded it within
    ``max(LOAD_S, timeout_s)`` is killed, not tried again (that wait is spent). Raises
    only where a child that runs could not load the function: the reward itself is at
    fault, and would be for every batch (``by_name``: the worker did not resolve it, and
    the child's error is the one resolving it here would have raised)."""
    wait_s = max(LOAD_S, timeout_s)
    tries = 2
    while True:
        try:
            child, new = _take()
        except (OSError, subprocess.SubprocessError) as e:
            tries -= 1
            if tries:
                continue
            return f"the process that scores it could not be started (tried twice; last: {e})"
        try:
            child.conn.send((reward_name, blob, list(sys.path), list(calls)))
            if not _poll(child.conn, wait_s):
                child.end()
                return f"the process that scores it did not load it within {wait_s:g} s"
            failed = child.conn.recv()
        except (EOFError, OSError):
            how = child.end()
            if not new:
                continue  # (ended while idle: a new one)
            tries -= 1
            if tries:
                continue
            return (
                f"the process that scores it ended before it loaded it (tried twice; last: "
                f"{how}); see the worker's log"
            )
        if failed is None:
            return child
        _park(child)  # (alive and idle: what failed was the loading)
        if by_name and isinstance(failed, RewardError):  # (as resolving it here would say)
            raise RewardError(str(failed))
        if isinstance(failed, BaseException):
            from laminar.rewards import _said

            failed = _said(failed)
        raise RewardError(
            f"task.reward {reward_name!r} does not load in the process that scores it "
            f"({failed}); it must import there as on the worker"
        )


def serve(conn: Connection, parent_pid: int) -> None:
    """The child's loop: a batch ``(name, pickled fn, sys.path, calls)`` in, ``None``
    (loaded) or what failed out, then one :class:`~laminar.rewards.Score` per call."""
    _die_with(parent_pid)
    from laminar.rewards import _outcomes, _said, _scored, resolve_reward

    loaded: dict = {}
    while True:
        try:
            if not conn.poll(IDLE_S + IDLE_MARGIN_S):
                return  # (idle, and not ended by the worker: it starts another when needed)
            name, blob, path, calls = conn.recv()
        except (EOFError, OSError):  # the worker is gone: so are we
            return
        if path != sys.path:
            sys.path[:] = path
            importlib.invalidate_caches()
        try:
            key = blob or name
            if key not in loaded:
                if blob is None:
                    fn = resolve_reward(name)
                else:
                    import cloudpickle

                    fn = cloudpickle.loads(blob)
                if len(loaded) > 8:  # (one reward a run; runs of tests make more)
                    loaded.clear()
                loaded[key] = fn
            fn = loaded[key]
        except BaseException as e:  # noqa: BLE001 — a user's module may raise anything
            try:  # (resolve_reward's own error, for a reward resolved here, is sent whole)
                conn.send(e if type(e) is RewardError else _said(e))
            except OSError:
                return
            continue
        try:
            conn.send(None)
            # (no Ctrl-C reaches this process, in its own session: a KeyboardInterrupt
            # here is the function's own)
            outcomes = _outcomes(fn, calls, main_interrupts=False)
            for call, outcome in zip(calls, outcomes, strict=False):
                conn.send(_scored(name, *outcome, call))
        except OSError:  # (the worker gave up on this batch, or is gone)
            return


def _die_with(parent_pid: int) -> None:
    """Be killed when the worker dies, even in the middle of a call that holds the GIL
    (Linux: ``PR_SET_PDEATHSIG``); an orphan would otherwise spin on for ever."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001, S110 — without it, an orphan ends at EOF
            pass
    if os.getppid() != parent_pid:  # (it died before the signal was asked for)
        os._exit(0)
