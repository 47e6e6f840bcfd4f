"""Actors and their handles: one created on a given worker, with the handles among its
arguments passed by value (:func:`start_actor`); handles that hold no future of their
creating task (:func:`detach`); the actors a run's setup made, released if it fails
(:func:`actors_made`, :func:`release_actors`); whether a failed call says its actor may be
lost (:func:`is_lost`); threads that keep the worker's context (:func:`start_thread`).

Importing it quiets one report of ``distributed``'s (:class:`_CancelledCallReport`): every
process that calls an actor through laminar imports it.

Apart from :mod:`laminar.cluster` (the workers: a local cluster of them, placement, and
the waits on an actor that watch the scheduler's view of its worker), from where each
public name here is imported as well: nothing here asks the scheduler about workers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator

logger = logging.getLogger(__name__)


_made = threading.local()


class _CancelledCallReport(logging.Filter):
    """Drops tornado's report of an actor call that ended because its actor's worker was
    lost and the actor then released.

    A call (from a worker-side handle, whose creating future the worker still holds as
    pending) to a worker that died retries its connection for
    ``distributed.comm.timeouts.connect`` (30 s), then awaits that future, which the run
    cancels as it releases the lost actor; the callback that ``distributed`` runs the call
    in re-raises the cancellation where no one awaits it, and tornado logs it as an ERROR
    with a 60-line traceback, one per call in flight: a soak's or a recovered run's
    terminal filled with them. The caller learns of the loss from its own wait and from
    loss detection (:func:`is_lost`, the manager's), and laminar says what happened; the
    report adds nothing to that. Only that report is dropped: other errors of the
    callback, and every other tornado error, are logged as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ != "FutureCancelledError":
            return True
        return "wait_then_set_result" not in record.getMessage()


def _quiet_cancelled_calls() -> None:
    tornado = logging.getLogger("tornado.application")
    if not any(isinstance(f, _CancelledCallReport) for f in tornado.filters):
        tornado.addFilter(_CancelledCallReport())


_quiet_cancelled_calls()


@contextlib.contextmanager
def actors_made() -> Iterator[list]:
    """Collect ``(cls, future)`` of every actor :func:`start_actor` starts in this
    thread meanwhile (a run's setup: what :func:`release_actors` ends if it fails)."""
    made: list = []
    outer, _made.list = getattr(_made, "list", None), made
    try:
        yield made
    finally:
        _made.list = outer


def release_actors(client, made: list, timeout: float = 10.0, close: bool = True) -> None:
    """Best effort, for a run that ended: close the actors of ``made``
    (:func:`actors_made`) that hold threads or files (a buffer flushes its store, a
    relay stops serving: ``close``, when the run did not, its setup having failed), then
    release every one, so none stays on the workers."""
    for _cls, future in made if close else ():
        if future.status != "finished" or not hasattr(_cls, "close"):
            continue
        try:
            with client.as_current():
                future.result().close().result(timeout=timeout)
        except Exception as e:  # noqa: BLE001 — lost, or failed itself: released below
            logger.debug("closing %s: %r", future.key, e)
    try:
        client.cancel([future for _, future in made], force=True)
    except Exception as e:  # noqa: BLE001 — (the scheduler gone too): the setup's error stands
        logger.warning("could not release a run's actors: %r", e)


def start_actor(client, cls, *args, worker: str, resource: str, **kwargs):
    """Start creating an actor of ``cls`` on ``worker``; returns the creating future
    (:func:`bind_actor` makes the handle once it is done).

    Actor handles among the constructor's arguments (in lists, tuples and dicts too)
    are passed by value (:func:`_by_value`): as they are, each would be a dependency
    of the creating task, which ``worker`` gathers from any worker that holds a copy of
    its key, every worker whose actor was created with it (a rollout holds the master
    relay's). One that hangs (stopped) never answers, and the creation waited for ever:
    a data module rebuilt while a rollout hung stalled the run so, one time in three."""
    made_by = cls
    if _has_actor((args, kwargs)):
        args = (cls, *(_by_value(a) for a in args))
        kwargs = {k: _by_value(v) for k, v in kwargs.items()}
        kwargs.setdefault("key", f"{cls.__name__}-{uuid.uuid4()}")
        made_by = _construct
    future = client.submit(
        made_by,
        *args,
        actor=True,
        workers=[worker],
        allow_other_workers=False,
        resources={resource: 1},
        pure=False,
        **kwargs,
    )
    if (made := getattr(_made, "list", None)) is not None:
        made.append((cls, future))
    return future


class _ActorRef:
    """An actor handle in a constructor's arguments, as plain data: the address and
    key it is rebuilt from in the new actor's process (:func:`_construct`)."""

    def __init__(self, actor) -> None:
        self.cls, self.address, self.key = actor._cls, actor._address, actor.key
        self.detached = type(actor) is not _actor_class()

    def handle(self):
        from distributed import Actor

        return (_Detached if self.detached else Actor)(self.cls, self.address, self.key)


def _actor_class():
    from distributed import Actor

    return Actor


def _has_actor(value, kind=None) -> bool:
    """Whether ``value`` is, or holds in plain lists, tuples and dict values, an actor
    handle (or a ``kind``)."""
    if isinstance(value, kind or _actor_class()):
        return True
    if type(value) is dict:
        return any(_has_actor(v, kind) for v in value.values())
    return type(value) in (list, tuple) and any(_has_actor(v, kind) for v in value)


def _by_value(value):
    """``value`` with every actor handle in it (in plain lists, tuples and dict values)
    as an :class:`_ActorRef`: a task's arguments are searched for handles (each a
    ``TaskRef``, a dependency), not inside other objects. A container without one is
    passed as it is (a named tuple, an ordered dict keep their type)."""
    if isinstance(value, _actor_class()):
        return _ActorRef(value)
    if not _has_actor(value):
        return value
    if type(value) is dict:
        return {k: _by_value(v) for k, v in value.items()}
    return type(value)(_by_value(v) for v in value)


def _handles(value):
    """:func:`_by_value` undone, in the new actor's process."""
    if isinstance(value, _ActorRef):
        return value.handle()
    if not _has_actor(value, _ActorRef):
        return value
    if type(value) is dict:
        return {k: _handles(v) for k, v in value.items()}
    return type(value)(_handles(v) for v in value)


def _construct(cls, /, *args, **kwargs):
    """``cls(*args, **kwargs)`` with the handles :func:`_by_value` passed rebuilt (the
    creating task of an actor: the worker keeps what it returns as the actor)."""
    return cls(*_handles(args), **_handles(kwargs))


class ActorLost(ConnectionError):
    """The worker holding an actor was lost (its creating task is gone)."""


class ActorHung(TimeoutError):
    """The worker creating an actor sent nothing for longer than it was given
    (:func:`bind_actor`'s ``silent_s``)."""


def is_lost(error: BaseException) -> bool:
    """Whether a failed actor call says its actor may be lost (its worker gone, the
    connection cut, the call cancelled or timed out), rather than an error the actor
    raised itself (re-raised here as it was)."""
    import asyncio
    import concurrent.futures

    from distributed.comm.core import CommClosedError

    cut = (CommClosedError, ConnectionError, TimeoutError)
    cancelled = (asyncio.CancelledError, concurrent.futures.CancelledError)
    # (distributed raises a plain OSError when it cannot connect, and a RuntimeError
    # for a call to an actor it knows lost; a FileNotFoundError is the actor's own)
    return (
        isinstance(error, cut + cancelled)
        or type(error) is OSError
        or (type(error) is RuntimeError and "Worker holding Actor was lost" in str(error))
    )


def detach(actor):
    """A handle to ``actor`` that holds no future of the task that created it, for
    passing in an actor method call or to :func:`start_actor` (never as a plain task's
    argument, which would make it a dependency).

    When the worker of a dependency of an actor's creating task is lost (the data module,
    whose handles every rollout was built with before :func:`start_actor` passed them
    by value), the scheduler marks the creating task erred, although the actor lives
    on. A handle to such an actor unpickled in another process asks the scheduler about
    its key, hears "erred", and refuses every call; a task that takes it as an argument
    never runs. This one does neither, and a
    call to it whose worker is gone fails at once instead of waiting for the task."""
    return _Detached(actor._cls, actor._address, actor.key)


def _detached_class():
    from distributed import Actor

    class Detached(Actor):
        def _try_bind_worker_client(self):
            from distributed import get_client, get_worker

            if not self._worker:
                try:
                    self._worker = get_worker()
                except ValueError:
                    self._worker = None
            if not self._client:
                try:
                    self._client = get_client()
                except ValueError:
                    self._client = None

        def __reduce__(self):
            return (_Detached, (self._cls, self._address, self.key))

    return Detached


def _Detached(cls, address: str, key: str):  # noqa: N802 — builds (and unpickles) one
    global _DETACHED
    if _DETACHED is None:
        _DETACHED = _detached_class()
    return _DETACHED(cls, address, key)


_DETACHED = None


def start_thread(target, name: str):
    """Start a daemon thread inside a copy of the caller's context.

    Called from an actor method, the new thread keeps the Dask worker context, so
    ``get_worker()``/``get_client()`` work in it and actor handles can bind to the worker.
    (A plain ``threading.Thread`` starts with an empty context and cannot.)
    """
    import contextvars
    import threading

    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(target,), name=name, daemon=True)
    thread.start()
    return thread
