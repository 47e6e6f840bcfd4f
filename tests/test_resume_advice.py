"""What a failed, stopped or aborted run says to continue it, and that what it says works:
`laminar run --resume RUN_DIR` continues a laminar run in place; a run of another
schedule (sync, one_step, stream, partial_rollout), which --resume refuses, goes on as
a new run from its newest checkpoint. Every place that gives the advice gave --resume
to all of them (pipelines/data_module.py's resume_hint, the RunFailed and
RunInterrupted of pipelines/api.py, the abort of `laminar run`).
"""

from __future__ import annotations

import re
import shlex
import threading

import pytest
from conftest import ctrl_c_every_poll, fake_cluster

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError, RunFailed
from pipelines.api import prepare_resume, prepare_run_dir
from pipelines.cli import main
from pipelines.data_module import resume_hint


def _run(tmp_path, schedule: str, checkpoint: bool = True):
    """A run directory as `laminar run` leaves it (its config.yaml), of ``schedule``,
    with a real checkpoint at version 1 of the default tiny model."""
    cfg = with_overrides(RunConfig(), ["trainer.steps=2", f"pipeline.schedule={schedule}"])
    run = prepare_run_dir(cfg, tmp_path / "run")
    if checkpoint:
        from laminar.learner import Learner
        from laminar.model import build_tiny_policy

        learner = Learner(cfg, build_tiny_policy(tmp_path / "policy", seed=0))
        learner.version = 1
        learner.save(run / "checkpoints" / "version-000001")
    return run


class _Reached(Exception):
    """`laminar run` got past every check to the start of its cluster."""


def _reaches_the_cluster(monkeypatch, argv: list[str]):
    """The config and run directory `laminar run argv` would start its cluster with."""

    def reached(cfg, run_dir=None):
        raise _Reached(cfg, run_dir)

    monkeypatch.setattr("laminar.deploy.open_cluster", reached)
    with pytest.raises(_Reached) as e:
        main(argv)
    return e.value.args


def _command(hint: str, new_dir) -> list[str]:
    """The `laminar run ...` command of ``hint``, its NEW_DIR filled in, as argv."""
    command = re.search(r"`laminar (run [^`]*)`", hint).group(1)
    return [a.replace("NEW_DIR", str(new_dir)) for a in shlex.split(command)]


def test_a_laminar_run_is_continued_with_resume(tmp_path):
    run = _run(tmp_path, "laminar")
    hint = resume_hint(run)
    assert hint == (
        f"continue it from its last checkpoint (version-000001) with `laminar run --resume {run}`"
    )
    assert resume_hint(run, python=True).endswith(f" or pipelines.resume({str(run)!r}, client)")
    # what it says works: past the config and checkpoint checks (to the stores, which
    # this run directory has none of)
    from storage.stores import StoreError

    assert _command(hint, tmp_path / "new") == ["run", "--resume", str(run)]
    with pytest.raises(StoreError, match="has stored no trajectory yet"):
        prepare_resume(run)


@pytest.mark.parametrize("schedule", ["sync", "partial_rollout"])
def test_a_baseline_run_is_continued_as_a_new_run_from_its_newest_checkpoint(
    tmp_path, monkeypatch, schedule
):
    """`laminar run --resume` refuses a baseline run; the advice named it all the same."""
    run = _run(tmp_path, schedule)
    ckpt = run / "checkpoints" / "version-000001"
    hint = resume_hint(run)
    assert "--resume " not in hint, hint
    assert hint == (
        "continue it in a new run from its last checkpoint (version-000001): "
        f"`laminar run {run}/config.yaml --run-dir NEW_DIR --set trainer.resume_from={ckpt}` "
        f"(it ran pipeline.schedule={schedule!r}, and `laminar run --resume` continues only "
        "laminar runs in place)"
    )
    with pytest.raises(ConfigError, match="cannot resume .* in place"):  # (as it says)
        prepare_resume(run)
    # what it says works: past every check, to the cluster, from that checkpoint
    new = tmp_path / "new"
    cfg, run_dir = _reaches_the_cluster(monkeypatch, _command(hint, new))
    assert run_dir == new.resolve() and cfg.pipeline.schedule == schedule
    assert cfg.trainer.resume_from == str(ckpt)
    python = resume_hint(run, python=True)
    assert f"pipelines.submit({str(run / 'config.yaml')!r}, client, run_dir=NEW_DIR, " in python
    assert f"overrides=['trainer.resume_from={ckpt}'])" in python


@pytest.mark.parametrize("schedule", ["laminar", "sync"])
def test_a_run_without_a_checkpoint_is_started_again_in_a_new_directory(
    tmp_path, monkeypatch, schedule
):
    run = _run(tmp_path, schedule, checkpoint=False)
    (run / "trajectories.zarr").mkdir()  # (something stored: its own directory is refused)
    hint = resume_hint(run)
    assert "--resume" not in hint and "it has no checkpoint yet" in hint, hint
    assert hint.startswith(f"start it again in a new run directory (`laminar run {run}/config.yaml")
    cfg, run_dir = _reaches_the_cluster(monkeypatch, _command(hint, tmp_path / "new"))
    assert run_dir == (tmp_path / "new").resolve() and cfg.trainer.resume_from is None


def test_a_new_run_into_a_baseline_runs_directory_is_told_what_continues_it(tmp_path):
    run = _run(tmp_path, "sync")
    (run / "trajectories.zarr").mkdir()
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(RunConfig(), run)
    said = str(e.value)
    assert "--resume " not in said, said
    assert "pass a new --run-dir, or continue it in a new run from its last checkpoint" in said
    assert f"--set trainer.resume_from={run / 'checkpoints' / 'version-000001'}`" in said


def _failed_in_order(run, monkeypatch) -> RunFailed:
    """The RunFailed of a RunHandle (no cluster) whose run stopped in order on an error."""
    from pipelines.api import RunHandle

    class Schedule:
        sft_info = None

        def setup(self, progress, stopping):
            pass

        def run(self, progress, stopping):
            return {}

    class Claim:
        def release(self):
            pass

    monkeypatch.setattr(
        "pipelines.summary.summarize", lambda *a: {"reason": "failed: reward broken"}
    )
    h = RunHandle.__new__(RunHandle)
    h.config, h.client, h.run_dir = RunConfig(), None, run
    h.summary = h.error = None
    h.training_began = False
    h._progress, h._stop, h._done = {}, threading.Event(), threading.Event()
    h._schedule, h._claim = Schedule(), Claim()
    h._drive()
    with pytest.raises(RunFailed) as e:
        h.wait()
    return e.value


def test_a_run_that_failed_in_order_says_what_continues_it(tmp_path, monkeypatch):
    run = _run(tmp_path, "sync")
    said = str(_failed_in_order(run, monkeypatch))
    assert "fix the cause, then continue it in a new run from its last checkpoint" in said
    assert "--resume " not in said and "pipelines.submit(" in said, said
    run = _run(tmp_path / "b", "laminar")
    said = str(_failed_in_order(run, monkeypatch))
    assert (
        "then continue it from its last checkpoint (version-000001) with "
        f"`laminar run --resume {run}`" in said
    )
    assert f"or pipelines.resume({str(run)!r}, client)" in said


def test_a_baseline_run_aborted_by_a_second_ctrl_c_is_told_what_continues_it(
    tmp_path, monkeypatch, capsys, logging_put_back
):
    """The second Ctrl-C aborts `laminar run`: its message named --resume for any run."""
    fake_cluster(monkeypatch)
    ctrl_c_every_poll(monkeypatch, "version-000003")  # (written)
    run = tmp_path / "run"
    sets = ["--set", "task.num_prompts=50", "--set", "pipeline.schedule=sync"]
    assert main(["run", "configs/tiny.yaml", *sets, "--run-dir", str(run)]) == 130
    err = capsys.readouterr().err
    ckpt = run.resolve() / "checkpoints" / "version-000003"
    assert (
        "did not stop in order; continue it in a new run from its last checkpoint "
        f"(version-000003): `laminar run {run.resolve()}/config.yaml --run-dir NEW_DIR --set "
        f"trainer.resume_from={ckpt}` (it ran pipeline.schedule='sync'"
    ) in err, err
    assert "--resume " not in err, err


def _checkpoints(tmp_path, versions: tuple[int, ...]):
    """A laminar run directory with real checkpoints (manifest.json included) at
    ``versions``."""
    from laminar.learner import Learner
    from laminar.model import build_tiny_policy

    cfg = with_overrides(RunConfig(), ["trainer.steps=2"])
    run = prepare_run_dir(cfg, tmp_path / "run")
    learner = Learner(cfg, build_tiny_policy(tmp_path / "policy", seed=0))
    for v in versions:
        learner.version = v
        learner.save(run / "checkpoints" / f"version-{v:06d}")
    return run


def _moved_aside(said: str, ckpt) -> None:
    """Rename ``ckpt`` aside as the advice ``said`` tells."""
    assert f"e.g. to {ckpt.name}.damaged" in said, said
    ckpt.rename(ckpt.with_name(f"{ckpt.name}.damaged"))


def test_a_file_gone_from_the_newest_checkpoint_names_the_one_before_and_the_move_aside(
    tmp_path,
):
    """`rm version-N/optimizer.pt; laminar run --resume RUN` said "lacks [...]; point
    trainer.resume_from at a checkpoints/version-N folder", which --resume does not take,
    naming neither the checkpoint before nor the move aside docs/faults.md promises for
    a file gone since it was written."""
    from laminar.learner import CheckpointError
    from storage.stores import StoreError

    run = _checkpoints(tmp_path, (1, 2))
    newest = run / "checkpoints" / "version-000002"
    (newest / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        prepare_resume(run, ["trainer.steps=5"])
    said = str(e.value)
    assert f"{newest}' lacks ['optimizer.pt']: it was written with them" in said, said
    assert "resume from an earlier checkpoint (version-000001, beside it)" in said, said
    assert f"`laminar run --resume {run}`" in said and "point trainer.resume_from" not in said
    _moved_aside(said, newest)
    # what it says works: past every checkpoint check (to the stores, which it has none of)
    with pytest.raises(StoreError, match="has stored no trajectory yet"):
        prepare_resume(run, ["trainer.steps=5"])


def test_a_damaged_only_checkpoint_is_told_to_start_again_in_a_new_directory(tmp_path, monkeypatch):
    """The run's only checkpoint damaged: the advice said "resume from an earlier
    checkpoint … move this one aside" (there is none), then --resume said "start it
    again", and `laminar run RUN/config.yaml` was refused (its directory holds a run).
    Each step now says the one thing that works: a new run in a new directory."""
    from laminar.learner import CheckpointError

    run = _checkpoints(tmp_path, (1,))
    only = run / "checkpoints" / "version-000001"
    (only / "rng.pt").write_bytes(b"not a zip")
    (run / "trajectories.zarr").mkdir()  # (something stored: its own directory is refused)
    with pytest.raises(CheckpointError) as e:
        prepare_resume(run, ["trainer.steps=5"])
    said = str(e.value)
    assert "earlier checkpoint to resume from" in said and "move this one aside" not in said
    assert "resume from an earlier checkpoint" not in said, said
    new = tmp_path / "new"
    cfg, run_dir = _reaches_the_cluster(monkeypatch, _command(said, new))
    assert run_dir == new.resolve() and cfg.trainer.resume_from is None
    # moved aside all the same: --resume names the same command, not "start it again"
    only.rename(only.with_name("version-000001.damaged"))
    with pytest.raises(ConfigError) as e:
        prepare_resume(run, ["trainer.steps=5"])
    said = str(e.value)
    assert "start it again in a new run directory" in said, said
    assert _command(said, new) == ["run", str(run / "config.yaml"), "--run-dir", str(new)]


def test_a_run_stopped_in_its_setup_is_told_the_command_that_starts_it_again(tmp_path, monkeypatch):
    """Stopped at `[starting actors]`, it said "start it again when ready", no command.
    The command it names now works: the same directory takes the new start (what the
    stopped one left there moved aside); a resume's names --resume."""
    from pipelines.driver import stopped_in_setup
    from storage import TrajectoryWriter

    run = _run(tmp_path, "laminar", checkpoint=False)
    TrajectoryWriter(run)  # (the buffer's empty store, as the setup leaves it)
    assert (run / "trajectories.zarr").is_dir()
    said = stopped_in_setup(run, "relays")
    assert "(before 'relays'): nothing was generated; start it again when ready" in said, said
    assert _command(said, None) == ["run", str(run / "config.yaml")]
    cfg, run_dir = _reaches_the_cluster(monkeypatch, _command(said, None))
    assert run_dir == run and cfg.trainer.resume_from is None
    assert not (run / "trajectories.zarr").exists()  # (moved aside)
    resumed = _run(tmp_path / "b", "laminar")
    said = stopped_in_setup(resumed, "relays")
    assert f"with `laminar run --resume {resumed}` when ready" in said, said


def _handle(run, began: bool = True):
    """A RunHandle (no cluster, no driver thread) of the run in ``run``, its setup done
    (``began``)."""
    from pipelines.api import RunHandle

    class Schedule:
        def start_records(self):
            return {
                "trainer_restarts": [],
                "data_restarts": [],
                "core_restarts": [],
                "resumed": None,
            }

    h = RunHandle.__new__(RunHandle)
    h.config, h.client, h.run_dir = RunConfig(), None, run
    h.summary = h.error = None
    h.training_began = began
    h._stop, h._summary_lock = threading.Event(), threading.Lock()
    h._schedule = Schedule()
    return h


def test_an_aborted_start_leaves_a_summary_that_says_so_not_an_earlier_starts(tmp_path):
    """After a second Ctrl-C, summary.json was the earlier start's (`reason: stopped,
    versions: 1`, which the audit takes as this start's end) or said "failed:
    ClusterError: the Dask client is closed … keep the client and cluster open until
    the run has ended (RunHandle.wait)", notebook advice, once the driver tripped on
    the closed cluster. It says "aborted: …" with what continues the run, and a failed
    driver's summary after it does not replace it."""
    import json

    from laminar.errors import ClusterError
    from storage.audit import ended_in_order

    run = _run(tmp_path, "laminar")
    (run / "summary.json").write_text(json.dumps({"reason": "stopped", "versions": 1}))
    h = _handle(run)
    why = f"aborted: Ctrl-C a second time, before it stopped in order; {resume_hint(run)}"
    h.abort(why)
    assert h._stop.is_set()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reason"] == why and summary["driver_failed"] is True
    assert not ended_in_order(summary["reason"])  # (the audit reads its end from the rows)
    h._summarize_failed(ClusterError("the Dask client is closed"))  # (the driver's, after)
    assert json.loads((run / "summary.json").read_text())["reason"] == why
    # one aborted in its setup: no run yet, no summary (as a setup that failed)
    (run / "summary.json").unlink()
    _handle(run, began=False).abort(why)
    assert not (run / "summary.json").exists()


def test_a_driver_that_fails_after_an_abort_records_the_abort(tmp_path):
    """The driver's thread got to its failed summary first: it says aborted all the same."""
    import json

    from laminar.errors import ClusterError

    run = _run(tmp_path, "laminar")
    h = _handle(run)
    h._aborted = "aborted: SIGTERM a second time"
    h._summarize_failed(ClusterError("the Dask client is closed"))
    assert json.loads((run / "summary.json").read_text())["reason"] == h._aborted


def test_laminar_runs_second_ctrl_c_aborts_the_handle(
    tmp_path, monkeypatch, capsys, logging_put_back
):
    """The CLI's abort records itself in the run's summary (RunHandle.abort)."""
    import pipelines.api

    fake_cluster(monkeypatch)
    ctrl_c_every_poll(monkeypatch, "version-000003")
    aborted: list[str] = []

    class Handle(pipelines.api.RunHandle):  # (ctrl_c_every_poll's stand-in)
        def abort(self, reason):
            aborted.append(reason)

    monkeypatch.setattr("pipelines.api.RunHandle", Handle)
    run = tmp_path / "run"
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
    assert main(argv) == 130
    assert aborted == [
        f"aborted: Ctrl-C a second time, before it stopped in order; {resume_hint(run.resolve())}"
    ]
