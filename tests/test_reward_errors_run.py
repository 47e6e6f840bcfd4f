"""A run whose reward fails on some responses, not enough to stop it: what its summary
and its rollouts say of the failures (the printed summary said nothing of them, and an
error said neither where the function raised nor on what)."""

from __future__ import annotations

import re

import pytest

from pipelines.cli_display import _print_summary

pytestmark = pytest.mark.slow


def test_a_completed_run_says_its_reward_errors_where_and_on_what(
    cluster_client, small_config, tmp_path, capsys
):
    """``_raises_on_some`` raises IndexError on the responses to about one prompt in
    eight: the run completes, its groups with a failure discarded. ``summary.json``
    counts the failures and the responses scored, the groups discarded and the latest
    error, which names the function's line and the response and answer it was given;
    the printed summary says it all in one line."""
    import pipelines

    run = pipelines.submit(
        small_config,
        cluster_client,
        run_dir=tmp_path / "run",
        overrides=["task.reward=laminar.rewards:_raises_on_some", "sft.torch_threads=1"],
    )
    summary = run.wait(timeout=300)  # generous: CI machines are shared
    assert summary["reason"] == "completed", summary["reason"]
    errors = summary["reward_errors"]
    assert errors["failed"] == sum(r["reward_errors"] for r in summary["rollouts"]) > 0
    assert errors["scored"] == sum(r["rewards_scored"] for r in summary["rollouts"]) > 0
    assert errors["groups_discarded"] == summary["buffer"]["groups_discarded"] > 0
    latest = errors["latest"]
    assert re.fullmatch(
        r"reward laminar.rewards:_raises_on_some raised IndexError: list index out of "
        r"range \(at .*/laminar/rewards.py:\d+ in _raises_on_some; response '.*', "
        r"answer '[0-9 ]+'\)",
        latest,
    ), latest
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "; reward errors left out\n" in out  # (the mean reward is of what scored)
    given = errors["failed"] + errors["scored"]
    assert (
        f"reward errors      {errors['failed']} of {given} responses "
        f"({errors['failed'] / given:.0%}), {errors['groups_discarded']} groups discarded; "
        f"latest: {latest}\n"
    ) in out


def test_a_reward_that_fails_nearly_always_stops_the_run_saying_so(
    cluster_client, small_config, tmp_path, monkeypatch, caplog
):
    """``None`` for 98% of responses, 1.0 for the rest (``None`` for a wrong answer):
    the few scores switched the run from the never-scores rule to the share rule, which
    waits its window (300 s) from the first score; the reviewer's run went 258 s at
    version 0 with 41,551 errors. The rule on 90% failing over its own window stops it
    (here with that window made 5 s, and the share rule's out of reach), said as it is
    decided; the summary counts the failures."""
    import logging

    import pipelines
    from laminar.errors import RunFailed

    monkeypatch.setattr("pipelines.driver_polls.OVERWHELMED_WINDOW_S", 5.0)  # (the driver
    monkeypatch.setattr("pipelines.driver_polls.REWARD_SHARE_WINDOW_S", 10_000.0)  # is here)
    run = pipelines.submit(
        small_config,
        cluster_client,
        run_dir=tmp_path / "run",
        overrides=[
            "task.reward=laminar.rewards:_mostly_none",
            "trainer.steps=1000",
            "sft.torch_threads=1",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="laminar"):
        with pytest.raises(RunFailed, match="stopped in order") as err:
            run.wait(timeout=300)  # generous: CI machines are shared
    summary = err.value.summary
    reason = summary["reason"]
    assert reason.startswith("failed: task.reward 'laminar.rewards:_mostly_none' failed on ")
    assert "responses it was given in the last 5 s (" in reason and "at least 90%)" in reason
    assert "returned None (a NoneType)" in reason
    assert any(
        r.getMessage().startswith("stopping the run: task.reward 'laminar.rewards:_mostly_none'")
        for r in caplog.records
    ), caplog.text
    errors = summary["reward_errors"]
    assert errors["failed"] > 9 * errors["scored"] > 0
