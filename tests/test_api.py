"""The notebook API's handle and ``laminar report``, as a notebook user meets them."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from conftest import resumable_run


@pytest.mark.slow
def test_an_interrupted_wait_stops_the_run_instead_of_leaving_it_going(
    cluster_client, small_config, tmp_path
):
    """A kernel interrupt (Ctrl-C) while ``wait()`` blocks stops the run in order, as
    `laminar run`'s first Ctrl-C does: it used to return control with the run still
    generating on the cluster, where the next submit stacked a second run beside it."""
    import pipelines
    from laminar.config import with_overrides
    from laminar.errors import RunStopped

    cfg = with_overrides(  # (uncached: a warm start that would train for hours)
        small_config, ["sft.steps=1000000", f"sft.cache_dir={tmp_path / 'cache'}"]
    )
    run = pipelines.submit(cfg, cluster_client, run_dir=tmp_path / "run")
    try:
        deadline = time.time() + 120
        while run.progress().get("phase") != "warm-start":
            assert time.time() < deadline and not run.done(), run.progress()
            time.sleep(0.1)
        main = threading.main_thread().ident
        timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(RunStopped, match="stopped during its setup"):
                run.wait(timeout=120)
        except KeyboardInterrupt:
            pytest.fail(f"wait() let the interrupt through; the run goes on: {run.progress()}")
        finally:
            timer.join()
        assert run.done() and run.progress()["phase"] == "stopped"
    finally:
        run.stop()
        run._done.wait(60)


def _stored_run(path, t0: float = 1.8e9):
    """Ten trajectories (reward rising with finish time, one a second) and ``cluster``
    rows of a run that ran 0..20 s (versions 0..4), stopped, and was resumed 120..140 s
    (versions 4..8)."""
    from factories import trajectory

    from storage import TrajectoryWriter
    from storage.metrics import MetricsWriter

    TrajectoryWriter(path).append(
        [
            trajectory(
                f"u{i}",
                f"g{i // 2}",
                sample_idx=i % 2,
                reward=i / 10,
                t_submit=t0,
                t_start=t0,
                t_finish=t0 + i,
                t_insert=t0 + i,
            ).to_record()
            for i in range(10)
        ]
    )
    rows = [(0, t) for t in range(0, 21, 5)] + [(1, t) for t in range(120, 141, 5)]
    MetricsWriter(path).append(
        "cluster",
        [
            {
                "segment": s,
                "elapsed_s": t,
                "wall_time": t0 + t,
                "version": t // 5 if s == 0 else (t - 120) // 5 + 4,
                "buffer_depth": 1,
                "oldest_buffered_age_s": 1.0,
            }
            for s, t in rows
        ],
    )


def _report_row(report) -> str:
    """The run's row of report.md's first table (the line below its header's rule)."""
    lines = report.read_text().splitlines()
    return lines[next(i for i, x in enumerate(lines) if x.startswith("| run | versions")) + 2]


def test_report_of_a_run_without_its_summary_takes_its_figures_from_the_stores(tmp_path):
    """A run whose driver was killed (a second Ctrl-C, a dead kernel) or that is still
    going has no summary.json (a resumed one: its earlier start's): its row was
    "nan → nan", "-" versions and "nan" wall seconds, though the stores hold them."""
    import json

    from pipelines.report import build_report

    run = tmp_path / "run"
    _stored_run(run)
    row = _report_row(build_report([run], tmp_path / "out"))
    # reward of the first vs last 20% by finish time (2 of 10), versions, RL wall time
    assert row.startswith("| run | 8 | 10 | 0.050 → 0.850 (+0.800) |"), row
    assert row.endswith("| 40 (2 starts) |"), row
    # The summary.json of the first start, before the resume: the stores' figures still.
    first = {"reason": "completed", "versions": 4, "reward_first_20pct": 0.05}
    first |= {"reward_last_20pct": 0.25, "reward_gain": 0.2, "rl_wall_s": 20.0}
    (run / "summary.json").write_text(json.dumps(first))
    assert _report_row(build_report([run], tmp_path / "out")) == row


def _handle_interrupted_once(summary=None, error=None):
    """A RunHandle (no cluster) whose run goes on until ``wait()``'s first wait is
    interrupted, then ends in order: with ``summary``, or with ``error``."""
    from pathlib import Path

    from pipelines.api import RunHandle

    h = RunHandle.__new__(RunHandle)
    h.run_dir, h.summary, h.error = Path("runs/x"), None, None
    h._stop = threading.Event()

    class Done:
        waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            assert h._stop.is_set(), "waited on without stopping the run"
            h.summary, h.error = summary, error
            return True

    h._done = Done()
    return h


def test_an_interrupted_wait_raises_once_the_run_stopped_so_a_loop_over_runs_ends():
    """``for x in grid: submit(...).wait()`` (a notebook's loop, a bench): an interrupt
    stopped the run in order and wait() returned its summary, reason "stopped", as if it
    had finished: the loop took it for a result and submitted the next run. Now wait()
    raises RunInterrupted, a KeyboardInterrupt, with the summary, once the run stopped."""
    from laminar.errors import RunStopped
    from pipelines.api import RunInterrupted

    summary = {"reason": "stopped", "versions": 3}
    h = _handle_interrupted_once(summary)
    with pytest.raises(RunInterrupted, match="stopped in order") as e:
        h.wait()
    assert isinstance(e.value, KeyboardInterrupt) and e.value.summary is summary
    assert h._stop.is_set()
    # stopped in its setup: RunStopped, as before (tests/test_api.py's first test)
    h = _handle_interrupted_once(error=RunStopped("stopped during its setup"))
    with pytest.raises(RunStopped):
        h.wait()


def test_a_bench_run_that_did_not_run_to_its_end_is_no_measurement(monkeypatch, tmp_path):
    """A bench run that ended before its steps (schedules) or its measuring window
    (repack) was measured as if it had run them; now it is a failed run: left out and
    listed (RunFailed, with its summary)."""
    from laminar.errors import RunFailed
    from pipelines import bench_repack, bench_schedules

    class Run:  # ended at once, stopped
        def progress(self):
            return {"phase": "setup"}

        def done(self):
            return True

        def stop(self):
            pass

        def wait(self, timeout=None):
            return {"reason": "stopped", "versions": 2}

    monkeypatch.setattr("pipelines.submit", lambda *a, **k: Run())
    with pytest.raises(RunFailed, match="ended 'stopped' before its steps") as e:
        bench_schedules._run(None, tmp_path / "run", [])
    assert e.value.summary["reason"] == "stopped"
    with pytest.raises(RunFailed, match="ended 'stopped' before its 90.0 s window"):
        bench_repack._arm(None, tmp_path / "run", [], 90.0, None, 0.1)


def _past_the_config_checks(run, overrides=()):
    """Whether a resume got past the refusals of a changed config (to the checkpoint's
    missing weights)."""
    from laminar.learner import CheckpointError
    from pipelines.api import prepare_resume

    with pytest.raises(CheckpointError, match="lacks"):  # (not a crash in the checks)
        prepare_resume(run, overrides)
    return True


def test_a_resume_that_would_change_the_prompts_is_refused_naming_the_field(tmp_path):
    """Re-issued siblings of a resumed run's groups are found by prompt key: a resume
    with another task, seed or prompt file silently put other prompts into old groups."""
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume

    run = resumable_run(tmp_path)
    before = (run / "config.yaml").read_text()
    for override, was in [("task.name=copy", "'count'"), ("seed=7", "0")]:
        key, value = override.split("=")
        with pytest.raises(ConfigError, match=rf"with {key}=.*{value}.*: it ran {key}={was}"):
            prepare_resume(run, [override])
    with pytest.raises(ConfigError, match=r"trainer.resume_from=.*version-000001"):
        prepare_resume(run, ["task.num_prompts=7"])
    assert (run / "config.yaml").read_text() == before
    # what does not make the prompts may change (a reward fixed after a failure)
    assert _past_the_config_checks(run, ["task.truncated_reward=0.5", "trainer.steps=3"])


def test_a_resume_refuses_a_prompt_file_whose_bytes_changed(tmp_path):
    """An edited prompt file with as many lines maps each key to another prompt: the
    run records the file's sha256 as it began, and a resume refuses other bytes; the
    same bytes moved elsewhere, and an old run without a record, resume."""
    import shutil

    from laminar.errors import ConfigError
    from pipelines.api import PROMPT_FINGERPRINT, prepare_resume

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 2", "answer": "3"}\n{"prompt": "4 5", "answer": "6"}\n')
    run = resumable_run(tmp_path, [f"task.prompt_file={prompts}"])
    assert (run / PROMPT_FINGERPRINT).read_text().split()[1] == str(prompts)
    assert _past_the_config_checks(run, ["trainer.steps=3"])
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(prompts, moved)
    assert _past_the_config_checks(run, ["trainer.steps=3", f"task.prompt_file={moved}"])
    prompts.write_text('{"prompt": "4 5", "answer": "6"}\n{"prompt": "1 2", "answer": "3"}\n')
    for given in ([], [f"task.prompt_file={prompts}"]):
        with pytest.raises(ConfigError, match=r"task.prompt_file '.*prompts.jsonl' is not what"):
            prepare_resume(run, ["trainer.steps=3", *given])
    # a run from before the record: resumed, and recorded from then on; its file named
    # from elsewhere (a relative path from another folder) is taken on trust
    (run / PROMPT_FINGERPRINT).unlink()
    shutil.copy(moved, prompts)
    (run / PROMPT_FINGERPRINT).unlink(missing_ok=True)
    assert _past_the_config_checks(run, ["trainer.steps=3", f"task.prompt_file={moved}"])
    # beside a prompt file, the synthetic task's settings make no prompt: free to change
    assert _past_the_config_checks(run, ["trainer.steps=3", "task.name=copy"])


def test_the_schedule_refusal_names_the_runs_value_and_the_set_given(tmp_path):
    """`--resume RUN --set pipeline.schedule=sync` of a laminar run said "it ran
    pipeline.schedule='sync'": the user's override, blamed on the run."""
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume

    run = resumable_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        prepare_resume(run, ["pipeline.schedule=sync"])
    msg = str(e.value)
    assert "it ran pipeline.schedule='laminar' and --set pipeline.schedule='sync'" in msg, msg
    assert "drop that --set" in msg
    run = resumable_run(tmp_path / "b", ["pipeline.schedule=sync"])
    with pytest.raises(ConfigError, match=r"it ran pipeline.schedule='sync', and") as e:
        prepare_resume(run)
    assert "--set pipeline.schedule" not in str(e.value)


def test_the_schedule_and_prompt_refusals_give_the_whole_command_of_a_new_run(tmp_path):
    """They suggested `--set trainer.resume_from=.../version-N` alone, which on the same
    `--resume` is refused again (it takes no trainer.resume_from): now the command of a
    new run from the checkpoint, with the setting that was refused in place."""
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume

    run = resumable_run(tmp_path)
    ckpt = run / "checkpoints" / "version-000001"
    start = f"`laminar run {run / 'config.yaml'} --run-dir NEW_DIR --set trainer.resume_from={ckpt}"
    for override in ("pipeline.schedule=sync", "seed=7"):
        with pytest.raises(ConfigError) as e:
            prepare_resume(run, [override])
        said = str(e.value)
        assert f"{start} --set {override}`" in said, said
        assert f"(from Python: overrides=['trainer.resume_from={ckpt}', '{override}'])" in said
    sync = resumable_run(tmp_path / "b", ["pipeline.schedule=sync"])
    with pytest.raises(ConfigError) as e:
        prepare_resume(sync)
    ckpt = sync / "checkpoints" / "version-000001"
    assert (
        f"`laminar run {sync / 'config.yaml'} --run-dir NEW_DIR --set trainer.resume_from={ckpt}`"
        in str(e.value)
    ), str(e.value)


def test_a_resume_refuses_run_dir_set_elsewhere_as_it_refuses_run_dir(tmp_path):
    """`--resume RUN --set run_dir=/elsewhere` was silently ignored: the run went on in
    RUN, not where it was asked to go."""
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume

    run = resumable_run(tmp_path)
    before = (run / "config.yaml").read_text()
    for value in (tmp_path / "elsewhere", "null"):
        with pytest.raises(ConfigError) as e:
            prepare_resume(run, ["trainer.steps=3", f"run_dir={value}"])
        said = str(e.value)
        assert f"with run_dir={tmp_path / 'elsewhere' if value != 'null' else None}:" in said
        assert "continues the run in its own directory" in said
        assert "--run-dir NEW_DIR --set trainer.resume_from=" in said
    assert not (tmp_path / "elsewhere").exists()
    assert (run / "config.yaml").read_text() == before
    # its own directory, named: no change, so not refused
    assert _past_the_config_checks(run, ["trainer.steps=3", f"run_dir={run}"])


def test_a_resume_refuses_trainer_resume_from_naming_how_to_roll_back(tmp_path, capsys):
    """`laminar run --resume RUN --set trainer.resume_from=RUN/checkpoints/version-N`
    resumed from the newest checkpoint and recorded resume_from null: the setting was
    silently ignored. Refused now, from the CLI and the Python API alike, naming how to
    roll back and the whole command of a new run from that checkpoint."""
    import pipelines
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume
    from pipelines.cli import main

    run = resumable_run(tmp_path)
    older = run / "checkpoints" / "version-000000"
    older.mkdir()
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        pipelines.resume(run, None, overrides=["trainer.steps=3", f"trainer.resume_from={older}"])
    said = str(e.value)
    assert f"with trainer.resume_from={older}:" in said, said
    assert "continues from the run's newest checkpoint (version-000001)" in said
    assert "move the later checkpoints/version-* folders aside" in said
    assert (
        f"`laminar run {run / 'config.yaml'} --run-dir NEW_DIR "
        f"--set trainer.resume_from={older}`" in said
    ), said
    assert f"overrides=['trainer.resume_from={older}']" in said
    assert main(["run", "--resume", str(run), "--set", f"trainer.resume_from={older}"]) == 2
    assert "takes no trainer.resume_from" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == before
    # the run's own value (null: it began from scratch), named: no change, not refused
    assert _past_the_config_checks(run, ["trainer.steps=3", "trainer.resume_from=null"])
    with pytest.raises(ConfigError, match="takes no trainer.resume_from"):
        prepare_resume(run, [f"trainer.resume_from={run / 'checkpoints' / 'version-000001'}"])


def test_the_python_api_takes_a_dict_and_no_overrides_and_names_what_it_takes(tmp_path):
    """`pipelines.submit(dict, client)` and `overrides=None` were TypeErrors from deep
    inside; a run directory that could not be made, a raw NotADirectoryError (only
    `laminar run` said what was in the way)."""
    import pipelines
    from laminar.config import RunConfig
    from laminar.errors import ConfigError
    from pipelines.api import prepare_resume, prepare_run_dir, resolve_config

    cfg = resolve_config({"trainer": {"steps": 3}, "seed": 2}, None)
    assert (cfg.trainer.steps, cfg.seed) == (3, 2)
    assert resolve_config({"trainer": {"steps": 3}}, ["seed=4"]).seed == 4
    assert resolve_config("configs/tiny.yaml", None) == resolve_config("configs/tiny.yaml")
    assert resolve_config(RunConfig(), None) == RunConfig()
    with pytest.raises(ConfigError, match=r"the config dict.*\n  trainer.stepz: unknown key"):
        resolve_config({"trainer": {"stepz": 3}})
    for config, overrides, said in [
        (5, (), r"config must be a YAML file's path .* not int"),
        ("configs/tiny.yaml", {"trainer.steps": 3}, r"overrides must be a list of 'section"),
        ("configs/tiny.yaml", [3], r"overrides must be a list"),
    ]:
        with pytest.raises(ConfigError, match=said):  # (before any use of the client)
            pipelines.submit(config, None, overrides=overrides)
    run = resumable_run(tmp_path)
    assert _past_the_config_checks(run, None)  # (resume's overrides=None too)
    with pytest.raises(ConfigError, match=r"overrides must be a list"):
        prepare_resume(run, {"trainer.steps": 3})
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"'.*a-file' is a file, not a folder; pass --run-dir"):
        prepare_run_dir(RunConfig(), tmp_path / "a-file" / "run")
    assert (tmp_path / "a-file").read_text() == "x"


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here"
)
def test_the_vllm_engine_without_vllm_is_refused_in_preflight_for_a_local_cluster(tmp_path):
    """It failed after the warm start, in a rollout worker, with a ModuleNotFoundError
    and Dask's dumps."""
    from laminar.config import RunConfig, with_overrides
    from laminar.errors import ConfigError
    from pipelines.api import preflight

    cfg = with_overrides(RunConfig(), ["rollout.engine=vllm", f"sft.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm but vLLM is not installed.*"):
        preflight(cfg)
    with pytest.raises(ConfigError, match=r"docs/engines.md.*or set rollout.engine=torch"):
        preflight(cfg)
    # a remote cluster's workers may have it: not refused for this machine's lack
    remote = with_overrides(cfg, ["cluster.kind=address", "cluster.address=tcp://h:8786"])
    try:
        preflight(remote)
    except ConfigError as e:
        assert "vLLM" not in str(e)


class Trainer:  # (a stand-in: Dask names an actor of it Trainer-<token>, as laminar's)
    pass


def test_a_run_submitted_to_a_cluster_holding_another_runs_trainer_is_warned():
    """A second run on one cluster was accepted and then sat in "warm-start" until the
    first ended, nothing said (helper 186): it is warned at submit."""
    from distributed import Client, LocalCluster

    from pipelines.api import SharedClusterWarning, warn_if_shared

    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (none while no run is there)
            assert warn_if_shared(client) == []
        other = client.submit(Trainer, actor=True)
        other.result()
        with pytest.warns(SharedClusterWarning, match=r"already holds another run \(its "):
            assert warn_if_shared(client) == [other.key]
