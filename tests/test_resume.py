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
from storage.live import claim


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
    with pytest.raises(ConfigError, match=r"it does not exist; give a run directory"):
        prepare_resume(tmp_path / "no-such-run")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"it is a file; give a run directory"):
        prepare_resume(tmp_path / "a-file")


def test_resume_refuses_a_run_without_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"no checkpoint.*trainer.checkpoint_every"):
        prepare_resume(_run_dir(tmp_path))


def test_resume_asks_for_more_steps_than_the_checkpoint_has(tmp_path):
    run = _run_dir(tmp_path, checkpoint_version=2)
    with pytest.raises(ConfigError, match=r"at version 2, 2 updates made, and trainer.steps=2.*"):
        prepare_resume(run)
    # A trainer restarted within the run skipped 2 version numbers: version 4 holds 2
    # updates (nothing owed), version 3 holds 1 (one owed: not refused for steps).
    state = run / "checkpoints" / "version-000004" / "trainer_state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"version": 4, "skipped_versions": 2}))
    with pytest.raises(ConfigError, match=r"version 4, 2 updates made.*trainer.steps=4"):
        prepare_resume(run)
    state.parent.rename(state.parent.with_name("version-000004.damaged"))
    state = run / "checkpoints" / "version-000003" / "trainer_state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"version": 3, "skipped_versions": 2}))
    from laminar.learner import CheckpointError

    with pytest.raises(CheckpointError, match="lacks"):  # (its weights are missing: later)
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


def test_resume_checks_the_checkpoint_before_it_writes_the_config(tmp_path, capsys, no_cluster):
    """An override the checkpoint cannot take (other optimizer or model settings) is
    refused before config.yaml is rewritten: the run stays resumable as it was. So is a
    checkpoint whose weights changed since it was written (one bit flipped, the
    safetensors header intact), which `laminar run --resume` loaded and trained on with
    no error: refused before any cluster starts, naming the file and the fix."""
    from laminar.learner import CheckpointError

    run = _checkpointed_run(tmp_path)
    before = (run / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"other optimizer settings \(trainer.weight_d"):
        prepare_resume(run, ["trainer.weight_decay=0.5"])
    with pytest.raises(CheckpointError, match=r"another model.*hidden_size.*model\.\*"):
        prepare_resume(run, ["model.hidden_size=64"])
    weights = run / "checkpoints" / "version-000001" / "model.safetensors"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    weights.write_bytes(bytes(flipped))
    assert main(["run", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"'{weights}' is damaged (its bytes changed since it was written: xxh3_128" in err
    # (its only checkpoint: no earlier one to move aside for, a new run directory)
    assert f"start it again in a new run directory (`laminar run {run}/config.yaml" in err
    weights.write_bytes(good)
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
    said = r"trainer_state.json' is damaged.*no earlier checkpoint.*a new run directory"
    with pytest.raises(CheckpointError, match=said):
        prepare_resume(run)


def test_a_report_into_a_file_is_refused_first(tmp_path):
    from pipelines.report import build_report

    (tmp_path / "taken").write_text("")
    with pytest.raises(ConfigError, match="is a file; the report is a folder"):
        build_report([tmp_path / "no-run"], out=tmp_path / "taken")


def test_a_directory_a_run_is_going_in_is_neither_resumed_nor_started_again(tmp_path):
    """RUN_DIR/driver.json, renewed by a running driver: while fresh, a resume or a new
    run there is refused (naming the driver); once stale (the driver killed), not."""
    import time

    from storage.live import LIVE_FILE, LIVE_STALE_S, running_driver

    run = _run_dir(tmp_path, checkpoint_version=2)
    live = {"pid": 4242, "host": "node7", "since": time.time() - 100, "seen": time.time()}
    (run / LIVE_FILE).write_text(json.dumps(live))
    assert running_driver(run)["pid"] == 4242
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"cannot resume .*a run is going there .*pid 4242"):
        prepare_resume(run, ["trainer.steps=50"])
    assert (run / "config.yaml").read_text() == before  # (not rewritten)
    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    with pytest.raises(ConfigError, match=r"cannot start a run in .*'node7'"):
        prepare_run_dir(cfg, run)
    (run / LIVE_FILE).write_text(json.dumps(live | {"seen": time.time() - LIVE_STALE_S - 1}))
    assert running_driver(run) is None
    # (went on, to the check of what is left to train)
    with pytest.raises(ConfigError, match=r"at version 2, 2 updates made, and trainer.steps=2"):
        prepare_resume(run)


def _resumable(tmp_path, name: str):
    """A run directory a resume can continue: a real checkpoint at version 1, an empty
    store."""
    from laminar.learner import Learner
    from laminar.model import build_tiny_policy
    from storage import TrajectoryWriter

    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    run = prepare_run_dir(cfg, tmp_path / name)
    learner = Learner(cfg, build_tiny_policy(tmp_path / "policy", seed=0))
    learner.version = 1
    learner.save(run / "checkpoints" / "version-000001")
    TrajectoryWriter(run)
    return run


def test_a_resume_the_cluster_cannot_place_gives_its_directory_back(cluster_client, tmp_path):
    """pipelines.resume claims the directory before it waits for workers: when none
    come, it is given back (a notebook that lives on would otherwise hold it)."""
    from laminar.errors import ClusterError
    from pipelines.api import resume
    from storage.live import running_driver

    run = _resumable(tmp_path, "run")
    claim(run).release()  # (the start that made it is gone)
    more = ["trainer.steps=3", "rollout.replicas=50", "cluster.placement_timeout_s=0"]
    with pytest.raises(ClusterError, match="rollout: 2 worker"):
        resume(run, cluster_client, overrides=more)
    assert running_driver(run) is None
    cfg, _, _ = prepare_resume(run, ["trainer.steps=3"])  # (free: taken at once)
    claim(run).release()


def test_a_run_directory_is_resumed_whatever_its_name_says_in_yaml(tmp_path):
    """Paths are set, not parsed as YAML: ' #' would start a comment, ': ' a mapping."""

    run = _resumable(tmp_path, "exp #2: lr")
    cfg, _, path = prepare_resume(run, ["trainer.steps=3"])
    assert path == run and cfg.run_dir == str(run)
    assert cfg.trainer.resume_from == str(run / "checkpoints" / "version-000001")


def test_a_new_run_does_not_overwrite_what_is_not_its_own(tmp_path):
    import shutil

    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"'.*a-file' is a file; pass a directory"):
        prepare_run_dir(cfg, tmp_path / "a-file")
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("my: own\n")
    with pytest.raises(ConfigError, match=r"not written by laminar, and a run would overwrite it"):
        prepare_run_dir(cfg, project)
    assert (project / "config.yaml").read_text() == "my: own\n"
    # its own config.yaml (a first attempt that failed before storing anything): again
    run = prepare_run_dir(cfg, tmp_path / "run")
    assert prepare_run_dir(cfg, tmp_path / "run") == run
    # a start stopped or failed in its setup (its store empty, no checkpoint): again
    from factories import trajectory

    from storage import TrajectoryWriter

    TrajectoryWriter(run)
    assert prepare_run_dir(cfg, run) == run  # (its empty store moved aside: 9b4e49d)
    # something stored and no checkpoint: --resume cannot continue it, so not offered
    TrajectoryWriter(run).append([trajectory("p0-0", "p0").to_record()])
    with pytest.raises(ConfigError, match=r"no checkpoint to continue from; pass a new"):
        prepare_run_dir(cfg, run)
    # moved, or named from another working directory: still its own config.yaml
    moved = tmp_path / "elsewhere"
    (tmp_path / "run").rename(moved)
    shutil.rmtree(moved / "trajectories.zarr")  # (as if nothing had been stored)
    assert prepare_run_dir(cfg, moved) == moved
