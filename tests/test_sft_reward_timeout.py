"""The warm start's scoring gives up early on a reward that hangs (laminar.sft.evaluate):
each call costs task.reward_timeout_s, and waiting for the 64 failures of the run's rule
kept the warm start silent for 64 timeouts (5 h 20 min at the default 300 s)."""

import math
import os
import time
from pathlib import Path

from laminar.config import with_overrides
from laminar.model import load_policy
from laminar.prompt_pool import load_prompts
from laminar.sft import GOES_ON, TIMEOUTS_TO_GIVE_UP, evaluate


def hangs(response: str, answer: str) -> float:
    time.sleep(3600)
    return 0.0


def hangs_first(response: str, answer: str) -> float:
    """Hangs on its first call (counted in a file: each cut call's process is killed)."""
    seen = Path(os.environ["SFT_TEST_HANG_MARK"])
    if not seen.exists():
        seen.write_text("hung")
        time.sleep(3600)
    return 1.0


def _scoring(small_config, tiny_policy, reward: str, caplog):
    cfg = with_overrides(
        small_config,
        [f"task.reward=test_sft_reward_timeout:{reward}", "task.reward_timeout_s=0.3"],
    )
    model, tok = load_policy(tiny_policy)
    prompts = load_prompts(cfg)[:40]
    t0 = time.time()
    with caplog.at_level("WARNING", logger="laminar.sft"):
        value = evaluate(cfg, model, tok, prompts)
    return value, time.time() - t0


def test_a_reward_that_hangs_is_given_up_on_after_a_few_timeouts(small_config, tiny_policy, caplog):
    value, _ = _scoring(small_config, tiny_policy, "hangs", caplog)
    assert math.isnan(value)
    first, last = [r.getMessage() for r in caplog.records]
    # given up after 3 timeouts, not one per response (40 here: 0.3 s and a new
    # process's 0.3 s each)
    assert "gives up on it after 3 such calls with none scored" in first
    assert "on 3 of the 3 responses it was given" in last
    assert "task.reward_timeout_s=0.3 s" in first and "test_sft_reward_timeout:hangs" in first
    assert f"after {TIMEOUTS_TO_GIVE_UP} such calls" in first
    assert "its reward is nan" in last and "raise task.reward_timeout_s" in last
    assert last.endswith(GOES_ON)  # (what the run does next: the rules that may stop it)
    assert f"on {TIMEOUTS_TO_GIVE_UP} of the {TIMEOUTS_TO_GIVE_UP} responses" in last


def test_a_reward_that_hangs_once_then_scores_is_not_given_up_on(
    small_config, tiny_policy, caplog, tmp_path, monkeypatch
):
    monkeypatch.setenv("SFT_TEST_HANG_MARK", str(tmp_path / "hung"))
    value, _ = _scoring(small_config, tiny_policy, "hangs_first", caplog)
    assert 0 < value <= 1  # (scored: 1.0, or truncated_reward for a response cut off)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "did not return within task.reward_timeout_s=0.3 s" in warning
