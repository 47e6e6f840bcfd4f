"""A trainer or data module taken for hung names the setting that fired: calls to them are
bounded by the lower of cluster.actor_timeout_s and faults.heartbeat_timeout_s, and a
small cluster.actor_timeout_s was blamed on faults.heartbeat_timeout_s (a run that failed
on a bare TimeoutError named neither). Measured on real runs of configs/tiny.yaml with
cluster.actor_timeout_s=0.05 or faults.heartbeat_timeout_s=0.01: 30-50 s each, too slow
for the suite; the messages are checked here from the real config."""

from laminar.config import RunConfig, with_overrides
from pipelines.driver_faults import core_bound, hung_because, timed_out_why


def test_a_small_actor_timeout_is_named_as_what_fired():
    cfg = with_overrides(RunConfig(), ["cluster.actor_timeout_s=5"])
    assert core_bound(cfg) == "cluster.actor_timeout_s=5"
    said = hung_because({"silent_s": 5.0, "bound": core_bound(cfg), "unanswered": True})
    assert "cluster.actor_timeout_s=5" in said and "heartbeat" not in said
    assert said.endswith("raise cluster.actor_timeout_s)")
    assert timed_out_why(cfg).endswith("raise cluster.actor_timeout_s")


def test_a_small_heartbeat_timeout_is_named_as_what_fired():
    cfg = with_overrides(RunConfig(), ["faults.heartbeat_timeout_s=3"])
    assert core_bound(cfg) == "faults.heartbeat_timeout_s=3"
    why = timed_out_why(cfg)
    assert "faults.heartbeat_timeout_s=3" in why and why.endswith("heartbeat_timeout_s")
    # a training loop silent past the heartbeat (its stats answered): no progress, not
    # no answer
    said = hung_because(
        {"silent_s": 61.0, "bound": "faults.heartbeat_timeout_s=60"} | {"unanswered": False}
    )
    assert said.startswith("no progress for 61 s (faults.heartbeat_timeout_s=60;")
