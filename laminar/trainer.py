"""The trainer: samples complete groups from the buffer, updates, publishes a version.

The training loop runs in its own thread; :meth:`Trainer.get_weights` (called by rollouts
at their batch boundaries) and :meth:`Trainer.stats` answer from the actor thread
meanwhile. A published version is an immutable CPU snapshot, so a rollout never reads
weights halfway through an update.

Order of publication: the buffer hears of version ``v`` *before* any rollout can load it,
so no trajectory ever finishes before the version that generated it
(``behavior_version <= finish_version``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from laminar.cluster import start_thread
from laminar.config import RunConfig
from laminar.contract import Trajectory
from laminar.update import grpo_step

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
        "s_train_mean": float((s_gen + res).mean()),
        "s_train_max": int((s_gen + res).max()),
    }


class Trainer:
    """Dask actor: the policy, its optimizer and the version counter (``trainer`` worker)."""

    def __init__(self, cfg: RunConfig, policy_dir: str, run_dir: str, buffer) -> None:
        from laminar.model import load_policy, state_dict_cpu

        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.buffer = buffer
        self.model, self.tok = load_policy(policy_dir)
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=t.betas
        )
        self.version = 0
        self._published = (0, state_dict_cpu(self.model))
        self.history: list[dict] = []
        self.done = False
        self.error: str | None = None
        self.checkpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wait_s = 0.0  # time spent waiting for the buffer to hold a full batch

    def start(self) -> None:
        self._thread = start_thread(self._run, "trainer")

    def stop(self, timeout: float = 60.0) -> dict:
        """Stop after the current update and write the final checkpoint."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def get_weights(self, have_version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published version, or ``None`` if the caller already has it."""
        version, state = self._published
        return None if version <= have_version else (version, state)

    def stats(self) -> dict:
        return {
            "version": self.version,
            "steps": self.cfg.trainer.steps,
            "done": self.done,
            "error": self.error,
            "wait_s": self.wait_s,
            "checkpoint": self.checkpoint,
            "last": self.history[-1] if self.history else None,
        }

    def get_history(self, start: int = 0) -> list[dict]:
        """Per-update metrics from update ``start`` on (0-based)."""
        return self.history[start:]

    def _run(self) -> None:
        try:
            self._train()
        except Exception:
            self.error = traceback.format_exc()
            logger.error("trainer failed:\n%s", self.error)
        finally:
            try:
                self.checkpoint = self._save_checkpoint()
            except Exception:
                self.error = (self.error or "") + traceback.format_exc()
            self.done = True

    def _train(self) -> None:
        from laminar.model import state_dict_cpu

        t_cfg, timeout = self.cfg.trainer, self.cfg.cluster.actor_timeout_s
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
            groups = {uid: i for i, uid in enumerate(dict.fromkeys(t.prompt_uid for t in batch))}
            metrics = grpo_step(
                self.model,
                self.optimizer,
                [t.prompt_tokens for t in batch],
                [t.response_tokens for t in batch],
                [t.behavior_logprobs for t in batch],
                [t.loss_mask for t in batch],
                torch.tensor([t.reward for t in batch], dtype=torch.float32),
                torch.tensor([groups[t.prompt_uid] for t in batch]),
                pad_token_id=self.tok.pad_token_id,
                clip_low=t_cfg.clip_low,
                clip_high=t_cfg.clip_high,
                temperature=self.cfg.rollout.temperature,
                max_grad_norm=t_cfg.max_grad_norm,
                micro_batch_tokens=t_cfg.micro_batch_tokens,
                agg=t_cfg.loss_agg,
                clip_c=t_cfg.clip_c,
            )
            self.version += 1
            # Publication: tell the buffer first, then expose the snapshot to rollouts.
            self.buffer.version_published(self.version).result(timeout)
            t_pub = time.time()
            self._published = (self.version, state_dict_cpu(self.model))
            now = time.time()
            self.history.append(
                {
                    "version": self.version,
                    "time": now,
                    "update_s": t_pub - t0,
                    "publish_s": now - t_pub,
                    "interval_s": now - last_update,
                    **batch_stats(batch),
                    **metrics,
                }
            )
            last_update = now

    def _save_checkpoint(self) -> str:
        """HF folder + optimizer state + trainer state under ``checkpoints/version-N``."""
        out = self.run_dir / "checkpoints" / f"version-{self.version:06d}"
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tok.save_pretrained(out)
        torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
        (out / "trainer_state.json").write_text(
            json.dumps({"version": self.version, "seed": self.cfg.seed}, indent=2)
        )
        return str(out)
