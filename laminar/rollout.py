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

The class is built from one mixin per concern, each in a module of its own:
:mod:`laminar.rollout_data` (the data module's calls, loss and rebuild; the partial log),
:mod:`laminar.rollout_weights` (pulls, version waits, interrupts),
:mod:`laminar.rollout_recovery` (a lost rollout's work), :mod:`laminar.rollout_moves`
(repack moves) and :mod:`laminar.rollout_rewards` (parity, rewards, sending to the
buffer). This module holds the actor's state, its control methods, the generation loop
and the mailbox through which the generation thread serves the manager's commands.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
import traceback

import torch

from laminar.cluster import actor_threads, start_thread
from laminar.config import RunConfig
from laminar.contract import PromptGroup
from laminar.engine import FinishedOutput, GenerationRequest, RequestState, make_engine
from laminar.rollout_data import DataLinkMixin
from laminar.rollout_moves import HOLD_LIMIT_TIMEOUTS as HOLD_LIMIT_TIMEOUTS
from laminar.rollout_moves import MovesMixin
from laminar.rollout_recovery import RecoveryMixin
from laminar.rollout_recovery import _finished as _finished
from laminar.rollout_rewards import _RESEND as _RESEND
from laminar.rollout_rewards import RewardsMixin
from laminar.rollout_weights import WeightsMixin

# (HOLD_LIMIT_TIMEOUTS, _finished and _RESEND, imported as themselves above, are
# re-exported: tests import them from here.)

logger = logging.getLogger(__name__)

PARITY_SAMPLE = 8  # responses per parity check
# An idle rollout waits this long in one call (a long poll of the prompt pool or its
# relay) before it looks again: waiting costs no calls, and it wakes as soon as groups
# or a version come.
IDLE_WAIT_S = 2.0


def groups_with_room(max_batch: int, unfinished: int, group_size: int, request_scale: float) -> int:
    """Whole prompt groups a refilling or topping-up engine takes beside ``unfinished``
    requests, so that it decodes ``max_batch`` at once.

    A group goes in once the engine has room for a group *of the modelled workload*:
    ``group_size`` requests unscaled, but with each real request standing for
    ``request_scale`` modelled ones (``rollout.pacing.request_scale``, docs/pacing.md), a
    real group is ``request_scale`` modelled groups, and the modelled engine would have
    taken the first of them when ``group_size / request_scale`` real slots came free. The
    rest wait in the engine's queue and start as slots free, one real request at a time
    where the modelled engine would take a modelled group at a time: a little fuller than
    the engine it stands for (docs/pacing.md, "Scaled workloads"). Waiting for room for a
    whole real group instead leaves a scaled engine at 16 to 32 of its 32 requests, where
    the workload it stands for (256 requests in groups of 16) leaves at most 15 of 256
    empty.

    >>> groups_with_room(256, 241, 16, 1.0), groups_with_room(256, 240, 16, 1.0)
    (0, 1)
    >>> groups_with_room(32, 31, 16, 8.0), groups_with_room(32, 30, 16, 8.0)  # 2 real slots
    (0, 1)
    >>> groups_with_room(32, 14, 16, 8.0), groups_with_room(32, 0, 16, 8.0)
    (2, 2)
    """
    admit = max(1, min(group_size, math.ceil(group_size / request_scale)))
    free = max_batch - unfinished
    if free < admit:
        return 0
    return (free + group_size - admit) // group_size


class RolloutReplica(DataLinkMixin, WeightsMixin, RecoveryMixin, MovesMixin, RewardsMixin):
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

        torch.set_num_threads(actor_threads(cfg))
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
        # The id of its last ask of the prompt pool, and whether its answer is still owed
        # (the call failed: asked again with the same id, the pool answers as before).
        self._ask_id = 0
        self._ask_open = False
        # Trajectories sent (or to be sent) to the buffer that its store has not committed
        # yet: uid -> [trajectory, the data epoch it was sent in (None: not yet)].
        self._unstored: dict[str, list] = {}
        # request id -> the finished output of each trajectory kept unstored (finished here,
        # or handed here to score) while the recovery log is on, for a rebuilt
        # partial-response pool (rollout_data._keep_finished; under _unstored_lock)
        self._finished_outputs: dict = {}
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
        # ... and the move it was exported for (the manager's token): a release or abort
        # of another move (a call delivered late) leaves it alone
        self._export_move: str | None = None
        self._hold_lock = threading.Lock()
        self._reprefill = False  # the next step re-prefills imported requests
        self._recompute = False  # ... or requests resumed after an interrupt
        # The manager's tokens of the latest imports that went through (holds)
        self._imported: collections.deque[str] = collections.deque(maxlen=64)
        # How often a batch took in more after it began (a top-up, an import), over the
        # rollout's life: published with its load, an export checks none came since the plan
        self._taken_in = 0
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
            # responses whose behavior logprob on a trained token is not finite (an
            # engine's NaN): marked failed, their group discarded (rollout_rewards)
            "logprob_errors": 0,
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

    async def heartbeat(self) -> float | None:
        """Seconds since the generation loop last advanced (a step, a served command, a
        chunk pulled, an idle poll, a poll while waiting on its relay); ``None`` once it
        has ended (failed or stopped: not hung). The manager declares a rollout hung when
        this grows past ``faults.heartbeat_timeout_s``, or when this call goes unanswered
        that long.

        ``async`` so that it is answered on the worker's event loop: the actor's plain
        methods share one thread, where a command (a pause, a move) may wait up to
        ``cluster.actor_timeout_s`` for the generation thread; queued behind it, the
        heartbeat of a rollout that was making progress went unanswered that long."""
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

    def _room(self) -> int:
        """Whole prompt groups to take beside the engine's unfinished requests
        (:func:`groups_with_room`)."""
        r = self.cfg.rollout
        scale = r.pacing.request_scale if r.pacing is not None else 1.0
        return groups_with_room(r.max_batch, len(self.engine.request_ids()), r.group_size, scale)

    def _refill(self, finished: bool) -> None:
        """Refill: take new groups while the engine has room for a group
        (:func:`groups_with_room`; asked when requests finished, else at most every 0.1 s
        while the pool says no)."""
        room = self._room()
        if room < 1 or (not finished and time.time() - self._t_refill < 0.1):
            return
        self._t_refill = time.time()
        groups = self._acquire(room)
        if groups:
            self._add(groups)

    def _top_up(self) -> None:
        """``rollout.top_up``: take new groups into the draining batch while the engine
        has room for a group (:func:`groups_with_room`) and this rollout's version is the
        newest published; after the first newer publication, drain (and pull it at the
        boundary)."""
        room = self._room()
        if room < 1:
            return
        version = self.engine.version
        t0 = time.perf_counter()
        ask = self._next_ask()
        ok, answer = self._data_call(
            self.pool, lambda: self.pool.top_up(room, self.rollout_id, version, ask)
        )
        self._ask_open = not ok
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
            self._taken_in += 1

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
        # The engine steps continuously from here to the loop's end: a paced step's
        # deadline follows the previous one's, so the work between steps runs within it
        # (laminar.pacing.Pacer.pace); what came before (a pull, a wait for data) earns
        # the first step no credit.
        pacer = getattr(self.engine, "pacer", None)
        if pacer is not None:
            pacer.restart()
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

    # -- the manager's commands, served by the generation thread ---------------------------------
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

    def _fail_commands(self) -> None:
        while True:
            try:
                _, box, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            box["error"] = RuntimeError(f"rollout {self.rollout_id} stopped")
            done.set()
