"""`laminar run --resume RUN_DIR`: what it refuses, and why, before any cluster starts.

The resume itself (a lost run continued in place) is in tests/test_faults.py.
"""

from __future__ import annotations

import json

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError
from pipelines.api import prepare_resume, prepare_run_dir
from pipelines.cli import main


def _run_dir(tmp_path, checkpoint_version: int | None = None):
    """A run directory as `laminar run` leaves it: its config and, optionally, the
    trainer state of a checkpoint (what resume reads before loading anything)."""
    run = prepare_run_dir(with_overrides(RunConfig(), ["trainer.steps=2"]), tmp_path / "run")
    if checkpoint_version is not None:
        ckpt = run / "checkpoints" / f"version-{checkpoint_version:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"version": checkpoint_version}))
    return run


def test_resume_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml, so it is not a run directory"):
        prepare_resume(tmp_path)


def test_resume_refuses_a_run_without_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"no checkpoint.*trainer.checkpoint_every"):
        prepare_resume(_run_dir(tmp_path))


def test_resume_asks_for_more_steps_than_the_checkpoint_has(tmp_path):
    run = _run_dir(tmp_path, checkpoint_version=2)
    with pytest.raises(ConfigError, match=r"at version 2 and trainer.steps=2.*trainer.steps=4"):
        prepare_resume(run)


def test_the_cli_names_what_to_drop_or_add(tmp_path, capsys):
    run = _run_dir(tmp_path, checkpoint_version=2)
    assert main(["run", "configs/tiny.yaml", "--resume", str(run)]) == 2
    assert "drop CONFIG and --run-dir" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "needs a CONFIG file (or --resume RUN_DIR)" in capsys.readouterr().err
    # A new run into a directory that holds one points at --resume.
    (run / "trajectories.zarr").mkdir()
    assert main(["run", "configs/tiny.yaml", "--run-dir", str(run)]) == 2
    assert f"laminar run --resume {run}" in capsys.readouterr().err


def _checkpointed_run(tmp_path):
    """A run directory with a real checkpoint at version 1 of the default tiny model."""
    from laminar.learner import Learner
    from laminar.model import build_tiny_policy

    run = _run_dir(tmp_path)
    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    learner = Learner(cfg, build_tiny_policy(tmp_path / "policy", seed=0))
    learner.version = 1
    learner.save(run / "checkpoints" / "version-000001")
    return run


def test_resume_checks_the_checkpoint_before_it_writes_the_config(tmp_path):
    """An override the checkpoint cannot take (other optimizer or model settings) is
    refused before config.yaml is rewritten: the run stays resumable as it was."""
    from laminar.learner import CheckpointError

    run = _checkpointed_run(tmp_path)
    before = (run / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"other optimizer settings \(trainer.lr"):
        prepare_resume(run, ["trainer.lr=1e-2"])
    with pytest.raises(CheckpointError, match=r"another model.*hidden_size.*model\.\*"):
        prepare_resume(run, ["model.hidden_size=64"])
    assert (run / "config.yaml").read_text() == before
    from storage import TrajectoryWriter

    TrajectoryWriter(run)  # (an empty store: nothing generated before the stop)
    cfg, _, _ = prepare_resume(run, ["trainer.steps=3"])  # and what it can take passes
    assert cfg.trainer.steps == 3 and cfg.trainer.resume_from.endswith("version-000001")
    # config.yaml keeps the override, not the checkpoint: it still repeats the whole run
    from laminar.config import load_config

    again = load_config(run / "config.yaml")
    assert again.trainer.steps == 3 and again.trainer.resume_from is None


def test_a_missing_resume_from_is_refused_before_the_cluster(tmp_path):
    from laminar.learner import CheckpointError
    from pipelines.api import preflight

    cfg = with_overrides(RunConfig(), [f"trainer.resume_from={tmp_path / 'nowhere'}"])
    with pytest.raises(CheckpointError, match="trainer.resume_from .*nowhere.* is not a folder"):
        preflight(cfg)


def test_a_damaged_checkpoint_state_is_named(tmp_path):
    from laminar.learner import CheckpointError

    run = _run_dir(tmp_path, checkpoint_version=2)
    (run / "checkpoints" / "version-000002" / "trainer_state.json").write_text('{"vers')
    with pytest.raises(CheckpointError, match=r"trainer_state.json' is damaged.*move this one"):
        prepare_resume(run)


def test_a_report_into_a_file_is_refused_first(tmp_path):
    from pipelines.report import build_report

    (tmp_path / "taken").write_text("")
    with pytest.raises(ConfigError, match="is a file; the report is a folder"):
        build_report([tmp_path / "no-run"], out=tmp_path / "taken")
