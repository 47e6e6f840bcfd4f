"""The vLLM engine: the shipped contract suite, and token-for-token parity with the torch
engine (same requests, same seeds, same tokens), including requests moved between them.

Needs vLLM, which lives in its own environment (it pins transformers<5.20)::

    .ci/vllm-env
    .venv-vllm/bin/python -m pytest tests/test_engine_vllm.py -p no:cacheprovider
"""

import json

import numpy as np
import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as exc:  # not installed, or installed without its CPU fixes
    pytest.skip(
        f"vLLM is not importable here ({type(exc).__name__}: {exc}); build its "
        "environment with .ci/vllm-env, then run .venv-vllm/bin/python -m pytest "
        "tests/test_engine_vllm.py",
        allow_module_level=True,
    )

from laminar.engine import EngineError, GenerationRequest, SamplingParams
from laminar.model import load_policy
from laminar.testing import LOGPROB_ATOL, EngineContract, drain, reference_logprobs, tokens_of
from laminar.torch_engine import TorchEngine
from laminar.vllm_engine import VLLMEngine, main

# vLLM's own deprecation noise, not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning:vllm.*"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the rollout workers run (and as the bench measures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return load_policy(tiny_policy)


@pytest.fixture
def engines():
    """Every VLLMEngine a test builds, closed when it ends."""
    made: list[VLLMEngine] = []
    yield made
    for eng in made:
        eng.close()


@pytest.fixture
def make_vllm(tiny_policy, policy, engines):
    tok = policy[1]

    def make(**kw) -> VLLMEngine:
        opts = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        eng = VLLMEngine(tiny_policy, **(opts | kw))
        engines.append(eng)
        return eng

    return make


def make_torch(policy, state=None, **kw) -> TorchEngine:
    model, tok = policy
    opts = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tokenizer=tok)
    return TorchEngine(model.config, state or model.state_dict(), **(opts | kw))


class TestVLLMEngine(EngineContract):
    @pytest.fixture
    def policy_dir(self, tiny_policy):
        return tiny_policy

    @pytest.fixture
    def make_engine(self, make_vllm):
        return make_vllm


def mixed_requests(n: int = 12, max_new_tokens: int = 40) -> list[GenerationRequest]:
    """Prompts of 2-9 tokens and every sampling option: temperatures, top-k, top-p, greedy."""
    temps, top_ks, top_ps = (1.0, 0.7, 0.0, 1.3), (0, 20, 0, 5), (1.0, 0.9, 1.0, 0.8, 1.0)
    return [
        GenerationRequest(
            f"m{i:02d}",
            tuple(4 + (5 * i + 11 * j) % 280 for j in range(2 + i % 8)),
            SamplingParams(
                max_new_tokens,
                temperature=temps[i % 4],
                top_k=top_ks[i % 4],
                top_p=top_ps[i % 5],
                seed=1000 + i,
            ),
        )
        for i in range(n)
    ]


def run(engine, reqs):
    for r in reqs:
        engine.add_request(r)
    return drain(engine)


def assert_same_outputs(a, b):
    assert tokens_of(a) == tokens_of(b)
    for rid, o in a.items():
        assert o.finish_reason == b[rid].finish_reason
        assert np.abs(o.logprobs - b[rid].logprobs).max() <= LOGPROB_ATOL


def test_same_tokens_as_the_torch_engine(policy, make_vllm):
    reqs = mixed_requests()
    assert_same_outputs(
        run(make_vllm(max_batch=8, max_seq_len=64), reqs),
        run(make_torch(policy, max_batch=8, max_seq_len=64), reqs),
    )


def test_preemption_under_a_small_capacity_changes_nothing(policy, make_vllm):
    reqs = mixed_requests()
    tight = make_vllm(max_batch=12, max_seq_len=64, kv_capacity_tokens=100)
    outs = run(tight, reqs)
    assert tight.stats()["preemptions"] > 0
    assert_same_outputs(outs, run(make_torch(policy, max_batch=12, max_seq_len=64), reqs))


def long_prompts() -> list[GenerationRequest]:
    """48 prompts of 56 tokens: 2,688 to prefill at once, past vLLM's default budget."""
    return [
        GenerationRequest(
            f"c{i:02d}", tuple(4 + (i + 3 * j) % 280 for j in range(56)), SamplingParams(8, seed=i)
        )
        for i in range(48)
    ]


def test_the_step_that_admits_a_request_prefills_it_whole(make_vllm):
    """vLLM's per-step token budget holds a whole step of laminar's admission
    (``_step_token_budget``), so what laminar admits (and the pacer charges) is prefilled
    in that step, and kv_stats counts it written, not waiting in neither queue. (Each
    prefilled request samples its first token in that step too: one that ends there, at
    eos, leaves at once.)"""
    eng = make_vllm(max_batch=48, max_seq_len=64)
    for r in long_prompts():
        eng.add_request(r)
    first = eng.step()
    assert all(len(o.response_tokens) == 1 for o in first), first
    kv = eng.kv_stats()
    assert (kv.running, kv.waiting) == (48 - len(first), 0)
    assert kv.used_tokens == kv.running * 56


def test_prefills_split_over_steps_sample_the_same_tokens(policy, make_vllm, monkeypatch):
    """Where vLLM prefills a prompt in chunks (laminar's budget never lets it: here the
    2,048 tokens it once was), the rows the sampler sees mid-prefill must not shift any
    request's token index."""
    monkeypatch.setattr("laminar.vllm_engine._step_token_budget", lambda *limits: 2048)
    reqs = long_prompts()
    eng = make_vllm(max_batch=48, max_seq_len=64)
    for r in reqs:
        eng.add_request(r)
    first = eng.step()
    assert first == [] and eng.kv_stats().used_tokens < 48 * 56  # some prompts half done
    outs = drain(eng)
    assert_same_outputs(outs, run(make_torch(policy, max_batch=48, max_seq_len=64), reqs))


def test_logprobs_match_a_plain_hf_forward(policy, make_vllm):
    model = policy[0].eval()
    outs = run(make_vllm(max_batch=12, max_seq_len=64), mixed_requests())
    for o in outs.values():
        ref = reference_logprobs(model, o, o.request.params.temperature)
        assert np.abs(ref - o.logprobs).max() <= LOGPROB_ATOL


@pytest.mark.parametrize("direction", ["vllm->torch", "torch->vllm"])
def test_requests_move_between_the_engines_and_continue_exactly(policy, make_vllm, direction):
    reqs = mixed_requests(8, max_new_tokens=30)
    unmoved = run(make_torch(policy, max_batch=8, max_seq_len=64), reqs)
    vllm_eng = make_vllm(max_batch=8, max_seq_len=64)
    torch_eng = make_torch(policy, max_batch=8, max_seq_len=64)
    src, dst = (vllm_eng, torch_eng) if direction == "vllm->torch" else (torch_eng, vllm_eng)
    for r in reqs:
        src.add_request(r)
    done = {}
    for _ in range(9):
        done |= {o.request.request_id: o for o in src.step()}
    moving = [rid for rid in src.request_ids() if rid not in done][:4]
    dst.import_(src.export(moving))
    moved = drain(dst)
    assert set(moved) == set(moving)
    assert all(o.n_moves == 1 for o in moved.values())
    outs = done | drain(src) | moved
    assert_same_outputs(outs, unmoved)


def test_reloaded_weights_sample_like_the_torch_engine_on_them(policy, make_vllm):
    model = policy[0]
    g = torch.Generator().manual_seed(3)
    new = {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g)
        for k, v in model.state_dict().items()
    }
    eng = make_vllm(max_batch=8, max_seq_len=64)
    reqs = mixed_requests(8)
    before = run(eng, reqs)
    eng.load_weights(new, 1)
    after = run(eng, reqs)
    assert tokens_of(after) != tokens_of(before)
    assert all(o.token_versions.tolist() == [1] * len(o.token_versions) for o in after.values())
    assert_same_outputs(after, run(make_torch(policy, new, max_batch=8, max_seq_len=64), reqs))


def test_paced_steps_are_modelled_as_on_the_torch_engine(policy, make_vllm):
    """Pacing sees the same steps on both engines: same batch, context and prefill."""
    from laminar.pacing import Pacer, TimeModel

    def pacer():  # not strict: this machine is slower than the modelled H800s
        return Pacer(TimeModel.named("H800", "7B", tp=4), 1.0, strict=False)

    reqs = mixed_requests(8, max_new_tokens=20)
    paced_vllm = make_vllm(max_batch=4, max_seq_len=64, pacer=pacer())
    paced_torch = make_torch(policy, max_batch=4, max_seq_len=64, pacer=pacer())
    assert_same_outputs(run(paced_vllm, reqs), run(paced_torch, reqs))
    v, t = paced_vllm.stats(), paced_torch.stats()
    assert v["paced_steps"] == t["paced_steps"] == v["steps"] > 0
    assert v["modelled_s"] == pytest.approx(t["modelled_s"], rel=1e-12)


def test_stop_strings_need_no_tokenizer_argument(policy, make_vllm):
    tok = policy[1]
    req = mixed_requests(3)[2]  # greedy
    greedy = run(make_vllm(max_batch=2, max_seq_len=64), [req])[req.request_id]
    word = tok.decode(greedy.response_tokens[2:3])
    params = SamplingParams(40, temperature=0.0, stop=(word,))
    out = run(
        make_vllm(max_batch=2, max_seq_len=64), [GenerationRequest("s", req.prompt_tokens, params)]
    )
    assert out["s"].finish_reason == "stop" and word in out["s"].text(tok)


def test_engines_share_the_process_and_close_cleanly(policy, make_vllm):
    import psutil

    reqs = mixed_requests(4, max_new_tokens=10)
    a, b = make_vllm(max_batch=4, max_seq_len=64), make_vllm(max_batch=4, max_seq_len=64)
    for r in reqs:
        a.add_request(r)
    a.close()
    a.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        a.step()
    assert tokens_of(run(b, reqs)) == tokens_of(run(make_torch(policy), reqs))
    b.close()
    c = make_vllm(max_batch=4, max_seq_len=64)  # a fresh start after every engine closed
    assert tokens_of(run(c, reqs)) == tokens_of(run(make_torch(policy), reqs))
    c.close()
    assert psutil.Process().children(recursive=True) == []


def test_starting_leaves_the_process_rng_and_threads_alone(make_vllm):
    torch.manual_seed(5)
    np.random.seed(5)
    expected = torch.rand(3), np.random.rand(3)
    torch.manual_seed(5)
    np.random.seed(5)
    make_vllm(max_batch=2, max_seq_len=32, seed=123)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)


def test_bench_prints_one_json_line(tiny_policy, capsys):
    main(["--bench", "--policy", str(tiny_policy), "--batch", "4", "--new-tokens", "12"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line)
    assert result["batch"] == 4 and result["new_tokens"] == 12
    assert len(result["tokens_per_s"]) == 3 and min(result["tokens_per_s"]) > 0


@pytest.mark.slow
def test_a_small_run_on_the_vllm_engine(cluster_client, small_config, tmp_path):
    """The tiny run with ``rollout.engine=vllm``: each rollout replica builds a VLLMEngine
    inside its Dask worker process, and the run trains on what it samples."""
    from factories import run_to_end

    from storage import open_run

    run, summary = run_to_end(
        cluster_client, small_config, tmp_path / "run", ["rollout.engine=vllm", "trainer.steps=2"]
    )
    assert summary["reason"] == "completed" and summary["versions"] == 2
    # kv_blocks_* are VLLMEngine's own stats: every replica sampled with vLLM.
    assert all(r["engine_kv_blocks_total"] > 0 for r in summary["rollouts"])
    assert open_run(run.run_dir).laminar.audit() == []
    engine = summary["engine"]
    assert engine["parity_checks"] >= 1
    assert 0 <= engine["parity_max_abs"] <= 1e-4
