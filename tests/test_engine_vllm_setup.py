"""How the vLLM engine sets vLLM up: what needs no vLLM to check (the engine itself is
tested in tests/test_engine_vllm.py, in vLLM's own environment)."""

import logging
import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.engine import EngineError
from laminar.engine_base import plan_admission
from laminar.vllm_engine import _check_model_runner, _step_token_budget, _vllm_environment

RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


@pytest.fixture
def environ(monkeypatch):
    """The variables _vllm_environment sets, restored after the test."""
    for name in (RUNNER, "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("given", [None, "0", "1"])
def test_vllm_is_set_to_its_v1_model_runner(environ, caplog, given):
    """laminar's sampler is a logits processor of vLLM's V1 model runner; the V2 runner
    (vLLM's default for Llama and Qwen models where it can run) never calls it. A user's
    other value is overridden, and said so."""
    if given is not None:
        environ.setenv(RUNNER, given)
    with caplog.at_level(logging.INFO, logger="laminar.vllm_engine"):
        _vllm_environment()
    assert os.environ[RUNNER] == "0"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    said = [r.getMessage() for r in caplog.records if RUNNER in r.getMessage()]
    assert len(said) == (given == "1")
    assert all("'1' overridden with 0" in m for m in said)


def test_an_engine_built_with_the_v2_runner_is_refused():
    """vLLM caches its environment once an engine of the process started: one started
    earlier with the variable set would put every later engine on the V2 runner, where
    nothing would sample. The built engine's config says which runner it got."""
    with pytest.raises(EngineError, match=RUNNER):
        _check_model_runner(SimpleNamespace(use_v2_model_runner=True))
    _check_model_runner(SimpleNamespace(use_v2_model_runner=False))
    _check_model_runner(SimpleNamespace())  # (a vLLM without the property: V1 only)
    _check_model_runner(None)


@st.composite
def engine_steps(draw):
    """An engine's limits, and the contexts of its running and waiting requests."""
    max_batch = draw(st.integers(1, 96))
    max_seq_len = draw(st.integers(2, 320))
    capacity = draw(st.integers(2, max_batch * max_seq_len))
    longest = min(max_seq_len, capacity)  # (check_request: a request must fit both)
    contexts = st.lists(st.integers(1, longest), max_size=2 * max_batch)
    return capacity, max_batch, max_seq_len, draw(contexts), draw(contexts)


@settings(max_examples=300, deadline=None)
@given(engine_steps())
def test_one_step_of_laminars_admission_fits_vllms_token_budget(step):
    """vLLM prefills at most max_num_batched_tokens a step and chunks the rest over later
    steps, where laminar's pacer and kv_stats took it as done. Every step laminar plans
    fits the budget: the admitted contexts plus one decode token per request kept
    running. (The budget was max(max_seq_len, max_batch, 2048): a batch of 64 prompts of
    100 tokens was split over several steps.)"""
    capacity, max_batch, max_seq_len, running, waiting = step
    running = running[:max_batch]
    plan = plan_admission(running, waiting, capacity=capacity, max_batch=max_batch)
    kept = len(running) - plan.preempt
    admitted = [*running[kept:], *waiting][: plan.admit]
    budget = _step_token_budget(capacity, max_batch, max_seq_len)
    assert kept + sum(admitted) <= budget
    assert max_batch <= budget <= max(max_batch * max_seq_len, max_seq_len)
    assert budget >= max_seq_len  # (what vLLM needs where it cannot chunk a prefill)
