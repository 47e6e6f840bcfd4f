"""The engine contract suite: what every generation engine must do, as pytest tests.

Ship-with-the-library tests in the manner of zarr's ``StoreTests``: an engine's test module
subclasses :class:`EngineContract` and provides two fixtures,

* ``policy_dir`` — a local HF policy folder (the tiny Llama will do);
* ``make_engine`` — a factory ``make_engine(**kw) -> Engine`` building a fresh engine on that
  policy, taking ``max_batch``, ``max_seq_len``, ``kv_capacity_tokens`` and ``seed``.

and pytest collects every ``test_*`` method below for it::

    class TestMyEngine(EngineContract):
        @pytest.fixture
        def make_engine(self, policy_dir):
            return lambda **kw: MyEngine(policy_dir, **kw)

References are computed independently of any engine: behavior logprobs are checked
against a plain ``transformers`` forward of the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from laminar.engine import (
    EngineError,
    FinishedOutput,
    GenerationRequest,
    RequestState,
    SamplingParams,
)

LOGPROB_ATOL = 1e-4  # fp32 on CPU


def drain(engine, *, check=None, limit: int = 100_000) -> dict[str, FinishedOutput]:
    """Step ``engine`` until idle; ``check(engine)`` runs after every step."""
    outs: dict[str, FinishedOutput] = {}
    for _ in range(limit):
        if not engine.has_work():
            return outs
        for o in engine.step():
            assert o.request.request_id not in outs, "a request finished twice"
            outs[o.request.request_id] = o
        if check is not None:
            check(engine)
    raise AssertionError(f"engine still busy after {limit} steps")


def requests(n: int, *, max_new_tokens: int = 24, seed0: int = 0, **params):
    """``n`` requests with prompts of 1-6 tokens and distinct seeds."""
    out = []
    for i in range(n):
        prompt = tuple(1 + (7 * i + 3 * j) % 90 for j in range(1 + i % 6))
        sp = SamplingParams(max_new_tokens=max_new_tokens, seed=seed0 + i, **params)
        out.append(GenerationRequest(f"q{i:03d}", prompt, sp))
    return out


def tokens_of(outs: dict[str, FinishedOutput]) -> dict[str, list[int]]:
    return {k: o.response_tokens.tolist() for k, o in outs.items()}


def reference_logprobs(model, out: FinishedOutput, temperature: float) -> np.ndarray:
    """Logprobs of ``out``'s response tokens under a plain forward of ``model``."""
    prompt = list(out.request.prompt_tokens)
    resp = out.response_tokens.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + resp])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)
    return logp.gather(1, torch.tensor(resp)[:, None])[:, 0].numpy()


class EngineContract:
    """Subclass with ``policy_dir`` and ``make_engine`` fixtures (see the module docstring)."""

    @pytest.fixture
    def hf_model(self, policy_dir):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True).eval()

    # -- sampling --------------------------------------------------------------------------
    def test_seeded_sampling_is_deterministic(self, make_engine):
        reqs = requests(6)
        a = tokens_of(drain(self._fresh(make_engine, reqs)))
        b = tokens_of(drain(self._fresh(make_engine, reqs)))
        assert a == b and len(a) == 6
        other = [
            GenerationRequest(r.request_id, r.prompt_tokens, SamplingParams(24, seed=1000 + i))
            for i, r in enumerate(reqs)
        ]
        assert tokens_of(drain(self._fresh(make_engine, other))) != a

    def test_tokens_do_not_depend_on_the_batch(self, make_engine):
        reqs = requests(10, temperature=0.9)
        wide = tokens_of(drain(self._fresh(make_engine, reqs, max_batch=16)))
        narrow = tokens_of(drain(self._fresh(make_engine, reqs, max_batch=3)))
        alone = {}
        for r in reqs[:3]:
            alone |= tokens_of(drain(self._fresh(make_engine, [r], max_batch=1)))
        assert wide == narrow
        assert alone == {k: wide[k] for k in alone}

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_behavior_logprobs_match_a_reference_forward(self, make_engine, hf_model, temperature):
        outs = drain(self._fresh(make_engine, requests(5, temperature=temperature)))
        worst = 0.0
        for o in outs.values():
            assert len(o.logprobs) == len(o.response_tokens) > 0
            assert np.all(o.logprobs <= 1e-6)
            ref = reference_logprobs(hf_model, o, temperature)
            worst = max(worst, float(np.abs(ref - o.logprobs).max()))
        assert worst <= LOGPROB_ATOL

    def test_greedy_and_its_equivalents_pick_the_argmax(self, make_engine, hf_model):
        greedy = tokens_of(drain(self._fresh(make_engine, requests(4, temperature=0.0))))
        top1 = tokens_of(drain(self._fresh(make_engine, requests(4, top_k=1))))
        nucleus = tokens_of(drain(self._fresh(make_engine, requests(4, top_p=1e-6))))
        assert greedy == top1 == nucleus
        r = requests(1, temperature=0.0)[0]
        seq = list(r.prompt_tokens)
        with torch.no_grad():
            for _ in range(len(greedy[r.request_id])):
                seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(r.prompt_tokens) :] == greedy[r.request_id]

    def test_top_k_restricts_to_the_k_most_likely_tokens(self, make_engine, hf_model):
        outs = drain(self._fresh(make_engine, requests(6, top_k=3, max_new_tokens=12)))
        for o in outs.values():
            seq = list(o.request.prompt_tokens) + o.response_tokens.tolist()
            with torch.no_grad():
                logits = hf_model(torch.tensor([seq])).logits[0].float()
            n = len(o.request.prompt_tokens)
            top3 = logits[n - 1 : -1].topk(3, dim=-1).indices
            assert (top3 == torch.tensor(o.response_tokens)[:, None]).any(-1).all()

    # -- capacity ---------------------------------------------------------------------------
    @pytest.mark.parametrize("capacity", [40, 90, 200])
    def test_kv_capacity_is_never_exceeded_and_changes_nothing(self, make_engine, capacity):
        reqs = requests(12, max_new_tokens=30)
        free = tokens_of(drain(self._fresh(make_engine, reqs, max_batch=12)))
        held_back = []

        def check(engine):
            kv = engine.kv_stats()
            assert kv.used_tokens <= kv.capacity_tokens
            held_back.append(kv.waiting > 0 and kv.running < 12)

        eng = self._fresh(make_engine, reqs, max_batch=12, kv_capacity_tokens=capacity)
        assert eng.kv_stats().capacity_tokens <= capacity
        assert tokens_of(drain(eng, check=check)) == free
        assert any(held_back)  # the capacity, not the batch limit, held requests back

    def test_kv_stats_and_request_ids_track_the_requests(self, make_engine):
        eng = make_engine(max_batch=3, max_seq_len=64)
        reqs = requests(5, max_new_tokens=20)
        for r in reqs:
            eng.add_request(r)
        kv = eng.kv_stats()
        assert (kv.running, kv.waiting, kv.used_tokens) == (0, 5, 0)
        assert kv.waiting_tokens == sum(len(r.prompt_tokens) for r in reqs)
        assert eng.request_ids() == [r.request_id for r in reqs]
        eng.step()
        kv = eng.kv_stats()
        assert (kv.running, kv.waiting) == (3, 2)
        assert kv.used_tokens == sum(len(r.prompt_tokens) for r in reqs[:3])
        assert kv.waiting_tokens == sum(len(r.prompt_tokens) for r in reqs[3:])
        assert set(eng.request_ids()) == {r.request_id for r in reqs}
        # (the first step admitted 3 and decoded none; what the pacer and the benches'
        # decode batch count)
        assert (eng.stats()["admitted"], eng.stats()["decode_tokens"]) == (3, 0)
        drain(eng)
        assert eng.kv_stats().used_tokens == 0 and eng.request_ids() == []
        assert eng.stats()["admitted"] == 5 + eng.stats()["preemptions"]

    def test_in_flight_shows_each_requests_tokens_so_far(self, make_engine):
        """What the partial-response log reads between steps: the tokens, logprobs and
        versions an export would carry, without taking the requests away."""
        reqs = requests(6, max_new_tokens=20, temperature=0.8)
        eng = self._fresh(make_engine, reqs, max_batch=4)
        for _ in range(5):
            eng.step()
        seen = {
            s.request_id: (list(s.tokens), list(s.logprobs), list(s.token_versions), s.seed)
            for s in eng.in_flight()
        }
        assert list(seen) == eng.request_ids() and any(t for t, *_ in seen.values())
        exported = eng.export(eng.request_ids())
        assert {
            s.request_id: (s.tokens, s.logprobs, s.token_versions, s.seed) for s in exported
        } == seen

    # -- export / import ----------------------------------------------------------------------
    @pytest.mark.parametrize("after_steps", [1, 7])
    def test_exported_requests_continue_exactly_elsewhere(self, make_engine, after_steps):
        reqs = requests(8, max_new_tokens=30, temperature=0.8)
        unmoved = drain(self._fresh(make_engine, reqs, max_batch=5))
        src = self._fresh(make_engine, reqs, max_batch=5)
        done = {}
        for _ in range(after_steps):
            done |= {o.request.request_id: o for o in src.step()}
        ids = src.request_ids()  # running first, then waiting: move some of each
        moving = ids[:2] + ids[-2:]
        states = src.export(moving)
        assert [s.request_id for s in states] == moving
        assert not set(moving) & set(src.request_ids())
        for s in states:
            assert isinstance(s, RequestState) and s.n_moves == 1
            assert s.tokens == unmoved[s.request_id].response_tokens.tolist()[: len(s.tokens)]
        dst = make_engine(max_batch=5, max_seq_len=64, seed=99)  # another engine seed
        dst.import_(states)
        moved = drain(dst)
        done |= drain(src)
        assert set(moved) == set(moving)
        for rid, o in moved.items():
            ref = unmoved[rid]
            assert o.response_tokens.tolist() == ref.response_tokens.tolist()
            assert np.allclose(o.logprobs, ref.logprobs, atol=LOGPROB_ATOL)
            assert o.n_moves == 1 and o.finish_reason == ref.finish_reason
        for rid, o in done.items():
            assert o.response_tokens.tolist() == unmoved[rid].response_tokens.tolist()

    def test_import_checks_versions_and_duplicates(self, make_engine, policy_dir):
        src = self._fresh(make_engine, requests(2, max_new_tokens=20))
        src.step()
        states = src.export(src.request_ids())
        dst = make_engine(max_batch=4, max_seq_len=64)
        dst.load_weights(_weights(policy_dir), 3)
        with pytest.raises(EngineError, match="version"):
            dst.import_(states)
        dst.import_(states, allow_version_change=True)
        with pytest.raises(EngineError, match="already in flight"):
            dst.import_(states[:1])
        # never back to an older version: its tokens would not rise (partial rollout)
        older = make_engine(max_batch=4, max_seq_len=64)
        newer = [replace(s, token_versions=[4] * len(s.token_versions)) for s in states]
        with pytest.raises(EngineError, match="newer"):
            older.import_(newer, allow_version_change=True)
        outs = drain(dst)
        for o in outs.values():
            v = o.token_versions.tolist()
            assert v[0] == 0 and v[-1] == 3 and v == sorted(v) and o.version == 3
        with pytest.raises(EngineError, match="no request"):
            dst.export(["nope"])

    # -- weights --------------------------------------------------------------------------------
    def test_weights_load_only_between_requests(self, make_engine, policy_dir, hf_model):
        eng = self._fresh(make_engine, requests(3))
        eng.step()
        new = _weights(policy_dir, noise=0.5)
        with pytest.raises(EngineError, match="drain|export"):
            eng.load_weights(new, 1)
        before = drain(eng)
        eng.load_weights(new, 1)
        assert eng.version == 1
        for r in requests(3):
            eng.add_request(r)
        after = drain(eng)
        assert tokens_of(after) != tokens_of(before)
        hf_model.load_state_dict(new)
        for o in after.values():
            assert o.version == 1 and set(o.token_versions.tolist()) == {1}
            ref = reference_logprobs(hf_model, o, 1.0)
            assert np.abs(ref - o.logprobs).max() <= LOGPROB_ATOL

    # -- stopping -------------------------------------------------------------------------------
    def test_stop_tokens_strings_and_lengths(self, make_engine, policy_dir):
        from laminar.model import load_tokenizer

        tok = load_tokenizer(policy_dir)
        base = requests(4, temperature=0.0, max_new_tokens=20)
        greedy = drain(self._fresh(make_engine, base))
        for o in greedy.values():
            assert o.finish_reason in ("eos", "length")
            if o.finish_reason == "length":
                assert len(o.response_tokens) == 20
            else:
                assert o.response_tokens[-1] == tok.eos_token_id
        r = base[0]
        resp = greedy[r.request_id].response_tokens.tolist()
        stop_tok = resp[min(3, len(resp) - 1)]
        first = resp.index(stop_tok)
        with_token = GenerationRequest(
            "t", r.prompt_tokens, SamplingParams(20, 0.0, seed=0, stop_token_ids=(stop_tok,))
        )
        out = drain(self._fresh(make_engine, [with_token]))["t"]
        assert out.finish_reason == "stop" and out.response_tokens.tolist() == resp[: first + 1]
        word = tok.decode([stop_tok])
        with_string = GenerationRequest(
            "s", r.prompt_tokens, SamplingParams(20, 0.0, seed=0, stop=(word,))
        )
        out = drain(self._fresh(make_engine, [with_string]))["s"]
        assert out.finish_reason == "stop" and word in out.text(tok)
        assert len(out.response_tokens) <= first + 1

    def test_ignore_eos_generates_max_new_tokens(self, make_engine, policy_dir):
        from laminar.model import load_tokenizer

        eos = load_tokenizer(policy_dir).eos_token_id
        n = 60

        def run(**params):
            eng = make_engine(max_batch=16, max_seq_len=n + 8)
            for r in requests(16, max_new_tokens=n, **params):
                eng.add_request(r)
            return drain(eng)

        natural = run()
        # The untrained policy samples eos at T = 1, or this test would prove nothing.
        assert any(o.finish_reason == "eos" for o in natural.values())
        forced = run(ignore_eos=True)
        assert set(forced) == set(natural)
        for rid, o in forced.items():
            assert len(o.response_tokens) == len(o.logprobs) == n
            assert o.finish_reason == "length" and not o.ended
            # Ignoring eos changes where a request stops, not what it samples.
            ref = natural[rid].response_tokens.tolist()
            assert o.response_tokens[: len(ref)].tolist() == ref
        assert any(eos in o.response_tokens[:-1].tolist() for o in forced.values())

    # -- bad input --------------------------------------------------------------------------------
    def test_bad_requests_are_refused_with_the_reason(self, make_engine):
        eng = make_engine(max_batch=4, max_seq_len=32, kv_capacity_tokens=40)
        sp = SamplingParams(max_new_tokens=8)
        cases = [
            (GenerationRequest("empty", (), sp), "empty prompt"),
            (GenerationRequest("long", (5,) * 30, sp), "max_seq_len"),
            (GenerationRequest("vocab", (5, 10**7), sp), "vocabulary"),
            (GenerationRequest("neg", (5, -1), sp), "vocabulary"),
            (GenerationRequest("n", (5,), SamplingParams(max_new_tokens=0)), "max_new_tokens"),
            (GenerationRequest("t", (5,), SamplingParams(8, temperature=-1)), "temperature"),
            (GenerationRequest("p", (5,), SamplingParams(8, top_p=0)), "top_p"),
            (GenerationRequest(7, (5,), sp), "request_id"),  # (seeded from the id's bytes)
        ]
        for req, reason in cases:
            with pytest.raises(EngineError, match=reason):
                eng.add_request(req)
        assert not eng.has_work()
        eng.add_request(GenerationRequest("twice", (5,), sp))
        with pytest.raises(EngineError, match="already in flight"):
            eng.add_request(GenerationRequest("twice", (6,), sp))
        assert eng.request_ids() == ["twice"]
        small = make_engine(max_batch=4, max_seq_len=64, kv_capacity_tokens=40)
        with pytest.raises(EngineError, match="capacity"):
            small.add_request(GenerationRequest("cap", (5,) * 30, SamplingParams(20)))

    def test_a_prompt_given_as_a_list_or_an_array_runs_as_a_tuple(self, make_engine):
        """``prompt_ids`` straight from a tokenizer is a list (the docs' example): it must
        generate what the tuple does, not fail the step of every request decoding with it."""
        reqs = requests(3, max_new_tokens=12)
        ref = tokens_of(drain(self._fresh(make_engine, reqs)))
        for kind in (list, np.array):
            same = [GenerationRequest(r.request_id, kind(r.prompt_tokens), r.params) for r in reqs]
            eng = self._fresh(make_engine, same)
            eng.step()
            moved = make_engine(max_batch=8, max_seq_len=64)
            states = eng.export(eng.request_ids()[:1])
            # held as the protocol's tuple of ints (what the partial log writes as JSON)
            assert all(type(t) is int for t in states[0].request.prompt_tokens), kind
            moved.import_(states)  # re-prefills prompt + tokens
            assert tokens_of(drain(eng)) | tokens_of(drain(moved)) == ref, kind
        for bad in ((5, 3.5), "hello"):
            with pytest.raises(EngineError, match="prompt"):
                make_engine(max_batch=4, max_seq_len=32).add_request(
                    GenerationRequest("bad", bad, SamplingParams(4))
                )

    def test_badly_typed_sampling_values_are_refused_on_arrival(self, make_engine):
        """A wrong type is refused by ``add_request`` naming the field, never a TypeError
        from the step (which fails every request decoding beside it) nor a silent misreading
        (``stop="ab"`` would stop at any "a" or "b")."""
        eng = make_engine(max_batch=4, max_seq_len=32)
        eng.add_request(GenerationRequest("ok", (5, 6), SamplingParams(6, seed=1)))
        cases = {
            "stop": dict(stop="ab"),
            "stop_token_ids": dict(stop_token_ids=7),
            "temperature": dict(temperature="0.7"),
            "top_k": dict(top_k=None),
            "top_p": dict(top_p="1"),
        }
        for field, kw in cases.items():
            with pytest.raises(EngineError, match=field):
                eng.add_request(GenerationRequest(field, (5,), SamplingParams(6, **kw)))
        with pytest.raises(EngineError, match="top_k"):
            eng.add_request(GenerationRequest("k", (5,), SamplingParams(6, top_k=1.5)))
        # a numpy integer or a list is fine
        fine = SamplingParams(6, top_k=np.int64(0), stop_token_ids=[7], seed=1)
        eng.add_request(GenerationRequest("np", (5, 6), fine))
        outs = drain(eng)
        assert set(outs) == {"ok", "np"} and len(outs["ok"].response_tokens) >= 1

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _fresh(make_engine, reqs, *, max_batch: int = 8, **kw):
        eng = make_engine(max_batch=max_batch, max_seq_len=64, **kw)
        for r in reqs:
            eng.add_request(r)
        return eng


def _weights(policy_dir, noise: float = 0.0) -> dict[str, torch.Tensor]:
    """The policy's state dict, optionally with every weight perturbed (fixed seed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if noise:
        g = torch.Generator().manual_seed(1)
        for v in state.values():
            v.add_(torch.randn(v.shape, generator=g) * noise * v.std().nan_to_num(0.0))
    return state
