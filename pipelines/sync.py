"""The synchronous schedule (verl's): generate the whole global batch, train on it, update
every rollout, repeat.

What it keeps global: everything. The prompt pool hands out one global batch per version,
split evenly over the rollouts; the trainer waits for every trajectory of it; rollouts
idle while it trains and until the new version reaches all of them. Trainer and rollouts
are *colocated*: when paced, the trainer has the whole cluster's GPUs
(``trainer.pacing.gpus``) and every iteration pays the switch from training to
generation (``trainer.pacing.colocated_switch_s``). Every trajectory is on-policy:
``s_train = 0``.

Run it::

    laminar run configs/tiny.yaml --set pipeline.schedule=sync
"""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.schedule import ScheduleSpec
from pipelines.driver import Schedule


class SyncSchedule(Schedule):
    name = "sync"

    @classmethod
    def spec(cls, cfg: RunConfig) -> ScheduleSpec:
        return ScheduleSpec("sync", dispatch="batches", lag=0, weights="colocated")
