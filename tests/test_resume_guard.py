"""A resume in place refuses a change of what the behavior logprobs depend on."""

from __future__ import annotations

import shlex

import pytest
from conftest import resumable_run


def _past_the_config_checks(run, overrides=()):
    from laminar.learner import CheckpointError
    from pipelines.api import prepare_resume

    with pytest.raises(CheckpointError, match="lacks"):  # (not a crash in the checks)
        prepare_resume(run, overrides)
    return True


def test_a_resume_with_another_temperature_is_refused_naming_the_new_run_that_can(tmp_path):
    """The store's untrained groups and the partial responses a resume finishes carry
    behavior logprobs of the run's temperature; the trainer takes its own at
    cfg.rollout.temperature. A resume with another one was accepted, and every such
    token's ratio was exp(logp_T' - logp_T): wrong, silently. Refused now, naming the
    field, both values and the new run from the checkpoint (which reads nothing of
    this store); config.yaml is left as it was."""
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume

    run = resumable_run(tmp_path)
    ckpt = run / "checkpoints" / "version-000001"
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        prepare_resume(run, ["rollout.temperature=0.7"])
    msg = str(e.value)
    assert "with rollout.temperature=0.7: it ran rollout.temperature=1.0" in msg, msg
    assert "importance ratios would be wrong" in msg and "drop that --set" in msg, msg
    setting = shlex.quote(f"trainer.resume_from={ckpt}")
    assert f"--run-dir NEW_DIR --set {setting} --set rollout.temperature=0.7`" in msg, msg
    assert "reads nothing of this store" in msg, msg
    assert (run / "config.yaml").read_text() == before
    # the same value given again, and the filters (the logprobs are the unfiltered
    # distribution's, the trainer's too), resume
    assert _past_the_config_checks(run, ["rollout.temperature=1.0", "trainer.steps=3"])
    assert _past_the_config_checks(run, ["rollout.top_p=0.9", "rollout.top_k=5"])
