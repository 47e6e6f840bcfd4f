"""What each schedule's spec refuses: options that mean nothing for it, and settings under
which it would silently behave as another schedule (docs/schedules.md)."""

from __future__ import annotations

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError
from laminar.schedule import ScheduleSpec
from pipelines.driver import schedule_class


@pytest.mark.parametrize(
    "fields, message",
    [
        # eta bounds dispatch only under dispatch='eta'; lag only under 'batches'
        (dict(eta=3), r"eta=3 .*dispatch='eta'"),
        (dict(dispatch="batches", eta=1), r"eta=1 .*dispatch='eta'"),
        (dict(lag=1), r"lag=1 .*dispatch='batches'"),
        (dict(dispatch="eta", lag=1), r"lag=1 .*dispatch='batches'"),
        # colocated: trainer and rollouts share the GPUs, nothing overlaps training
        (dict(weights="colocated"), r"colocated"),
        (dict(dispatch="batches", lag=1, trainer="one_step", weights="colocated"), r"colocated"),
        (dict(dispatch="batches", trainer="stream", weights="colocated"), r"colocated"),
        # a barrier batch is complete at each publication: nothing to interrupt, and a
        # rollout takes its share of it at once
        (dict(dispatch="batches", weights="global", interrupt=True), r"interrupt"),
        (dict(dispatch="batches", refill=True), r"refill"),
    ],
)
def test_a_spec_whose_option_means_nothing_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ScheduleSpec("x", **fields)


def test_the_five_schedules_specs_are_valid():
    for name in ("laminar", "sync", "one_step", "stream", "partial_rollout"):
        cfg = with_overrides(RunConfig(), [f"pipeline.schedule={name}", "trainer.mini_batches=2"])
        assert schedule_class(name).spec(cfg).name == name
