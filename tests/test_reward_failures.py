"""The rules that stop a run for its reward function's failures, on the stats the driver
polls from its rollouts (``pipelines.driver_polls.RewardFailures``, with the poll's time
given), and the same rule in the warm start's scoring. The share rule's scenarios run on
a window of 60 s (``W``, the never-scores rule's) for round numbers; the run's default is
longer (``test_the_default_window_lets_a_minute_long_outage_go_on``)."""

from __future__ import annotations

import logging
import math

import pytest

from laminar.config import with_overrides
from pipelines.driver_polls import REWARD_FAILURE_WINDOW_S, RewardFailures

W = REWARD_FAILURE_WINDOW_S
LATEST = "reward m:f returned nan"


def stats(rollout_id: str, errors: int, scored: int, latest: str | None = LATEST) -> dict:
    """A rollout's stats as far as the rules read them (RolloutReplica.stats' keys)."""
    return {
        "rollout_id": rollout_id,
        "reward_errors": errors,
        "rewards_scored": scored,
        "last_reward_error": latest if errors else None,
    }


def polls(failures: RewardFailures, rates: dict[str, tuple[int, int]], t0, t1, every=1.0):
    """Polls every ``every`` s from ``t0`` to ``t1`` of rollouts whose counters grow by
    ``rates[id]`` = (failed, scored) a poll, from what ``failures`` last saw of each.
    Returns (the time, the reason) of the first poll that stops the run, else None."""
    counts = {rid: failures._seen.get(rid, (0, 0)) for rid in rates}
    t = t0
    while t <= t1:
        for rid, (f, s) in rates.items():
            counts[rid] = (counts[rid][0] + f, counts[rid][1] + s)
        if why := failures.check([stats(r, *c) for r, c in counts.items()], t):
            return t, why
        t += every
    return None


def test_a_reward_failing_on_half_the_responses_stops_after_a_window_of_it():
    """Half failing discards nearly every group (all but 1/16 of groups of 4), and the
    run trained on the few whose every response scored: it stops, one window after its
    first score, naming the field, the share and window measured, the error, the fix."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    stopped = polls(failures, {"r0": (2, 2), "r1": (2, 2)}, 0.0, 3 * W)
    assert stopped is not None
    t, why = stopped
    assert t == W  # (a window from the first poll, which saw the first score)
    # the polls after that first one, within the window: 60 of them, 4 failed + 4 scored
    assert why == (
        "task.reward 'm:f' failed on 240 of the 480 responses it was given in the last 60 s, "
        "a share of 0.50, over task.reward_max_failure_share=0.25; each failure discards "
        "its whole group, so the run would train only on the few groups whose every "
        f"response scored (latest: {LATEST}); fix the function, or the service it calls, "
        "or raise task.reward_max_failure_share (up to 1.0: only a reward that never "
        "scores stops the run) to train on the groups it does score"
    )


@pytest.mark.parametrize("failed, scored", [(1, 9), (1, 4), (4, 96)])
def test_transient_failures_below_the_share_go_on(failed, scored):
    """10%, 20% or 4% of responses failing (a judge service that times out now and then)
    keeps most groups: the run goes on, for windows and windows."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert polls(failures, {"r0": (failed, scored), "r1": (failed, scored)}, 0.0, 10 * W) is None


def test_a_short_outage_goes_on_and_a_long_one_stops():
    """A reward service down for a while, every response failing meanwhile: the run goes
    on while the window's share stays at most the limit (15 s of a 60 s window at 0.25),
    and stops when more of the window failed."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert polls(failures, {"r0": (0, 8)}, 0.0, 2 * W) is None
    assert polls(failures, {"r0": (8, 0)}, 2 * W + 1, 2 * W + 15) is None  # 15 s down
    assert polls(failures, {"r0": (0, 8)}, 2 * W + 16, 5 * W) is None
    t, why = polls(failures, {"r0": (8, 0)}, 5 * W + 1, 6 * W)  # down again, for good
    assert t == 5 * W + 16 and "failed on 128 of the 480 responses" in why  # (0.27)


def test_the_default_window_lets_a_minute_long_outage_go_on():
    """Over the default window (REWARD_SHARE_WINDOW_S, 300 s) a reward service down for a
    minute (a judge restarting) costs 20% of it: the run goes on at 0.25; over 60 s it
    stopped 16 s into the outage. Down for good, it stops once the share passes 0.25."""
    from pipelines.driver_polls import REWARD_SHARE_WINDOW_S as S

    failures = RewardFailures("m:f", 0.25)
    assert failures.window_s == S == 300
    assert polls(failures, {"r0": (0, 8)}, 0.0, 2 * S) is None
    assert polls(failures, {"r0": (8, 0)}, 2 * S + 1, 2 * S + 60) is None  # 60 s down
    assert polls(failures, {"r0": (0, 8)}, 2 * S + 61, 4 * S) is None
    t, why = polls(failures, {"r0": (8, 0)}, 4 * S + 1, 5 * S)  # down again, for good
    assert t == 4 * S + 76 and "failed on 608 of the 2400 responses" in why, why
    assert "in the last 300 s" in why


def test_exactly_at_the_share_goes_on_and_one_failure_more_stops():
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert failures.check([stats("r0", 0, 1)], 0.0) is None  # the first score
    # a window later: 64 failed, 192 scored, exactly 0.25 of 256
    assert failures.check([stats("r0", 64, 193)], W) is None
    why = failures.check([stats("r0", 65, 193)], W + 1)
    assert "failed on 65 of the 257 responses it was given in the last 60 s" in why
    assert "a share of 0.25, over task.reward_max_failure_share=0.25" in why


def test_fewer_than_64_failures_in_the_window_go_on_whatever_their_share():
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert failures.check([stats("r0", 0, 1)], 0.0) is None
    assert failures.check([stats("r0", 63, 2)], W) is None  # (0.98 of 64)


def test_a_lost_rollouts_counters_leave_and_its_replacement_counts_from_zero():
    """Per rollout, what is new since its last answer: the sum over the live rollouts
    goes down when one is lost (its counters leave the stats), which is nothing new, not
    responses unscored; its replacement, a new rollout id, counts from 0."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    # r0 has scored 10000 (a long run); r1 fails on 2 in 9 (0.22: the run goes on)
    assert failures.check([stats("r0", 0, 10000), stats("r1", 0, 0)], 0.0) is None
    assert polls(failures, {"r0": (0, 4), "r1": (2, 7)}, 1.0, W) is None
    # r0 lost: its counters leave the stats; r1's 120 failures a window, at 0.22, go on
    assert polls(failures, {"r1": (2, 7)}, W + 1, 2 * W) is None
    # its replacement r2, from 0, fails on every response: the window's share passes
    # 0.25 at its 6th poll, (120 + 4 * 6) / (540 + 4 * 6)
    t, why = polls(failures, {"r1": (2, 7), "r2": (4, 0)}, 2 * W + 1, 3 * W)
    assert t == 2 * W + 6 and "failed on 144 of the 564 responses" in why, why


def test_a_rollout_left_out_of_a_poll_is_not_counted_twice():
    """A rollout whose stats call is still out is left out of a poll, then comes back
    with its counters grown: what grew meanwhile is counted once."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert failures.check([stats("r0", 0, 1), stats("r1", 0, 1)], 0.0) is None
    for t in range(1, 61):
        seen = [stats("r0", 3 * t, 1 + 9 * t)]  # fails on 3 in 12, exactly 0.25
        if t % 10:  # r1, the same, is left out of every tenth poll
            seen.append(stats("r1", 3 * t, 1 + 9 * t))
        assert failures.check(seen, float(t)) is None, t
    why = failures.check([stats("r0", 183, 550), stats("r1", 187, 550)], 61.0)
    # the window (1, 61]: r0's 60 polls of 3 and 9; r1's from 1 to 59, then 10 and 18
    assert "failed on 364 of the 1444 responses" in why, why


def test_at_a_share_of_one_only_a_reward_that_never_scores_stops():
    failures = RewardFailures("m:f", 1.0, window_s=W)
    assert polls(failures, {"r0": (9, 1)}, 0.0, 5 * W) is None
    never = RewardFailures("m:f", 1.0, window_s=W)
    t, why = polls(never, {"r0": (2, 0), "r1": (2, 0)}, 0.0, 2 * W)
    assert t == W and why.startswith("task.reward 'm:f' failed on all 244 responses")


def test_failures_before_the_first_score_are_the_never_scores_rules():
    """A reward service that starts late: what failed before its first score is not
    counted by the share rule (the never-scores rule gives it a window to start)."""
    failures = RewardFailures("m:f", 0.25, window_s=W)
    assert polls(failures, {"r0": (8, 0)}, 0.0, W - 5) is None  # 55 s down: 448 failed
    assert polls(failures, {"r0": (0, 8)}, W - 4, 4 * W) is None


def test_the_share_is_a_task_key_in_0_to_1():
    from laminar.config import RunConfig
    from laminar.errors import ConfigError

    assert RunConfig().task.reward_max_failure_share == 0.25
    assert (
        with_overrides(
            RunConfig(), ["task.reward_max_failure_share=1"]
        ).task.reward_max_failure_share
        == 1
    )
    for bad, said in [("0", "greater than 0"), ("1.5", "less than or equal to 1")]:
        with pytest.raises(ConfigError, match=rf"task.reward_max_failure_share: .*{said}"):
            with_overrides(RunConfig(), [f"task.reward_max_failure_share={bad}"])


def test_the_warm_starts_scoring_by_the_same_share(small_config, tmp_path, caplog):
    """The warm start's score over responses of which half failed is the mean of a biased
    half: nan (not kept), with the run's message as a warning; the run goes on, and its
    rollouts' failures stop it. Accepted (a share of 1.0), it is scored."""
    from laminar.prompt_pool import load_prompts
    from laminar.sft import warm_start

    # (small_config's 20 SFT steps: with fewer, most responses run to the length limit,
    # and are not given to the reward)
    cfg = with_overrides(
        small_config, [f"sft.cache_dir={tmp_path}", "task.reward=laminar.rewards:_half_nan"]
    )
    prompts = load_prompts(cfg)
    with caplog.at_level(logging.WARNING, logger="laminar.sft"):
        _, info = warm_start(cfg, prompts)
    assert math.isnan(info["eval_reward"])
    said = caplog.text
    assert "task.reward 'laminar.rewards:_half_nan' failed on" in said, said
    assert ", scoring the warm start, a share of 0." in said and "returned nan" in said
    assert "task.reward_max_failure_share=0.25" in said
    # (the share is not in the weights' cache key: the same weights, trained once)
    accepted = with_overrides(cfg, ["task.reward_max_failure_share=1.0"])
    again = warm_start(accepted, prompts)[1]
    assert again["cached"] is True and math.isfinite(again["eval_reward"])


def test_a_reward_failing_on_nearly_every_response_stops_without_the_share_window():
    """``None`` for a wrong answer, 1.0 for a right one: 99% failing, a few scored. The
    scores switched the run to the share rule, which waits its window (300 s) from the
    first score: 258 s of a run at version 0 and 41,551 errors, with no group to train.
    Failing on 90% or more over OVERWHELMED_WINDOW_S (120 s) stops it then."""
    from laminar.rewards import OVERWHELMED_WINDOW_S

    failures = RewardFailures("m:f", 0.25)  # (the default share window, 300 s)
    t, why = polls(failures, {"r0": (99, 1), "r1": (99, 1)}, 0.0, 400.0)
    assert t == OVERWHELMED_WINDOW_S == 120
    # the polls in (0, 120]: 120 of them, 198 failed and 2 scored each
    assert why == (
        "task.reward 'm:f' failed on 23760 of the 24000 responses it was given in the "
        "last 120 s (99%, at least 90%); a group is trained on only when every response "
        "in it scored, so nearly every group is discarded and the run would train on "
        f"next to nothing (latest: {LATEST}); fix the function (a reward returns a number "
        "for every response, e.g. 0.0 for a wrong one), or the service it calls"
    )


def test_nearly_always_failing_is_judged_over_its_own_window_not_from_the_start():
    """A reward service that starts late (its first 100 s all failures) and then scores
    goes on: the last 120 s are not 90% failures once it is up. An outage of a minute
    later on goes on too; one for good stops the run 108 s into it (at a share limit of
    0.5, the share rule would take 150 s of its 300)."""
    failures = RewardFailures("m:f", 0.5)
    assert polls(failures, {"r0": (8, 0)}, 0.0, 50.0) is None  # (under the never-scores 60 s)
    assert polls(failures, {"r0": (0, 8)}, 51.0, 600.0) is None
    assert polls(failures, {"r0": (8, 0)}, 601.0, 660.0) is None  # a minute down
    assert polls(failures, {"r0": (0, 8)}, 661.0, 1500.0) is None
    t, why = polls(failures, {"r0": (8, 0)}, 1501.0, 1700.0)  # down for good
    assert t == 1501.0 + 107 and "(90%, at least 90%)" in why, (t, why)


def test_a_share_limit_of_0_9_or_more_is_the_nearly_always_rules_too():
    """task.reward_max_failure_share=0.95 accepts 92% failing: the rule of 90% over 120 s
    does not stop it either, and at 1.0 neither does 99%."""
    assert polls(RewardFailures("m:f", 0.95), {"r0": (92, 8)}, 0.0, 1000.0) is None
    assert polls(RewardFailures("m:f", 1.0), {"r0": (99, 1)}, 0.0, 1000.0) is None
    t, why = polls(RewardFailures("m:f", 0.95), {"r0": (97, 3)}, 0.0, 1000.0)
    assert t == 120 and "(97%, at least 95%)" in why


def test_the_stop_is_said_when_decided_with_the_reward_batches_it_waits_for(caplog):
    """A reward that hangs: the run decided to stop, then said nothing for a minute, until
    a rollout's "stopped with 2 reward batches still out after 60 s". The decision is
    said at once, with what it waits for and how long."""
    failures = RewardFailures("m:f", 0.25, wait_s=60.0)
    with caplog.at_level(logging.WARNING, logger="laminar"):
        assert failures.check([stats("r0", 64, 0) | {"pending_rewards": 2}], 0.0) is None
        why = failures.check([stats("r0", 64, 0) | {"pending_rewards": 2}], W)
    assert why is not None
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping")]
    assert said == [
        f"stopping the run: {why} (waiting up to 60 s, cluster.actor_timeout_s, for the 2 "
        "reward batches in flight)"
    ]
