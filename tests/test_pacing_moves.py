"""A paced source hands a move's requests over no earlier than its step ends, and a
paced destination decodes them no earlier than the time model lets it."""

import time


def test_an_export_served_in_a_paced_steps_wait_is_handed_over_at_the_steps_deadline(
    tiny_policy, small_config
):
    """The manager's export runs from the source's wait_hook, while a paced step waits
    out its modelled time. Its states hold that step's tokens: returned at once, a
    destination could decode on from them before the source's modelled step had ended.
    The export returns at the step's deadline (nothing left of the wait), not before."""
    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "rollout.pacing.dilation=30"])
    rollout = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    pacer = rollout.engine.pacer
    rollout._add([PromptGroup(f"p{g:08d}", g, (5, 6, 7), "x", 4, 0) for g in range(2)])
    rollout._in_batch = True  # (as in the decode loop)
    exported: list[tuple[dict | None, float]] = []
    due: list[float] = []
    asked = False

    def hook(seconds):  # the rollout's _serve_for, with the manager's export waiting
        if asked and not exported:
            due.append(time.time() + pacer.until_deadline())  # (the step's deadline)
            exported.append((rollout._export_all(), pacer.until_deadline()))
        rollout._serve_for(pacer.until_deadline())

    rollout.engine.wait_hook = hook
    rollout.engine.step()  # admits (a prefill)
    asked = True
    rollout.engine.step()  # decodes: its wait serves the export
    ((out, left),) = exported
    assert out is not None and out["states"] and all(st.tokens for st in out["states"])
    assert left == 0.0  # handed over at the deadline, not while the step still ran
    # ... and says so: the requests' pause starts there (the manager's pause_s)
    assert out["handed_at"] >= due[0] - 1e-3


def test_requests_imported_between_steps_get_a_whole_modelled_step_after_they_arrive(
    tiny_policy, small_config
):
    """An import served between two paced steps, after the previous step's deadline, rode
    that deadline: the next step chained to it (deadline + its modelled time) and ended
    less than a modelled step after the requests arrived, running them ahead of the time
    model. The rollout floors the next step at the import's time (Pacer.floor)."""
    from laminar.config import with_overrides
    from laminar.contract import PromptGroup
    from laminar.rollout import RolloutReplica

    cfg = with_overrides(small_config, ["rollout.parity_every=0", "rollout.pacing.dilation=30"])
    dst = RolloutReplica("r0", cfg, str(tiny_policy), None, None, None)
    src = RolloutReplica("r1", cfg, str(tiny_policy), None, None, None)
    src._add([PromptGroup("q00000000", 9, (5, 6), "x", 2, 0)])
    src.engine.step()  # (their prefill: a token each)
    states = src.engine.export(src.engine.request_ids())
    pacer = dst.engine.pacer
    dst._add([PromptGroup(f"p{g:08d}", g, (5, 6, 7), "x", 4, 0) for g in range(2)])
    dst._in_batch = True  # (as in the decode loop)
    pacer.restart()
    dst.engine.step()  # admits
    before = pacer.modelled_s
    dst.engine.step()  # decodes, and returns at its deadline
    step = pacer.modelled_s - before
    time.sleep(step / 2)  # host work between the steps, within the next one's time
    arrived = pacer.clock()
    assert dst._import(0, states, None, sources=1)
    before = pacer.modelled_s
    dst.engine.step()  # re-prefills them (chained, it would end at the old deadline + T)
    assert pacer.clock() >= arrived + 0.999 * (pacer.modelled_s - before)
