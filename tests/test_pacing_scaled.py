"""The scaled pacer against the full-size workload it stands for, modelled step by step.

Pure functions of ``laminar.pacing``: no engine, no wall clock (a fake one where time counts)."""

import pytest

from laminar.pacing import Clock, Pacer, Scale, TimeModel

PROMPT = 5  # real prompt tokens


def _real_steps(admit_at: list[int], lengths: list[int]):
    """The real engine's steps: request i is admitted (prefilled: its first token) at step
    ``admit_at[i]`` and decodes one token a step until it holds ``lengths[i]``. Yields
    ``(batch, context_tokens, prefill_tokens, admitted)`` as ``engine_base`` reports them:
    ``context_tokens`` is Σ (context − 1) over the decoding requests."""
    s = 0
    while True:
        admitted = [i for i, a in enumerate(admit_at) if a == s]
        decoding = [i for i, a in enumerate(admit_at) if a < s and s - a < lengths[i]]
        if not admitted and not decoding and s > max(admit_at):
            return
        # request i holds PROMPT + (s - a) tokens: the prompt and what it generated
        context = sum(PROMPT + (s - admit_at[i]) - 1 for i in decoding)
        yield len(decoding), context, PROMPT * len(admitted), len(admitted)
        s += 1


def _full_size(m: TimeModel, admit_at, lengths, L: int, R: int, fused: bool) -> float:
    """Seconds of the full-size workload: each real request is R requests of an L×
    longer prompt and response; each step decodes one token of every running request
    over the KV it holds (its context less the token being decoded), and a request is
    prefilled (its first token) L steps per real step after the first."""
    total, t = 0.0, 0
    end = max(a + n for a, n in zip(admit_at, lengths, strict=True)) * L
    while t < end:
        prefill = sum(R * PROMPT * L for a in admit_at if a * L == t)
        running = [
            (t - a * L) for a, n in zip(admit_at, lengths, strict=True) if a * L < t < (a + n) * L
        ]  # tokens generated so far: the last of them is decoded in this step
        kv = sum(R * (PROMPT * L + g - 1) for g in running)
        if running or prefill:
            total += m.step_time(R * len(running), kv, prefill, fused=fused)
        t += 1
    return total


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    "admit_at,lengths",
    [
        ([0] * 4, [3, 5, 8, 2]),  # one local batch, draining
        ([0, 0, 2, 3, 3], [6, 2, 4, 1, 5]),  # admissions beside decoding requests
    ],
)
def test_a_scaled_step_costs_the_full_size_steps_it_stands_for(admit_at, lengths, fused):
    """Σ over a batch's real steps of the pacer's step × λ is the full-size workload's
    time, modelled step by step: a real request of c tokens stands for σ requests of λ·c
    tokens, holding λ·c − 1 of KV (not λ·(c − 1): decode steps read cheap by 0.3–3%)."""
    m = TimeModel.named("H800", "7B", tp=4)
    L, R = 16, 8
    pacer = Pacer(m, dilation=2.0, fused_prefill=fused, length_scale=L, request_scale=R)
    paced = sum(pacer.modelled(*step) for step in _real_steps(admit_at, lengths))
    want = _full_size(m, admit_at, lengths, L, R, fused)
    assert paced * L / 2.0 == pytest.approx(want, rel=1e-9)


class FakeTime:
    """A clock and a sleep on it: time passes only when the test (or a sleep) says."""

    def __init__(self) -> None:
        self.t = 100.0
        self.late = 0.0  # how far the next sleep overshoots (a command served in it)

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds + self.late
        self.late = 0.0


def _step(pacer: Pacer, clock: FakeTime, compute: float) -> None:
    """One paced step of 8 requests over 800 tokens whose real work takes ``compute``."""
    t0 = clock.t
    clock.t += compute
    pacer.pace(t0, batch=8, context_tokens=800, prefill_tokens=0, sleep=clock.sleep)


def test_overruns_report_how_long_they_stretched_the_modelled_clock():
    """A step whose compute passes its deadline, and one whose wait (a rollout's
    wait_hook serving a command) returns past it, stretch the modelled clock by that
    much: both add to ``overrun_s``; only the first is an overrun step (its compute)."""
    m = TimeModel.named("H800", "7B", tp=4)
    clock = FakeTime()
    pacer = Pacer(m, dilation=10.0, strict=False, clock=clock)
    target = pacer.modelled(8, 800, 0)
    t0 = clock.t
    _step(pacer, clock, 0.25 * target)  # on time
    assert clock.t == pytest.approx(t0 + target) and pacer.stats()["overrun_s"] == 0.0
    pacer.restart()  # (each step from its own start: nothing caught up)
    _step(pacer, clock, 1.5 * target)  # compute over the model
    assert pacer.overruns == 1 and pacer.stats()["overrun_s"] == pytest.approx(0.5 * target)
    pacer.restart()
    clock.late = 0.2 * target  # the wait served a command that ran past the deadline
    _step(pacer, clock, 0.0)
    assert pacer.overruns == 1 and pacer.stats()["overrun_s"] == pytest.approx(0.7 * target)


def test_host_work_between_continuous_steps_runs_within_the_next_steps_time():
    """While the engine steps continuously, a step's deadline is the previous one's plus
    its modelled time: the host work between two steps (rewards handed on, pool calls,
    commands) is absorbed while it fits, as a real engine overlaps it with the GPU's
    step, instead of stretching the modelled clock by ``dilation``× its wall time."""
    m = TimeModel.named("H800", "7B", tp=4)
    clock = FakeTime()
    pacer = Pacer(m, dilation=10.0, strict=False, clock=clock)
    T = pacer.modelled(8, 800, 0)
    begin = clock.t
    for _ in range(4):
        _step(pacer, clock, 0.2 * T)
        clock.t += 0.3 * T  # host work between steps
    # four steps and their host work took four modelled steps (and the last host work)
    assert clock.t == pytest.approx(begin + 4 * T + 0.3 * T)
    assert pacer.overruns == 0 and pacer.stats()["overrun_s"] == 0.0
    # compute and host work past the deadline: an overrun, caught up by the next step
    clock.t += 0.6 * T  # 0.9 T of host work since the deadline
    _step(pacer, clock, 0.3 * T)
    assert pacer.overruns == 1 and clock.t == pytest.approx(begin + 5 * T + 0.2 * T)
    _step(pacer, clock, 0.1 * T)
    assert clock.t == pytest.approx(begin + 6 * T) and pacer.stats()["overrun_s"] == 0.0
    # a lateness no step caught up (the next starts more than a step after the
    # deadline) stays in overrun_s
    _step(pacer, clock, 1.5 * T)
    clock.t += 2 * T
    assert pacer.stats()["overrun_s"] == pytest.approx(0.5 * T)
    t0 = clock.t
    _step(pacer, clock, 0.1 * T)  # idle for more than a step: no credit
    assert clock.t == pytest.approx(t0 + T) and pacer.stats()["overrun_s"] == pytest.approx(0.5 * T)
    # restart (a batch boundary: a pull, a wait for data) earns the next step no credit
    # even when the pause was shorter than a step
    pacer.restart()
    clock.t += 0.5 * T
    t0 = clock.t
    _step(pacer, clock, 0.1 * T)
    assert clock.t == pytest.approx(t0 + T)
    assert pacer.stats()["modelled_s"] == pytest.approx(9 * T)


def test_a_clock_reports_how_long_its_holds_ran_past_their_model():
    clock = FakeTime()
    held = Clock(
        Scale(dilation=2.0, length_scale=4.0), strict=False, sleep=clock.sleep, clock=clock
    )
    t0 = clock.t
    clock.t += 0.5  # 2 s modelled = 1 s here: on time
    held.hold(t0, 2.0, "update")
    t0 = clock.t
    clock.t += 3.0  # 2 s over
    held.hold(t0, 2.0, "sync")
    t0 = clock.t
    clock.late = 0.25  # woke late
    held.hold(t0, 2.0, "sync")
    stats = held.stats()
    assert stats["update"]["overrun_s"] == 0.0 and stats["update"]["overruns"] == 0
    assert stats["sync"]["overrun_s"] == pytest.approx(2.25) and stats["sync"]["overruns"] == 1


def _engine_fill(max_batch: int, group: int, request_scale: float, steps: int = 20000) -> float:
    """Mean share of ``max_batch`` a refilling engine decodes, each running request
    finishing with probability 1/40 a step (geometric lengths) and groups taken by
    :func:`laminar.rollout.groups_with_room`, the surplus queued."""
    import random

    from laminar.rollout import groups_with_room

    rng = random.Random(0)
    unfinished, decoded = 0, 0
    for _ in range(steps):
        unfinished += group * groups_with_room(max_batch, unfinished, group, request_scale)
        running = min(unfinished, max_batch)
        decoded += running
        unfinished -= sum(rng.random() < 1 / 40 for _ in range(running))
    return decoded / (steps * max_batch)


def test_a_scaled_engine_refills_as_full_as_the_engine_it_stands_for():
    """A real group of a scaled workload is ``request_scale`` modelled groups: taken
    once a modelled group's room is free, it keeps the engine about as full as the
    full-size engine (256 requests, groups of 16) keeps itself: a little fuller, since
    its queue starts one real request at a time (docs/pacing.md, "Scaled workloads":
    99.8% against 97.1%). Waiting for a whole real group's room would leave the scaled
    engine (32 requests) a quarter empty on average."""
    full_size = _engine_fill(256, 16, 1.0, steps=4000)
    scaled = _engine_fill(32, 16, 8.0)
    whole_real_groups = _engine_fill(32, 16, 1.0)
    assert full_size > 0.95
    assert full_size <= scaled < full_size + 0.04, (scaled, full_size)
    assert whole_real_groups < full_size - 0.15, (whole_real_groups, full_size)
