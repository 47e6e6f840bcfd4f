"""Bad inputs of `laminar run --resume` (and pipelines.resume), refused before any cluster
starts, each named with its fix:

- a damaged trajectory store: a chunk of a per-trajectory or leave-event array, or of the
  tokens the resumed buffer holds again, that does not decode. Before, a damaged array
  the resume's plan does not read (``reward``, ``t_insert``, ...) failed the buffer on
  the cluster, after the warm start, naming no array; one it does read was refused
  naming the store alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from laminar.config import RunConfig, with_overrides
from pipelines.api import prepare_resume, prepare_run_dir
from pipelines.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint at version 1 of the default tiny model; runs get a copy."""
    from laminar.learner import Learner
    from laminar.model import build_tiny_policy

    root = tmp_path_factory.mktemp("saved")
    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    learner = Learner(cfg, build_tiny_policy(root / "policy", seed=0))
    learner.version = 1
    return learner.save(root / "version-000001")


def _resumable(run: Path, saved: Path, records=()) -> Path:
    """``run`` (a run directory) with the checkpoint and a trajectory store of
    ``records``, as a run stopped at version 1 leaves it."""
    from storage.trajectories import TrajectoryWriter

    shutil.copytree(saved, run / "checkpoints" / "version-000001")
    records, events = records or ((), ())
    TrajectoryWriter(run).append(list(records), list(events))
    return run


# -- a damaged trajectory store ------------------------------------------------------


def _record(uid: str, status: str, sample_version: int = -1) -> dict:
    from storage.schema import ALL_FIELDS

    group, idx = uid.rsplit("-", 1)
    return {f: 0 for f in ALL_FIELDS} | {
        "uid": uid,
        "prompt_uid": group,
        "prompt_key": int(group[1:]),
        "sample_idx": int(idx),
        "group_size": 2,
        "finish_version": 0,
        "sample_version": sample_version,
        "reward": 0.5,
        "finish_reason": "eos",
        "rollout_ids": "rollout-0",
        "status": status,
        "t_insert": 1.0,
        "t_sample": 2.0 if sample_version >= 0 else float("nan"),
        "prompt_tokens": np.array([1, 5], np.int32),
        "response_tokens": np.array([7, 2, 3], np.int32),
        "behavior_logprobs": np.array([-0.1, -0.2, -0.3], np.float32),
        "loss_mask": np.array([1, 1, 1], np.uint8),
        "token_versions": np.array([], np.int32),
    }


# One group trained into the checkpoint (consumed at version 0), one buffered at the
# stop: the resume holds it again, reading its tokens.
RECORDS = (
    [_record("p00000000-0", "buffered"), _record("p00000000-1", "buffered")]
    + [_record("p00000001-0", "buffered"), _record("p00000001-1", "buffered")],
    [
        {"uid": u, "status": "consumed", "sample_version": 0, "t_sample": 2.0}
        for u in ("p00000000-0", "p00000000-1")
    ],
)


@pytest.fixture(scope="module")
def stored(saved, tmp_path_factory):
    """A stopped run's directory with its store; tests damage a copy."""
    root = tmp_path_factory.mktemp("stored")
    cfg = with_overrides(RunConfig(), ["trainer.steps=2", "task.num_prompts=64"])
    return _resumable(prepare_run_dir(cfg, root / "run"), saved, RECORDS)


def test_a_whole_store_resumes_holding_its_buffered_group_again(stored, tmp_path):
    run = shutil.copytree(stored, tmp_path / "run")
    _, plan, _ = prepare_resume(run, ["trainer.steps=3"])
    assert plan.readmit == ["p00000001-0", "p00000001-1"] and plan.consumed == 2


def _damage(chunk: Path, how: str) -> None:
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2] if how == "cut" else b"")


@pytest.mark.parametrize(
    "array, how",
    [
        ("reward", "cut"),  # (the plan does not read it: the buffer did, on the cluster)
        ("reward", "emptied"),
        ("t_insert", "cut"),
        ("prompt_uid", "cut"),  # (the plan reads it: refused, naming the store alone)
        ("event_status", "emptied"),
        ("response_tokens", "cut"),  # (the held-again group's: the buffer read them)
    ],
)
def test_a_damaged_store_array_is_refused_before_the_cluster_starts(
    stored, tmp_path, capsys, no_cluster, array, how
):
    run = shutil.copytree(stored, tmp_path / "run")
    before = (run / "config.yaml").read_text()
    store = run / "trajectories.zarr"
    chunk = store / array / "c" / "0"
    _damage(chunk, how)
    assert main(["run", "--resume", str(run), "--set", "trainer.steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume '{run}': '{store}' is damaged: its array {array!r}" in err, err
    assert f"chunk '{chunk}'" in err and "does not decode" in err
    assert "restore the run directory from a copy" in err
    ckpt = run / "checkpoints" / "version-000001"
    assert f"--run-dir NEW_DIR --set trainer.resume_from={ckpt}" in err
    assert (run / "config.yaml").read_text() == before
