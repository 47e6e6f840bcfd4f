"""The tiny policy, the KV-cached forward and the torch engine."""

import json

import numpy as np
import pytest
import torch

from laminar.engine import GenerationRequest, TorchEngine
from laminar.errors import LaminarError, ModelError
from laminar.model import CachedDecoder, check_policy_dir, load_policy
from laminar.update import pack, response_logprobs


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return load_policy(tiny_policy)


def make_engine(policy, **kw):
    model, tok = policy
    opts = dict(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=8, max_seq_len=48
    )
    return TorchEngine(model.config, model.state_dict(), **(opts | kw))


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


def test_cached_decoder_matches_hf_forward_with_left_padding(policy):
    model, _ = policy
    dec = CachedDecoder(model.config, model.state_dict())
    seqs = [[1, 5, 6, 7, 8], [1, 9], [1, 11, 12, 13, 14, 15, 16]]
    width = max(map(len, seqs))
    toks = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width + 1, dtype=torch.bool)
    for i, s in enumerate(seqs):
        toks[i, width - len(s) :] = torch.tensor(s)
        valid[i, width - len(s) : width] = True
    pos = (valid[:, :width].long().cumsum(1) - 1).clamp(min=0)
    cache = dec.new_cache(len(seqs), width + 1)
    logits = dec.forward(toks, pos, cache, 0, valid)
    nxt = logits.argmax(-1)
    valid[:, width] = True
    logits2 = dec.forward(nxt[:, None], pos[:, -1:] + 1, cache, width, valid)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s + [int(nxt[i])]])).logits[0]
            assert torch.allclose(ref[-2], logits[i], atol=1e-4)
            assert torch.allclose(ref[-1], logits2[i], atol=1e-4)


def test_behavior_logprobs_match_the_trainer_forward(policy):
    model, tok = policy
    eng = make_engine(policy, temperature=0.7)
    prompts = [(1, 5, 6), (1, 7), (1, 8, 9, 10, 11)]
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(str(i), p, max_new_tokens=12))
    outs = []
    while eng.has_work():
        outs += eng.step()
    outs.sort(key=lambda o: o.request.request_id)
    batch = pack(
        [np.array(o.request.prompt_tokens) for o in outs],
        [o.response_tokens for o in outs],
        [o.logprobs for o in outs],
        [np.ones(len(o.response_tokens)) for o in outs],
        tok.pad_token_id,
    )
    with torch.no_grad():
        trainer_lp = response_logprobs(model, batch, temperature=0.7)
    diff = ((trainer_lp - batch.old_logprobs).abs() * batch.response_mask).max()
    assert float(diff) < 1e-4


def test_engine_finishes_every_request_and_reports_kv(policy):
    eng = make_engine(policy, max_batch=3)
    for i in range(5):
        eng.add_request(GenerationRequest(str(i), (1, 5 + i), max_new_tokens=6))
    assert eng.kv_stats().waiting == 5
    eng.step()
    kv = eng.kv_stats()
    assert (
        kv.running == 3 and kv.waiting == 2 and 0 < kv.used_tokens <= kv.capacity_tokens == 3 * 48
    )
    outs = eng.step()
    while eng.has_work():
        outs += eng.step()
    assert len(outs) <= 5
    for o in outs:
        assert o.finish_reason in ("eos", "length") and len(o.response_tokens) <= 6
        assert (o.finish_reason == "eos") == (o.response_tokens[-1] == 2)
        assert np.all(o.logprobs <= 0) and o.version == 0


def test_engine_seeded_sampling_is_reproducible(policy):
    def run():
        eng = make_engine(policy, seed=7)
        eng.add_request(GenerationRequest("a", (1, 5, 6), max_new_tokens=10))
        outs = []
        while eng.has_work():
            outs += eng.step()
        return outs[0].response_tokens.tolist()

    assert run() == run()


def test_engine_refuses_bad_requests_and_mid_batch_weight_loads(policy):
    model, _ = policy
    eng = make_engine(policy)
    with pytest.raises(LaminarError, match="empty prompt"):
        eng.add_request(GenerationRequest("a", (), max_new_tokens=4))
    with pytest.raises(LaminarError, match="exceeds the engine's max_seq_len"):
        eng.add_request(GenerationRequest("b", (1,) * 40, max_new_tokens=20))
    eng.add_request(GenerationRequest("c", (1, 5), max_new_tokens=20))
    eng.step()
    if eng.has_work():
        with pytest.raises(LaminarError, match="drain the batch first"):
            eng.load_weights(model.state_dict(), 1)
    while eng.has_work():
        eng.step()
    eng.load_weights(model.state_dict(), 1)
    assert eng.version == 1


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


def test_cached_decoder_matches_qwen2_with_biases_and_gqa():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    dec = CachedDecoder(model.config, model.state_dict())
    seq = torch.tensor([[3, 7, 11, 13, 17]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    logits = dec.forward(seq, torch.arange(5)[None], dec.new_cache(1, 5), 0, valid)
    with torch.no_grad():
        ref = model(seq).logits[0, -1]
    assert torch.allclose(ref, logits[0], atol=1e-4)
