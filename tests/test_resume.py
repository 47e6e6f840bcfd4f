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
