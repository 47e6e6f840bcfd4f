"""examples/custom_task/ (the worked example of a task of your own) stays runnable: its
config loads, passes preflight from its folder (the prompts in the tiny model's words
and within rollout.max_seq_len, the reward importable as module:function) and its
reward's doctests hold. (Its run itself, about 30 s: `laminar run config.yaml` there.)"""

from __future__ import annotations

import doctest
import importlib
import json

from conftest import REPO

EXAMPLE = REPO / "examples" / "custom_task"


def test_the_custom_task_example_passes_preflight_and_its_doctests(monkeypatch):
    from laminar.config import load_config
    from laminar.tasks import jsonl_prompts
    from pipelines.preflight import preflight
    from pipelines.run_dir import absolute_paths

    monkeypatch.chdir(EXAMPLE)  # (as the README runs it: from there, on PYTHONPATH)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = absolute_paths(load_config("config.yaml"))
    assert cfg.task.reward == "add_reward:add_reward"
    preflight(cfg)
    module = importlib.import_module("add_reward")
    assert doctest.testmod(module).failed == 0
    prompts = jsonl_prompts(cfg.task.prompt_file)
    lines = (EXAMPLE / "prompts.jsonl").read_text().splitlines()
    assert [p.answer for p in prompts] == [json.loads(line)["answer"] for line in lines]
    assert all(module.add_reward(p.answer, p.answer) == 1.0 for p in prompts)
