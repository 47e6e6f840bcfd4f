"""How the vLLM engine sets vLLM up: what needs no vLLM to check (the engine itself is
tested in tests/test_engine_vllm.py, in vLLM's own environment)."""

import logging
import os
from types import SimpleNamespace

import pytest

from laminar.engine import EngineError
from laminar.vllm_engine import _check_model_runner, _vllm_environment

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
