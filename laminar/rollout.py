"""A rollout replica: a generation engine, its weight version and its local batch.

The generation loop runs in its own thread, so the actor's control methods (stats, stop)
answer while it decodes. One iteration of the loop is one *local batch*:

1. at the batch boundary, pull the newest complete version from the local relay (never
   mid-trajectory; see :mod:`laminar.relay`);
2. take ``rollout.groups_per_batch`` prompt groups from the pool (back-pressure may give
   fewer, or none: then wait a little);
3. decode until the batch drains; every finished trajectory is rewarded by a Dask task and
   enters the experience buffer on its own, while the rest of the batch decodes on.

How many groups a rollout asks for, and when it loads weights, follow the run's schedule
(:class:`~laminar.schedule.ScheduleSpec`): under ``refill`` (partial rollout) it takes new
groups whenever its engine has room instead of draining local batches, and under
``interrupt`` every publication pauses it (:meth:`RolloutReplica.pause`): its unfinished
requests wait while it loads the new version, then resume with their KV recomputed, the
new tokens sampled by the new weights. Paced with ``rollout.pacing.pull_s``, a pull at a
batch boundary lasts the modelled host-to-device copy.

Repack (:mod:`laminar.repack`, driven by :class:`laminar.manager.RolloutManager`) moves a
draining batch between rollouts of the same version. The generation thread alone touches
the engine: the manager's requests (export everything, import these states) wait in a
mailbox that the thread serves between decode steps. An exporting rollout is *held* at
its batch boundary until the manager releases it, so a failed import can always be
undone by importing the states back; once released, the freed rollout pulls the newest
weights and takes new prompts.

The data module (prompt pool, buffer, partial-response pool) may be lost with its
worker and rebuilt within the run (docs/faults.md, "Data-module loss"). A rollout that
finds it gone decodes its batch on, keeps every finished trajectory, and waits at the
batch boundary until :meth:`RolloutReplica.attach_data` hands it the new one. It keeps
each trajectory it sent to the buffer until the buffer says its store has it, and sends
those again to the new buffer (which drops what it has).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback

import numpy as np
import torch

from laminar.cluster import actor_result, is_lost, start_thread
from laminar.config import RunConfig
from laminar.contract import PromptGroup, Trajectory
from laminar.engine import FinishedOutput, GenerationRequest, RequestState, make_engine

logger = logging.getLogger(__name__)

PARITY_SAMPLE = 8  # responses per parity check
# An idle rollout waits this long in one call (a long poll of the prompt pool or its
# relay) before it looks again: waiting costs no calls, and it wakes as soon as groups
# or a version come.
IDLE_WAIT_S = 2.0
# A rollout waiting for a version it was told of polls its relay this long at a time (it
# wakes the moment the version completes), serving the manager's commands between polls.
VERSION_POLL_S = 0.5
# While the data module looks lost, a rollout asks the old buffer this often whether it
# answers after all (a slow call, not a loss) ...
PROBE_S = 3.0
# A source held by a move for this many actor timeouts without being released takes its
# requests back: the manager that held it was lost or gave up (a copy it had imported
# elsewhere then decodes twice, and the buffer keeps the first to arrive; losing them would
# leave their groups incomplete).
HOLD_LIMIT_TIMEOUTS = 5
RESEND_CHUNK = 64  # ... and sends its kept trajectories to a new one this many at a time
_RESEND = object()  # the reward collector's cue to send the kept trajectories again


def _finished(
    state: RequestState, reason: str, t_finish: float, version: int | None = None
) -> FinishedOutput:
    """A recovered request as ended with ``reason``. One with no token logged yet is
    given the version that sampled its batch (``version``, else the recovery's
    ``behavior_version``)."""
    if version is None and not state.tokens:
        version = state.request.meta["behavior_version"]
    return FinishedOutput.from_state(state, reason, t_finish, version)


class RolloutReplica:
    """Dask actor: one replica of the rollout tier (placed on a ``rollout`` worker)."""

    def __init__(
        self,
        rollout_id: str,
        cfg: RunConfig,
        policy_dir: str,
        pool,
        buffer,
        relay,
        partial=None,
        checkpoints_dir: str | None = None,
        spec=None,
    ) -> None:
        """``partial``: the :class:`~laminar.partial.PartialResponsePool` to log unfinished
        trajectories to (none: no log); ``checkpoints_dir``: where old versions are found
        when the relay no longer keeps them (recovery); ``spec``: the run's
        :class:`~laminar.schedule.ScheduleSpec` (default: Laminar's)."""
        from laminar.model import load_tokenizer
        from laminar.relay_client import Puller
        from laminar.schedule import LAMINAR

        torch.set_num_threads(cfg.cluster.torch_threads)
        self.rollout_id = rollout_id
        self.spec = spec or LAMINAR
        # interrupt: (the version to wait for, the requests held meanwhile)
        self._paused: tuple[int, list[RequestState]] | None = None
        self._t_refill = 0.0  # refill: when the pool was last asked during a batch
        self.cfg = cfg
        self.pool, self.buffer, self.partial = pool, buffer, partial
        self.checkpoints_dir = checkpoints_dir
        self._logged: dict[str, int] = {}  # request id -> tokens in the partial log
        # Finished, not yet logged as finished: request id -> (tokens logged, output).
        self._ended: dict[str, tuple[int, FinishedOutput]] = {}
        self._t_logged = time.time()
        # The data module: which one (rebuilt ones count up), and since when it is lost.
        self._data_epoch = 0
        self._data_lost: float | None = None
        # Trajectories sent (or to be sent) to the buffer that its store has not committed
        # yet: uid -> [trajectory, the data epoch it was sent in (None: not yet)].
        self._unstored: dict[str, list] = {}
        self._unstored_lock = threading.Lock()
        self._adopted: queue.Queue = queue.Queue()  # (version, states) from recovery
        self._rescore: queue.Queue = queue.Queue()  # finished states from recovery
        self.puller = Puller(relay, cfg.relay.timeout_s)
        self._beat = time.time()  # the generation loop's last sign of progress
        self.puller.on_progress = self._tick  # a long pull, or a wait on a relay
        self.fingerprints: dict[int, int] = {}  # version loaded -> xxh3-64 (audit_weights)
        self._synced = False  # the relay has shown us a version
        self._inbox: queue.Queue = queue.Queue()  # manager commands for the generation thread
        self._claim = threading.Lock()  # a command runs, or is withdrawn, never both
        self._in_batch = False  # decoding a batch: moves may take from or add to it
        self._batch_seq = 0  # batches decoded so far, this one included
        self._topping_up = False  # rollout.top_up: this batch still takes new groups
        self._held = False  # exported for a move: wait at the boundary until released
        self._held_since = 0.0
        # ... and what it exported, (version, states), until the manager commits the move
        # (release) or aborts it (abort_export): they are still this rollout's
        self._exported: tuple[int, list[RequestState]] | None = None
        self._hold_lock = threading.Lock()
        self._reprefill = False  # the next step re-prefills imported requests
        self._recompute = False  # ... or requests resumed after an interrupt
        # The request ids of the latest imports (holds: an import went through)
        self._imported: collections.deque[frozenset[str]] = collections.deque(maxlen=64)
        self._load: dict = {}  # published by the generation thread after every step
        self.tok = load_tokenizer(policy_dir)
        self.engine = make_engine(
            cfg.rollout,
            policy_dir,
            seed=cfg.seed * 1000 + int(rollout_id.lstrip("r") or 0),
            version=0,
        )
        # A paced engine waits out each step's modelled time: serve commands meanwhile.
        self.engine.wait_hook = self._serve_for
        self._params = cfg.rollout.sampling_params()
        # Behavior/trainer parity: the trainer's forward (laminar.update) on this
        # replica's own finished responses, with the same weights, every few batches.
        self._reference = None
        if cfg.rollout.parity_every:
            from laminar.model import load_policy

            self._reference, _ = load_policy(policy_dir)
            self._reference.eval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (trajectories, reward future), oldest first, for the reward collector's thread.
        self._to_score: queue.Queue = queue.Queue()
        self._abandon = threading.Event()  # stop waiting for rewards (stopped, not drained)
        self.error: str | None = None
        self.last_reward_error: str | None = None
        self.counts = {
            "batches": 0,
            "trajectories": 0,
            "inserted": 0,
            "reward_errors": 0,
            "rewards_scored": 0,  # responses the reward function scored (not truncated ones)
            "response_tokens": 0,
            "decode_steps": 0,
            "weight_loads": 0,
            "weight_bytes": 0,
            "parity_checks": 0,
            "parity_moved_responses": 0,  # moved by repack, then checked
            "parity_max_abs": float("nan"),  # latest check
            "parity_mean_abs": float("nan"),
            "parity_worst_abs": 0.0,  # over the run
            "idle_s": 0.0,
            "weight_wait_s": 0.0,
            "pulls_unreachable": 0,  # batch boundaries whose relay could not be reached
            "pulls_failed": 0,  # ... whose pull failed otherwise (a chunk's checksum)
            "decode_s": 0.0,
            "moves_out": 0,
            "moves_in": 0,  # sources whose requests this rollout took
            "moves_taken_back": 0,  # exports undone: the move did not happen
            "holds_timed_out": 0,  # ... of them, after a hold no manager ended
            "requests_out": 0,
            "requests_in": 0,
            "reprefill_tokens": 0,
            "reprefill_s": 0.0,
            "partial_flushes": 0,
            "partial_tokens": 0,
            "adopted_batches": 0,
            "adopted_requests": 0,
            # recovered unfinished, but no copy of their version was left: sent to the
            # buffer unscored as errors, which discards their groups whole
            "dropped_requests": 0,
            "dropped_groups": 0,
            "rescored_requests": 0,  # recovered finished, reward was in flight: scored here
            "interrupts": 0,  # interrupt: publications that paused this rollout
            "interrupted_requests": 0,  # ... the unfinished requests they held (0: idle)
            "sync_wait_s": 0.0,  # ... and the time it waited for their weights
            "recomputed_tokens": 0,  # ... and the KV it recomputed after them
            "recompute_s": 0.0,  # ... and the time of the steps that recomputed it
            "data_rebuilds": 0,  # data modules that replaced a lost one
            "data_wait_s": 0.0,  # ... and the time it waited at a boundary for them
            "resent": 0,  # trajectories sent again to a rebuilt buffer
            "topped_up_groups": 0,  # rollout.top_up: groups taken into a draining batch
            "top_up_asks": 0,  # ... the pool calls that asked for them
            "top_up_s": 0.0,  # ... and the wall time between decode steps they took
        }

    # -- control methods (run on the actor thread while the loop decodes) ---------------
    def start(self) -> None:
        self._thread = start_thread(self._run, f"gen-{self.rollout_id}")
        start_thread(self._collect_loop, f"rewards-{self.rollout_id}")

    def stop(self, timeout: float | None = None) -> dict:
        """Stop after the current decode step; finished trajectories still reach the buffer.
        Waits up to ``timeout`` (default: the step, and the rewards still out, which the
        generation thread waits ``cluster.actor_timeout_s`` for, with 30 s to spare)."""
        self._stop.set()
        if timeout is None:
            timeout = self.cfg.cluster.actor_timeout_s + 30.0
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def stats(self) -> dict:
        kv = self.engine.kv_stats()
        return {
            # (the wall time its counters were read: a driver's poll of many rollouts
            # reads them seconds apart on a loaded host, and rates need their own clock)
            "read_at": time.time(),
            **self.counts,
            **{f"engine_{k}": v for k, v in self.engine.stats().items()},
            "rollout_id": self.rollout_id,
            "version": self.engine.version,
            "kv_used": kv.used_tokens,
            "kv_capacity": kv.capacity_tokens,
            "running": kv.running,
            "waiting": kv.waiting,
            "pending_rewards": self._to_score.unfinished_tasks,
            "unstored": len(self._unstored),
            "data_lost": self._data_lost is not None,
            "relay_switches": self.puller.switches,
            "alive": self._thread is not None and self._thread.is_alive(),
            "error": self.error,
            "last_reward_error": self.last_reward_error,
        }

    # -- the generation loop ----------------------------------------------------------
    def _tick(self) -> None:
        self._beat = time.time()

    def heartbeat(self) -> float | None:
        """Seconds since the generation loop last advanced (a step, a served command, a
        chunk pulled, an idle poll, a poll while waiting on its relay); ``None`` once it
        has ended (failed or stopped: not hung). The manager declares a rollout hung when
        this grows past ``faults.heartbeat_timeout_s``, or when this call goes unanswered
        that long."""
        if self._thread is None or not self._thread.is_alive():
            return None
        return time.time() - self._beat

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._tick()
                self._wait_while_held()
                if self._paused is not None:  # a global weight update interrupted us
                    self._resume_paused()
                    continue
                if not self.engine.has_work() and not self._adopted.empty():
                    self._topping_up = False
                    self._take_adopted()  # a lost rollout's batch, at its own version
                elif not self.engine.has_work():  # a batch boundary
                    self._maybe_load_weights()
                    t = time.time()
                    groups, published = self._take(self._ask(), IDLE_WAIT_S)
                    if not groups:
                        if published > self.engine.version:  # it is on its way to our relay
                            self._wait_for_version(published, IDLE_WAIT_S)
                        self._collect_rewards(block=False)
                        # A move planned while our batch drained arrives now: refused (no
                        # batch to import into), so its source takes its states back
                        # instead of waiting out the manager's timeout.
                        self._serve()
                        self.counts["idle_s"] += time.time() - t
                        continue
                    self.counts["idle_s"] += time.time() - t  # (the long poll's wait)
                    self._add(groups)
                    self._topping_up = self.cfg.rollout.top_up and published <= self.engine.version
                self._decode()
            self._collect_rewards(block=True)
        except Exception:
            self.error = self.error or traceback.format_exc()
            logger.error("rollout %s failed:\n%s", self.rollout_id, self.error)
        finally:
            self._fail_commands()
            self._to_score.put(None)  # the collector ends after what is queued

    def _call(self, actor_future, actor=None):
        """Every actor-to-actor call has a timeout: a call to a lost actor never returns.
        With its ``actor``, one whose worker is lost fails within a second."""
        if actor is not None:
            return actor_result(actor, actor_future, self.cfg.cluster.actor_timeout_s)
        return actor_future.result(timeout=self.cfg.cluster.actor_timeout_s)

    def _ask(self) -> int:
        """Groups to ask the pool for at a batch boundary: a local batch (Laminar), the
        whole global batch (the sync family: the pool gives this rollout its share), or
        what fills the engine (refill)."""
        r = self.cfg.rollout
        if self.spec.dispatch == "batches":
            return self.cfg.trainer.groups_per_step
        if self.spec.refill:
            return max(1, r.max_batch // r.group_size)
        return r.groups_per_batch

    def _acquire(self, n: int) -> list[PromptGroup]:
        ok, groups = self._data_call(
            self.pool, lambda: self.pool.acquire(n, self.rollout_id, self.engine.version)
        )
        return groups if ok else []

    def _take(self, n: int, wait_s: float) -> tuple[list[PromptGroup], int]:
        """Ask the pool for ``n`` groups, waiting up to ``wait_s`` for them in the pool
        (a long poll); returns the groups and the trainer's newest published version.

        The generation thread blocks meanwhile, and little waits on it: an idle rollout
        holds no batch to move, the manager's other calls and stats are not served by it,
        a publication (which a partial rollout's pause follows) wakes the poll at once,
        and a move's import, planned while the last batch drained, is refused after the
        poll (``_run``)."""
        self._tick()
        epoch = self._data_epoch
        if self._data_lost is None:
            try:
                future = self.pool.take(n, self.rollout_id, self.engine.version, wait_s)
                return actor_result(self.pool, future, wait_s + self.cfg.cluster.actor_timeout_s)
            except Exception as e:
                self._lose_data(e)
        self._await_data(epoch, serve=True)
        return [], self.engine.version

    # -- the data module's loss -----------------------------------------------------------
    def _data_call(self, actor, call) -> tuple[bool, object]:
        """``(True, result)`` of ``call()`` on the data module's ``actor``; ``(False,
        None)`` while the data module is lost (this call may find it so)."""
        if self._data_lost is not None:
            return False, None
        try:
            return True, self._call(call(), actor)
        except Exception as e:
            self._lose_data(e)
            return False, None

    def _lose_data(self, error: Exception) -> None:
        """A call to the data module failed: lost (its worker gone, or not answering),
        or an error of its own, which fails this rollout as before."""
        if not is_lost(error):
            raise error
        if self._data_lost is None:
            self._data_lost = time.time()
            logger.warning(
                "rollout %s: the data module does not answer (%s: %s); generating on, "
                "keeping what finishes, until it is back or rebuilt",
                self.rollout_id,
                type(error).__name__,
                error,
            )

    def _await_data(self, epoch: int, serve: bool) -> None:
        """Wait until a data module newer than ``epoch`` is attached, or the old one
        answers after all; ``serve``: the generation thread, serving commands meanwhile.
        Fails after ``faults.data_restart_timeout_s``."""
        t0 = time.time()
        timeout = self.cfg.faults.data_restart_timeout_s
        next_probe = t0 + PROBE_S
        while self._data_epoch == epoch and self._data_lost is not None:
            if self._stop.is_set():
                return
            if time.time() - self._data_lost > timeout:
                raise RuntimeError(
                    f"rollout {self.rollout_id}: the data module was lost and not rebuilt "
                    f"within faults.data_restart_timeout_s={timeout:g} s"
                )
            if time.time() > next_probe:
                next_probe = time.time() + PROBE_S
                try:
                    actor_result(self.buffer, self.buffer.stats(), 2.0)
                except Exception:  # noqa: BLE001 — still gone
                    pass
                else:
                    if self._data_epoch == epoch:
                        self._data_lost = None  # it was slow, not lost
                        logger.warning("rollout %s: the data module answers again", self.rollout_id)
            if serve:
                self._serve(0.05)
            else:
                time.sleep(0.05)
        if serve:
            self.counts["data_wait_s"] += time.time() - t0

    def data_holdings(self) -> list[str]:
        """The prompt groups this rollout holds trajectories of: decoding, handed to it
        by a recovery, waiting for a reward, or sent and not yet stored. (Served by the
        generation thread: what it holds does not change meanwhile.)"""
        return self._command(self._holdings)

    def _holdings(self) -> list[str]:
        groups = {st.request.meta["group"].prompt_uid for st in self.engine.in_flight()}
        for _, states in list(self._adopted.queue) + self._exported_batches():
            groups |= {st.request.meta["group"].prompt_uid for st in states}
        for states in list(self._rescore.queue):
            groups |= {st.request.meta["group"].prompt_uid for st in states}
        groups |= {st.request.meta["group"].prompt_uid for st in self._paused_states()}
        with self._unstored_lock:
            groups |= {t.prompt_uid for t, _ in self._unstored.values()}
        return sorted(groups)

    def attach_data(self, pool, buffer, partial) -> int:
        """The data module rebuilt in place of a lost one: use it from now on. Every
        unfinished trajectory is registered with the new partial-response pool, with the
        tokens it has, and every kept one is sent again to the new buffer. Returns how
        many were registered."""
        return self._command(lambda: self._attach(pool, buffer, partial))

    def _attach(self, pool, buffer, partial) -> int:
        from dataclasses import replace

        self.pool, self.buffer, self.partial = pool, buffer, partial
        self._data_epoch += 1
        self._data_lost = None
        registered = 0
        if partial is not None:
            # (Paused requests are this batch's too: they wait outside the engine for a
            # version, sampled so far by the one it holds.)
            unfinished = self.engine.in_flight() + self._paused_states()
            batches = [(self.engine.version, unfinished)]
            batches += list(self._adopted.queue) + self._exported_batches()
            for version, states in batches:
                copies = [
                    replace(
                        st,
                        tokens=list(st.tokens),
                        logprobs=list(st.logprobs),
                        token_versions=list(st.token_versions),
                    )
                    for st in states
                ]
                if copies:
                    self._call(partial.register(self.rollout_id, version, copies), partial)
                    registered += len(copies)
            self._logged = {st.request_id: len(st.tokens) for st in unfinished}
            self._ended.clear()  # (kept as unstored: the new buffer gets them)
        self.counts["data_rebuilds"] += 1
        self._to_score.put(_RESEND)
        logger.warning(
            "rollout %s: a rebuilt data module; %d unfinished trajectories registered with "
            "it, %d kept trajectories to send again",
            self.rollout_id,
            registered,
            len(self._unstored),
        )
        return registered

    def _wait_for_version(self, version: int, wait_s: float) -> None:
        """Wait up to ``wait_s`` until the relay has ``version`` (or newer) and load it,
        in short long polls with the manager's commands served between them."""
        from laminar.relay_core import RelayError

        deadline = time.time() + wait_s
        while self.engine.version < version and time.time() < deadline:
            if self._stop.is_set() or self._paused is not None:
                return
            self._serve()
            try:
                update = self.puller.newest(
                    self.engine.version, wait_s=VERSION_POLL_S, wait_switch=False
                )
            except RelayError as e:  # lost, or a failed pull: the next poll tries again
                self._pull_failed(e)
                self._serve_for(min(VERSION_POLL_S, max(0.0, deadline - time.time())))
                continue
            if update is not None:
                self._load_version(*update)

    def _room(self) -> int:
        """Whole prompt groups the engine has room for beside its unfinished requests."""
        r = self.cfg.rollout
        return (r.max_batch - len(self.engine.request_ids())) // r.group_size

    def _refill(self, finished: bool) -> None:
        """Refill: take new groups while the engine has room for a whole group (asked
        when requests finished, else at most every 0.1 s while the pool says no)."""
        room = self._room()
        if room < 1 or (not finished and time.time() - self._t_refill < 0.1):
            return
        self._t_refill = time.time()
        groups = self._acquire(room)
        if groups:
            self._add(groups)

    def _top_up(self) -> None:
        """``rollout.top_up``: take new groups into the draining batch while the engine
        has room for a whole group and this rollout's version is the newest published;
        after the first newer publication, drain (and pull it at the boundary)."""
        room = self._room()
        if room < 1:
            return
        version = self.engine.version
        t0 = time.perf_counter()
        ok, answer = self._data_call(
            self.pool, lambda: self.pool.top_up(room, self.rollout_id, version)
        )
        self.counts["top_up_asks"] += 1
        self.counts["top_up_s"] += time.perf_counter() - t0
        if not ok:
            self._topping_up = False
            return
        groups, published = answer
        if published > version:
            self._topping_up = False
        if groups:
            self._add(groups, batch=False)
            self.counts["topped_up_groups"] += len(groups)

    def pause(self, version: int) -> int:
        """Interrupt (partial rollout): hold every unfinished request until the relay has
        ``version``, load it, and resume them, recomputing their KV; served between two
        decode steps. Returns how many requests were held."""
        return self._command(lambda: self._pause(version))

    def _pause(self, version: int) -> int:
        if self.engine.version >= version:
            return 0
        if self._paused is not None:  # paused already (served while waiting): wait longer
            held, states = self._paused
            self._paused = (max(held, version), states)
            self.counts["interrupts"] += 1  # (its requests are counted held once)
            return 0
        states = self.engine.export(list(self.engine.request_ids()), moved=False)
        self._paused = (version, states)
        self.counts["interrupts"] += 1
        self.counts["interrupted_requests"] += len(states)
        return len(states)

    def _resume_paused(self) -> None:
        from laminar.relay_core import RelayError

        t = time.time()
        # (The target is read again each round: a pause served meanwhile may raise it.)
        while self.engine.version < self._paused[0] and not self._stop.is_set():
            self._tick()
            self._serve()
            try:
                update = self.puller.newest(self.engine.version, wait_s=VERSION_POLL_S)
            except RelayError as e:
                # Lost (none switched in within relay.timeout_s: the master, while the
                # trainer restarts), or a failed pull (a chunk's checksum): the paused
                # requests need this version, so the next poll tries again.
                self._pull_failed(e, f"paused for version {self._paused[0]}: trying again")
                self._serve_for(VERSION_POLL_S)
                continue
            if update is not None:
                self._load_version(*update)
        self.counts["sync_wait_s"] += time.time() - t
        version, states = self._paused
        self._paused = None
        if self._stop.is_set() and self.engine.version < version:
            # Stopped before the version came: the requests stay unfinished (the store
            # keeps nothing of them, as of any request still generating at a stop).
            return
        self.engine.import_(states, allow_version_change=True)
        self._recompute = True
        self.counts["recomputed_tokens"] += sum(st.context_len for st in states)

    def _pull_failed(self, error: Exception, then: str = "", always: bool = False) -> None:
        """Count a pull that failed: its relay lost (``pulls_unreachable``) or the pull
        itself (``pulls_failed``: a chunk's checksum, a version evicted while read). With
        ``then``, say so and what happens next: once per kind, or ``always``."""
        from laminar.relay_client import RelayUnreachable

        key = "pulls_unreachable" if isinstance(error, RelayUnreachable) else "pulls_failed"
        if then and (always or not self.counts[key]):
            what = key.replace("_", " ")
            logger.warning("rollout %s: %s (%s); %s", self.rollout_id, what, error, then)
        self.counts[key] += 1

    def _maybe_load_weights(self) -> None:
        """The rollout wait: ask the local relay for a newer complete version, load it.

        Before its first batch a rollout waits until the relay holds the trainer's
        starting version: a resumed trainer starts at its checkpoint's version, not at
        the base policy the engine was built from."""
        from laminar.relay_client import RelayUnreachable
        from laminar.relay_core import RelayError

        t = time.time()
        while not self._synced and not self._stop.is_set():
            self._tick()
            try:
                self._synced = bool(self.puller.versions())
            except RelayUnreachable:  # (none switched in within relay.timeout_s: again)
                self.counts["pulls_unreachable"] += 1
            if not self._synced:
                # The manager's commands are served meanwhile: a data-module rebuild
                # asks this rollout too (a replacement may wait here a while).
                self._serve(0.02)

        t_pull = time.time()
        try:
            # A lost relay is not waited on here: this batch goes on with the weights
            # held, and the next boundary pulls again (from the relay the manager
            # switched us to by then: within a detection round for a downstream relay,
            # once the trainer has restarted for the master).
            update = self.puller.newest(self.engine.version, wait_switch=False)
        except RelayError as e:  # lost, or a failed pull (a chunk that failed its
            # checksum, a version evicted past relay.timeout_s): the engine keeps the
            # whole version it holds (it owns its weights)
            self._pull_failed(e, f"generating on at version {self.engine.version}")
            update = None
        if update is not None:
            self._load_version(*update)
            pacing = self.cfg.rollout.pacing
            if self.spec.weights == "relay" and pacing is not None and pacing.pull_s:
                from laminar.pacing import scale_of

                # The modelled host-to-device copy, of which the real pull was part.
                left = scale_of(pacing).wall(pacing.pull_s) - (time.time() - t_pull)
                self._serve_for(max(0.0, left))
        self.counts["weight_wait_s"] += time.time() - t

    def _load_version(self, version: int, state: dict) -> None:
        """Load ``version`` into the engine (and the parity reference)."""
        self.engine.load_weights(state, version)
        if self._reference is not None:
            self._reference.load_state_dict(state)
        if self.cfg.relay.audit_weights:
            from laminar.relay_core import state_fingerprint

            self.fingerprints[version] = state_fingerprint(state)
        self.counts["weight_loads"] += 1
        self.counts["weight_bytes"] = self.puller.bytes

    def set_relay(self, relay) -> None:
        """Pull from ``relay`` from now on: the manager's answer to the loss of ours
        (docs/faults.md). A pull waiting on the lost relay starts again on this one.
        ``None``: ours is lost and none replaces it yet (the master, while the trainer
        restarts): batches go on with the weights held."""
        self.puller.switch(relay)

    def get_fingerprints(self) -> dict[int, int]:
        return dict(self.fingerprints)

    def _add(self, groups: list[PromptGroup], batch: bool = True) -> None:
        now = time.time()
        new = []
        for g in groups:
            for i in g.sample_indices:
                req = GenerationRequest(
                    request_id=f"{g.prompt_uid}-{i:03d}",
                    prompt_tokens=g.prompt_tokens,
                    params=self._params,
                    meta={"group": g, "sample_idx": i, "t_submit": now},
                )
                self.engine.add_request(req)
                new.append(req.request_id)
        if self.partial is not None:
            added = set(new)
            states = [
                RequestState(st.request, seed=st.seed, t_start=st.t_start)
                for st in self.engine.in_flight()
                if st.request_id in added
            ]
            ok, _ = self._data_call(
                self.partial,
                lambda: self.partial.register(self.rollout_id, self.engine.version, states),
            )
            if ok:  # (lost: a rebuilt pool has them registered in full)
                self._logged.update(dict.fromkeys(new, 0))
        self.counts["batches"] += batch

    # -- the partial-response log (laminar.partial) --------------------------------------
    def _log_partial(self, finished=(), force: bool = False) -> None:
        """Send the unfinished requests' new tokens to the partial-response pool when one
        has ``faults.flush_tokens`` unlogged or ``faults.flush_s`` have passed (a loss
        then regenerates at most that much). Waits for the pool: one log in flight.

        Requests that finished go with the next send, marked finished (their version no
        longer needs keeping); the end of a batch always sends them (:meth:`_decode`)."""
        if self.partial is None or self._data_lost is not None:
            return  # (lost: a rebuilt pool has every unfinished one registered in full)
        for out in finished:
            rid = out.request.request_id
            if rid in self._logged:
                self._ended[rid] = (self._logged.pop(rid), out)
        f = self.cfg.faults
        states = self.engine.in_flight()
        due = force or time.time() - self._t_logged >= f.flush_s
        if not due:
            due = any(
                len(st.tokens) - self._logged.get(st.request_id, 0) >= f.flush_tokens
                for st in states
            )
        if not due:
            return
        tokens = {}
        for st in states:
            n = self._logged.get(st.request_id, 0)
            if len(st.tokens) > n:
                tokens[st.request_id] = (
                    n,
                    st.tokens[n:],
                    st.logprobs[n:],
                    st.token_versions[n:],
                )
        ended = {}
        for rid, (n, out) in self._ended.items():
            tokens[rid] = (
                n,
                out.response_tokens[n:].tolist(),
                out.logprobs[n:].tolist(),
                out.token_versions[n:].tolist(),
            )
            ended[rid] = (out.finish_reason, out.t_finish)
        if tokens:
            ok, _ = self._data_call(
                self.partial, lambda: self.partial.flush(self.rollout_id, tokens, ended)
            )
            if not ok:
                return
            self._ended.clear()
            for rid, (n, toks, _, _) in tokens.items():
                if rid not in ended:
                    self._logged[rid] = n + len(toks)
            self.counts["partial_flushes"] += 1
            self.counts["partial_tokens"] += sum(len(t[1]) for t in tokens.values())
        self._t_logged = time.time()

    def rescore(self, states: list) -> None:
        """Take a lost rollout's *finished* trajectories (their rewards were in flight):
        score them and insert them into the buffer; nothing is decoded."""
        self._rescore.put(states)

    def adopt(self, version: int, states: list) -> None:
        """Take a lost rollout's unfinished requests (their newest tokens sampled by
        ``version``) as a batch of their own at the next batch boundary, loading that
        version for them. Under an interrupting schedule (partial rollout) they go on at
        this rollout's version instead, if newer, their KV recomputed: as after an
        interrupt, a response continues with the newest weights."""
        self._adopted.put((version, states))

    def _fetch_version(self, version: int) -> dict:
        """An old ``version``'s weights: its relay's kept copy, else its checkpoint
        (:class:`~laminar.relay_core.VersionUnavailable` if neither has it)."""
        from laminar.relay_client import fetch_version
        from laminar.relay_core import RelayError, VersionUnavailable

        try:
            return fetch_version(version, self.puller, self.checkpoints_dir)
        except VersionUnavailable:
            raise
        except RelayError as e:  # lost, or a failed pull: the checkpoint may have it
            self._pull_failed(e, f"version {version}: looking for its checkpoint", always=True)
            return fetch_version(version, None, self.checkpoints_dir)

    def _take_adopted(self) -> None:
        from laminar.relay_core import VersionUnavailable

        version, states = self._adopted.get_nowait()
        # (partial rollout: every rollout holds the newest version; loading an older
        # one for these would sample the rest of them by weights the run has left)
        newer_here = self.spec.interrupt and self.engine.version > version
        if self.engine.version != version and not newer_here:
            try:
                weights = self._fetch_version(version)
            except VersionUnavailable as e:
                self._drop_adopted(version, states, e)
                return
            self._load_version(version, weights)
        self.engine.import_(states, allow_version_change=self.spec.interrupt)
        self._logged.update({st.request_id: len(st.tokens) for st in states})
        self._reprefill = True
        self.counts["adopted_batches"] += 1
        self.counts["adopted_requests"] += len(states)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in states)

    def _adopt_now(self) -> None:
        """Under an interrupting schedule, a lost rollout's requests of this version or
        older join the running engine at once (as after an interrupt), rather than at a
        batch boundary that refilling may put off for a whole update."""
        while (
            self.spec.interrupt
            and not self._adopted.empty()
            and self._adopted.queue[0][0] <= self.engine.version
        ):
            self._take_adopted()

    def _drop_adopted(self, version: int, states: list[RequestState], why: Exception) -> None:
        """No copy of ``version`` is left for a lost rollout's unfinished ``states``:
        their groups are dropped, not finished at another version.

        Their siblings that finished before the loss were sampled by ``version`` (in the
        buffer, or being scored): restarted at this rollout's version, these would give
        one group two behavior policies, and GRPO's advantages compare a group's samples
        as draws of one. Nothing of the group has been trained on (the buffer releases
        whole groups only), so each of these goes to the buffer as it is, marked
        ``finish_reason="error"`` and not scored: the buffer discards its group whole
        once the group is in (``groups_discarded``), and the prompt pool makes the group
        up as it does for any group that left untrained. Logged as finished first, so a
        loss of this rollout before the buffer has them hands them on as such."""
        now = time.time()
        outputs = [_finished(st, "error", now, version) for st in states]
        if self.partial is not None:  # (the pool has every token: nothing new to log)
            for out in outputs:
                self._ended[out.request.request_id] = (len(out.response_tokens), out)
            self._log_partial(force=True)
        groups = {st.request.meta["group"].prompt_uid for st in states}
        self.counts["dropped_requests"] += len(states)
        self.counts["dropped_groups"] += len(groups)
        logger.warning(
            "rollout %s: %s; %d recovered trajectories of version %d cannot be finished by "
            "it: their %d groups are discarded (a group mixing two versions would break "
            "its GRPO advantages)",
            self.rollout_id,
            why,
            len(states),
            version,
            len(groups),
        )
        self._submit_rewards(outputs, score=False)

    def _decode(self) -> None:
        """Decode until the engine drains (or hands its requests away)."""
        every = self.cfg.rollout.parity_every
        check = every and (self.counts["batches"] - 1) % every == 0
        sample: list[FinishedOutput] = []
        moved: list[FinishedOutput] = []
        # decode_s grows step by step, not once per batch: a refilled batch (partial
        # rollout) can last a whole update, and a counter read mid-batch would lag it.
        t_mark = time.time()
        self._in_batch = True
        self._batch_seq += 1
        try:
            self._publish_load()
            while self.engine.has_work() and not self._stop.is_set():
                self._tick()
                # Requests imported before this step re-prefill in it. (A paced engine
                # serves commands while it waits out a step: what that step imports is
                # the next step's to re-prefill.)
                reprefill, self._reprefill = self._reprefill, False
                # (an interrupt's recomputation is the schedule's cost, not a move's: its
                # own counter, beside recomputed_tokens, as reprefill_s is reprefill_tokens')
                recompute, self._recompute = self._recompute, False
                t_step = time.perf_counter()
                finished = self.engine.step()
                if reprefill:
                    self.counts["reprefill_s"] += time.perf_counter() - t_step
                if recompute:
                    self.counts["recompute_s"] += time.perf_counter() - t_step
                self.counts["decode_steps"] += 1
                self._log_partial(finished)
                if finished:
                    self._submit_rewards(finished)
                    # Moved responses (re-prefilled here) are always checked when parity
                    # checks are on; others every `parity_every` batches. Only responses
                    # wholly of this version compare with this version's forward.
                    v = self.engine.version
                    same = [o for o in finished if (o.token_versions == v).all()]
                    if every:
                        got = [o for o in same if o.n_moves]
                        moved += got[: PARITY_SAMPLE - len(moved)]
                    if check:
                        got = [o for o in same if not o.n_moves]
                        sample += got[: PARITY_SAMPLE - len(sample)]
                self._collect_rewards(block=False)
                if self._held:  # exported (served in a paced step's wait): nothing new
                    pass
                elif self.spec.refill and self._paused is None:
                    self._adopt_now()
                    self._refill(bool(finished))
                elif self._topping_up and finished:
                    self._top_up()
                self._publish_load()
                self._serve()
                now = time.time()
                self.counts["decode_s"] += now - t_mark
                t_mark = now
            if self._ended:  # the batch is over: no finished request stays unlogged
                self._log_partial(force=True)
        finally:
            self._in_batch = False
            self._publish_load()
        self.counts["decode_s"] += time.time() - t_mark
        if sample or moved:
            self._check_parity(sample + moved)

    # -- repack: the manager's commands, served by the generation thread ----------------
    def load(self) -> dict:
        """This rollout's load for the repack planner (as of its latest decode step)."""
        return dict(self._load)

    def _publish_load(self) -> None:
        kv = self.engine.kv_stats()
        self._load = {
            "rollout_id": self.rollout_id,
            "version": self.engine.version,
            "kv_used": kv.used_tokens / max(kv.capacity_tokens, 1),
            "n_requests": kv.running + kv.waiting,
            "in_batch": self._in_batch,
            # which batch: KV "falls" only within one (a new batch after a long one
            # holds less KV, but nothing of it has finished)
            "batch": self._batch_seq,
            "held": self._held,
            "t": time.time(),
        }

    def export_for_move(
        self, batch: int | None = None, max_requests: int | None = None
    ) -> dict | None:
        """Hand every unfinished request to the manager and hold at the batch boundary
        until :meth:`release` (the move is done) or :meth:`abort_export` (it is not).
        ``None`` if there is no batch to take any more, or if it is not the one the
        manager planned with: another batch than ``batch`` (:meth:`load`'s; the planned
        one drained and a fresh one began), or more than ``max_requests`` requests (it
        took new groups since: the destination's limits were planned without them)."""
        return self._command(lambda: self._export_all(batch, max_requests))

    def import_for_move(
        self,
        version: int,
        states: list,
        batch: int | None = None,
        sources: int = 0,
        max_requests: int | None = None,
    ) -> bool:
        """Take over ``states`` (sampled by ``version``) into the running batch: a repack
        move's from ``sources`` rollouts (counted as ``moves_in``), or a lost rollout's
        (``sources=0``: a recovery, not a move). Refused (``False``) unless this rollout
        is decoding a batch of that same version — the batch the manager planned with
        (``batch``, :meth:`load`'s), not a fresh one begun since, which the planner did
        not count — and would then hold at most ``max_requests`` (the planner's
        ``max_batch``: a batch that took new groups since, ``rollout.top_up``, may have
        no room left for what was planned)."""
        return self._command(lambda: self._import(version, states, batch, sources, max_requests))

    def release(self) -> None:
        """Commit the move :meth:`export_for_move` began: the exported requests are the
        destination's now. The rollout pulls the newest weights and takes new prompts
        (or, after :meth:`abort_export`, decodes its batch on)."""
        with self._hold_lock:
            self._held, self._exported = False, None

    def abort_export(self) -> int:
        """Undo :meth:`export_for_move`: take the exported requests back and decode them
        on. For a move that did not happen (the destination refused, or the manager gave
        up waiting for the export, which may yet have run). Returns how many came back."""
        return self._command(self._take_back)

    def holds(self, request_ids: list[str]) -> bool:
        """Whether this rollout took every one of ``request_ids``: decodes them, or
        imported them and some finished since (the manager asks a destination whose
        import it got no answer to: asked after the import, served after it)."""
        return self._command(lambda: self._holds(request_ids))

    def _holds(self, request_ids: list[str]) -> bool:
        wanted = set(request_ids)
        if wanted <= set(self.engine.request_ids()):
            return True
        # (A move's tail is near its end: one may finish before the question comes.)
        return any(wanted <= ids for ids in self._imported)

    def _paused_states(self) -> list[RequestState]:
        paused = self._paused
        return list(paused[1]) if paused is not None else []

    def _exported_batches(self) -> list[tuple[int, list[RequestState]]]:
        exported = self._exported
        return [exported] if exported is not None else []

    def _export_all(self, batch: int | None = None, max_requests: int | None = None):
        if not self._in_batch or self._held or not self.engine.has_work():
            return None
        if batch is not None and batch != self._batch_seq:
            return None
        ids = list(self.engine.request_ids())
        if max_requests is not None and len(ids) > max_requests:
            return None
        t0 = time.perf_counter()
        self._log_partial(force=True)  # the log holds every exported token
        states = self.engine.export(ids)
        for st in states:
            self._logged.pop(st.request_id, None)
        for st in states:  # the rollouts a trajectory passed through, in order
            st.request.meta["rollout_path"] = [
                *st.request.meta.get("rollout_path", []),
                self.rollout_id,
            ]
        with self._hold_lock:
            self._held, self._exported = True, (self.engine.version, states)
        self._held_since = time.time()
        self.counts["moves_out"] += 1
        self.counts["requests_out"] += len(states)
        return {
            "version": self.engine.version,
            "states": states,
            "tokens": sum(len(st.tokens) for st in states),
            "context_tokens": sum(st.context_len for st in states),
            "export_s": time.perf_counter() - t0,
        }

    def _take_back(self) -> int:
        """The exported requests back into the engine, as they were before the export
        (not counted as moved, nor this rollout as on their path twice)."""
        from dataclasses import replace

        with self._hold_lock:
            if self._exported is None:  # nothing exported, or the move was committed
                return 0
            version, states = self._exported
            if self.engine.version != version:  # a held source loads no weights: a bug
                raise RuntimeError(
                    f"rollout {self.rollout_id} holds requests of version {version} but "
                    f"its engine is at {self.engine.version}"
                )
            self._held, self._exported = False, None
        back = []
        for st in states:
            st.request.meta["rollout_path"] = st.request.meta["rollout_path"][:-1]
            back.append(replace(st, n_moves=st.n_moves - 1))
        self.engine.import_(back)
        self._logged.update({st.request_id: len(st.tokens) for st in back})
        self._reprefill = True  # (its time in reprefill_s: its tokens beside it)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in back)
        self.counts["moves_out"] -= 1
        self.counts["requests_out"] -= len(back)
        self.counts["moves_taken_back"] += 1
        return len(back)

    def _import(
        self,
        version: int,
        states: list,
        batch: int | None,
        sources: int,
        max_requests: int | None = None,
    ) -> bool:
        # (Paused: the batch is on its way out to wait for a version; taken in, these
        # would decode on with the old weights past the interrupt.)
        if not self._in_batch or self._held or self._paused is not None or self._stop.is_set():
            return False
        if self.engine.version != version:
            return False
        if batch is not None and batch != self._batch_seq:
            return False
        held = len(self.engine.request_ids())
        if max_requests is not None and held + len(states) > max_requests:
            return False
        self.engine.import_(states)
        self._imported.append(frozenset(st.request_id for st in states))
        self._logged.update({st.request_id: len(st.tokens) for st in states})
        self._reprefill = True
        self.counts["moves_in"] += sources
        self.counts["requests_in"] += len(states)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in states)
        return True

    def _command(self, fn):
        """Run ``fn`` on the generation thread between two decode steps; wait for it.

        A command not started within the timeout is withdrawn, so it can never run
        later (a move the manager gave up on must not happen behind its back)."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"rollout {self.rollout_id} is not generating: {self.error}")
        done, box = threading.Event(), {"state": "pending"}
        self._inbox.put((fn, box, done))
        if not done.wait(self.cfg.cluster.actor_timeout_s):
            with self._claim:
                withdrawn = box["state"] == "pending"
                if withdrawn:
                    box["state"] = "withdrawn"
            if withdrawn or not done.wait(self.cfg.cluster.actor_timeout_s):
                raise TimeoutError(f"rollout {self.rollout_id} did not serve a repack command")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _serve(self, wait: float = 0.0) -> None:
        """Run the manager's pending commands (waiting up to ``wait`` s for one)."""
        self._tick()
        try:
            item = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, box, done = item
            with self._claim:
                run = box["state"] == "pending"
                box["state"] = "running" if run else box["state"]
            if run:
                try:
                    box["result"] = fn()
                except Exception as e:  # noqa: BLE001 — handed to the caller
                    box["error"] = e
                done.set()
                self._publish_load()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _serve_for(self, seconds: float) -> None:
        """Sleep ``seconds``, serving the manager's commands as they come."""
        deadline = time.perf_counter() + seconds
        while (left := deadline - time.perf_counter()) > 0:
            self._serve(left)

    def _wait_while_held(self) -> None:
        limit = HOLD_LIMIT_TIMEOUTS * self.cfg.cluster.actor_timeout_s
        while self._held and not self._stop.is_set():
            self._serve(0.02)
            if self._held and time.time() - self._held_since > limit:
                # (a release may come meanwhile: then nothing is taken back)
                if n := self._take_back():
                    logger.warning(
                        "rollout %s: held by a move for over %.0f s, neither released nor "
                        "aborted (the manager was lost?): took its %d requests back",
                        self.rollout_id,
                        limit,
                        n,
                    )
                    self.counts["holds_timed_out"] += 1

    def _fail_commands(self) -> None:
        while True:
            try:
                _, box, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            box["error"] = RuntimeError(f"rollout {self.rollout_id} stopped")
            done.set()

    def _check_parity(self, outputs: list[FinishedOutput]) -> None:
        """Max/mean |behavior logprob - trainer logprob| over these responses' tokens."""
        from laminar.update import trajectory_logprobs

        trainer_side = trajectory_logprobs(
            self._reference,
            [np.asarray(o.request.prompt_tokens) for o in outputs],
            [o.response_tokens for o in outputs],
            pad_token_id=self.tok.pad_token_id,
            temperature=self.cfg.rollout.temperature,
        )
        diff = np.abs(np.concatenate(trainer_side) - np.concatenate([o.logprobs for o in outputs]))
        c = self.counts
        c["parity_checks"] += 1
        c["parity_moved_responses"] += sum(o.n_moves > 0 for o in outputs)
        c["parity_max_abs"] = float(diff.max())
        c["parity_mean_abs"] = float(diff.mean())
        c["parity_worst_abs"] = max(c["parity_worst_abs"], c["parity_max_abs"])

    def _submit_rewards(self, outputs: list[FinishedOutput], score: bool = True) -> None:
        """Trajectories of ``outputs`` to the reward collector, which inserts them into the
        buffer once scored (``score=False``: as they are, their reward NaN)."""
        trajs, items = [], []
        for out in outputs:
            g: PromptGroup = out.request.meta["group"]
            resp = out.response_tokens
            items.append((out.text(self.tok), g.answer, out.ended))
            trajs.append(
                Trajectory(
                    uid=out.request.request_id,
                    prompt_uid=g.prompt_uid,
                    prompt_key=g.prompt_key,
                    sample_idx=out.request.meta["sample_idx"],
                    group_size=g.group_size,
                    prompt_tokens=np.asarray(g.prompt_tokens, dtype=np.int32),
                    response_tokens=resp,
                    behavior_logprobs=out.logprobs,
                    loss_mask=np.ones(len(resp), dtype=np.uint8),
                    # (a recovered response may have no token yet: its version's)
                    behavior_version=int(out.token_versions.min(initial=out.version)),
                    # Stored only when a response mixes versions (the schema's convention).
                    token_versions=out.token_versions
                    if len(resp) and out.token_versions.min() != out.token_versions.max()
                    else np.zeros(0, np.int32),
                    n_migrations=out.n_moves,
                    finish_reason=out.finish_reason,
                    rollout_ids=",".join(
                        [*out.request.meta.get("rollout_path", []), self.rollout_id]
                    ),
                    t_submit=out.request.meta["t_submit"],
                    t_start=out.t_start,
                    t_finish=out.t_finish,
                )
            )
            self.counts["response_tokens"] += len(resp)
        self.counts["trajectories"] += len(trajs)
        with self._unstored_lock:  # kept until the store has it
            self._unstored.update((t.uid, [t, None]) for t in trajs)
        self._to_score.put(
            (trajs, items, self._reward_task(items)) if score else (trajs, None, None)
        )

    def _collect_rewards(self, block: bool) -> None:
        """Submit the rewards of recovered finished trajectories; with ``block``, wait
        (up to ``cluster.actor_timeout_s``) until every reward has reached the buffer.
        Raises what failed the reward collector."""
        while not self._rescore.empty():
            states = self._rescore.get_nowait()
            outputs = [_finished(st, *st.request.meta["finished"]) for st in states]
            # (a dropped one, :meth:`_drop_adopted`, goes to the buffer unscored again)
            for score in (True, False):
                if same := [o for o in outputs if (o.finish_reason != "error") == score]:
                    self._submit_rewards(same, score=score)
            self.counts["rescored_requests"] += len(states)
        deadline = time.time() + self.cfg.cluster.actor_timeout_s
        while block and self._to_score.unfinished_tasks and self.error is None:
            if time.time() > deadline:
                self._abandon.set()
                logger.warning(
                    "rollout %s: stopped with %d reward batches still out after %.0f s",
                    self.rollout_id,
                    self._to_score.unfinished_tasks,
                    self.cfg.cluster.actor_timeout_s,
                )
                break
            time.sleep(0.02)
        if self.error is not None:
            raise RuntimeError(f"rollout {self.rollout_id}: the reward collector failed")

    def _scores(self, items: list, future=None, attempts: int = 3):
        """The scores of ``items`` once their reward task is done (``None``: abandoned).

        Waits on a done-callback rather than ``future.result(timeout=...)`` in a loop:
        distributed's ``sync`` can meet the task finishing as its own timeout fires and
        then fails with ``UnboundLocalError`` instead of a result (seen under load). A
        task the cluster cancelled (its worker lost) is submitted again."""
        future = future or self._reward_task(items)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(1.0):
            if self._abandon.is_set():
                return None
        if future.status == "cancelled" and attempts > 1:
            return self._scores(items, None, attempts - 1)
        return future.result()

    def _reward_task(self, items: list):
        from distributed import get_client

        from laminar.rewards import score_batch

        t = self.cfg.task
        return get_client().submit(
            score_batch, t.reward, items, t.truncated_reward, t.reward_timeout_s, pure=False
        )

    def _collect_loop(self) -> None:
        """Rewarded trajectories into the buffer, oldest first, on a thread of their own:
        a reward whose result sits on a hung worker holds up this thread (Dask computes
        it again once that worker is gone), never generation or the rollout's heartbeat."""
        while (item := self._to_score.get()) is not None:
            try:
                if item is _RESEND:
                    self._resend()
                else:
                    self._insert_scored(*item)
            except Exception:
                error = traceback.format_exc()
                self.error = self.error or error
                logger.error("rollout %s: reward collector failed:\n%s", self.rollout_id, error)
                self._abandon.set()
            finally:
                self._to_score.task_done()
        self._to_score.task_done()

    def _insert_scored(self, trajs: list[Trajectory], items: list | None, future) -> None:
        if items is None:  # sent unscored (:meth:`_drop_adopted`)
            self._send(trajs)
            self.counts["inserted"] += len(trajs)
            return
        scores = self._scores(items, future)
        if scores is None:
            return
        for t, s, (_, _, scored) in zip(trajs, scores, items, strict=True):
            t.reward = s.reward
            if s.error is None:
                self.counts["rewards_scored"] += scored
            else:
                t.finish_reason = "error"
                self.last_reward_error = s.error
                self.counts["reward_errors"] += 1
                n = self.counts["reward_errors"]
                if n == 1 or n % 1000 == 0:  # say it, without flooding the console
                    logger.warning(
                        "rollout %s: %d reward failures so far; latest (%s): %s; its "
                        "group is discarded",
                        self.rollout_id,
                        n,
                        t.uid,
                        s.error,
                    )
        self._send(trajs)
        self.counts["inserted"] += len(trajs)

    def _send(self, trajs: list[Trajectory]) -> None:
        """Insert into the buffer; forget what its store has committed. A lost buffer:
        wait for the rebuilt one, to which :meth:`_resend` sends them (or retry, if the
        old one answers after all)."""
        while True:
            epoch = self._data_epoch
            with self._unstored_lock:
                for t in trajs:
                    if t.uid in self._unstored:
                        self._unstored[t.uid][1] = epoch
            try:
                out = self._call(self.buffer.insert(trajs, self.rollout_id), self.buffer)
            except Exception as e:
                self._lose_data(e)
                self._await_data(epoch, serve=False)
                if self._data_epoch != epoch or self._stop.is_set():
                    return  # a new buffer: the resend has them
                continue  # the old buffer answers again: send them again
            with self._unstored_lock:
                for uid in out["stored"]:
                    self._unstored.pop(uid, None)
            return

    def _resend(self) -> None:
        """Send the kept trajectories that went to an earlier buffer to the current one."""
        epoch = self._data_epoch
        with self._unstored_lock:
            old = [t for t, sent in self._unstored.values() if sent is not None and sent < epoch]
        for i in range(0, len(old), RESEND_CHUNK):
            self._send(old[i : i + RESEND_CHUNK])
        self.counts["resent"] += len(old)
