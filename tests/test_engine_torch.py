"""The torch engine: the shipped contract suite, plus what only it promises."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.engine import GenerationRequest, SamplingParams
from laminar.model import load_policy
from laminar.sampling import uniforms
from laminar.testing import EngineContract, drain, tokens_of
from laminar.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return load_policy(tiny_policy)


def build(policy, **kw):
    model, tok = policy
    opts = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tokenizer=tok)
    return TorchEngine(model.config, model.state_dict(), **(opts | kw))


class TestTorchEngine(EngineContract):
    @pytest.fixture
    def policy_dir(self, tiny_policy):
        return tiny_policy

    @pytest.fixture
    def make_engine(self, policy):
        return lambda **kw: build(policy, **kw)


def assert_same_tokens_up_to_rounding(model, outs, ref, atol: float = 1e-6):
    """The same tokens, except where the two runs part at a rounding tie.

    Logits computed in another batch shape (or re-prefilled) differ by ~1e-7, so where
    a token's uniform lies that close to a boundary of the CDF (about one token in 10^8)
    two runs may sample neighbours and go on differently. At the first difference the
    uniform must be within ``atol`` of the CDF between the two tokens (``T = 1``, no
    filtering: the requests' sampling)."""
    assert set(outs) == set(ref)
    for rid, o in outs.items():
        a, b = o.response_tokens.tolist(), ref[rid].response_tokens.tolist()
        if a == b:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert i is not None, f"{rid}: one response is a prefix of the other"
        p = o.request.params
        assert p.temperature == 1 and p.top_p == 1 and p.top_k == 0
        with torch.no_grad():
            logits = model(torch.tensor([[*o.request.prompt_tokens, *a[:i]]])).logits[0, -1]
        cdf = torch.softmax(logits.double(), -1).cumsum(-1)
        target = float(uniforms([p.seed], [i])[0]) * float(cdf[-1])
        gap = min(abs(target - float(cdf[j])) for j in range(min(a[i], b[i]), max(a[i], b[i])))
        assert gap <= atol, f"{rid}: token {i} is {a[i]} here, {b[i]} there, {gap=:.2e}"


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 40)), min_size=1, max_size=14),
    capacity=st.integers(53, 400),
    max_batch=st.integers(1, 8),
)
def test_capacity_is_never_exceeded_for_any_workload(policy, lengths, capacity, max_batch):
    """Any prompts/limits, any capacity: KV use stays within it and every request ends
    with the tokens it would have had with room to spare."""
    reqs = [
        GenerationRequest(f"r{i}", tuple(range(3, 3 + p)), SamplingParams(n, seed=i))
        for i, (p, n) in enumerate(lengths)
    ]

    def run(**kw):
        eng = build(policy, max_seq_len=52, **kw)
        for r in reqs:
            eng.add_request(r)

        def check(e):
            kv = e.kv_stats()
            assert kv.used_tokens <= kv.capacity_tokens
            assert kv.running <= e.max_batch

        return eng, drain(eng, check=check)

    eng, outs = run(max_batch=max_batch, kv_capacity_tokens=min(capacity, max_batch * 52))
    assert_same_tokens_up_to_rounding(policy[0], outs, run(max_batch=16)[1])
    for r in reqs:
        assert len(outs[r.request_id].response_tokens) <= r.params.max_new_tokens


def test_preempted_requests_resume_where_they_stopped(policy):
    reqs = [GenerationRequest(f"r{i}", (3, 4, 5), SamplingParams(40, seed=i)) for i in range(6)]
    eng = build(policy, max_batch=6, max_seq_len=64, kv_capacity_tokens=100)
    for r in reqs:
        eng.add_request(r)
    outs = drain(eng)
    assert eng.stats()["preemptions"] > 0
    roomy = build(policy, max_batch=6, max_seq_len=64)
    for r in reqs:
        roomy.add_request(r)
    assert tokens_of(outs) == tokens_of(drain(roomy))
    assert roomy.stats()["preemptions"] == 0


def test_long_tail_requests_decode_in_a_shrinking_batch(policy):
    """Continuous batching: new requests join while others run, finished ones leave."""
    eng = build(policy, max_batch=4, max_seq_len=64)
    for i in range(4):
        eng.add_request(GenerationRequest(f"a{i}", (3, 4), SamplingParams(5 + 10 * i, seed=i)))
    sizes = []
    for step in range(60):
        if step == 8:
            eng.add_request(GenerationRequest("late", (3, 4), SamplingParams(5, seed=9)))
        eng.step()
        sizes.append(eng.kv_stats().running)
        if not eng.has_work():
            break
    assert sizes[0] == 4 and 0 < min(sizes[4:9]) < 4  # a0 left after 5 tokens
    assert sizes[8] > sizes[7] or sizes[8] == 4  # "late" joined without waiting for a drain
    assert not eng.has_work()


def test_engine_parity_with_the_trainer_forward(policy):
    """Behavior logprobs vs the trainer's own forward (laminar.update), the parity figure
    recorded in the closing note: max abs diff ≤ 1e-4 in fp32 on CPU."""
    from laminar.update import pack, response_logprobs

    model, tok = policy
    eng = build(policy, max_batch=16, max_seq_len=64)
    for i in range(16):
        prompt = tuple(3 + (i * 5 + j) % 50 for j in range(1 + i % 7))
        eng.add_request(GenerationRequest(str(i), prompt, SamplingParams(40, 0.7, seed=i)))
    outs = sorted(drain(eng).values(), key=lambda o: int(o.request.request_id))
    batch = pack(
        [np.array(o.request.prompt_tokens) for o in outs],
        [o.response_tokens for o in outs],
        [o.logprobs for o in outs],
        [np.ones(len(o.response_tokens)) for o in outs],
        tok.pad_token_id,
    )
    with torch.no_grad():
        lp = response_logprobs(model, batch, temperature=0.7)
    diff = ((lp - batch.old_logprobs).abs() * batch.response_mask).max()
    assert float(diff) <= 1e-4


def test_a_seed_outside_64_bits_is_refused_on_arrival(policy):
    """The sampler hashes seeds as uint64: a negative or too large seed must be refused
    when the request arrives, not fail the step of every request decoding with it."""
    from laminar.engine import EngineError

    eng = build(policy, max_batch=4, max_seq_len=32)
    eng.add_request(GenerationRequest("ok", (3, 4), SamplingParams(4, seed=2**64 - 1)))
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(EngineError, match="seed"):
            eng.add_request(GenerationRequest(f"s{bad}", (3, 4), SamplingParams(4, seed=bad)))
    assert len(drain(eng)["ok"].response_tokens) >= 1


def test_a_vanishing_temperature_samples_the_argmax_with_logprob_0(policy):
    """``logits / T`` overflows float32 for T ≲ 1e-38: the limit T → 0 is the argmax with
    behavior logprob 0, not NaN logprobs and a token drawn from NaN probabilities."""
    reqs = [
        GenerationRequest(f"g{i}", (3 + i, 4), SamplingParams(8, 0.0, seed=i)) for i in range(3)
    ]

    def run(temperature):
        eng = build(policy, max_batch=4, max_seq_len=32)
        for r in reqs:
            p = SamplingParams(8, temperature, seed=r.params.seed)
            eng.add_request(GenerationRequest(r.request_id, r.prompt_tokens, p))
        return drain(eng)

    greedy = run(0.0)
    for t in (1e-30, 1e-38, 1e-44):
        outs = run(t)
        assert tokens_of(outs) == tokens_of(greedy)
        for o in outs.values():
            assert np.all(o.logprobs == 0), (t, o.logprobs)


def test_filters_break_ties_as_the_argmax_does():
    """Tied logits: top-k and top-p keep the lowest token ids first, so ``top_k=1`` and
    a tiny ``top_p`` pick what greedy picks (the argmax: the first maximum), whatever
    order an unstable sort leaves tied entries in on a device."""
    from laminar.sampling import sample

    logits = torch.zeros(3, 300)
    logits[:, [7, 200, 250]] = 5.0
    u = uniforms([1, 2, 3], [0, 0, 0])
    ones = np.ones(3)
    greedy, _ = sample(logits, u, np.zeros(3), np.zeros(3, int), ones)
    top1, _ = sample(logits, u, ones, np.ones(3, int), ones)
    nucleus, _ = sample(logits, u, ones, np.zeros(3, int), np.full(3, 1e-9))
    assert greedy.tolist() == top1.tolist() == nucleus.tolist() == [7, 7, 7]
    wide, n = logits[:1].expand(50, -1), np.ones(50)
    top2, _ = sample(wide, uniforms(range(50), [0] * 50), n, np.full(50, 2), n)
    assert set(top2.tolist()) == {7, 200}


def test_a_row_that_does_not_filter_draws_as_it_would_alone():
    """A row with neither filter beside one with ``top_k``: its draw is its own. The
    nucleus mask used to apply ``top_p=1`` to it: where rounding summed its mass past 1
    (a peaked row: most tokens ~1e-9 or less), the tail past mass 1 was dropped, and a
    draw that fell there moved (103 of 400 rows here)."""
    from laminar.sampling import sample

    torch.manual_seed(0)
    n = 400
    logits = torch.randn(n, 50) * 20
    u = np.full(n, 1 - 1e-12)  # (the last tokens of each row's CDF)
    ones, k = np.ones(n), np.zeros(n, int)
    alone, _ = sample(logits, u, ones, k, ones)
    k[0] = 5
    beside, _ = sample(logits, u, ones, k, ones)
    assert (alone[1:] == beside[1:]).all()


def test_a_tokenizer_without_a_pad_token_is_fine(policy):
    """Llama-3-style tokenizers have no pad token (``pad_token_id`` is None); the engine
    pads prefill rows with a token no row attends to, so any id does."""
    reqs = [
        GenerationRequest(f"r{i}", tuple(range(3, 4 + 3 * i)), SamplingParams(6, seed=i))
        for i in range(3)
    ]
    outs = []
    for pad in (None, 0):
        eng = build(policy, pad_token_id=pad, max_batch=4, max_seq_len=32)
        for r in reqs:
            eng.add_request(r)
        outs.append(tokens_of(drain(eng)))
    assert outs[0] == outs[1]


def test_text_leaves_out_a_final_stop_token_as_it_does_eos(policy):
    """``FinishedOutput.text`` is what a reward scores, "without a final stop token":
    a response ended by one of ``stop_token_ids`` loses it as one ended by eos does."""
    _, tok = policy
    eng = build(policy, max_batch=2, max_seq_len=40)
    eng.add_request(GenerationRequest("a", (3, 4), SamplingParams(20, seed=5, ignore_eos=True)))
    resp = drain(eng)["a"].response_tokens.tolist()
    stop = resp[4]
    eng.add_request(
        GenerationRequest("b", (3, 4), SamplingParams(20, seed=5, stop_token_ids=(stop,)))
    )
    out = drain(eng)["b"]
    first = resp.index(stop)
    assert out.finish_reason == "stop" and out.response_tokens.tolist() == resp[: first + 1]
    assert out.text(tok) == tok.decode(resp[:first])


def test_a_request_the_engine_refuses_at_admission_loses_no_other(policy):
    """``_start`` may refuse a request (vLLM's own input checks): the error goes up from
    ``step``, and the refused request and every one behind it stay queued, in order —
    they were all taken off the queue before any started, and the later ones were lost
    from both queues (neither in flight nor ever finished)."""
    from laminar.engine import EngineError

    class Refusing(TorchEngine):
        def _start(self, state):
            if state.request_id == "bad":
                raise EngineError("refused")
            super()._start(state)

    model, tok = policy
    opts = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    eng = Refusing(model.config, model.state_dict(), max_batch=4, max_seq_len=32, **opts)
    reqs = [GenerationRequest(r, (3, 4, 5), SamplingParams(6, seed=i)) for i, r in enumerate("ab")]
    reqs.insert(1, GenerationRequest("bad", (3, 4, 5), SamplingParams(6, seed=9)))
    for r in reqs:
        eng.add_request(r)
    with pytest.raises(EngineError, match="refused"):
        eng.step()
    assert eng.request_ids() == ["a", "bad", "b"]  # a started; bad and b still waiting
    kv = eng.kv_stats()
    assert (kv.running, kv.waiting) == (1, 2)
    # Nothing lost: all three continue elsewhere, with the tokens they would have had.
    elsewhere = build(policy, max_batch=4, max_seq_len=32)
    elsewhere.import_(eng.export(eng.request_ids()))
    plain = build(policy, max_batch=4, max_seq_len=32)
    for r in reqs:
        plain.add_request(r)
    assert tokens_of(drain(elsewhere)) == tokens_of(drain(plain))


def test_stop_strings_decode_the_response_once_a_token(policy):
    """A request with several stop strings decodes its response once per token, not once
    per stop string per token (the whole response each time: quadratic in its length)."""
    from laminar.engine import RequestState
    from laminar.engine_base import stop_reason

    _, tok = policy
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    params = SamplingParams(20, stop=("<never1>", "<never2>", "<never3>"))
    state = RequestState(GenerationRequest("s", (3, 4), params), seed=0, tokens=[5, 6, 7])
    assert stop_reason(state, 7, eos=tok.eos_token_id, tokenizer=Counting()) is None
    assert decoded == [3]


def test_imported_states_are_the_engines_own_copies(policy):
    """``import_`` keeps copies of a state's token, logprob and version lists: the caller's
    states stay as given (a rollout keeps its exported ones to take back), and two
    engines importing the same states never append to one list (they did, and each
    response took the other's tokens too)."""
    reqs = [GenerationRequest(f"r{i}", (3, 4 + i), SamplingParams(12, seed=i)) for i in range(3)]
    src = build(policy, max_batch=4, max_seq_len=32)
    for r in reqs:
        src.add_request(r)
    src.step()
    src.step()
    states = src.export(src.request_ids())
    before = [(list(s.tokens), list(s.logprobs), list(s.token_versions)) for s in states]
    one, two = (build(policy, max_batch=4, max_seq_len=32) for _ in range(2))
    one.import_(states)
    two.import_(states)
    outs_one, outs_two = drain(one), drain(two)
    assert [(s.tokens, s.logprobs, s.token_versions) for s in states] == before
    ref = build(policy, max_batch=4, max_seq_len=32)
    for r in reqs:
        ref.add_request(r)
    assert tokens_of(outs_one) == tokens_of(outs_two) == tokens_of(drain(ref))
