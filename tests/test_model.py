"""The tiny policy and the KV-cached forward (the engine: test_engine_torch.py)."""

import json

import pytest
import torch

from laminar.errors import ModelError
from laminar.model import CachedDecoder, cache_bytes, check_policy_dir, load_policy


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return load_policy(tiny_policy)


def test_policy_folder_is_a_plain_hf_checkpoint(tiny_policy, policy):
    model, tok = policy
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in tiny_policy.iterdir()
    }
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert tok.decode(tok("n 12 >")["input_ids"]) == "n 12 >"
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tiny_policy, local_files_only=True)
    assert type(again).__name__ == "LlamaForCausalLM"


def check_decoder_against_hf(model, seqs):
    """Prefill right-padded rows, then decode one ragged step; compare with HF."""
    dec = CachedDecoder(model.config, model.state_dict())
    width = max(map(len, seqs))
    toks = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    cache = dec.new_cache(len(seqs) + 1, width + 4)  # a spare row: views must work
    # (what preflight weighs against a worker's memory_limit is what the engine makes)
    assert cache_bytes(model.config, len(seqs) + 1, width + 4) == cache.nbytes
    logits = dec.prefill(toks, lengths, cache[:, :, : len(seqs)])
    nxt = logits.argmax(-1)
    logits2 = dec.decode(nxt, lengths, cache[:, :, : len(seqs)])
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s + [int(nxt[i])]])).logits[0]
            assert torch.allclose(ref[-2], logits[i], atol=1e-4)
            assert torch.allclose(ref[-1], logits2[i], atol=1e-4)


def test_cached_decoder_matches_hf_with_ragged_rows(policy):
    model, _ = policy
    check_decoder_against_hf(model, [[1, 5, 6, 7, 8], [1, 9], [1, 11, 12, 13, 14, 15, 16]])


def test_model_folder_errors(tmp_path, tiny_policy):
    with pytest.raises(ModelError, match="does not exist; set model.path"):
        check_policy_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match=r"lacks \['tokenizer.json', 'model.safetensors'\]"):
        check_policy_dir(tmp_path)
    other = tmp_path / "gpt"
    other.mkdir()
    for f in tiny_policy.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="model_type 'gpt2'"):
        check_policy_dir(other)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_model_file_that_is_a_folder_is_named_not_a_traceback(tmp_path, tiny_policy, name):
    """A folder where config.json (or a tokenizer file) belongs raised a raw
    IsADirectoryError out of `laminar run`."""
    folder = tmp_path / "policy"
    folder.mkdir()
    for f in tiny_policy.iterdir():
        if f.is_file() and f.name != name:
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / name).mkdir()
    with pytest.raises(ModelError, match=rf"{name}' is damaged \(IsADirectoryError.*model.path"):
        check_policy_dir(folder)


@pytest.mark.parametrize("field", ["attention_dropout", "resid_pdrop"])
def test_a_policy_with_dropout_is_refused_naming_the_field(tmp_path, tiny_policy, field):
    """The trainer's forwards run in training mode and the engines sample without
    dropout: a policy whose config turns it on would train on ratios that are noise,
    not 1, on fresh data. Refused where the folder is checked (before any cluster
    starts), naming the field and the fix; at 0 it loads."""
    folder = tmp_path / "policy"
    folder.mkdir()
    for f in tiny_policy.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    assert config["attention_dropout"] == 0.0  # (the built-in model has none)
    (folder / "config.json").write_text(json.dumps(config | {field: 0.1}))
    with pytest.raises(ModelError, match=rf"\({field}=0.1 in its config.json\).*Set {field} to 0"):
        check_policy_dir(folder)
    with pytest.raises(ModelError, match=field):
        load_policy(folder)
    (folder / "config.json").write_text(json.dumps(config | {field: 0}))
    check_policy_dir(folder)


# A small HF model's shape: 2 layers, grouped-query attention
SMALL = dict(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SMALL |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _small(config_cls, model_cls, **extra):
    """A small random HF model of :data:`SMALL`'s shape, in eval mode."""
    torch.manual_seed(0)
    return model_cls(config_cls(**SMALL, **extra)).eval()


def test_cached_decoder_matches_qwen2_with_biases_and_gqa():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _small(Qwen2Config, Qwen2ForCausalLM)
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    check_decoder_against_hf(model, [[3, 7, 11, 13, 17], [4, 9], [5]])


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_cached_decoder_matches_llama_with_biases(bias):
    """A Llama with ``attention_bias`` has biases on q/k/v *and* o; with ``mlp_bias``,
    on gate/up/down: every one of them must reach the cached forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _small(LlamaConfig, LlamaForCausalLM, **{bias: True})
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    check_decoder_against_hf(model, [[3, 7, 11, 13, 17], [4, 9], [5]])


def test_cached_decoder_refuses_what_it_would_compute_wrong():
    """A config whose forward differs from the cached decoder's maths (another MLP
    activation, sliding-window attention) is refused, not generated from silently."""
    from transformers import LlamaConfig, Qwen2Config

    gelu = LlamaConfig(**SMALL, hidden_act="gelu")
    window = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    for cfg, reason in [(gelu, "hidden_act 'gelu'"), (window, "sliding")]:
        with pytest.raises(ModelError, match=reason):
            CachedDecoder(cfg, {})
    # A sliding window switched off (Qwen2's default) is a plain full-attention model.
    plain = Qwen2Config(**SMALL, sliding_window=4)
    assert not getattr(plain, "use_sliding_window", False)


def test_the_decoder_owns_its_weights(policy):
    """The state it loads from may be reused at once (the relay puller's receive buffer
    is): writing into it must not change the weights the engine generates with."""
    model, _ = policy
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dec = CachedDecoder(model.config, state)
    before = dec.embed.clone()
    state["model.embed_tokens.weight"].add_(1.0)  # (the next pull, writing in place)
    assert torch.equal(dec.embed, before)


def test_a_load_missing_a_weight_changes_nothing(policy):
    """A state dict that lacks a layer's weight is refused whole: the decoder keeps all
    of its old weights, not the new embeddings beside a truncated stack of layers."""
    model, _ = policy
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dec = CachedDecoder(model.config, state)
    embed, layers = dec.embed.clone(), [dict(layer) for layer in dec.layers]
    new = {k: v + 1.0 for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelError, match="model.layers.1.mlp.up_proj.weight"):
        dec.load(new)
    assert torch.equal(dec.embed, embed) and len(dec.layers) == len(layers) == dec.n_layers
    for now, before in zip(dec.layers, layers, strict=True):
        assert all(now[k] is before[k] for k in before)
