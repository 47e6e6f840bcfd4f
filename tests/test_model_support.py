"""What a model folder must be for the run's engines and warm start, checked before any
cluster work (``preflight``) rather than after the warm start has trained."""

from __future__ import annotations

import json
import logging
import math

import pytest

from laminar.config import with_overrides
from laminar.errors import ConfigError
from laminar.model import build_tiny_policy

SHAPE = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _folder(tmp_path, name, config=None, tokenizer_config=None):
    """A tiny Llama folder, its config.json / tokenizer_config.json edited in place."""
    path = build_tiny_policy(tmp_path / name, **SHAPE)
    for file, edit in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if edit:
            data = json.loads((path / file).read_text())
            edit(data)
            (path / file).write_text(json.dumps(data))
    return path


def _cfg(small_config, tmp_path, path, *more):
    return with_overrides(
        small_config,
        [f"sft.cache_dir={tmp_path / 'cache'}", f"model.path={path}", "sft.steps=2", *more],
    )


def test_a_model_the_torch_engine_cannot_run_is_refused_in_preflight(small_config, tmp_path):
    """RoPE scaling passed every check, trained the whole warm start, then failed scoring
    it (the torch engine's forward refused it). Refused for rollout.engine=torch, naming
    model.path, the reason and the engine that runs it; not for vllm's."""
    from pipelines.api import preflight

    path = _folder(tmp_path, "llama3", lambda c: c.update(rope_parameters=LLAMA3))
    with pytest.raises(ConfigError, match=r"model.path .*llama3.*rope_type 'llama3'") as e:
        preflight(_cfg(small_config, tmp_path, path))
    assert "rollout.engine=vllm" in str(e.value)
    gelu = _folder(tmp_path, "gelu", lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ConfigError, match=r"hidden_act 'gelu'.*use another model"):
        preflight(_cfg(small_config, tmp_path, gelu))
    # vLLM's engine runs it (a remote cluster: vLLM need not be installed here)
    remote = ["rollout.engine=vllm", "cluster.kind=address", "cluster.address=tcp://h:8786"]
    preflight(_cfg(small_config, tmp_path, path, *remote))


def test_the_warm_start_of_a_vllm_run_is_not_scored_by_an_engine_that_cannot_run_it(
    small_config, tmp_path, caplog
):
    """The warm start is scored with the torch engine on the trainer's worker; for a
    rollout.engine=vllm run of a model it cannot run, its reward is nan (not kept), named
    in a warning, instead of the run failing after training."""
    from laminar.prompts import load_prompts
    from laminar.sft import warm_start

    path = _folder(tmp_path, "llama3", lambda c: c.update(rope_parameters=LLAMA3))
    cfg = _cfg(small_config, tmp_path, path, "rollout.engine=vllm", "task.num_prompts=16")
    with caplog.at_level(logging.WARNING, logger="laminar.sft"):
        out, info = warm_start(cfg, load_prompts(cfg))
    assert math.isnan(info["eval_reward"]) and "rope_type 'llama3'" in caplog.text
    assert json.loads((out / "sft_info.json").read_text())["eval_rewards"] == {}


@pytest.mark.parametrize(
    "scaling, kind",
    [
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, "llama3"),
        ({"type": "linear", "factor": 2.0}, "linear"),  # (older 4.x configs: "type")
    ],
)
def test_a_transformers_4_config_with_rope_scaling_is_refused_not_run_unscaled(scaling, kind):
    """transformers 4.x (>=4.56 is supported) keeps RoPE scaling in ``rope_scaling``
    beside ``rope_theta``, with no ``rope_parameters``: the decoder read only the latter,
    took the default RoPE, and rollouts sampled from other logits than the trainer's."""
    from types import SimpleNamespace

    from laminar.errors import ModelError
    from laminar.model import CachedDecoder, torch_engine_refusal

    def v4(**rope):  # (transformers 5 turns a 4.x config.json into rope_parameters)
        return SimpleNamespace(hidden_act="silu", rope_theta=500000.0, **rope)

    assert torch_engine_refusal(v4(rope_scaling=None)) is None
    assert torch_engine_refusal(v4(rope_scaling={"rope_type": "default"})) is None
    reason, vllm_ok = torch_engine_refusal(v4(rope_scaling=scaling))
    assert f"rope_type {kind!r}" in reason and vllm_ok
    with pytest.raises(ModelError, match=f"rope_type {kind!r}"):
        CachedDecoder(v4(rope_scaling=scaling), {})


def test_the_rope_theta_of_a_transformers_4_config_is_read():
    from types import SimpleNamespace

    from laminar.model import _rope_theta

    assert _rope_theta(SimpleNamespace(rope_theta=500000.0, rope_scaling=None)) == 500000.0
    assert _rope_theta(SimpleNamespace(rope_parameters={"rope_theta": 7.0})) == 7.0
    assert _rope_theta(SimpleNamespace()) == 10000.0


def _no_eos(c):
    c.pop("eos_token", None)


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused_in_preflight(
    small_config, tmp_path
):
    """It passed preflight; the warm start then failed on the cluster with a numpy
    TypeError (each demonstration ends with eos_token_id None), and without the warm start
    no response ever stopped (the engines compare each token with None)."""
    from laminar.errors import ModelError
    from pipelines.api import preflight

    path = _folder(tmp_path, "noeos", lambda c: c.pop("eos_token_id"), _no_eos)
    for more in ([], ["sft.enabled=false"]):
        with pytest.raises(ModelError, match=r"noeos.*model.path.*no end-of-sequence") as e:
            preflight(_cfg(small_config, tmp_path, path, *more))
        assert '"eos_token" in' in str(e.value) and "tokenizer_config.json" in str(e.value)


def test_a_models_eos_token_id_stands_in_for_its_tokenizers_missing_one(small_config, tmp_path):
    """config.json's eos_token_id stands in, for every user of the folder: the warm start
    trains and scores, its saved tokenizer and the engine stop at that token."""
    from laminar.engine import make_engine
    from laminar.model import load_tokenizer
    from laminar.prompts import load_prompts
    from laminar.sft import warm_start
    from pipelines.api import preflight

    path = _folder(tmp_path, "noeos", None, _no_eos)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert load_tokenizer(path).eos_token_id == eos
    cfg = _cfg(small_config, tmp_path, path, "task.num_prompts=16")
    preflight(cfg)
    out, info = warm_start(cfg, load_prompts(cfg))
    assert 0 <= info["eval_reward"] <= 1 and load_tokenizer(out).eos_token_id == eos
    assert make_engine(cfg.rollout, str(out), seed=0).eos == eos


def test_token_ids_past_the_models_vocabulary_are_refused_in_preflight(small_config, tmp_path):
    """A tokenizer with tokens added after the model was saved (add_tokens without
    resize_token_embeddings) encodes ids the embedding has no row for: an IndexError on
    the cluster, in the warm start or a rollout. Refused naming the line of the prompt
    file and model.path; an answer's too, when the warm start trains on it."""
    from transformers import AutoTokenizer

    from pipelines.api import preflight

    path = _folder(tmp_path, "added")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["foo", "bar"])
    tok.save_pretrained(path)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "c 1 >", "answer": "1"}, {"prompt": "c 2 foo >", "answer": "2"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = [f"task.prompt_file={prompts}", "task.reward=exact_match"]
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2: the prompt .*id 29[45].*added"):
        preflight(_cfg(small_config, tmp_path, path, *run))
    rows[1] = {"prompt": "c 2 >", "answer": "2 bar"}
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2: the answer .*resize_token"):
        preflight(_cfg(small_config, tmp_path, path, *run))
    preflight(_cfg(small_config, tmp_path, path, *run, "sft.enabled=false"))
    # a special token past the table
    tok.add_special_tokens({"pad_token": "<newpad>"})
    tok.save_pretrained(path)
    with pytest.raises(ConfigError, match=r"the pad token of model.path .*added.*vocab_size"):
        preflight(_cfg(small_config, tmp_path, path, *run, "sft.enabled=false"))
