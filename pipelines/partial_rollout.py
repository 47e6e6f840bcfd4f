"""Partial rollout (AReaL's): rollouts generate continuously; every weight update
interrupts all of them, which load the new version and resume their unfinished
responses, recomputing the KV cache — one response then mixes versions.

What it keeps global: the weight update. The trainer samples complete groups as they
arrive, like Laminar's; at each publication the manager pauses every rollout, the
weights reach all of them at once (paced: a global NCCL broadcast) and each recomputes
the KV of everything it holds (paced: prefill time). Rollouts keep their engines full
(no local batches). Staleness is bounded as AReaL bounds it: prompt groups dispatched
never exceed ``(version + pipeline.eta + 1) × trainer.groups_per_step``. η is at least 1
(at 0 nothing of the next batch goes out before its version: that is sync, refused). That bounds
dispatch, not each trajectory's ``s_train`` (a long response is trained when it
finishes, possibly more than η versions on; docs/schedules.md): for a hard bound, add
``buffer.max_train_staleness``. η must bind: ``buffer.max_outstanding_groups`` (which
counts the same groups) of at least ``(η + 1) × trainer.groups_per_step``, or the
config is refused on load. Every token records the version that sampled it
(``token_versions``); ``behavior_version`` is the oldest.

Run it::

    laminar run configs/tiny.yaml --set pipeline.schedule=partial_rollout --set pipeline.eta=1
"""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.schedule import ScheduleSpec
from pipelines.driver import Schedule


class PartialRolloutSchedule(Schedule):
    name = "partial_rollout"

    @classmethod
    def spec(cls, cfg: RunConfig) -> ScheduleSpec:
        # (an η that back-pressure would override, or 0, is refused by the config, on
        # load: laminar/config.py)
        return ScheduleSpec(
            "partial_rollout",
            dispatch="eta",
            eta=cfg.pipeline.eta,
            weights="global",
            interrupt=True,
            refill=True,
        )
