"""A model past save_pretrained's max_shard_size is saved as model.safetensors.index.json
and its shards, with no model.safetensors: its checkpoints resume and serve a recovery."""

from __future__ import annotations

import pytest
import torch
from learner_cases import CFG, batch, weights

from laminar.learner import CheckpointError, Learner, check_checkpoint
from laminar.relay_client import fetch_version
from laminar.relay_core import VersionUnavailable


@pytest.fixture
def sharded(monkeypatch):
    from transformers import LlamaForCausalLM

    save = LlamaForCausalLM.save_pretrained
    monkeypatch.setattr(
        LlamaForCausalLM,
        "save_pretrained",
        lambda self, d, **k: save(self, d, **{**k, "max_shard_size": "500KB"}),
    )


def test_a_sharded_checkpoint_resumes_and_serves_a_recovery(tiny_policy, tmp_path, sharded):
    """It was refused as lacking model.safetensors (a resume), and read as damaged by a
    recovery's fetch of an old version; its shards are checked like the one file."""
    from transformers import AutoConfig

    first = Learner(CFG, tiny_policy)
    first.update(batch(0))
    ckpt = first.save(tmp_path / "version-000001")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (ckpt / "model.safetensors").exists()
    check_checkpoint(ckpt, AutoConfig.from_pretrained(tiny_policy), CFG)
    resumed = Learner(CFG, tiny_policy, resume_from=ckpt)
    a, b = weights(first), weights(resumed)
    assert resumed.version == 1 and all(torch.equal(a[k], b[k]) for k in a)
    state = fetch_version(1, None, tmp_path)
    assert set(state) == set(a) and all(torch.equal(state[k], a[k]) for k in a)
    shards[-1].write_bytes(shards[-1].read_bytes()[:-8])  # one shard cut short
    with pytest.raises(CheckpointError, match=shards[-1].name):
        check_checkpoint(ckpt, AutoConfig.from_pretrained(tiny_policy), CFG)
    shards[0].unlink()  # one shard gone: not loaded as part of the weights
    with pytest.raises(VersionUnavailable, match=shards[0].name):
        fetch_version(1, None, tmp_path)
