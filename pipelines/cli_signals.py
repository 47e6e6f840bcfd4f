"""How a ``laminar`` command stops: SIGTERM and SIGHUP taken as Ctrl-C is (the command
ends, what it started closed, 128 + the signal's number its exit code), and output whose
reader is gone (a pipe's reader exited, a terminal hung up) dropped instead of failing the
stop.

Apart from the commands because :func:`pipelines.cli.main` installs it for every one of
them, and ``laminar run``'s progress (:mod:`pipelines.cli_run`) adds its own on top.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import sys

# The signals that stop a run in order, as Ctrl-C does: SIGTERM (`kill`, `scancel`, a
# Slurm job's walltime, with `#SBATCH --signal=B:TERM@300` ahead of it) and SIGHUP (the
# terminal or SSH session gone; not where it is ignored, under `nohup`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside a run's progress (its setup, a bench, a report): ends
    the command as Ctrl-C does, what it started (a cluster, Slurm jobs) closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signalled(signum, frame):
    raise _Signalled(signum)


@contextlib.contextmanager
def _handling(signums, handler):
    """``handler`` for each of ``signums`` meanwhile, then the handlers before it back;
    one that is ignored (nohup's SIGHUP) stays ignored."""
    old = {}
    for signum in signums:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            old[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in old.items():
            signal.signal(signum, before)


def _exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP (an
    interrupted wait() keeps what interrupted it as its cause)."""
    for e in (interrupt, interrupt.__cause__):
        if isinstance(e, _Signalled):
            return 128 + e.signum
    return 128 + signal.SIGINT


def _stream_gone(stream) -> bool:
    """Whether ``stream``'s reader is gone: a pipe whose reader exited (POLLERR), a
    terminal hung up (POLLHUP)."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError):  # (closed, or no file descriptor)
        return False


def _safely(show, *args, **kwargs) -> None:
    """Call ``show``, something that prints; when what reads the output is gone (`tee`
    ended by the same Ctrl-C, a hung-up terminal), the rest of it goes nowhere, and the
    run still stops in order and says so in its exit code."""
    try:
        show(*args, **kwargs)
        sys.stdout.flush()  # (here, not at exit: Python would report the error there)
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise
        gone = [s for s in (sys.stdout, sys.stderr) if _stream_gone(s)] or [sys.stdout]
        for stream in gone:  # (its unflushed rest would fail again: it goes nowhere)
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
