"""Emulated accelerator timing: the model's numbers and a paced engine that follows them."""

import itertools
import statistics
import time

import pytest
import torch

from laminar.engine import GenerationRequest, SamplingParams
from laminar.errors import LaminarError
from laminar.model import load_policy
from laminar.pacing import Pacer, PacingError, TimeModel
from laminar.torch_engine import TorchEngine


def test_the_7b_h800_model_reproduces_the_cluster_notes():
    m = TimeModel.named("H800", "7B", tp=4)
    assert m.weight_read_time == pytest.approx(1.27e-3, rel=0.01)
    assert m.compute_per_sequence == pytest.approx(7.7e-6, rel=0.01)
    assert m.model.kv_bytes_per_token == 57_344
    assert m.prefill_time(1) == pytest.approx(6.4e-6, rel=0.01)
    assert m.decode_time(1, 0) == pytest.approx(3.3e-3, rel=0.02)
    assert m.decode_time(256, 256 * 4096) == pytest.approx(9.5e-3, rel=0.03)
    assert 160 < m.batch_limit < 170
    # Memory-bound below B: a step costs nearly the same for 1 or 100 sequences.
    assert m.decode_time(100, 0) / m.decode_time(1, 0) < 1.1
    assert m.decode_time(400, 0) > 1.5 * m.decode_time(100, 0)  # compute-bound above
    big = TimeModel.named("H800", "32B", tp=4)
    assert big.decode_time(64, 64 * 2000) > m.decode_time(64, 64 * 2000)
    assert big.kv_capacity_tokens < m.kv_capacity_tokens


def test_unknown_names_and_impossible_placements_are_refused():
    with pytest.raises(LaminarError, match="accelerator 'B300' is unknown"):
        TimeModel.named("B300", "7B")
    with pytest.raises(LaminarError, match="do not fit"):
        _ = TimeModel.named("L40S", "72B", tp=1).kv_capacity_tokens


@pytest.fixture(scope="module")
def policy(tiny_policy):
    # One intra-op thread, as in a rollout worker: with two on a loaded 2-core machine,
    # a step waits for a descheduled OpenMP thread (measured: 2 ms steps taking 500 ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_policy(tiny_policy)
    torch.set_num_threads(threads)


def paced_engine(policy, pacer: Pacer) -> TorchEngine:
    model, tok = policy
    return TorchEngine(
        model.config,
        model.state_dict(),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch=8,
        max_seq_len=64,
        pacer=pacer,
    )


def test_a_paced_engine_steps_at_the_modelled_times(policy):
    # ≈ 100 ms a step: far above the real compute even on a loaded CI machine.
    pacer = Pacer(TimeModel.named("H800", "7B", tp=4), dilation=30.0)
    eng = paced_engine(policy, pacer)
    for i in range(8):
        prompt = (3,) * (2 + 3 * i)
        eng.add_request(GenerationRequest(str(i), prompt, SamplingParams(4 + 2 * i, seed=i)))
    walls, modelled, ends = [], [], []
    begin = time.perf_counter()
    while eng.has_work():
        kv = eng.kv_stats()
        batch, context = kv.running, kv.used_tokens
        t0 = time.perf_counter()
        before = pacer.modelled_s
        eng.step()
        ends.append(time.perf_counter())
        walls.append(ends[-1] - t0)
        modelled.append(pacer.modelled_s - before)
        if batch:  # a decode step: its modelled time follows from batch and context alone
            m = pacer.model
            assert modelled[-1] >= 30.0 * m.decode_time(batch, context) * 0.999
    assert len(walls) > 10 and len(set(round(x, 6) for x in modelled)) > 3
    # Never faster than the model: steps run back to back, each step's deadline the
    # previous one's plus its modelled time (a late wake-up of one step is caught up by
    # the next, so a single step may be shorter than its own modelled time).
    deadlines = itertools.accumulate(modelled, initial=begin)
    assert all(end > d - 1e-3 for end, d in zip(ends, list(deadlines)[1:], strict=True))
    lag = [w - m for w, m in zip(walls, modelled, strict=True)]
    # ... and close to it. The bound catches a pacer that waits the modelled time over
    # again on top of the step (or twice a step): a lag of ~100 % of the modelled time.
    # It is not tighter because what is left is the OS's late wake-up from the sleep: a
    # loaded 2-core host (load 9-13) showed a median lag of 5.5-5.8 ms on ~100 ms steps,
    # over the 5 % this once asserted. (A pacer that does not subtract the step's own
    # compute lags by that compute, a few ms at this dilation: no bound here tells it.)
    assert statistics.median(lag) < 0.25 * statistics.median(modelled)
    stats = eng.stats()
    assert stats["paced_steps"] == len(walls) and 0 < stats["compute_s"]
    assert stats["overruns"] <= len(walls) // 4  # a warm-up step or a noisy neighbour


def test_a_pacer_that_cannot_keep_up_stops_the_run(policy):
    pacer = Pacer(TimeModel.named("H800", "7B", tp=4), dilation=1e-4, window=8)
    eng = paced_engine(policy, pacer)
    for i in range(8):
        eng.add_request(GenerationRequest(str(i), (3, 4), SamplingParams(40, seed=i)))
    with pytest.raises(PacingError, match=r"Raise rollout.pacing.dilation to at least"):
        for _ in range(40):
            eng.step()
    assert pacer.overruns >= 8


def test_a_paced_step_hands_its_wait_to_the_wait_hook(policy):
    """A rollout serves repack commands while a paced step waits out its modelled time:
    the engine calls its wait_hook with exactly the time left, and the step still takes
    the modelled time; an import made from inside the hook is decoded from the next step."""
    pacer = Pacer(TimeModel.named("H800", "7B", tp=4), dilation=30.0)
    eng = paced_engine(policy, pacer)
    waits: list[float] = []

    def hook(seconds):
        waits.append(seconds)
        if len(waits) == 2:  # as the manager would: a request arrives mid-wait
            eng.import_([*other.export(["moved"])])
        time.sleep(seconds)

    other = paced_engine(policy, Pacer(TimeModel.named("H800", "7B", tp=4), dilation=1.0))
    other.add_request(GenerationRequest("moved", (3, 4, 5), SamplingParams(6, seed=7)))
    other.step()
    eng.wait_hook = hook
    eng.add_request(GenerationRequest("own", (3,) * 5, SamplingParams(20, seed=1)))
    done, t0 = {}, time.perf_counter()
    while eng.has_work():
        for out in eng.step():
            done[out.request.request_id] = out
    assert set(done) == {"own", "moved"} and done["moved"].n_moves == 1
    ref = paced_engine(policy, None)  # the same request, never moved
    ref.add_request(GenerationRequest("moved", (3, 4, 5), SamplingParams(6, seed=7)))
    unmoved = [out for _ in range(64) if ref.has_work() for out in ref.step()]
    assert [o.response_tokens.tolist() for o in unmoved] == [done["moved"].response_tokens.tolist()]
    assert len(waits) == pacer.steps - pacer.overruns and all(w > 0 for w in waits)
    assert time.perf_counter() - t0 >= pacer.modelled_s * 0.999


def test_what_a_paced_step_finished_is_seen_while_it_waits_out_its_time(policy):
    """A command served from the wait_hook (a rebuilt data module asking the rollout
    which groups it holds) sees the step's finished outputs in ``finishing()``: they are
    out of ``in_flight()`` and not yet returned by ``step()``. Unseen, the rebuild took
    their group for held by nobody and generated its samples a second time."""
    pacer = Pacer(TimeModel.named("H800", "7B", tp=4), dilation=30.0)
    eng = paced_engine(policy, pacer)
    seen: list[tuple[list[str], list[str]]] = []

    def hook(seconds):
        seen.append(
            (
                [o.request.request_id for o in eng.finishing()],
                [st.request_id for st in eng.in_flight()],
            )
        )
        time.sleep(seconds)

    eng.wait_hook = hook
    eng.add_request(GenerationRequest("short", (3, 4), SamplingParams(1, seed=0)))
    eng.add_request(GenerationRequest("long", (3, 4), SamplingParams(5, seed=1)))
    finished = []
    while eng.has_work():
        finished += [o.request.request_id for o in eng.step()]
        assert eng.finishing() == []  # (only while the step waits)
    waited_with = [f for f, _ in seen if f]
    assert sorted(sum(waited_with, [])) == sorted(finished) == ["long", "short"]
    for f, flying in seen:  # never in both, never in neither until step() returns
        assert not set(f) & set(flying)


def test_fused_prefill_hides_compute_under_the_weight_read():
    m = TimeModel.named("H800", "7B", tp=4)
    decode = m.decode_time(32, 4000)
    assert m.step_time(32, 4000, 0, fused=True) == decode == m.step_time(32, 4000, 0)
    # a small prefill fits under the weight read: free when fused, not when additive
    assert m.step_time(32, 4000, 50, fused=True) == decode < m.step_time(32, 4000, 50)
    # a large one is compute-bound: fused saves the weight read, less the decode compute
    # that the additive step already hid under it
    big = 20_000
    saved = m.step_time(32, 4000, big) - m.step_time(32, 4000, big, fused=True)
    assert saved == pytest.approx(m.weight_read_time - 32 * m.compute_per_sequence, rel=1e-9)
    pacer = Pacer(m, dilation=2.0, fused_prefill=True)
    assert pacer.modelled(32, 4000, 50) == pytest.approx(2.0 * decode)


def test_a_step_that_only_prefills_pays_the_fixed_cost_and_the_weight_read():
    """docs/pacing.md: an additive step is ``decode(b, S) + prefill(n)``, and ``decode(0, S)``
    is ``t_fix`` plus the weight read; a forward that prefills reads every weight. A local
    batch's first step (all admitted, none decoding) cost its prefill compute alone: 0.64 ms
    for 100 tokens of the 7B on 4 H800s, below the 1.27 ms weight read, and less than the
    same step fused, which the model says can only hide cost."""
    m = TimeModel.named("H800", "7B", tp=4)
    for n in (1, 100, 20_000):
        additive = m.step_time(0, 0, n)
        assert additive == pytest.approx(m.t_fix + m.weight_read_time + m.prefill_time(n))
        assert m.step_time(0, 0, n, fused=True) <= additive
    assert m.step_time(0, 0, 0) == m.step_time(0, 0, 0, fused=True) == 0  # nothing to do
    assert Pacer(m, dilation=2.0).modelled(0, 0, 100, admitted=1) == pytest.approx(
        2 * (m.t_fix + m.weight_read_time + m.prefill_time(100))
    )


def test_a_paced_steps_outputs_finish_at_its_deadline_not_when_its_compute_ended(policy):
    """A paced step's last token ends in modelled time at the step's deadline. The
    engine stamped ``t_finish`` when the compute ended, before the step waited out its
    modelled time: every latency read short by up to one paced step. Seen from a
    command served in the wait (``finishing()``) too, and unchanged unpaced."""
    pacer = Pacer(TimeModel.named("H800", "7B", tp=4), dilation=30.0)
    eng = paced_engine(policy, pacer)
    seen = []

    def hook(seconds):
        seen.extend(eng.finishing())
        time.sleep(seconds)

    eng.wait_hook = hook
    for i, n in enumerate((1, 3)):
        eng.add_request(GenerationRequest(f"r{i}", (3, 4, 5), SamplingParams(n, seed=i)))
    done = []
    while eng.has_work():
        before, modelled = time.time(), pacer.modelled_s
        finished = eng.step()
        step = pacer.modelled_s - modelled
        # (each step paced from its own start: no credit from the one before)
        pacer.restart()
        for out in finished:
            assert out.t_finish >= before + 0.999 * step, (out.t_finish - before, step)
        done += finished
    assert sorted(o.request.request_id for o in done) == ["r0", "r1"]
    assert {o.request.request_id: o.t_finish for o in seen} == {
        o.request.request_id: o.t_finish for o in done
    }
    unpaced = paced_engine(policy, None)
    unpaced.add_request(GenerationRequest("u", (3, 4, 5), SamplingParams(1, seed=0)))
    before = time.time()
    (out,) = unpaced.step()
    assert before <= out.t_finish <= time.time()


def test_requests_that_join_after_a_late_step_earn_no_catch_up_credit():
    """After a step that ran late, the next step chains to its deadline and catches up.
    An import served between the two (after that deadline) rode that credit: the moved
    requests' next step ended less than its modelled time after they arrived. With
    ``floor`` (what a rollout calls as it imports) the next deadline is at least the
    import's time plus the step's modelled time; the lateness is counted as not caught
    up. An import served within a step's wait (before its deadline) changes nothing."""
    now = [0.0]

    def pacer():
        return Pacer(
            TimeModel.named("H800", "7B", tp=4), dilation=30, strict=False, clock=lambda: now[0]
        )

    def run(floor_at, t_start):
        """Step M starts at 0 and overruns (its compute ends at 1.5 T, no wait); requests
        join at ``floor_at`` (None: none do); the next step starts at ``t_start``."""
        p = pacer()
        T = p.modelled(8, 8 * 50, 0)
        now[0] = 1.5 * T
        p.pace(0.0, batch=8, context_tokens=8 * 50, prefill_tokens=0, sleep=lambda s: None)
        if floor_at is not None:
            p.floor(floor_at * T)
        now[0] = t_start * T
        target = p.modelled(8, 8 * 51, 60, admitted=1)
        slept = []
        p.pace(
            now[0],
            batch=8,
            context_tokens=8 * 51,
            prefill_tokens=60,
            admitted=1,
            sleep=slept.append,
        )
        return T, target, now[0] + slept[0], p

    T, target, deadline, p = run(None, 1.6)  # nothing joined: the catch-up holds
    assert deadline == pytest.approx(T + target)
    T, target, deadline, p = run(1.55, 1.6)  # an import between the steps
    assert deadline == pytest.approx(1.55 * T + target)
    assert p.stats()["overrun_s"] == pytest.approx(0.5 * T)  # step M's lateness: kept
    # Joined within a wait (before the previous deadline): chained as before.
    p = pacer()
    T = p.modelled(8, 8 * 50, 0)
    now[0] = 0.1 * T
    p.pace(0.0, batch=8, context_tokens=8 * 50, prefill_tokens=0, sleep=lambda s: None)
    p.floor(0.5 * T)
    now[0] = 1.05 * T
    slept = []
    p.pace(now[0], batch=8, context_tokens=8 * 50, prefill_tokens=0, sleep=slept.append)
    assert now[0] + slept[0] == pytest.approx(2 * T)
