"""Bad input met at `laminar run`: refused before any cluster starts, naming the field or
the path and the fix, and nothing of the user's is touched."""

from __future__ import annotations

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError, ModelError
from pipelines import cli

FAST = ["--set", "task.num_prompts=50"]


def test_a_run_dir_that_is_a_file_is_refused_and_the_file_kept(tmp_path, capsys, no_cluster):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    assert cli.main(["run", "configs/tiny.yaml", *FAST, "--run-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"run directory {str(f)!r} is a file" in err and "--run-dir" in err
    assert f.read_text() == "mine"
    # ... or a file further up the path; or a folder this user cannot make
    assert cli.main(["run", "configs/tiny.yaml", *FAST, "--run-dir", str(f / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{str(f)!r} is a file, not a folder; pass --run-dir" in err
    assert f.read_text() == "mine"
    assert cli.main(["run", "configs/tiny.yaml", *FAST, "--run-dir", "/proc/laminar-run"]) == 2
    assert "cannot make the run directory '/proc/laminar-run' (" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_cache_dir_that_cannot_be_made_is_named_before_the_cluster_starts(
    tmp_path, capsys, no_cluster, where
):
    f = tmp_path / "afile"
    f.write_text("")
    bad = str(f / "cache") if where == "file" else "/proc/laminar-nope"
    run = tmp_path / "run"
    args = ["run", "configs/tiny.yaml", *FAST, "--set", f"sft.cache_dir={bad}"]
    assert cli.main([*args, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"the warm-start cache {bad!r}, from sft.cache_dir, is not a folder" in err
    assert "set sft.cache_dir to one" in err
    assert not run.exists()  # refused before the run directory was made


def test_the_warm_start_names_its_cache_on_the_worker_too(tmp_path, monkeypatch):
    """Where the pre-start check did not run (a notebook's submit) or the worker's file
    system differs, the worker's error still names the setting and the path."""
    from laminar.sft import warm_start

    f = tmp_path / "afile"
    f.write_text("")
    monkeypatch.setenv("LAMINAR_CACHE", str(f / "cache"))
    with pytest.raises(ConfigError, match=r"afile/cache', from LAMINAR_CACHE \(sft.cache_dir"):
        warm_start(with_overrides(RunConfig(), ["sft.steps=0"]), [])


def test_a_cache_that_is_not_needed_is_not_checked(tmp_path, tiny_policy):
    from laminar.sft import check_cache_dir

    f = tmp_path / "afile"
    f.write_text("")
    bad = [f"sft.cache_dir={f / 'cache'}"]
    with pytest.raises(ConfigError, match="sft.cache_dir"):
        check_cache_dir(with_overrides(RunConfig(), bad))
    # a model of one's own, no warm start: the cache is never used
    check_cache_dir(with_overrides(RunConfig(), [*bad, f"model.path={tiny_policy}", "sft.steps=0"]))


def test_a_sequence_longer_than_the_models_context_is_refused(tmp_path):
    """rollout.max_seq_len past the model's positions (the tiny Llama's 512) was taken:
    the rollouts generated past what the policy was built for."""
    from pipelines.api import preflight

    cfg = with_overrides(
        RunConfig(),
        ["rollout.max_seq_len=600", "rollout.max_new_tokens=500", f"sft.cache_dir={tmp_path}"],
    )
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_seq_len \(600\) exceeds the context of "
        r"the built-in tiny model \(512 positions",
    ):
        preflight(cfg)
    preflight(with_overrides(cfg, ["rollout.max_seq_len=512", "rollout.max_new_tokens=400"]))


def test_decoupled_with_one_mini_batch_is_warned_to_train_as_tis(tmp_path, caplog):
    """With one optimizer step the proximal policy is the step's own: decoupled is tis to
    the last bit (tests/test_learner.py's corrections test compares each to none only),
    and its clip_frac and approx_kl stay 0. The start says so, naming the setting."""
    import logging

    from pipelines.api import preflight

    cfg = with_overrides(RunConfig(), ["trainer.correction=decoupled", f"sft.cache_dir={tmp_path}"])
    with caplog.at_level(logging.WARNING, logger="laminar"):
        preflight(cfg)
        assert "trainer.mini_batches to 2 or more" in caplog.text
        caplog.clear()
        preflight(with_overrides(cfg, ["trainer.mini_batches=2"]))
        preflight(with_overrides(cfg, ["trainer.correction=tis"]))
    assert "mini_batches" not in caplog.text


def test_a_staleness_bound_that_evicts_what_it_lets_out_is_warned_with_the_setting(
    tmp_path, caplog
):
    """tiny.yaml with buffer.max_train_staleness=1 (32 groups out, 16 a batch) evicted
    32% of what it generated, the longest responses, and said nothing; with 16 out, none
    (docs/schedules.md). The start names the setting; partial rollout's η alike."""
    import logging

    from laminar.config import load_config
    from pipelines.api import preflight

    cfg = load_config(
        "configs/tiny.yaml", [f"sft.cache_dir={tmp_path}", "buffer.max_train_staleness=1"]
    )
    with caplog.at_level(logging.WARNING, logger="laminar"):
        preflight(cfg)
        assert "Set buffer.max_outstanding_groups=16 to generate only" in caplog.text
        caplog.clear()
        for fine in (
            ["buffer.max_outstanding_groups=16"],
            ["buffer.max_train_staleness=2"],
            ["buffer.max_train_staleness=null"],
        ):
            assert with_overrides(cfg, fine).doomed_dispatch() is None, fine
        preflight(with_overrides(cfg, ["buffer.max_outstanding_groups=16"]))
    assert "max_train_staleness" not in caplog.text
    eta = with_overrides(
        cfg,
        ["pipeline.schedule=partial_rollout", "pipeline.eta=2", "buffer.max_outstanding_groups=48"],
    )
    assert "set pipeline.eta=1" in eta.doomed_dispatch()
    assert with_overrides(eta, ["pipeline.eta=1"]).doomed_dispatch() is None


def test_a_config_file_that_is_not_utf8_is_refused_with_exit_2(tmp_path, capsys, no_cluster):
    """It was a UnicodeDecodeError traceback, exit 1; a run directory's config.yaml on
    --resume too (read by the same load_config)."""
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe trainer:\n")
    assert cli.main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"config file {str(bad)!r} is not UTF-8 text" in err and "save it as UTF-8" in err
    assert "Traceback" not in err
    run = tmp_path / "run"
    (run / "checkpoints" / "version-000001").mkdir(parents=True)
    (run / "config.yaml").write_bytes(b"run_dir: x\n\xff\xfe\n")
    assert cli.main(["run", "--resume", str(run)]) == 2
    assert "config.yaml' is not UTF-8 text" in capsys.readouterr().err


def test_a_path_from_the_home_folder_is_read_from_there(tmp_path, tiny_policy, monkeypatch):
    """`~/...` is the home folder of the machine that reads the path (config.md). The
    prompt file, model and checkpoint readers took it for a folder named `~` ("prompt
    file '~/p.jsonl' does not exist"), and `run_dir=~/runs/y` made a folder `~` in the
    working directory, where the run wrote (helper 185)."""
    import shutil

    from laminar.learner import CheckpointError
    from pipelines.api import absolute_paths, preflight, prepare_run_dir

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (home / "p.jsonl").write_text('{"prompt": "n 2 >", "answer": "1 2"}\n' * 4)
    shutil.copytree(tiny_policy, home / "model")
    given = ["task.prompt_file=~/p.jsonl", "model.path=~/model", "sft.steps=0"]
    cfg = absolute_paths(with_overrides(RunConfig(), [*given, "run_dir=~/runs/y"]))
    assert cfg.task.prompt_file == "~/p.jsonl"  # (recorded as given: read where it is read)
    preflight(cfg)
    assert prepare_run_dir(cfg, None) == home / "runs" / "y"
    assert not (tmp_path / "~").exists()
    with pytest.raises(CheckpointError, match=f"trainer.resume_from '{home}/nothing'"):
        preflight(with_overrides(cfg, ["trainer.resume_from=~/nothing"]))
    with pytest.raises(ModelError, match="is a file; set model.path to the folder"):
        preflight(with_overrides(cfg, ["model.path=~/p.jsonl"]))


def test_a_run_directory_for_a_checkpoint_or_one_without_its_config_says_the_fix(tmp_path):
    """`trainer.resume_from=RUN_DIR` (or its checkpoints/) listed the files a checkpoint
    lacks; `--resume` of a run whose config.yaml was deleted said it "is not a run
    directory", though it held checkpoints and stores (helper 185)."""
    from laminar.learner import CheckpointError, check_checkpoint
    from pipelines.api import prepare_resume

    run = tmp_path / "run"
    (run / "checkpoints" / "version-000003").mkdir(parents=True)
    (run / "trajectories.zarr").mkdir()
    newest = run / "checkpoints" / "version-000003"
    for given, what in ((run, "folder"), (run / "checkpoints", "checkpoints folder")):
        with pytest.raises(
            CheckpointError,
            match=rf"is a run's {what}, not a checkpoint; .* trainer.resume_from={newest} "
            rf"\(or continue that run in place: laminar run --resume {run}\)",
        ):
            check_checkpoint(given, None, RunConfig())
    with pytest.raises(
        ConfigError,
        match=r"holds a run \(checkpoints, trajectories.zarr\) but its config.yaml is gone; "
        rf"restore config.yaml .* --set trainer.resume_from={newest}",
    ):
        prepare_resume(run)


def test_a_prompt_file_whose_answers_count_in_range_cannot_read_is_refused(tmp_path):
    """task.reward=count_in_range with answers that are not 'lo hi' passed preflight,
    then every reward failed and the run stopped a minute later (helper 185)."""
    from laminar.errors import DataError
    from pipelines.api import preflight

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "n 2 >", "answer": "1 3"}\n{"prompt": "n 3 >", "answer": "1 2 3"}\n'
    )
    cfg = with_overrides(
        RunConfig(),
        [f"task.prompt_file={prompts}", "task.reward=count_in_range", f"sft.cache_dir={tmp_path}"],
    )
    with pytest.raises(DataError, match=rf"{prompts}:2: the answer '1 2 3' is not 'lo hi'"):
        preflight(cfg)


def test_a_kv_cache_past_a_local_workers_memory_is_refused_naming_the_settings(tmp_path):
    """rollout.max_concurrency=7000 passed every check; 15 s in, Dask restarted the
    rollout worker as it created the engine past its memory_limit, and the run failed
    with "lost while it created a RolloutReplica actor", naming no setting (helper 185)."""
    from pipelines.api import preflight

    cfg = with_overrides(RunConfig(), ["rollout.max_concurrency=7000", f"sft.cache_dir={tmp_path}"])
    with pytest.raises(
        ConfigError,
        match=r"KV cache would take .* GiB on each rollout worker \(rollout.max_concurrency=7000 "
        r"requests of rollout.max_seq_len=.*cluster.memory_limit=4GiB",
    ):
        preflight(cfg)
    preflight(with_overrides(cfg, ["cluster.memory_limit=0"]))  # (no limit: not checked)
