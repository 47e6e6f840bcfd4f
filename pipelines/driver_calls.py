"""Calls to many actors at once, with one deadline for them all, and the calls of a
run's stop, which say which actor did not answer.

A call to an actor whose worker is lost raises at once or never returns: these skip it,
or fail within their timeout, rather than wait for it. Apart from ``pipelines/driver.py``
because every part of the driver and its restarts within the run
(``pipelines/restart.py``) make such calls. Used by ``laminar run``'s driver.
"""

from __future__ import annotations

import time

from laminar.cluster import actor_result
from laminar.errors import ClusterError


def _stopping(actor, method: str, timeout: float):
    """``actor.method()``'s answer at the run's stop, within ``timeout``
    (:func:`~laminar.cluster.actor_result`: within a second once its worker is gone). One
    that does not answer in time raises a :class:`ClusterError` that says which."""
    try:
        return actor_result(actor, getattr(actor, method)(), timeout)
    except TimeoutError as e:
        raise ClusterError(
            f"{method}() of the actor on {actor._address} did not answer within "
            f"{timeout:g} s as the run stopped (hung?)"
        ) from e


def _send(calls: list) -> list:
    """Call every actor method at once; the futures of the calls made (one to an actor
    whose worker is known lost raises at once: skipped)."""
    futures = []
    for call in calls:
        try:
            futures.append(call())
        except Exception:  # noqa: BLE001 — its worker is known lost
            continue
    return futures


def _answers(calls: list, timeout: float = 5.0) -> list:
    """Call every actor method at once; the results of those that answer within
    ``timeout`` (one wait for them all: calls that never answer do not add up). A call
    to an actor whose worker is lost raises at once or never returns: skipped (the
    manager detects the loss and recovers its work)."""
    return _results(_send(calls), timeout)


def _results(futures: list, timeout: float) -> list:
    """The results of those of ``futures`` (:func:`_send`'s) that come within
    ``timeout``, one wait for them all; the rest are skipped (:func:`_answers`)."""
    out = []
    deadline = time.monotonic() + timeout
    for f in futures:
        try:
            # (not 0 past the deadline: distributed then times out an answer already in)
            out.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 — lost or stalled
            continue
    return out
