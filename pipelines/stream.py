"""Stream generation: the trainer takes one optimizer step per mini-batch as soon as its
groups have finished, while the rest of the global batch still generates; then a global
update.

What it keeps global: the batch and the weight update. The prompt pool hands out one
global batch per version; the trainer splits it into ``trainer.mini_batches`` optimizer
steps, each taken on the groups that completed first, and publishes once the last is
done — every rollout idles from the end of its share of the batch until the new version
reaches all of them at once (paced: a global NCCL broadcast). Training overlaps the long
tail of generation; every trajectory is on-policy for the batch's first step
(``s_train = 0``). In one part (``trainer.mini_batches`` 1, its default, or a batch of
one group) nothing would overlap and the run would be sync without colocation: the run
config refuses it, naming the fix.

Run it::

    laminar run configs/tiny.yaml --set pipeline.schedule=stream --set trainer.mini_batches=4
"""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.schedule import ScheduleSpec
from pipelines.driver import Schedule


class StreamSchedule(Schedule):
    name = "stream"

    @classmethod
    def spec(cls, cfg: RunConfig) -> ScheduleSpec:
        return ScheduleSpec("stream", dispatch="batches", lag=0, trainer="stream", weights="global")
