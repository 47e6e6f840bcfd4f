"""A paced source hands a move's requests over no earlier than its step ends."""


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
    asked = False

    def hook(seconds):  # the rollout's _serve_for, with the manager's export waiting
        if asked and not exported:
            exported.append((rollout._export_all(), pacer.until_deadline()))
        rollout._serve_for(pacer.until_deadline())

    rollout.engine.wait_hook = hook
    rollout.engine.step()  # admits (a prefill)
    asked = True
    rollout.engine.step()  # decodes: its wait serves the export
    ((out, left),) = exported
    assert out is not None and out["states"] and all(st.tokens for st in out["states"])
    assert left == 0.0  # handed over at the deadline, not while the step still ran
