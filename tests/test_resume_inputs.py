"""Bad inputs of `laminar run --resume` (and pipelines.resume), refused before any cluster
starts, each named with its fix:

- a relative ``task.prompt_file``: a run records the file's absolute path when it starts;
  a run that recorded it relative (before laminar made it absolute) is resumed from
  another working directory by finding the file where the run was started; a file not
  found, or whose bytes changed, is named with every path tried;
- the other relative paths (``model.path``, ``sft.cache_dir``, ``trainer.resume_from``,
  the cluster's files): recorded absolute too, and those of an older run found where it
  was started; a ``model.path`` found nowhere is named with every path tried;
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

from laminar.config import RunConfig, load_config, with_overrides
from laminar.errors import ConfigError
from pipelines.api import PROMPT_FINGERPRINT, absolute_paths, prepare_resume, prepare_run_dir
from pipelines.cli import main

REPO = Path(__file__).resolve().parent.parent
PROMPTS = "".join(
    f'{{"prompt": "n {n} >", "answer": "{" ".join(str(i) for i in range(1, n + 1))}"}}\n'
    for n in range(1, 5)
)


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


def _started_in(start: Path, saved: Path, monkeypatch) -> Path:
    """A run started in ``start`` with ``task.prompt_file=data/p.jsonl`` and
    ``--run-dir runs/a``, as laminar recorded it before it made the path absolute: both
    relative in its config.yaml (and in prompt_file.sha256, beside the file's sha256)."""
    (start / "data").mkdir(parents=True)
    (start / "data" / "p.jsonl").write_text(PROMPTS)
    monkeypatch.chdir(start)
    cfg = with_overrides(RunConfig(), ["trainer.steps=2", "task.prompt_file=data/p.jsonl"])
    run = prepare_run_dir(cfg, "runs/a")
    text = (run / "config.yaml").read_text()
    text = text.replace(str(start / "data" / "p.jsonl"), "data/p.jsonl")
    (run / "config.yaml").write_text(text)
    fingerprint = run / PROMPT_FINGERPRINT
    fingerprint.write_text(fingerprint.read_text().replace(str(start) + "/", ""))
    assert "prompt_file: data/p.jsonl" in text and "run_dir: runs/a" in text
    return _resumable(run, saved)


class _Reached(Exception):
    """`laminar run` got past every check to the start of its cluster."""


def test_a_run_records_its_prompt_file_absolute_and_resumes_from_elsewhere(
    tmp_path, saved, monkeypatch
):
    """`laminar run --set task.prompt_file=data/p.jsonl` recorded the path as given: a
    resume from another directory (a notebook's, a job script's) did not find it, and a
    worker whose working directory differs read another file or none."""
    start = tmp_path / "repo"
    (start / "data").mkdir(parents=True)
    (start / "data" / "p.jsonl").write_text(PROMPTS)
    monkeypatch.chdir(start)

    def reached(cfg, run_dir=None):
        raise _Reached(cfg, run_dir)

    monkeypatch.setattr("laminar.deploy.open_cluster", reached)
    argv = ["run", str(REPO / "configs" / "tiny.yaml"), "--run-dir", "runs/a"]
    with pytest.raises(_Reached) as e:
        main([*argv, "--set", "task.prompt_file=data/p.jsonl", "--set", "trainer.steps=2"])
    cfg, run = e.value.args
    absolute = str(start / "data" / "p.jsonl")
    assert cfg.task.prompt_file == absolute  # (what the cluster's workers read)
    assert load_config(run / "config.yaml").task.prompt_file == absolute
    assert (run / PROMPT_FINGERPRINT).read_text().split()[1] == absolute
    # (pipelines.submit's run directory, and any other prepared directly, too)
    plain = prepare_run_dir(
        with_overrides(RunConfig(), ["task.prompt_file=data/p.jsonl"]), tmp_path / "b"
    )
    assert load_config(plain / "config.yaml").task.prompt_file == absolute

    _resumable(run, saved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg, _, _ = prepare_resume(run, ["trainer.steps=3"])
    assert cfg.task.prompt_file == absolute


def test_a_run_that_recorded_a_relative_prompt_file_finds_it_where_it_started(
    tmp_path, saved, monkeypatch
):
    """Before laminar recorded the path absolute, a resume from another directory
    failed in preflight with "prompt file 'data/p.jsonl' does not exist; set
    task.prompt_file" (no word of where it looked); with a file of that relative
    path there and no sha256 recorded, it trained on that one. The run's own file is
    found where the run was started (its run_dir recorded relative to it), checked
    against its sha256, and recorded absolute from then on."""
    start = tmp_path / "repo"
    run = _started_in(start, saved, monkeypatch)
    digest = (run / PROMPT_FINGERPRINT).read_text()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "p.jsonl").write_text(PROMPTS[::-1])  # (same name, other bytes)
    monkeypatch.chdir(elsewhere)
    cfg, _, path = prepare_resume(run.resolve(), ["trainer.steps=3"])
    found = str(start / "data" / "p.jsonl")
    assert cfg.task.prompt_file == found
    assert load_config(path / "config.yaml").task.prompt_file == found
    assert (run / PROMPT_FINGERPRINT).read_text() == digest  # (the record stands)


def test_a_relative_prompt_file_not_found_is_named_with_the_paths_tried(
    tmp_path, saved, monkeypatch, capsys, no_cluster
):
    """A run folder moved since (where it started is unknown) and resumed from another
    directory: the error names the field, the path it tried, the bytes it wants and
    the fix; nothing of the run directory is rewritten."""
    run = _started_in(tmp_path / "repo", saved, monkeypatch)
    moved, elsewhere = _moved_and_resumed_elsewhere(run, tmp_path, monkeypatch)
    before = (moved / "config.yaml").read_text()
    digest = (moved / PROMPT_FINGERPRINT).read_text().split()[0]
    assert main(["run", "--resume", str(moved), "--set", "trainer.steps=3"]) == 2
    err = capsys.readouterr().err
    tried = elsewhere / "data" / "p.jsonl"
    assert (
        f"task.prompt_file 'data/p.jsonl' is not a file: tried '{tried}' (from this "
        "working directory)"
    ) in err, err
    assert f"sha256 {digest}" in err
    assert "--set task.prompt_file=/path/to/p.jsonl" in err
    assert "or resume from the directory the run was started in" in err
    assert (moved / "config.yaml").read_text() == before
    # what it says works: the file's path given
    given = str(tmp_path / "repo" / "data" / "p.jsonl")
    cfg, _, _ = prepare_resume(moved, ["trainer.steps=3", f"task.prompt_file={given}"])
    assert cfg.task.prompt_file == given


def test_a_prompt_file_found_with_other_bytes_is_named_with_both_digests(
    tmp_path, saved, monkeypatch
):
    """Where the run was started, the file was edited since; from this directory, a
    file of that relative path holds other bytes too: each is named with its sha256."""
    start = tmp_path / "repo"
    run = _started_in(start, saved, monkeypatch)
    (start / "data" / "p.jsonl").write_text(PROMPTS + PROMPTS)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "p.jsonl").write_text(PROMPTS[::-1])
    monkeypatch.chdir(elsewhere)
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        prepare_resume(run.resolve(), ["trainer.steps=3"])
    msg = str(e.value)
    assert "task.prompt_file 'data/p.jsonl' is not what the run began with" in msg, msg
    for where, why in [(start, "where the run was started"), (elsewhere, "from this working")]:
        assert f"'{where / 'data' / 'p.jsonl'}' ({why}" in msg, msg
    assert (run / PROMPT_FINGERPRINT).read_text().split()[0] in msg
    assert (run / "config.yaml").read_text() == before
    # the run's bytes in this directory's copy: resumed from it
    (elsewhere / "data" / "p.jsonl").write_text(PROMPTS)
    cfg, _, _ = prepare_resume(run.resolve(), ["trainer.steps=3"])
    assert cfg.task.prompt_file == str(elsewhere / "data" / "p.jsonl")


@pytest.mark.parametrize("text", ["", "not a digest\n"])
def test_a_damaged_prompt_fingerprint_is_named(tmp_path, saved, monkeypatch, text):
    """An empty prompt_file.sha256 failed the resume with a bare IndexError."""
    run = _started_in(tmp_path / "repo", saved, monkeypatch)
    (run / PROMPT_FINGERPRINT).write_text(text)
    with pytest.raises(ConfigError, match=r"prompt_file.sha256 does not read as .*delete it"):
        prepare_resume(run.resolve(), ["trainer.steps=3"])


# -- the other relative paths --------------------------------------------------------


def test_a_run_records_its_model_cache_and_checkpoint_paths_absolute(
    tmp_path, saved, tiny_policy, monkeypatch
):
    """`--set model.path=models/tiny --set sft.cache_dir=cache` were recorded as given:
    a resume from another directory (or a worker with another working directory) read
    another folder or none, and warmed another cache (training again)."""
    start = tmp_path / "repo"
    shutil.copytree(tiny_policy, start / "models" / "tiny")
    shutil.copytree(saved, start / "from" / "version-000001")
    monkeypatch.chdir(start)

    def reached(cfg, run_dir=None):
        raise _Reached(cfg, run_dir)

    monkeypatch.setattr("laminar.deploy.open_cluster", reached)
    sets = [
        "model.path=models/tiny",
        "sft.cache_dir=cache",
        "trainer.resume_from=from/version-000001",
        "trainer.steps=2",
    ]
    argv = ["run", str(REPO / "configs" / "tiny.yaml"), "--run-dir", "runs/a"]
    with pytest.raises(_Reached) as e:
        main([*argv, *(a for s in sets for a in ("--set", s))])
    cfg, run = e.value.args
    recorded = load_config(run / "config.yaml")
    for got in (cfg, recorded):  # (what the workers read, and what a resume reads)
        assert got.model.path == str(start / "models" / "tiny")
        assert got.sft.cache_dir == str(start / "cache")
        assert got.trainer.resume_from == str(start / "from" / "version-000001")


def test_what_is_not_a_path_from_here_stays_as_given(tmp_path, monkeypatch):
    """A model.path naming nothing here (a hub id: preflight names it as given), a
    path from the home folder (expanded on the machine that reads it) and a Slurm
    python with no '/' (a command on the compute node's PATH) are left as given."""
    monkeypatch.chdir(tmp_path)
    cfg = with_overrides(
        RunConfig(),
        [
            "model.path=Qwen/Qwen2.5-0.5B",
            "sft.cache_dir=~/cache",
            "cluster.slurm.python=python3",
            "cluster.slurm.log_directory=logs",
            "cluster.protocol=tls",
            "cluster.security.ca_file=tls/ca.pem",
            "cluster.security.cert=~/tls/cert.pem",
            "cluster.security.key=tls/key.pem",
        ],
    )
    got = absolute_paths(cfg)
    assert got.model.path == "Qwen/Qwen2.5-0.5B"
    assert got.sft.cache_dir == "~/cache" and got.cluster.security.cert == "~/tls/cert.pem"
    assert got.cluster.slurm.python == "python3"
    assert got.cluster.slurm.log_directory == str(tmp_path / "logs")
    assert got.cluster.security.ca_file == str(tmp_path / "tls" / "ca.pem")
    assert got.cluster.security.key == str(tmp_path / "tls" / "key.pem")
    (tmp_path / "Qwen" / "Qwen2.5-0.5B").mkdir(parents=True)  # (a folder of that name)
    python = with_overrides(cfg, ["cluster.slurm.python=venv/bin/python"])
    got = absolute_paths(python)
    assert got.model.path == str(tmp_path / "Qwen" / "Qwen2.5-0.5B")
    assert got.cluster.slurm.python == str(tmp_path / "venv" / "bin" / "python")
    assert absolute_paths(RunConfig()) == RunConfig()  # (nothing set: nothing changed)


def test_a_relative_laminar_cache_is_recorded_as_this_directory_resolves_it(tmp_path, monkeypatch):
    """sft.cache_dir unset, the cache is $LAMINAR_CACHE: a relative one would resolve
    against each worker's (and a resume's) own directory, so the run records it
    absolute; an absolute or home-relative one, or a cache_dir set, is left as it is."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAMINAR_CACHE", "cache")
    assert absolute_paths(RunConfig()).sft.cache_dir == str(tmp_path / "cache")
    set_dir = with_overrides(RunConfig(), [f"sft.cache_dir={tmp_path / 'mine'}"])
    assert absolute_paths(set_dir) == set_dir
    for given in ("~/cache", "/shared/cache"):
        monkeypatch.setenv("LAMINAR_CACHE", given)
        assert absolute_paths(RunConfig()) == RunConfig()


def _started_with_folders(start: Path, saved: Path, tiny_policy: Path, monkeypatch) -> Path:
    """A run started in ``start`` with ``model.path=models/tiny``, ``sft.cache_dir=cache``
    and ``--run-dir runs/a``, as laminar recorded them before it made them absolute."""
    shutil.copytree(tiny_policy, start / "models" / "tiny")
    (start / "cache").mkdir()  # (the run made it)
    monkeypatch.chdir(start)
    cfg = with_overrides(
        RunConfig(), ["trainer.steps=2", "model.path=models/tiny", "sft.cache_dir=cache"]
    )
    run = prepare_run_dir(cfg, "runs/a")
    text = (run / "config.yaml").read_text()
    text = text.replace(str(start / "models" / "tiny"), "models/tiny")
    text = text.replace(str(start / "cache"), "cache")
    (run / "config.yaml").write_text(text)
    assert "path: models/tiny" in text and "cache_dir: cache" in text
    return _resumable(run, saved)


def test_a_run_that_recorded_relative_folders_finds_them_where_it_started(
    tmp_path, saved, tiny_policy, monkeypatch
):
    """Resumed from another directory, such a run failed in preflight ("model folder
    'models/tiny' does not exist"), or, with no model.path, warmed a new cache where it
    was resumed from (training again). Both are found where the run was started, and
    recorded absolute from then on; a --set of one now is taken from here."""
    start = tmp_path / "repo"
    run = _started_with_folders(start, saved, tiny_policy, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "cache").mkdir(parents=True)  # (not the run's: where it started is first)
    monkeypatch.chdir(elsewhere)
    cfg, _, path = prepare_resume(run.resolve(), ["trainer.steps=3"])
    for got in (cfg, load_config(path / "config.yaml")):
        assert got.model.path == str(start / "models" / "tiny")
        assert got.sft.cache_dir == str(start / "cache")
    cfg, _, _ = prepare_resume(run.resolve(), ["trainer.steps=3", "sft.cache_dir=other"])
    assert cfg.sft.cache_dir == str(elsewhere / "other")


def test_a_relative_model_path_found_nowhere_is_named_with_the_paths_tried(
    tmp_path, saved, tiny_policy, monkeypatch, capsys, no_cluster
):
    run = _started_with_folders(tmp_path / "repo", saved, tiny_policy, monkeypatch)
    moved, elsewhere = _moved_and_resumed_elsewhere(run, tmp_path, monkeypatch)
    before = (moved / "config.yaml").read_text()
    assert main(["run", "--resume", str(moved), "--set", "trainer.steps=3"]) == 2
    err = capsys.readouterr().err
    tried = elsewhere / "models" / "tiny"
    assert (
        f"model.path 'models/tiny' is not a folder: tried '{tried}' (from this working "
        "directory); give the path of the folder the run read (a local HF folder)"
    ) in err, err
    assert "--set model.path=/path/to/tiny" in err
    assert "or resume from the directory the run was started in" in err
    assert (moved / "config.yaml").read_text() == before
    # what it says works: the folder's path given
    given = str(tmp_path / "repo" / "models" / "tiny")
    cfg, _, _ = prepare_resume(moved, ["trainer.steps=3", f"model.path={given}"])
    assert cfg.model.path == given


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


def _moved_and_resumed_elsewhere(run, tmp_path, monkeypatch):
    """``run`` moved to another folder (its recorded relative ``run_dir`` no longer
    names where it was started) and the working directory another one: the moved run's
    folder and that directory."""
    moved = tmp_path / "moved" / "a"
    shutil.move(run, moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return moved, elsewhere
