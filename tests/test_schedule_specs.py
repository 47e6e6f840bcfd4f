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
        # a refilling rollout rarely reaches a batch boundary, where relay pulls happen
        (dict(dispatch="eta", eta=1, refill=True), r"refill .*needs interrupt"),
    ],
)
def test_a_spec_whose_option_means_nothing_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ScheduleSpec("x", **fields)


def test_the_five_schedules_specs_are_valid():
    for name in ("laminar", "sync", "one_step", "stream", "partial_rollout"):
        sets = [f"pipeline.schedule={name}", "trainer.mini_batches=2", "pipeline.eta=2"]
        cfg = with_overrides(RunConfig(), sets)
        assert schedule_class(name).spec(cfg).name == name


@pytest.mark.parametrize(
    "sets, message",
    [
        # trainer.mini_batches unset: its default, 1, is one part
        ([], r"trainer.mini_batches is 1, .*the sync schedule without colocation"),
        (
            ["trainer.mini_batches=1"],
            r"Set trainer.mini_batches to 2 or more.*or use pipeline.schedule=sync",
        ),
        # parts hold whole groups: 4 mini-batches of a batch of one group are one part
        (
            ["trainer.mini_batches=4", "trainer.groups_per_step=1"],
            r"trainer.groups_per_step is 1, .*Set trainer.groups_per_step to 2 or more",
        ),
    ],
)
def test_stream_in_one_part_is_refused_as_the_sync_schedule(sets, message):
    """Stream overlaps the training of a global batch's first parts with the generation of
    the rest; in one part the trainer waits for the whole batch, trains it and publishes
    it to every rollout at once: sync without colocation, benchmarked under stream's name."""
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), ["pipeline.schedule=stream", *sets])
    two = with_overrides(RunConfig(), ["pipeline.schedule=stream", "trainer.mini_batches=2"])
    assert schedule_class("stream").spec(two).trainer == "stream"


def test_partial_rollout_with_eta_0_is_refused_as_the_sync_schedule():
    """With η = 0 no group of the next batch goes out before the version that generates it
    is published: the rollouts idle while the trainer trains, and no publication finds a
    response to interrupt — sync without colocation, benchmarked under partial_rollout's
    name."""
    with pytest.raises(ConfigError, match=r"pipeline.eta=0: .*Set pipeline.eta to 1 or more"):
        with_overrides(RunConfig(), ["pipeline.schedule=partial_rollout", "pipeline.eta=0"])
    one = with_overrides(RunConfig(), ["pipeline.schedule=partial_rollout", "pipeline.eta=1"])
    assert schedule_class("partial_rollout").spec(one).eta == 1


def test_the_documented_stream_and_partial_rollout_commands_run():
    from pathlib import Path

    from laminar.config import load_config

    root = Path(__file__).parents[1]
    for name in ("stream", "partial_rollout"):
        for doc in (root / "docs" / "schedules.md", root / "pipelines" / f"{name}.py"):
            line = next(x for x in doc.read_text().splitlines() if f"schedule={name} --set" in x)
            sets = [s.strip() for s in line.split("--set ")[1:]]
            cfg = load_config(root / "configs" / "tiny.yaml", sets)
            assert schedule_class(name).spec(cfg).name == name


def test_laminar_back_pressure_bounds_what_is_out_not_each_s_train():
    """``buffer.max_outstanding_groups`` bounds how many groups are out, not how many
    versions a long group lives through: while one group decodes on, the trainer consumes
    the others and freed room goes out again, version after version (docs/schedules.md
    says so; it claimed Laminar's s_train was bounded by back-pressure)."""
    from laminar.prompt_pool import PromptPoolCore
    from laminar.tasks import Prompt

    core = PromptPoolCore(
        [(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4, max_outstanding=3, seed=0
    )
    slow, *fast = core.acquire(3, "r0")
    for version in range(1, 11):  # each version trains two groups, the slow one decodes on
        core.release([g.prompt_uid for g in fast])
        core.version_published(version)
        fast = core.acquire(3, "r0", version)
        assert len(fast) == 2 and slow.prompt_uid in core.outstanding
    # trained now, the slow group's s_train is 10, past any bound max_outstanding / G gives
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "schedules.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `laminar`"))
    assert "bounded by back-pressure" not in row
    assert "buffer.max_train_staleness" in row


def test_partial_rollout_refuses_an_eta_that_back_pressure_overrides(tmp_path, no_cluster):
    """η allows ``(η + 1) × groups_per_step`` groups out (dispatched, not yet consumed);
    ``buffer.max_outstanding_groups`` counts the same groups. Below that, back-pressure
    holds dispatch first and the run keeps a tighter bound than the η it reports: with
    configs/tiny.yaml's 32 (two batches of 16) ``pipeline.eta=4`` ran as η = 1. Refused
    as the config is read: `laminar run configs/tiny.yaml --set
    pipeline.schedule=partial_rollout` (η 2: 48 groups) was refused only once the run's
    cluster had started (~19 s), its config.yaml left behind in the run directory."""
    from pathlib import Path

    from laminar.config import load_config
    from pipelines.cli import main

    cls = schedule_class("partial_rollout")
    base = ["pipeline.schedule=partial_rollout", "trainer.groups_per_step=16"]
    tight = with_overrides(
        RunConfig(), [*base, "buffer.max_outstanding_groups=32", "pipeline.eta=1"]
    )
    with pytest.raises(ConfigError) as e:
        with_overrides(tight, ["pipeline.eta=4"])
    said = str(e.value)
    assert (
        "pipeline.schedule=partial_rollout with pipeline.eta=4: (pipeline.eta + 1) × "
        "trainer.groups_per_step = 80 groups may be out, but buffer.max_outstanding_groups"
        "=32 stops dispatch first (the bound in force would be eta=1): set "
        "buffer.max_outstanding_groups to at least 80, or pipeline.eta=1"
    ) in said, said
    assert cls.spec(with_overrides(tight, ["pipeline.eta=1"])).eta == 1
    roomy = with_overrides(RunConfig(), base + ["buffer.max_outstanding_groups=80"])
    assert cls.spec(with_overrides(roomy, ["pipeline.eta=4"])).eta == 4
    # on load, before any cluster, and nothing written to the run directory
    root = Path(__file__).parents[1]
    tiny = str(root / "configs" / "tiny.yaml")
    with pytest.raises(ConfigError, match=r"buffer.max_outstanding_groups to at least 48"):
        load_config(tiny, ["pipeline.schedule=partial_rollout"])
    run = tmp_path / "run"
    argv = ["run", tiny, "--set", "pipeline.schedule=partial_rollout", "--run-dir", str(run)]
    assert main(argv) == 2  # (no_cluster: a cluster started fails the test)
    assert not run.exists()
    # the documented command runs
    line = next(
        x
        for x in (root / "docs" / "schedules.md").read_text().splitlines()
        if "schedule=partial_rollout --set" in x
    )
    sets = [s.strip() for s in line.split("--set ")[1:]]
    cls.spec(load_config(root / "configs" / "tiny.yaml", sets))


def test_partial_rollouts_back_pressure_refusal_suggests_only_settings_that_hold():
    """With room for less than two batches the η the bound allows is 0, which the config
    refuses (partial rollout would be sync): the message suggested it all the same."""
    base = ["pipeline.schedule=partial_rollout", "trainer.groups_per_step=16"]
    with pytest.raises(ConfigError) as e:
        with_overrides(RunConfig(), [*base, "pipeline.eta=1", "buffer.max_outstanding_groups=20"])
    assert "max_outstanding_groups to at least 32" in str(e.value)
    assert "pipeline.eta=0" not in str(e.value)
    with pytest.raises(ConfigError, match=r"at least 64, or pipeline.eta=2"):
        with_overrides(RunConfig(), [*base, "pipeline.eta=3", "buffer.max_outstanding_groups=48"])
