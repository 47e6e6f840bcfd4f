"""The rollout manager: recovers lost rollouts, runs the repack planner and carries out
its moves.

**Recovery** (``faults.recover``, docs/faults.md). Every ``faults.detect_interval_s`` the
manager checks with the scheduler that every rollout's worker is alive. A lost rollout's
unfinished trajectories come back from the partial-response pool (:mod:`laminar.partial`)
and are imported into a healthy rollout decoding a batch of the same weight version; if
none is, the least loaded healthy rollout *adopts* them as a batch of their own at its
next boundary, loading that version from its relay's kept versions or the trainer's
checkpoint. Either way each trajectory keeps one behavior version, its group stays whole,
and at most one flush interval of tokens is regenerated. Each recovery is a row of the
``faults`` table of ``metrics.zarr``. A hung rollout is fenced (its worker restarted) and
lost once its worker is gone; one whose fence fails (its worker still there
``faults.fence_wait_s`` after) is taken as lost all the same, its process left for the
user to stop (fenced in the data module: what it sends later changes nothing). With
``faults.recover`` off there is no pool to resume from: the manager still detects a
lost (or hung) rollout, records it (a ``faults`` row of ``how`` ``unrecovered``) and
fails with an error naming it, on which the driver fails the run in order — never a run
that goes on quietly with fewer rollouts.

**Repack** (with a ``repack`` section).

Every ``repack.interval_s`` (the paper: 5 s), and right after each trainer publication,
the manager asks every rollout for its load, plans with :func:`laminar.repack.plan` and
executes each move in three steps:

1. the source exports every unfinished request (tokens, logprobs and versions so far)
   and holds at its batch boundary (a paced source hands them over at its step's
   deadline);
2. the destination imports them into its running batch, which re-prefills them — only
   if it still decodes a batch of the same version (it may have drained meanwhile);
   otherwise the source takes them back;
3. the source is released: it pulls the newest weights and takes new prompts.

No request is lost: the source holds what it exported until the move is committed or
aborted, so a state leaves the source only into the destination or back into the
source. Nor is one in two engines, except where the manager lost track of a move: a
destination that answered neither its import nor the question whether it took it (the
source takes the requests back), or a source whose hold ran out, its manager lost
mid-round, after the destination imported. Both then decode them, and the buffer keeps
the copy that finishes first (docs/repack.md, "Moves"). Each move is a row of the
``repacks`` table of ``metrics.zarr`` (requests and tokens moved, re-prefilled tokens,
the pause it caused its source's requests, from the export's hand-over to the release);
the manager keeps a row only until the driver has copied it (:meth:`get_rows`), and
keeps the totals of :meth:`stats` as moves and recoveries happen.

**Layout.** This module holds the actor's state, its loop, its stats and ``take_over``,
and the call helpers both concerns share; recovery is :mod:`laminar.manager_recovery`,
repack :mod:`laminar.manager_repack` (one mixin each).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import Counter

from laminar.cluster import actor_result, scheduler_workers, start_thread
from laminar.config import RunConfig
from laminar.manager_recovery import RecoveryMixin
from laminar.manager_repack import RepackMixin, repack_max_batch
from laminar.manager_repack import planner_loads as planner_loads

logger = logging.getLogger(__name__)

# The totals a manager's stats() reports, kept as its moves and recoveries happen (its
# rows are not kept: the driver's copy holds them), and carried over by take_over().
_TOTALS = (
    "recoveries",
    "recovered_requests",
    "requests_moved",
    "tokens_moved",
    "reprefill_tokens",
    "pause_s",
)


class RolloutManager(RecoveryMixin, RepackMixin):
    """Dask actor (on the data worker): the repack loop over every rollout."""

    def __init__(
        self,
        cfg: RunConfig,
        rollouts: dict,
        master_relay,
        partial=None,
        workers: dict | None = None,
        *,
        relays: dict | None = None,
        relay_workers: dict | None = None,
        rollout_relays: dict | None = None,
    ) -> None:
        """``rollouts`` maps each rollout id to its actor handle, ``workers`` to its
        worker's address (for loss detection); ``partial`` is the partial-response pool.
        ``relays`` maps each relay id to its handle in chain order (master first),
        ``relay_workers`` to its worker, ``rollout_relays`` each rollout to the relay it
        pulls from: a lost downstream relay is cut out of the chain (:meth:`drop_relays`)."""
        self.cfg = cfg
        self.rcfg = cfg.repack
        self.rollouts = dict(rollouts)
        self.master = master_relay
        self.max_batch = repack_max_batch(cfg)
        self.timeout = cfg.cluster.actor_timeout_s
        # A call this thread must not wait on for the actor timeout (every heartbeat
        # blind meanwhile): one not answered this soon is left to detection
        self.quick_s = min(self.timeout, 5.0)
        # rid -> (batch, kv_used) at the last check: the falling-KV rule, and the batch a
        # move of that round may import into
        self._prev: dict[str, tuple[int | None, float]] = {}
        self._seen_version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One per executed (or rolled back) move, from the ``_rows_base``-th on: those the
        # driver fetched are dropped at its next fetch (:meth:`get_rows`).
        self.rows: list[dict] = []
        self._rows_base = 0
        self._rows_lock = threading.Lock()  # (appended by the loop, dropped by get_rows)
        # (skipped: exports answered with nothing to move; exports_unanswered: not
        # answered in time, aborted)
        self.counts = {
            "checks": 0,
            "moves": 0,
            "rolled_back": 0,
            "skipped": 0,
            "exports_unanswered": 0,
        }
        self.partial = partial
        self.workers = dict(workers or {})
        self.lost: dict[str, float] = {}  # rollout id -> when its loss was detected
        # the rollouts a manager lost with the data module had found lost (take_over):
        # their entries, restored from its log, are taken once more (_retake_late)
        self._lost_before: set[str] = set()
        self.fault_rows: list[dict] = []  # one per recovered batch
        self.replacements: dict[str, str] = {}  # lost rollout id -> the one that replaced it
        self._joining: queue.Queue = queue.Queue()  # (id, handle, worker, replaces, relay)
        self.relays = dict(relays or {"master": master_relay})
        self.relay_workers = dict(relay_workers or {})
        self.rollout_relays = dict(rollout_relays or {})
        self.relays_lost: dict[str, dict] = {}  # relay id -> what its loss changed
        self._alive_at: dict[str, float] = {}  # rollout -> when it last showed progress
        # rollout -> (when it was asked, its heartbeat call in flight)
        self._beat_calls: dict[str, tuple[float, object]] = {}
        self._beat_asked = 0.0  # when the rollouts were last asked (heartbeat_interval)
        self._beats_read: float | None = None  # when check_heartbeats last ran
        self.hung: dict[str, dict] = {}  # rollout -> when it was declared hung, its fence
        self.masters: list[dict] = []  # master relays that replaced a lost one (restarts)
        self._master_lost: float | None = None  # when the master's worker was found gone
        # The totals of stats() (_TOTALS), with those of the managers this one took over
        # from (lost with the data module): summing the rows at each of the driver's polls
        # cost O(moves), a second a poll after a million moves.
        self._totals: Counter = Counter()
        self.error: str | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, "repack")

    def stop(self, timeout: float = 30.0) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def take_over(self, last: dict, rollouts: dict, workers: dict) -> None:
        """Go on from a manager lost with the data module, from its last ``stats()``: the
        rollouts and relays it had found lost, hung or replaced stay so, the relay each
        rollout pulls from stands, and its totals carry on into this one's. ``rollouts``
        (id -> handle, made by :func:`laminar.cluster.detach`: the scheduler holds their
        creating tasks erred, their data-module arguments being lost) and ``workers``
        are the live rollouts, given here rather than to the constructor for that
        reason (a task with such an argument never runs)."""
        self.rollouts.update(rollouts)
        self.workers.update(workers)
        self.lost.update(last["lost"])
        # (its recovery of them may have reached no rollout, or not the log: the rebuild
        # restores what the log says they own, or had been taken from them, and nothing
        # finds them lost again)
        self._lost_before.update(last["lost"])
        self.replacements.update(last["replacements"])
        self.relays_lost.update(last["relays_lost"])
        self.hung.update(last["hung"])
        self.masters += last["masters_replaced"]
        self.rollout_relays.update(last["rollout_relays"])
        if self.partial is not None and self.lost:
            # The new pool fences the rollouts taken as lost (one given up may live on;
            # the log it replaces had them): best effort, the lost module's handles that
            # process holds reach nothing anyway. From a thread of its own: called in
            # this actor call, on the pool's own worker, distributed hands back the
            # pool's async method itself, whose coroutine nobody awaited (the fences were
            # never made: "'coroutine' object has no attribute 'result'").
            def fence() -> None:
                calls = {rid: self._try(lambda r=rid: self.partial.fence(r)) for rid in self.lost}
                for rid, call in sorted(calls.items()):
                    self._noting(f"partial.fence({rid})", call)

            fencing = start_thread(fence, "fence-lost")
            fencing.join()
        counted = ("checks", "moves", "rolled_back", "skipped", "exports_unanswered")
        for k in (*counted, "global_pauses"):
            if k in last:
                self.counts[k] = self.counts.get(k, 0) + last[k]
        for k in _TOTALS:
            self._totals[k] += last[k]

    def _record_moves(self, rows: list[dict]) -> None:
        """A planning round's move rows: kept until the driver has fetched them, and
        counted in the totals."""
        with self._rows_lock:
            self.rows += rows
            for r in rows:
                if r["ok"]:
                    self._totals["requests_moved"] += r["requests"]
                    self._totals["tokens_moved"] += r["tokens"]
                    self._totals["reprefill_tokens"] += r["context_tokens"]
                self._totals["pause_s"] += r["pause_s"]

    def _record_faults(self, rows: list[dict]) -> None:
        """A recovery's rows (one per batch resumed), counted in the totals. Kept: there
        is one per batch a loss left, not one per move."""
        self.fault_rows += rows
        self._totals["recoveries"] += len(rows)
        self._totals["recovered_requests"] += sum(r["requests"] for r in rows)

    def stats(self) -> dict:
        c = self._totals
        return {
            "lost": dict(self.lost),
            "replacements": dict(self.replacements),
            "relays_lost": {rid: dict(info) for rid, info in self.relays_lost.items()},
            "hung": {rid: dict(info) for rid, info in self.hung.items()},
            "chain": self._chain(),
            "rollout_relays": dict(self.rollout_relays),
            "masters_replaced": [dict(m) for m in self.masters],
            "recoveries": c["recoveries"],
            "recovered_requests": c["recovered_requests"],
            **self.counts,
            "max_batch": self.max_batch,
            "requests_moved": c["requests_moved"],
            "tokens_moved": c["tokens_moved"],
            "reprefill_tokens": c["reprefill_tokens"],
            "pause_s": c["pause_s"],
            "error": self.error,
        }

    def get_rows(self, start: int = 0) -> list[dict]:
        """The move rows from the ``start``-th on (counted from the manager's first).
        Asking from ``start`` says the caller holds those before it: they are dropped
        here (a million moves, some hours at R = 256, held 0.7 GB). The driver asks from
        the count it has stored, so a fetch whose answer it did not get is asked again
        whole; a caller asking from before its last ``start`` gets the rows still kept."""
        with self._rows_lock:
            drop = min(max(start - self._rows_base, 0), len(self.rows))
            del self.rows[:drop]
            self._rows_base += drop
            return self.rows[max(start - self._rows_base, 0) :]

    def get_fault_rows(self, start: int = 0) -> list[dict]:
        return self.fault_rows[start:]

    def get_lost(self) -> dict[str, float]:
        return dict(self.lost)

    async def pause_all(self, version: int) -> dict:
        """A global weight update (partial rollout): every live rollout holds its
        unfinished requests until it has loaded ``version`` (:meth:`RolloutReplica.pause`).
        Returns once each has paused; one that does not answer within half of
        ``cluster.actor_timeout_s`` is left to loss detection (the trainer waits for this
        call as long as that whole timeout, counted from before it reached here: a
        rollout slow to answer must not fail the run), and a hung one is not asked."""
        import asyncio

        gone = {*self.lost, *self.hung}
        live = [r for rid, r in list(self.rollouts.items()) if rid not in gone]

        async def one(rollout) -> int | None:
            try:
                return await asyncio.wait_for(rollout.pause(version), self.timeout / 2)
            except Exception:  # noqa: BLE001 — lost or hung: detection handles it
                return None

        held = await asyncio.gather(*(one(r) for r in live))
        self.counts["global_pauses"] = self.counts.get("global_pauses", 0) + 1
        return {
            "paused": sum(h is not None for h in held),
            "requests": sum(h or 0 for h in held),
        }

    def _run(self) -> None:
        last = last_detect = time.time()
        # (Recovery resumes from the partial-response pool; without faults.recover there
        # is none, and detection fails the run on a loss instead: detect().)
        recover = self.cfg.faults.recover
        detect = bool(self.workers) and (self.partial is not None or not recover)
        try:
            while not self._stop.wait(0.05):
                self._take_joining()
                now = time.time()
                if detect and now - last_detect >= self.cfg.faults.detect_interval_s:
                    last_detect = now
                    self.detect()
                    if self.error is not None:  # (a loss with faults.recover off)
                        return
                if self.rcfg is None:
                    continue
                published = self._published()
                if published or time.time() - last >= self.rcfg.interval_s:
                    last = time.time()
                    self.check()
        except Exception:
            self.error = traceback.format_exc()
            logger.error("rollout manager failed:\n%s", self.error)

    @staticmethod
    def _try(call):
        """Start an actor call; the exception instead of a future if it cannot start."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 — a known-lost worker: a failed step
            return e

    # -- faults ---------------------------------------------------------------------------
    def _alive(self) -> list[str]:
        return [rid for rid in self.rollouts if rid not in self.lost]

    def _healthy(self) -> list[str]:
        """The live rollouts not declared hung: a hung one may still answer ``load()``
        (its generation loop is what stopped), but what it is given waits out its fence
        and is then recovered again."""
        return [rid for rid in self._alive() if rid not in self.hung]

    def _loads(self) -> dict[str, dict]:
        """Every healthy rollout's load; one that does not answer within a few seconds is
        skipped this round (a lost one is detected by :meth:`detect`)."""
        futures = {}
        for rid in self._healthy():
            try:
                futures[rid] = self.rollouts[rid].load()
            except Exception:  # noqa: BLE001 — its worker is known lost
                continue
        out = {}
        deadline = time.time() + self.quick_s
        for rid, f in futures.items():
            while (left := deadline - time.time()) > 0:
                try:
                    out[rid] = f.result(timeout=min(left, self.cfg.faults.detect_interval_s))
                except TimeoutError:
                    # A rollout lost at the same time as the one being recovered never
                    # answers: stop waiting once the scheduler has dropped its worker
                    # (the next detect() round then finds it at once).
                    try:
                        gone = rid in self.workers and (
                            self.workers[rid] not in self._scheduler_workers()
                        )
                    except Exception:  # noqa: BLE001 — unknown: wait for it on
                        gone = False
                    if gone:
                        break
                    continue
                except Exception:  # noqa: BLE001 — failed: not a candidate now
                    pass
                break
        return out

    def _scheduler_workers(self) -> set[str]:
        return set(scheduler_workers())

    def _chain(self) -> list[str]:
        return [rid for rid in self.relays if rid not in self.relays_lost]

    def _noting(
        self,
        what: str,
        future,
        errors: list[str] | None = None,
        *,
        actor=None,
        deadline: float | None = None,
    ) -> tuple[bool, object]:
        """``(True, result)`` of ``future`` (or of an exception :meth:`_try` returned in
        its place), or ``(False, None)``, the failure logged and recorded in ``errors``.
        A call made while rebuilding the chain may fail when more than one relay was lost
        (a whole host): what it left undone falls to the next round. The wait ends at
        ``deadline`` (else after the actor timeout) and, given the call's ``actor``, about
        a second after its worker is lost."""
        timeout = self.timeout if deadline is None else max(deadline - time.time(), 0.1)
        try:
            if isinstance(future, Exception):
                raise future
            if actor is not None:
                return True, actor_result(actor, future, timeout)
            return True, future.result(timeout=timeout)
        except Exception as e:  # noqa: BLE001
            if errors is not None:
                errors.append(f"{what}: {e!r}")
            logger.warning("%s failed: %r", what, e)
            return False, None
