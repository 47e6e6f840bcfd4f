"""A rollout replica: a generation engine, its weight version and its local batch.

The generation loop runs in its own thread, so the actor's control methods (stats, stop)
answer while it decodes. One iteration of the loop is one *local batch*:

1. at the batch boundary, pull the newest complete version from the local relay (never
   mid-trajectory; see :mod:`laminar.relay`);
2. take ``rollout.groups_per_batch`` prompt groups from the pool (back-pressure may give
   fewer, or none: then wait a little);
3. decode until the batch drains; every finished trajectory is rewarded by a Dask task and
   enters the experience buffer on its own, while the rest of the batch decodes on.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque

import numpy as np
import torch

from laminar.cluster import start_thread
from laminar.config import RunConfig
from laminar.contract import PromptGroup, Trajectory
from laminar.engine import FinishedOutput, GenerationRequest, make_engine

logger = logging.getLogger(__name__)

PARITY_SAMPLE = 8  # responses per parity check


class RolloutReplica:
    """Dask actor: one replica of the rollout tier (placed on a ``rollout`` worker)."""

    def __init__(
        self, rollout_id: str, cfg: RunConfig, policy_dir: str, pool, buffer, relay
    ) -> None:
        from laminar.model import load_tokenizer
        from laminar.relay import Puller

        torch.set_num_threads(cfg.cluster.torch_threads)
        self.rollout_id = rollout_id
        self.cfg = cfg
        self.pool, self.buffer = pool, buffer
        self.puller = Puller(relay, cfg.relay.timeout_s)
        self.fingerprints: dict[int, int] = {}  # version loaded -> xxh3-64 (audit_weights)
        self._synced = False  # the relay has shown us a version
        self.tok = load_tokenizer(policy_dir)
        self.engine = make_engine(
            cfg.rollout,
            policy_dir,
            seed=cfg.seed * 1000 + int(rollout_id.lstrip("r") or 0),
            version=0,
        )
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
        self._pending: deque = deque()  # (trajectories, reward future)
        self.error: str | None = None
        self.counts = {
            "batches": 0,
            "trajectories": 0,
            "inserted": 0,
            "reward_errors": 0,
            "response_tokens": 0,
            "decode_steps": 0,
            "weight_loads": 0,
            "weight_bytes": 0,
            "parity_checks": 0,
            "parity_max_abs": float("nan"),  # latest check
            "parity_mean_abs": float("nan"),
            "parity_worst_abs": 0.0,  # over the run
            "idle_s": 0.0,
            "weight_wait_s": 0.0,
            "decode_s": 0.0,
        }

    # -- control methods (run on the actor thread while the loop decodes) ---------------
    def start(self) -> None:
        self._thread = start_thread(self._run, f"gen-{self.rollout_id}")

    def stop(self, timeout: float = 30.0) -> dict:
        """Stop after the current decode step; finished trajectories still reach the buffer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def stats(self) -> dict:
        kv = self.engine.kv_stats()
        return {
            **self.counts,
            **{f"engine_{k}": v for k, v in self.engine.stats().items()},
            "rollout_id": self.rollout_id,
            "version": self.engine.version,
            "kv_used": kv.used_tokens,
            "kv_capacity": kv.capacity_tokens,
            "running": kv.running,
            "waiting": kv.waiting,
            "pending_rewards": len(self._pending),
            "alive": self._thread is not None and self._thread.is_alive(),
            "error": self.error,
        }

    # -- the generation loop ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._maybe_load_weights()
                groups = self._call(self.pool.acquire(self.cfg.rollout.groups_per_batch))
                if not groups:
                    t = time.time()
                    self._collect_rewards(block=False)
                    self._stop.wait(0.05)
                    self.counts["idle_s"] += time.time() - t
                    continue
                self._generate(groups)
            self._collect_rewards(block=True)
        except Exception:
            self.error = traceback.format_exc()
            logger.error("rollout %s failed:\n%s", self.rollout_id, self.error)

    def _call(self, actor_future):
        # Every actor-to-actor call has a timeout: a call to a lost actor never returns.
        return actor_future.result(timeout=self.cfg.cluster.actor_timeout_s)

    def _maybe_load_weights(self) -> None:
        """The rollout wait: ask the local relay for a newer complete version, load it.

        Before its first batch a rollout waits until the relay holds the trainer's
        starting version: a resumed trainer starts at its checkpoint's version, not at
        the base policy the engine was built from."""
        t = time.time()
        while not self._synced and not self._stop.is_set():
            self._synced = bool(self._call(self.puller.relay.versions()))
            if not self._synced:
                self._stop.wait(0.02)
        update = self.puller.newest(self.engine.version)
        if update is not None:
            version, state = update
            self.engine.load_weights(state, version)
            if self._reference is not None:
                self._reference.load_state_dict(state)
            if self.cfg.relay.audit_weights:
                from laminar.relay import state_fingerprint

                self.fingerprints[version] = state_fingerprint(state)
            self.counts["weight_loads"] += 1
            self.counts["weight_bytes"] = self.puller.bytes
        self.counts["weight_wait_s"] += time.time() - t

    def get_fingerprints(self) -> dict[int, int]:
        return dict(self.fingerprints)

    def _generate(self, groups: list[PromptGroup]) -> None:
        now = time.time()
        for g in groups:
            for i in range(g.group_size):
                self.engine.add_request(
                    GenerationRequest(
                        request_id=f"{g.prompt_uid}-{i:03d}",
                        prompt_tokens=g.prompt_tokens,
                        params=self._params,
                        meta={"group": g, "sample_idx": i, "t_submit": now},
                    )
                )
        self.counts["batches"] += 1
        every = self.cfg.rollout.parity_every
        check = every and (self.counts["batches"] - 1) % every == 0
        sample: list[FinishedOutput] = []
        t0 = time.time()
        while self.engine.has_work() and not self._stop.is_set():
            finished = self.engine.step()
            self.counts["decode_steps"] += 1
            if finished:
                self._submit_rewards(finished)
                if check and len(sample) < PARITY_SAMPLE:
                    sample += finished[: PARITY_SAMPLE - len(sample)]
            self._collect_rewards(block=False)
        self.counts["decode_s"] += time.time() - t0
        if sample:
            self._check_parity(sample)

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
        c["parity_max_abs"] = float(diff.max())
        c["parity_mean_abs"] = float(diff.mean())
        c["parity_worst_abs"] = max(c["parity_worst_abs"], c["parity_max_abs"])

    def _submit_rewards(self, outputs: list[FinishedOutput]) -> None:
        from distributed import get_client

        from laminar.rewards import score_batch

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
                    behavior_version=int(out.token_versions.min()),
                    # Stored only when a response mixes versions (the schema's convention).
                    token_versions=out.token_versions
                    if out.token_versions.min() != out.token_versions.max()
                    else np.zeros(0, np.int32),
                    n_migrations=out.n_moves,
                    finish_reason=out.finish_reason,
                    rollout_ids=self.rollout_id,
                    t_submit=out.request.meta["t_submit"],
                    t_start=out.t_start,
                    t_finish=out.t_finish,
                )
            )
            self.counts["response_tokens"] += len(resp)
        self.counts["trajectories"] += len(trajs)
        future = get_client().submit(
            score_batch, self.cfg.task.reward, items, self.cfg.task.truncated_reward, pure=False
        )
        self._pending.append((trajs, future))

    def _collect_rewards(self, block: bool) -> None:
        """Move rewarded trajectories into the buffer, oldest first."""
        while self._pending and (block or self._pending[0][1].done()):
            trajs, future = self._pending.popleft()
            scores = future.result(timeout=self.cfg.cluster.actor_timeout_s)
            for t, s in zip(trajs, scores, strict=True):
                t.reward = s.reward
                if s.error is not None:
                    t.finish_reason = "error"
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
            self._call(self.buffer.insert(trajs))
            self.counts["inserted"] += len(trajs)
