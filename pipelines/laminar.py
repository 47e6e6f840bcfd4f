"""The Laminar schedule: nothing global. Trajectories stream into the buffer one by one,
the trainer samples complete groups at its own pace, and each rollout pulls the newest
weights only when its own local batch has drained (with repack, draining batches of one
version move onto fewer rollouts so the freed ones refresh sooner).

What it keeps global: nothing. The prompt pool hands out groups as back-pressure allows
(``buffer.max_outstanding_groups``), the trainer publishes each version once to the master
relay and goes on, and no rollout waits for another.

Run it::

    laminar run configs/tiny.yaml

or from a notebook::

    import pipelines
    handle = pipelines.submit("configs/tiny.yaml", client)   # returns at once
    handle.progress(); handle.wait()
"""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.schedule import LAMINAR, ScheduleSpec
from pipelines.driver import Schedule


class LaminarSchedule(Schedule):
    name = "laminar"

    @classmethod
    def spec(cls, cfg: RunConfig) -> ScheduleSpec:
        return LAMINAR
