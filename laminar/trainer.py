"""The trainer: samples complete groups from the buffer, updates, publishes a version.

With ``trainer.ranks = N > 1`` the trainer is data-parallel: :class:`Trainer` is rank 0
and :class:`TrainerRank` actors on other ``trainer`` workers are ranks 1..N-1. Their
threads join one ``torch.distributed`` group (gloo on CPU, NCCL on GPU) when started and
leave it when stopped; rank 0 samples each global batch and broadcasts it, every rank
trains on its shard, gradients are summed, and rank 0 alone publishes and checkpoints.

The training loop runs in its own thread; :meth:`Trainer.stats` answers from the actor
thread meanwhile. Weights leave the trainer only through the relay tier
(:mod:`laminar.relay`): after each update the loop copies the weights into the master
relay, which shares this process (the *publication stall*, recorded as ``publish_s``),
and goes on training while the relays carry the version to the rollouts.

Order of publication: the buffer hears of version ``v`` *before* any rollout can load it,
so no trajectory ever finishes before the version that generated it
(``behavior_version <= finish_version``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from laminar.cluster import start_thread
from laminar.config import RunConfig
from laminar.contract import Trajectory
from laminar.learner import Learner

logger = logging.getLogger(__name__)


def batch_stats(batch: list[Trajectory]) -> dict[str, float]:
    """Reward and staleness of a sampled batch (versions: ``s_gen``, ``residence``, ``s_train``)."""
    s_gen = np.array([t.finish_version - t.behavior_version for t in batch])
    res = np.array([t.sample_version - t.finish_version for t in batch])
    return {
        "reward_mean": float(np.mean([t.reward for t in batch])),
        "response_len_mean": float(np.mean([len(t.response_tokens) for t in batch])),
        "tokens": int(sum(len(t.prompt_tokens) + len(t.response_tokens) for t in batch)),
        "s_gen_mean": float(s_gen.mean()),
        "s_gen_max": int(s_gen.max()),
        "residence_mean": float(res.mean()),
        "residence_max": int(res.max()),
        "s_train_mean": float((s_gen + res).mean()),
        "s_train_max": int((s_gen + res).max()),
    }


class Trainer:
    """Dask actor: the policy, its optimizer and the version counter (``trainer`` worker)."""

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str,
        run_dir: str,
        buffer,
        master_relay,
        init_method: str = "",
    ) -> None:
        from laminar.relay import Publisher

        torch.set_num_threads(cfg.cluster.torch_threads)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.buffer = buffer
        self.ranks = cfg.trainer.ranks
        self.init_method = init_method
        self.learner = _learner(cfg, policy_dir, rank=0)
        self.publisher = Publisher(master_relay, cfg.relay.timeout_s)
        self.fingerprints: dict[int, int] = {}  # version -> xxh3-64 (relay.audit_weights)
        self.history: list[dict] = []
        self.done = False
        self.error: str | None = None
        self.checkpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wait_s = 0.0  # time spent waiting for the buffer to hold a full batch
        self.weights_checksum: float | None = None  # at the end, when data-parallel

    def start(self) -> None:
        self._thread = start_thread(self._run, "trainer")

    def stop(self, timeout: float = 60.0) -> dict:
        """Stop after the current update and write the final checkpoint."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    @property
    def version(self) -> int:
        return self.learner.version

    def publish(self) -> float:
        """Hand the current weights to the master relay; returns the stall (seconds)."""
        state = self.learner.model.state_dict()
        stall = self.publisher.publish(self.version, state)
        if self.cfg.relay.audit_weights:
            from laminar.relay import state_fingerprint

            self.fingerprints[self.version] = state_fingerprint(state)
        return stall

    def get_fingerprints(self) -> dict[int, int]:
        return dict(self.fingerprints)

    def stats(self) -> dict:
        return {
            "version": self.version,
            "steps": self.cfg.trainer.steps,
            "done": self.done,
            "error": self.error,
            "wait_s": self.wait_s,
            "skipped_steps": self.learner.skipped_steps,
            "ranks": self.ranks,
            "weights_checksum": self.weights_checksum,
            "checkpoint": self.checkpoint,
            "last": self.history[-1] if self.history else None,
        }

    def get_history(self, start: int = 0) -> list[dict]:
        """Per-update metrics from update ``start`` on (0-based)."""
        return self.history[start:]

    def _run(self) -> None:
        try:
            if self.ranks > 1:
                _join_group(self.cfg, self.init_method, rank=0)
            self._train()
        except Exception:
            self.error = traceback.format_exc()
            logger.error("trainer failed:\n%s", self.error)
        finally:
            try:
                if self.ranks > 1:
                    _broadcast(None)  # the other ranks leave the group
                    self.weights_checksum = _leave_group(self.learner)
                self.checkpoint = self._save_checkpoint()
            except Exception:
                self.error = (self.error or "") + traceback.format_exc()
            self.done = True

    def _train(self) -> None:
        t_cfg, timeout = self.cfg.trainer, self.cfg.cluster.actor_timeout_s
        if self.version:  # resumed: trajectories finish at the checkpoint's version on
            self.buffer.version_published(self.version).result(timeout)
        self.publish()  # the starting version (rollouts start from the base policy)
        last_update = time.time()
        while self.version < t_cfg.steps and not self._stop.is_set():
            t_wait = time.time()
            batch = self.buffer.sample(t_cfg.groups_per_step, self.version).result(timeout)
            if batch is None:
                self._stop.wait(0.02)
                self.wait_s += time.time() - t_wait
                continue
            self.wait_s += time.time() - t_wait
            t0 = time.time()
            if self.ranks > 1:
                _broadcast(batch)
            metrics = self.learner.update(batch)
            if not metrics["applied_steps"]:
                logger.warning(
                    "update at version %d skipped: non-finite loss or gradient (%d so far); "
                    "its batch is consumed, no weights are published",
                    self.version,
                    self.learner.skipped_steps,
                )
                continue
            # Publication: tell the buffer first, then hand the weights to the relays.
            self.buffer.version_published(self.version).result(timeout)
            t_pub = time.time()
            stall = self.publish()
            now = time.time()
            self.history.append(
                {
                    "version": self.version,
                    "time": now,
                    "update_s": t_pub - t0,
                    "publish_s": stall,
                    "interval_s": now - last_update,
                    **batch_stats(batch),
                    **metrics,
                }
            )
            last_update = now
            every = t_cfg.checkpoint_every
            if every and self.version % every == 0 and self.version < t_cfg.steps:
                self.checkpoint = self._save_checkpoint()

    def _save_checkpoint(self) -> str | None:
        """HF folder + optimizer, RNG and trainer state under ``checkpoints/version-N``,
        written aside and renamed into place: a folder there is always complete. A
        version already saved (periodically, then at the end) is not written again.

        First the buffer commits its store, so that it records every trajectory the
        updates up to here consumed (a resume must not train them again); when it cannot
        (the data module is lost) no checkpoint is written and the newest one stands."""
        root = self.run_dir / "checkpoints"
        out = root / f"version-{self.version:06d}"
        if out.exists():
            return str(out)
        try:
            self.buffer.sync().result(timeout=self.cfg.cluster.actor_timeout_s)
        except Exception as e:  # noqa: BLE001 — the data module is gone or cannot write
            logger.warning(
                "no checkpoint at version %d: the trajectory store could not be committed "
                "(%s: %s); the newest checkpoint stands",
                self.version,
                type(e).__name__,
                e,
            )
            return self.checkpoint
        tmp = root / f".version-{self.version:06d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.save(tmp)
        tmp.rename(out)
        return str(out)


class TrainerRank:
    """Dask actor: data-parallel rank ``rank`` ≥ 1 of the trainer (another ``trainer``
    worker). It holds a full replica of the policy and optimizer, trains on its shard of
    every batch rank 0 broadcasts, and ends when rank 0 broadcasts ``None``."""

    def __init__(self, cfg: RunConfig, policy_dir: str, rank: int, init_method: str) -> None:
        torch.set_num_threads(cfg.cluster.torch_threads)
        self.cfg, self.rank, self.init_method = cfg, rank, init_method
        self.learner = _learner(cfg, policy_dir, rank=rank)
        self.error: str | None = None
        self.done = False
        self.weights_checksum: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, f"trainer-rank{self.rank}")

    def _run(self) -> None:
        try:
            _join_group(self.cfg, self.init_method, rank=self.rank)
            while (batch := _broadcast()) is not None:
                self.learner.update(batch)
            self.weights_checksum = _leave_group(self.learner)
        except Exception:
            self.error = traceback.format_exc()
            logger.error("trainer rank %d failed:\n%s", self.rank, self.error)
        finally:
            self.done = True

    def stats(self) -> dict:
        return {
            "rank": self.rank,
            "version": self.learner.version,
            "done": self.done,
            "error": self.error,
            "weights_checksum": self.weights_checksum,
        }


def _learner(cfg: RunConfig, policy_dir: str, rank: int) -> Learner:
    from laminar.learner import torch_all_reduce

    n = cfg.trainer.ranks
    return Learner(
        cfg,
        policy_dir,
        resume_from=cfg.trainer.resume_from,
        rank=rank,
        world_size=n,
        all_reduce=torch_all_reduce if n > 1 else None,
    )


def _join_group(cfg: RunConfig, init_method: str, rank: int) -> None:
    import datetime

    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=cfg.trainer.ranks,
        timeout=datetime.timedelta(seconds=cfg.cluster.actor_timeout_s * 5),
    )


def _broadcast(batch=None):
    """Rank 0 sends ``batch`` (or ``None``: stop); every other rank receives it."""
    import torch.distributed as dist

    box = [batch]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _leave_group(learner: Learner) -> float:
    """Leave the process group; returns a checksum of the weights (equal on every rank)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    with torch.no_grad():
        return float(sum(p.double().sum() for p in learner.model.parameters()))


def free_port() -> int:
    """A free TCP port on this machine (a Dask task on rank 0's worker)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
