"""The run's first reward call cut at task.reward_timeout_s is warned of, once, naming the
setting (pipelines.driver_polls.RewardFailures): a reward that never returns stops the
run only after 64 such failures, hours at the default 300 s, and said nothing till then."""

from __future__ import annotations

import logging

from pipelines.driver_polls import RewardFailures

CUT = "reward m:slow did not return within task.reward_timeout_s=300 s"


def stats(rollout_id: str, errors: int, scored: int, latest: str | None) -> dict:
    return {
        "rollout_id": rollout_id,
        "reward_errors": errors,
        "rewards_scored": scored,
        "last_reward_error": latest,
    }


def test_the_first_reward_timeout_is_warned_of_once(caplog):
    failures = RewardFailures("m:slow", 0.25)
    with caplog.at_level(logging.WARNING, logger="laminar"):
        assert failures.check([stats("r0", 0, 0, None)], 0.0) is None
        assert failures.check([stats("r0", 1, 0, "reward m:slow returned nan")], 1.0) is None
        assert not caplog.records  # (not a timeout: the rules' business)
        assert failures.check([stats("r0", 2, 0, CUT), stats("r1", 1, 0, CUT)], 2.0) is None
        assert failures.check([stats("r0", 3, 0, CUT), stats("r1", 2, 0, CUT)], 3.0) is None
    (said,) = [r.getMessage() for r in caplog.records]
    assert "task.reward 'm:slow'" in said and "task.reward_timeout_s=300 s" in said
    assert "only after 64 such failures" in said and "lower task.reward_timeout_s" in said
