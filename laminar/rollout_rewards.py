"""Finished trajectories: checked against the trainer, rewarded, sent to the buffer.

:class:`RewardsMixin`: each finished response becomes a
:class:`~laminar.contract.Trajectory`, scored by a Dask task on a rollout's worker
(:func:`~laminar.rewards.score_batch`) and inserted into the buffer, oldest first, by the
reward collector's own thread (a reward whose result sits on a hung worker holds up that
thread, never generation or the heartbeat). One with a behavior logprob that is not finite
on a token it trains on is marked ``finish_reason="error"`` as it is built, as a reward
failure marks one: the buffer discards its group whole. A trajectory is kept until the
buffer says its store has it, and sent again to a rebuilt buffer. Also here: the
behavior/trainer parity check on a sample of finished responses.

Apart from the generation loop (:mod:`laminar.rollout`), which hands a response over here
once it finishes: what follows runs mostly on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import numpy as np

from laminar.contract import PromptGroup, Trajectory
from laminar.engine import FinishedOutput
from laminar.rollout_recovery import _finished

# (the actor's logger: its records read as the rollout's, whichever module they come from)
logger = logging.getLogger("laminar.rollout")

# A rollout sends its kept trajectories to a rebuilt buffer this many at a time.
RESEND_CHUNK = 64
_RESEND = object()  # the reward collector's cue to send the kept trajectories again


class RewardsMixin:
    """Parity checks, rewards and sending to the buffer, for
    :class:`~laminar.rollout.RolloutReplica` (whose ``__init__`` sets up the state)."""

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
            self._check_logprobs(trajs[-1], out)
            self.counts["response_tokens"] += len(resp)
        self.counts["trajectories"] += len(trajs)
        with self._unstored_lock:  # kept until the store has it
            self._unstored.update((t.uid, [t, None]) for t in trajs)
        self._to_score.put(
            (trajs, items, self._reward_task(items)) if score else (trajs, None, None)
        )

    def _check_logprobs(self, t: Trajectory, out: FinishedOutput) -> None:
        """Mark ``t`` failed (``finish_reason="error"``) when a token it trains on has a
        behavior logprob that is not finite (an engine's NaN or -inf): its ratio would be
        NaN or e^20, and the update's loss NaN (its gradient 0 or NaN: the step applied
        with NaN metrics, or the whole batch skipped for one token). Its group is
        discarded whole by the buffer, as for a reward failure, and logged."""
        if t.finish_reason == "error":
            return
        bad = np.flatnonzero(~np.isfinite(t.behavior_logprobs) & (t.loss_mask > 0))
        if not len(bad):
            return
        i = int(bad[0])
        version = int(out.token_versions[i]) if len(out.token_versions) > i else out.version
        t.finish_reason = "error"
        self.counts["logprob_errors"] += 1
        n = self.counts["logprob_errors"]
        if n == 1 or n % 1000 == 0:  # say it, without flooding the console
            logger.warning(
                "rollout %s: %d trajectories so far with a behavior logprob that is not "
                "finite; latest: trajectory %s has behavior_logprobs[%d] = %s (%d such "
                "tokens), sampled at version %d; marked finish_reason='error': its group "
                "is discarded",
                self.rollout_id,
                n,
                t.uid,
                i,
                float(t.behavior_logprobs[i]),
                len(bad),
                version,
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
        # On a rollout's worker (any: Dask balances them), never on the trainer's and data
        # module's (data-trainer) or a relay's: a heavy reward competes with what runs
        # there. Its calls run in a child process (with a timeout), so the worker's event
        # loop and the actor on it go on whatever a call does.
        return get_client().submit(
            score_batch,
            t.reward,
            items,
            t.truncated_reward,
            t.reward_timeout_s,
            resources={"rollout": 1},
            pure=False,
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
            except Exception as e:
                error = traceback.format_exc()
                self.error = self.error or error
                if self._stop.is_set():  # (the cluster going away under a stopped rollout:
                    # its client closed, its tasks cancelled; the log keeps what it held)
                    logger.info(
                        "rollout %s: stopped; its reward collector gave up (%s: %s)",
                        self.rollout_id,
                        type(e).__name__,
                        e,
                    )
                else:
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
                self.last_reward_error = s.said
                self.counts["reward_errors"] += 1
                n = self.counts["reward_errors"]
                if n == 1 or n % 1000 == 0:  # say it, without flooding the console
                    logger.warning(
                        "rollout %s: %d reward failures so far; latest (%s): %s; its "
                        "group is discarded",
                        self.rollout_id,
                        n,
                        t.uid,
                        s.said,
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
