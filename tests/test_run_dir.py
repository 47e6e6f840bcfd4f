"""What a new run's directory may already hold: a run writes its stores, checkpoints,
summary and the like there, so a directory holding any of those that is not a run's own
(or a run's that stored something) is refused before anything in it is touched."""

from __future__ import annotations

import json
import shutil

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError
from pipelines.run_dir import RUN_FILES, prepare_run_dir


def _cfg():
    return with_overrides(RunConfig(), ["trainer.steps=2"])


def _listing(path):
    return sorted(
        (str(p.relative_to(path)), p.read_bytes() if p.is_file() else None) for p in path.rglob("*")
    )


def test_a_folder_of_the_users_holding_a_runs_names_is_refused_untouched(tmp_path):
    """Its summary.json was overwritten, its prompt_file.sha256 deleted and its
    checkpoints/ mixed with the run's."""
    mine = tmp_path / "userdir"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "model.pt").write_bytes(b"weights")
    (mine / "summary.json").write_text('{"mine": 1}\n')
    (mine / "prompt_file.sha256").write_text("data\n")
    before = _listing(mine)
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(_cfg(), mine)
    message = str(e.value)
    for name in ("summary.json", "prompt_file.sha256", "checkpoints", "pass a new --run-dir"):
        assert name in message
    assert _listing(mine) == before  # (no config.yaml, no driver.json left)


@pytest.mark.parametrize("name", RUN_FILES)
def test_each_name_a_run_writes_is_refused_in_a_folder_that_is_not_a_run(tmp_path, name):
    mine = tmp_path / "userdir"
    mine.mkdir()
    (mine / name).write_text("mine\n")
    with pytest.raises(ConfigError, match=f"holds {name}, which a run would overwrite"):
        prepare_run_dir(_cfg(), mine)
    assert (mine / name).read_text() == "mine\n" and not (mine / "config.yaml").exists()


def test_a_copied_run_without_its_store_is_refused_keeping_its_checkpoint(tmp_path):
    """A run copied with trajectories.zarr left out: its checkpoint was overwritten by the
    new run's, and the new run's metrics rows appended to the old ones."""
    run = prepare_run_dir(_cfg(), tmp_path / "run")
    ckpt = run / "checkpoints" / "version-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 1}))
    (run / "summary.json").write_text('{"versions": 1}\n')
    copy = shutil.copytree(run, tmp_path / "copy")
    assert not (copy / "trajectories.zarr").exists()
    before = _listing(copy)
    with pytest.raises(ConfigError, match=r"already holds a run; pass a new --run-dir"):
        prepare_run_dir(_cfg(), copy)
    assert _listing(copy) == before


def test_what_laminar_makes_before_a_run_starts_there_is_not_refused(tmp_path):
    """open_cluster makes tls/ and slurm/ in the run directory it is given before
    pipelines.submit prepares it; a start that failed before storing anything leaves
    its config.yaml, prompt fingerprint and summary: each is started in again."""
    fresh = tmp_path / "fresh"
    (fresh / "tls").mkdir(parents=True)
    (fresh / "slurm").mkdir()
    assert prepare_run_dir(_cfg(), fresh) == fresh.resolve()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "b"}\n')
    cfg = with_overrides(_cfg(), [f"task.prompt_file={prompts}"])
    run = prepare_run_dir(cfg, tmp_path / "run")
    assert (run / "prompt_file.sha256").exists()
    (run / "summary.json").write_text('{"reason": "failed"}\n')
    (run / "checkpoints").mkdir()  # (nothing saved in it)
    assert prepare_run_dir(cfg, run) == run


def test_a_run_whose_store_and_checkpoints_are_gone_but_its_metrics_are_is_refused(tmp_path):
    """Its metrics record updates: a new run appended its rows to that run's."""
    from storage.metrics import MetricsWriter

    run = prepare_run_dir(_cfg(), tmp_path / "run")
    MetricsWriter(run).append("cluster", [{"time": 1.0, "workers": 3}])
    assert prepare_run_dir(_cfg(), run) == run  # (a failed start's rows: taken over)
    MetricsWriter(run).append("updates", [{"version": 1, "loss": 0.5}])
    with pytest.raises(ConfigError, match=r"already holds a run with no checkpoint"):
        prepare_run_dir(_cfg(), run)


def test_a_failed_starts_records_are_moved_aside_not_appended_to(tmp_path):
    """A new run in a failed start's directory appended to its metrics.zarr (its clock
    from 0 again: cluster.time went backwards, one segment of two starts) and its
    tensorboard/, and the report read its summary.json: each is moved aside, kept."""
    from storage.metrics import MetricsWriter, open_metrics, segments

    def rows(times, depth):
        return [
            {
                "elapsed_s": t,
                "wall_time": 1e9 + t,
                "segment": 0,
                "version": 0,
                "buffer_depth": depth,
            }
            for t in times
        ]

    run = prepare_run_dir(_cfg(), tmp_path / "run")
    w = MetricsWriter(run, tensorboard=True)
    w.append("cluster", rows((1.0, 8.0), 5))
    w.close()
    (run / "summary.json").write_text('{"reason": "failed: RuntimeError"}\n')
    (run / "dispatch_lease.json").write_text('{"end": 64}\n')
    assert prepare_run_dir(_cfg(), run) == run
    aside = {p.name.split(".failed-")[0]: p for p in run.iterdir() if ".failed-" in p.name}
    assert sorted(aside) == ["dispatch_lease.json", "metrics.zarr", "summary.json", "tensorboard"]
    assert not any((run / name).exists() for name in aside)
    assert json.loads(aside["summary.json"].read_text())["reason"].startswith("failed")
    assert any(aside["tensorboard"].iterdir())
    # the failed start's rows kept (a copy named metrics.zarr reads them) ...
    shutil.copytree(aside["metrics.zarr"], tmp_path / "kept" / "metrics.zarr")
    assert open_metrics(tmp_path / "kept", "cluster")["time"].values.tolist() == [1.0, 8.0]
    # ... and the new run's clock starts its own store
    w = MetricsWriter(run)
    w.append("cluster", rows((0.5, 1.0), 7))
    cluster = open_metrics(run, "cluster")
    assert cluster["time"].values.tolist() == [0.5, 1.0]
    assert [(s["start_s"], s["end_s"]) for s in segments(cluster)] == [(0.5, 1.0)]
    # a second takeover in the same second keeps the first one's records too
    (run / "summary.json").write_text("{}\n")
    assert prepare_run_dir(_cfg(), run) == run
    assert len([p for p in run.iterdir() if p.name.startswith("summary.json.failed-")]) == 2


def test_submit_refuses_a_taken_directory_before_it_waits_for_workers(tmp_path):
    """`submit` waited for the role workers (up to cluster.placement_timeout_s: queued
    Slurm jobs) before it looked at the run directory, then said only that no workers
    came; a finished run's directory is refused at once, as `resume` does (helper 186)."""
    from distributed import Client, LocalCluster

    import pipelines

    run = prepare_run_dir(_cfg(), tmp_path / "run")
    (run / "checkpoints" / "version-000001").mkdir(parents=True)
    cfg = with_overrides(_cfg(), ["cluster.placement_timeout_s=600"])
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,  # (no role resources: a wait would last 600 s)
    ):
        with pytest.raises(ConfigError, match=r"already holds a run; pass a new --run-dir"):
            pipelines.submit(cfg, client, run_dir=run)
