"""A slow reward's warm-start scoring says how far it has got (laminar.sft.evaluate):
256 calls of 2 s each, one after another, kept the warm start silent for 8.5 minutes."""

from __future__ import annotations

import re
import time

from laminar.config import with_overrides
from laminar.model import load_policy
from laminar.prompt_pool import load_prompts
from laminar.rewards import exact_match
from laminar.sft import evaluate


def sleepy(response: str, answer: str) -> float:
    """:func:`exact_match` after 10 ms: a slow reward, here not slow enough to wait for."""
    time.sleep(0.01)
    return exact_match(response, answer)


def test_a_slow_scoring_says_its_progress(small_config, tiny_policy, caplog, monkeypatch):
    """Past ``SCORING_SLOW_S`` (0 here), at most once every ``SCORING_SAID_EVERY_S`` (0
    here: after every chunk), a warning says how many responses are done, of how many,
    the time a response and what is left, and how to skip it; a fast one says nothing."""
    cfg = with_overrides(small_config, ["task.reward=test_sft_scoring_progress:sleepy"])
    model, tok = load_policy(tiny_policy)
    prompts = load_prompts(cfg)[:40]
    monkeypatch.setattr("laminar.sft.SCORING_SLOW_S", 1e9)
    with caplog.at_level("WARNING", logger="laminar.sft"):
        evaluate(cfg, model, tok, prompts)
    assert not caplog.records  # (not slow: nothing said)
    monkeypatch.setattr("laminar.sft.SCORING_SLOW_S", 0.0)
    monkeypatch.setattr("laminar.sft.SCORING_SAID_EVERY_S", 0.0)
    with caplog.at_level("WARNING", logger="laminar.sft"):
        value = evaluate(cfg, model, tok, prompts)
    assert 0 <= value <= 1
    said = [r.getMessage() for r in caplog.records]
    done = [int(re.search(r", (\d+) of 40 responses done in ", m).group(1)) for m in said]
    # one at a time until one scores, then in chunks of 16; not said after the last one
    assert done and done == sorted(done) and done[-1] < 40, said
    assert said[0].startswith(
        "warm start: scoring its policy with task.reward 'test_sft_scoring_progress:sleepy', "
    )
    assert "s a response, one after another; about " in said[0]
    assert said[0].endswith("sft.enabled=false skips the warm start and this")
