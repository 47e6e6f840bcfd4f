"""The `laminar` command's own behaviour: what a user's mistake gets (an exit code and a
message on stderr that names the fix, never a traceback), flags that conflict, Ctrl-C.
Everything here runs in-process with no cluster (`pipelines.cli.main` returns the exit
code); the end-to-end CLI runs are in tests/test_end_to_end.py."""

from __future__ import annotations

import pytest
from conftest import ctrl_c_every_poll, fake_cluster

from pipelines import cli


def test_certs_into_a_path_that_is_a_file_names_it(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for target in (f, f / "tls"):
        assert cli.main(["certs", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("laminar: error: ") and "Traceback" not in err
        assert f"{str(f)!r} is a file, not a folder" in err and "pass another folder" in err
    assert f.read_text() == "mine"


def test_certs_into_a_folder_that_cannot_be_made_says_so(tmp_path, capsys):
    assert cli.main(["certs", "/proc/laminar-tls"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the TLS files to '/proc/laminar-tls'" in err
    assert "a folder this user can create and write" in err


@pytest.fixture
def no_bench(monkeypatch):
    """A bench that got past the command line's checks would run: fail instead."""

    def refuse(*a, **k):
        raise AssertionError("the benchmark was started")

    monkeypatch.setattr("pipelines.bench.run_bench", refuse)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["engine", "--batches", "1,a"], "--batches"),
        (["relay", "--relays", "2,,4"], "--relays"),
        (["relay", "--sizes-mb", "64,-1"], "--sizes-mb"),
        (["relay", "--protocols", "tcp,udp"], "--protocols"),
        (["relay", "--protocols", ","], "--protocols"),
        (["pacing", "--contexts", "x"], "--contexts"),
        (["schedules", "--splits", "laminar"], "--splits"),
        (["schedules", "--splits", "laminar=x"], "--splits"),
        (["engine", "--repeats", "0"], "--repeats"),
        (["engine", "--new-tokens", "-5"], "--new-tokens"),
        # refused at parse time, not once a cluster has started (or never: a NaN soak ends
        # at once, a NaN threshold is never reached)
        (["soak", "--duration-s", "0"], "--duration-s"),
        (["soak", "--duration-s", "nan"], "--duration-s"),
        (["soak", "--kill-every-s", "0"], "--kill-every-s"),
        (["repack", "--duration-s", "-5"], "--duration-s"),
        (["relay", "--relays", "1,4"], "--relays"),
        (["schedules", "--gpus", "4"], "--gpus"),
        (["schedules", "--reward-threshold", "nan"], "--reward-threshold"),
    ],
)
def test_a_bench_flag_that_does_not_parse_is_a_usage_error(argv, flag, capsys, no_bench):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "Traceback" not in err


def test_bench_lists_parse(monkeypatch):
    seen = {}

    def fake(name, out, **options):
        seen.update(options)
        return type("R", (), {"failed": []})()

    monkeypatch.setattr("pipelines.bench.run_bench", fake)
    argv = ["bench", "schedules", "--splits", "laminar=6, stream=7", "--gpus", "128"]
    assert cli.main(argv) == 0
    assert seen == {"splits": {"laminar": 6, "stream": 7}, "gpus": 128}
    assert cli.main(["bench", "engine", "--batches", "1,16", "--repeats", "2"]) == 0
    assert seen["batches"] == (1, 16) and seen["repeats"] == 2


def test_scheduler_and_scheduler_file_are_refused_together(tmp_path, capsys, no_cluster):
    f = tmp_path / "scheduler.json"
    argv = ["run", "configs/tiny.yaml", "--scheduler", "tcp://h:8786", "--scheduler-file", str(f)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # named as the user typed them (not as the --set overrides they become)
    assert "argument --scheduler-file: not allowed with argument --scheduler" in err
    assert "--set" not in err.splitlines()[-1]


def _main_no_interrupt(argv):
    try:
        return cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped `laminar` as a KeyboardInterrupt (a traceback)")


def test_ctrl_c_twice_aborts_with_130_and_says_how_to_continue(
    tmp_path, monkeypatch, capsys, logging_put_back
):
    """The first Ctrl-C asks the run to stop in order; the second aborts it: exit 130,
    a message (no traceback) naming `--resume`, and the cluster still closed."""
    import logging
    import signal

    closed = fake_cluster(monkeypatch)
    # (a checkpoint to continue from: without one, --resume refuses the run, and the
    # message says to start it again in a new directory)
    stops = ctrl_c_every_poll(monkeypatch, "version-000001")
    run = tmp_path / "run"
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
    loggers = [logging.getLogger(name) for name in ("distributed", "asyncio")]
    levels = [lg.level for lg in loggers]
    try:
        assert _main_no_interrupt(argv) == 130
        # (Dask's and asyncio's errors of the torn-down cluster: ~90 lines after the
        # message, with a real cluster; helper 188)
        assert [lg.level for lg in loggers] == [logging.CRITICAL, logging.CRITICAL]
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"laminar run --resume {run}" in err
    assert stops == [True] and closed == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_ctrl_c_while_the_cluster_starts_exits_130_without_a_traceback(
    tmp_path, monkeypatch, capsys
):
    def interrupted():
        raise KeyboardInterrupt

    fake_cluster(monkeypatch, on_enter=interrupted)
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50"]
    assert _main_no_interrupt([*argv, "--run-dir", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert err.startswith("laminar: interrupted") and "Traceback" not in err


def test_a_bench_out_that_cannot_be_written_is_refused_before_the_bench_runs(
    tmp_path, capsys, no_bench
):
    """A bench takes minutes to hours: an --out it could not write at the end is
    refused at the start."""
    f = tmp_path / "afile"
    f.write_text("")
    for out, why in [
        (tmp_path, f"--out {str(tmp_path)!r} is a folder"),
        (f / "engine.json", f"{str(f)!r} is a file, not a folder"),
        ("/proc/laminar/engine.json", "cannot write --out '/proc/laminar/engine.json'"),
    ]:
        assert cli.main(["bench", "engine", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("laminar: error: ") and why in err, err


def test_a_refused_bench_command_makes_no_folder_of_its_out(tmp_path, capsys):
    """--out's folder was made as it was checked, before the bench refused a flag it does
    not take: the refused command left it behind (helper 189). The bench makes it as it
    writes (run_bench refuses --gpus for engine before it runs anything)."""
    out = tmp_path / "new" / "deeper" / "engine.json"
    assert cli.main(["bench", "engine", "--out", str(out), "--gpus", "64"]) == 2
    assert "--gpus" in capsys.readouterr().err and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "argv, why",
    [
        (["schedules", "--from-runs"], "--from-runs computes the result of the runs"),
        (["schedules", "--from-runs", "--runs-dir", "NOPE"], "no folder 'NOPE"),
        (["schedules", "--from-runs", "--runs-dir", "KEPT", "--arms", "laminar"], "drop --arms"),
        (
            ["schedules", "--from-runs", "--runs-dir", "KEPT", "--seeds", "2", "--gpus", "128"],
            "drop --gpus, --seeds",
        ),
        (["schedules", "--from-runs", "--runs-dir", "KEPT", "--seeds", "0"], "drop --seeds"),
        (
            ["schedules", "--from-runs", "--runs-dir", "KEPT", "--probe-iterations", "6"],
            "drop --probe-iterations",
        ),
        (
            ["schedules", "--no-search", "--probe-warmup", "1"],
            "--probe-warmup set the split search's probes, and --no-search runs none",
        ),
        (["schedules", "--probe-iterations", "0"], "argument --probe-iterations"),
        (["schedules", "--arms", "laminar,lamnar"], "unknown schedule 'lamnar' in --arms"),
        (["schedules", "--splits", "lamnar=5"], "unknown schedule 'lamnar' in --splits"),
        (["schedules", "--seeds", "-1"], "argument --seeds: '-1' is not a whole number ≥ 0"),
        (["soak", "--data-apart", "--resume-lost"], "--resume-lost and --data-apart"),
        # (it ran to its end, killing nothing: no recovery measured, and nothing said)
        (["soak", "--duration-s", "60", "--kill-every-s", "90"], "--kill-every-s 90 is not below"),
        (["soak", "--kill-every-s", "600"], "--kill-every-s 600 is not below --duration-s 600"),
        # (a file: a traceback minutes on, or an error naming --run-dir; helper 189)
        (["schedules", "--runs-dir", "FILE"], "is a file, not a folder; give a folder's"),
        (["repack", "--runs-dir", "FILE/sub"], "is a file, not a folder; give a folder's"),
        (["engine", "--vllm-python", "NOPE"], "--vllm-python 'NOPE' does not exist"),
        (["relay", "--protocols", "tcp,ucx"], "--protocols=tcp,ucx: UCX needs the distributed-"),
    ],
)
def test_bench_flags_that_conflict_or_name_nothing_are_refused(
    argv, why, tmp_path, capsys, no_bench
):
    (tmp_path / "kept").mkdir()
    argv = [str(tmp_path / "kept") if a == "KEPT" else a for a in argv]
    argv = [str(tmp_path / "nope") if a == "NOPE" else a for a in argv]
    (tmp_path / "afile").write_text("")
    argv = [a.replace("FILE", str(tmp_path / "afile")) for a in argv]
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert why.replace("'NOPE", repr(str(tmp_path / "nope"))[:-1]) in err, err
    assert "Traceback" not in err


def test_the_split_search_probes_length_reaches_the_bench(monkeypatch):
    """--probe-warmup and --probe-iterations (Python's probe_warmup, probe_iterations:
    the CLI had no way to lengthen a probe whose neighbours lie within its noise)."""
    from types import SimpleNamespace

    given = {}

    def run_bench(name, out, **options):
        given.update(options)
        return SimpleNamespace(failed=[])

    monkeypatch.setattr("pipelines.bench.run_bench", run_bench)
    argv = ["bench", "schedules", "--seeds", "0", "--probe-warmup", "1", "--probe-iterations", "8"]
    assert cli.main(argv) == 0
    assert given["probe_warmup"] == 1 and given["probe_iterations"] == 8, given


def test_each_bench_flags_help_names_the_benches_that_take_it():
    """`laminar bench --help` says which benchmarks a flag is for ("engine, pacing: ..."):
    the same benchmarks whose function takes its option (the others refuse it)."""
    import re

    from pipelines.bench import _FLAGS, BENCHES, bench_options

    subcommands = next(a for a in cli.build_parser()._actions if a.dest == "command")
    actions = {s: a for a in subcommands.choices["bench"]._actions for s in a.option_strings}
    bench = next(a for a in subcommands.choices["bench"]._actions if a.dest == "name")
    assert set(bench.choices) == set(BENCHES)
    for option, flag in _FLAGS.items():
        said = set()
        for names in re.findall(r"(?:^|; )([a-z, ]+): ", actions[flag].help):
            said |= {n.strip() for n in names.split(",")}
        takes = {name for name in BENCHES if option in bench_options(name)}
        assert said == takes, f"{flag}: help says {sorted(said)}, taken by {sorted(takes)}"


def test_a_run_whose_driver_failed_exits_1_with_what_the_stores_hold(capsys):
    """A run that failed under its driver (a cluster lost under it) is a failed run, exit
    1 as one that stopped in order on an error, not 2, a usage error; one that failed in
    its setup (no run yet) still raises to the usage handler."""
    from types import SimpleNamespace

    from laminar.errors import ClusterError

    def handle(summary, began=True):
        def wait():
            raise ClusterError("lost the trainer and data module")

        return SimpleNamespace(
            done=lambda: True,
            progress=lambda: {},
            wait=wait,
            summary=summary,
            training_began=began,
        )

    display = SimpleNamespace(show=lambda *a, **k: None, close=lambda: None)
    failed = {
        "run_dir": "runs/x",
        "reason": "failed: ClusterError: lost the trainer and data module",
        "trajectories": 96,
        "consumed": 64,
        "reward_first_20pct": 0.5,
        "reward_last_20pct": 0.75,
        "versions": 3,
    }
    assert cli._watch(handle(failed), display) == 1
    out, err = capsys.readouterr()
    assert "failed: ClusterError" in out and "versions           3" in out
    assert "lost the trainer and data module" in err
    with pytest.raises(ClusterError):
        cli._watch(handle(None, began=False), display)
    # Failed after training began, and even its summary.json could not be written: still
    # a failed run (1), not a usage error (2).
    assert cli._watch(handle(None), display) == 1
    out, err = capsys.readouterr()
    assert "lost the trainer and data module" in err and "Traceback" not in err


def test_the_printed_summary_says_how_many_updates_a_run_with_skipped_versions_made(capsys):
    """A version number a failed update skipped is not an update: the summary line says
    how many updates the final weights hold when the two differ, and nothing more when
    they do not."""
    summary = _summary("runs/x", "done") | {"versions": 6, "updates": 4}
    cli._print_summary(summary)
    assert "versions           6  (4 updates made)\n" in capsys.readouterr().out
    cli._print_summary({**summary, "updates": 6})
    assert "versions           6\n" in capsys.readouterr().out


def test_a_resume_says_what_it_re_issued_alike_at_its_start_and_in_its_summary(
    tmp_path, capsys, monkeypatch
):
    """A resume that re-issued 32 groups the store held nothing of (8 samples each) said
    "the missing siblings of 0 re-issued ... 32 groups with nothing stored re-issued
    whole" at its start, and "256 missing siblings re-issued" at its end: the count of
    every re-issued sample, named as the siblings alone."""
    from laminar.config import RunConfig
    from laminar.errors import ConfigError
    from storage.resume import ResumePlan

    plan = ResumePlan(version=4, readmit=["u0"], readmit_groups=["p0"], stored=40)
    plan.reissue = {f"p{i}": (i, 8, tuple(range(8))) for i in range(1, 33)}
    plan.log_groups = 32
    monkeypatch.setattr("pipelines.api.prepare_resume", lambda *a: (RunConfig(), plan, tmp_path))

    def no_cluster(*a, **k):
        raise ConfigError("no cluster here")

    monkeypatch.setattr("laminar.deploy.open_cluster", no_cluster)
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "back in the buffer (1 group), 0 dropped\n" in out
    # the groups a resume drops, by why (the header named "stored in part" alone)
    plan.drop, plan.dropped_late, plan.dropped_incomplete = ["u1", "u2", "u3"], 2, 1
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    assert (
        "3 dropped (2 groups finished after version 4, by weights the resume redoes; 1 group "
        "stored in part, whose missing samples another policy would generate: docs/faults.md)"
    ) in capsys.readouterr().out
    plan.drop, plan.dropped_late, plan.dropped_incomplete = [], 0, 0
    assert "32 groups with nothing stored re-issued whole" in out
    cli._print_summary(_summary() | {"resumed": plan.summary()})
    out = capsys.readouterr().out
    assert (
        "1 trajectories back in the buffer, 256 samples re-issued (32 groups with nothing "
        "stored, whole), 0 dropped (0 groups stored in part)\n" in out
    ), out
    # a resume from before groups stored in part were dropped: their siblings re-issued
    old = plan.summary() | {"reissued_groups": 34, "reissued_samples": 260}
    del old["dropped_incomplete_groups"]
    cli._print_summary(_summary() | {"resumed": old})
    assert (
        "260 samples re-issued (the missing siblings of 2 groups; 32 groups with nothing "
        "stored, whole), 0 dropped\n" in capsys.readouterr().out
    )
    # a summary from before the groups were counted: the samples alone
    cli._print_summary(
        _summary()
        | {"resumed": {"version": 4, "readmitted": 1, "dropped": 0, "reissued_samples": 3}}
    )
    assert "back in the buffer, 3 samples re-issued, 0 dropped\n" in capsys.readouterr().out


def test_a_run_from_a_checkpoint_says_the_warm_start_reward_is_not_where_it_began(tmp_path, capsys):
    """A new run from `trainer.resume_from` printed "warm-start reward 0.551" under a
    first-20% reward of 0.94: the base model's, which it did not start from. Now the line
    says so; a run from the warm start (or resumed in place from one) prints it as before."""
    from types import SimpleNamespace

    from laminar.config import RunConfig, with_overrides
    from pipelines.api import prepare_run_dir

    ckpt = tmp_path / "a" / "checkpoints" / "version-000040"
    summary = _summary() | {"sft": {"wall_s": 1.0, "eval_reward": 0.551, "eval_prompts": 256}}
    display = SimpleNamespace(show=lambda *a, **k: None, close=lambda: None)
    for name, overrides in (("from40", [f"trainer.resume_from={ckpt}"]), ("plain", [])):
        run = prepare_run_dir(with_overrides(RunConfig(), overrides), tmp_path / name)
        handle = SimpleNamespace(
            done=lambda: True, progress=lambda: {}, wait=lambda: summary, run_dir=run
        )
        assert cli._watch(handle, display) == 0
        line = next(
            x for x in capsys.readouterr().out.splitlines() if x.startswith("warm-start reward")
        )
        if overrides:
            assert line == (
                "warm-start reward  0.551 (one sample each of 256 prompts; not this run's "
                f"start: it began from the weights of {ckpt})"
            )
        else:
            assert line == "warm-start reward  0.551 (one sample each of 256 prompts)"


def test_a_reader_that_stops_early_ends_the_audit_quietly(tmp_path):
    """`laminar audit --json RUN | head`: once the reader has gone, the broken pipe ends
    the command with 141 (as a shell reports it), not a traceback on stderr."""
    import subprocess
    import sys

    from conftest import REPO
    from test_storage import record

    from storage.trajectories import TrajectoryWriter

    TrajectoryWriter(tmp_path / "run").append([record(i) for i in range(3)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "audit", "--json", str(tmp_path / "run")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # (the reader gone before anything is written)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _summary(run_dir="runs/x", reason="stopped") -> dict:
    """A summary as the driver writes it, with what `_print_summary` reads."""
    return {
        "run_dir": run_dir,
        "reason": reason,
        "reward_first_20pct": 0.5,
        "reward_last_20pct": 0.75,
        "reward_gain": 0.25,
        "versions": 3,
        "trajectories": 96,
        "consumed": 64,
        "prompt_tokens": 10,
        "response_tokens": 20,
        "staleness": {"s_gen_mean": 0.0, "s_train_mean": 1.0},
        "rl_wall_s": 3.0,
        "sft": {"wall_s": 1.0, "cached": True},
        "checkpoint": "runs/x/checkpoints/version-000003",
    }


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_or_sighup_stops_the_run_in_order_like_ctrl_c(
    signame, code, tmp_path, monkeypatch, capsys
):
    """`scancel`, a Slurm job's walltime (SIGTERM) or a dropped SSH session (SIGHUP) used
    to kill the driver outright: no final checkpoint, no summary.json. Now the first one
    stops the run in order, as Ctrl-C does; the exit code says which signal (128 + its
    number), so that a job script can tell the stopped run from a completed one."""
    import os
    import signal

    signum = getattr(signal, signame)
    closed = fake_cluster(monkeypatch)
    stops = []

    class Handle:  # a run that ends in order once asked to stop; its first poll: the signal
        training_began = True

        def __init__(self, cfg, client, run_dir, resume=None):
            self.run_dir = run_dir
            self.polls = 0

        def done(self):
            return bool(stops)

        def progress(self):
            self.polls += 1
            if self.polls == 1:
                os.kill(os.getpid(), signum)
            return {"phase": "setup"}

        def stop(self):
            stops.append(True)

        def wait(self):
            return _summary(str(self.run_dir))

    def killed(*a):  # (what the signal would do unhandled: end the driver, no stop)
        raise AssertionError(f"{signame} reached the default handler")

    monkeypatch.setattr("pipelines.api.RunHandle", Handle)
    monkeypatch.setattr("pipelines.cli.time.sleep", lambda s: None)
    before = signal.signal(signum, killed)
    try:
        run = tmp_path / "run"
        argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
        assert _main_no_interrupt(argv) == code
        assert signal.getsignal(signum) is killed  # put back
    finally:
        signal.signal(signum, before)
    out, err = capsys.readouterr()
    assert stops == [True] and closed == [True]
    assert f"stopping ({signame})" in out and "== summary ==" in out, out
    assert "Traceback" not in err


def test_a_scheduler_file_path_is_taken_as_it_is_given(tmp_path, monkeypatch):
    """--scheduler-file went into a YAML override unquoted: "exp #2/sched.json" became
    "exp" (the rest a YAML comment)."""
    import contextlib

    seen = []

    @contextlib.contextmanager
    def fake_open_cluster(cfg, run_dir=None):
        seen.append(cfg.cluster)
        raise KeyboardInterrupt  # (stop there: the run is not the point)
        yield

    monkeypatch.setattr("laminar.deploy.open_cluster", fake_open_cluster)
    sched = str(tmp_path / "exp #2: lr" / "sched.json")
    run = tmp_path / "run"
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
    assert _main_no_interrupt([*argv, "--scheduler-file", sched]) == 130
    assert seen[-1].kind == "address" and seen[-1].scheduler_file == sched
    assert seen[-1].address is None
    argv[-1] = str(tmp_path / "run2")
    assert _main_no_interrupt([*argv, "--scheduler", "tcp://h:8786"]) == 130
    assert seen[-1].address == "tcp://h:8786" and seen[-1].scheduler_file is None


def test_ctrl_c_with_the_output_piped_to_a_reader_it_also_ended_stops_in_order(tmp_path):
    """`laminar run ... | tee log`, then Ctrl-C: the same Ctrl-C ends `tee`, and printing
    "stopping ..." (in the signal handler) or the summary raised BrokenPipeError: the
    command ended with 141 at once, the run not stopped in order. Now the output goes
    nowhere, the run stops in order, and the exit code is a stopped run's, 0."""
    import json
    import subprocess
    import sys
    import threading

    from conftest import REPO

    code = """
import json, os, signal, sys
from pipelines import cli

class Handle:
    run_dir = "runs/x"
    training_began = True
    summary = None

    def __init__(self):
        self.stopped = False
        self.polls = 0

    def done(self):
        return self.stopped

    def progress(self):
        self.polls += 1
        if self.polls == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return {"phase": "setup"}

    def stop(self):
        self.stopped = True
        print("STOPPED", file=sys.stderr, flush=True)

    def wait(self):
        return SUMMARY

cli.time.sleep = lambda s: None
SUMMARY = json.loads(sys.argv[1])
sys.exit(cli._follow(Handle()))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(_summary())],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # (the reader gone, as `tee` after the Ctrl-C)
    # A child that never stops (its polls do not sleep) is killed, failing the test: it
    # outlived a timed-out test before, spinning a core under the suite's later tests.
    killer = threading.Timer(120, proc.kill)
    killer.start()
    try:
        err = proc.stderr.read()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=120) == 0, err
    assert "STOPPED" in err and "Traceback" not in err and "BrokenPipe" not in err, err


def test_the_summary_says_a_trainer_lost_after_its_final_checkpoint_was_not_restarted(capsys):
    """A restart that found the run's final checkpoint (pipelines.restart._finish) has no
    readmitted trajectories nor later numbering: printing it raised KeyError after a
    completed run, and a core restart's line said numbering went on."""
    final = {"lost_worker": "tcp://t:1", "checkpoint": "c", "checkpoint_version": 4}
    final |= {"after_version": 4, "lost_updates": 0, "finished": True, "restart_s": 0.1}
    core = {**final, "held_again": 0, "registered": 3, "restart_s": 5.0}
    faults = {"lost": {}, "trainer_restarts": [final], "core_restarts": [core]}
    cli._print_summary({**_summary("runs/x"), "faults": faults})
    out = capsys.readouterr().out
    assert "trainer            lost after its final checkpoint (version 4)" in out
    assert "trainer + data     lost together after the final checkpoint (version 4)" in out
    assert "numbering goes on" not in out


def test_the_summary_says_a_rollout_lost_with_recovery_off_was_not_recovered(capsys):
    """With faults.recover=false a loss is in faults.unrecovered (what it held, hung or
    not): the summary said "0 unfinished trajectories resumed elsewhere in 0 recoveries",
    and of a hung one "worker restarted, then recovered as lost"."""
    unrecovered = {
        "r1": {"time": 9.0, "how": "unrecovered", "worker": "tcp://w:1", "hung": True},
        "r2": {"time": 9.5, "how": "unrecovered", "worker": "tcp://w:2", "hung": False},
    }
    unrecovered["r1"] |= {"requests": 3, "unscored": 7, "as_of": 8.6}
    unrecovered["r2"] |= {"requests": None, "unscored": None, "as_of": None}
    faults = {"lost": {"r1": 9.0, "r2": 9.5}, "hung": {"r1": 5.0}, "unrecovered": unrecovered}
    faults |= {"recoveries": 0, "recovered_requests": 0}
    cli._print_summary({**_summary("runs/x"), "faults": faults})
    out = capsys.readouterr().out
    assert "r1 hung, then lost, not recovered (faults.recover=false): 3 unfinished" in out
    assert "7 unscored trajectories" in out
    assert "r2 lost, not recovered (faults.recover=false): what it held unknown" in out
    assert "recoveries" not in out and "recovered as lost" not in out, out


def test_a_stop_signal_during_a_print_to_stdout_still_says_it_stops(monkeypatch, capfd):
    """A signal that came in the middle of the progress line's print found stdout's
    buffer busy: the handler's own print raised "RuntimeError: reentrant call", which
    ended `laminar run` with a traceback instead of a stop in order. It says so on
    stderr then."""
    from pipelines import cli_run

    def busy(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    monkeypatch.setattr(cli_run, "print", busy, raising=False)
    cli_run._say_from_a_handler("\nstopping (Ctrl-C): finishing the current update")
    out, err = capfd.readouterr()
    assert err == "stopping (Ctrl-C): finishing the current update\n" and out == ""


def test_a_tilde_after_equals_which_the_shell_leaves_is_the_home_folder(tmp_path, monkeypatch):
    """`--out=~/b.json`: bash does not expand ~ after =; it was checked expanded and
    written as given, into a folder named ~ here."""
    monkeypatch.setenv("HOME", str(tmp_path))
    seen = {}

    def fake(name, out, **options):
        seen.update(options, out=out)
        return type("R", (), {"failed": []})()

    monkeypatch.setattr("pipelines.bench.run_bench", fake)
    argv = ["bench", "schedules", "--out=~/b.json", "--runs-dir=~/runs", "--seeds", "1"]
    assert cli.main(argv) == 0
    assert seen["out"] == str(tmp_path / "b.json") and seen["runs_dir"] == str(tmp_path / "runs")
    args = cli.build_parser().parse_args(["run", "configs/tiny.yaml", "--run-dir=~/r"])
    assert args.run_dir == str(tmp_path / "r")
    args = cli.build_parser().parse_args(["run", "--resume=~/r"])
    assert args.resume == str(tmp_path / "r")


def test_the_splits_help_says_only_the_arms_named_skip_the_search():
    """It said "(no search)": the arms --splits does not name are still searched."""
    subcommands = next(a for a in cli.build_parser()._actions if a.dest == "command")
    bench = subcommands.choices["bench"]
    text = next(a.help for a in bench._actions if "--splits" in a.option_strings)
    assert "(no search)" not in text and "the others still are" in text


@pytest.mark.parametrize("share", [0.54, float("nan"), None])
def test_the_summary_says_how_many_groups_trained_on_were_flat(share, capsys):
    """GRPO learns nothing from a group whose rewards are all equal: the printed summary
    says what share of the groups trained on were (none trained on: NaN, null in
    summary.json; a summary written before the key: absent), and prints no line when
    that share is unknown."""
    summary = _summary() | ({} if share is None else {"flat_group_share": share})
    cli._print_summary(summary)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("flat groups")]
    if share == 0.54:
        assert lines == [
            "flat groups        54% of those trained on (every reward equal: advantage 0, "
            "no gradient)"
        ]
    else:
        assert lines == []


def _stopping_handle(monkeypatch, began: bool, end):
    """`laminar run`'s RunHandle as a run that is Ctrl-C'd at its first poll and ends
    once asked to stop, with ``end(handle)`` (a summary, or raises)."""
    import os
    import signal

    class Handle:
        training_began = began

        def __init__(self, cfg, client, run_dir, resume=None):
            self.config, self.run_dir, self.stopped = cfg, run_dir, False

        def done(self):
            return self.stopped

        def progress(self):
            if not self.stopped:
                os.kill(os.getpid(), signal.SIGINT)
            return {"phase": "setup"}

        def stop(self):
            self.stopped = True

        def wait(self):
            return end(self)

    monkeypatch.setattr("pipelines.api.RunHandle", Handle)
    monkeypatch.setattr("pipelines.cli.time.sleep", lambda s: None)


def test_a_run_stopped_in_order_before_its_steps_says_how_to_continue_it(
    tmp_path, monkeypatch, capsys
):
    """A clean stop (Ctrl-C once, SIGTERM) printed its summary and nothing on what
    continues the run, which the abort, walltime and failure paths all say."""
    fake_cluster(monkeypatch)
    run = tmp_path / "run"

    def stopped(handle):
        (handle.run_dir / "checkpoints" / "version-000003").mkdir(parents=True)
        return _summary(str(handle.run_dir))

    _stopping_handle(monkeypatch, True, stopped)
    sets = ["--set", "task.num_prompts=50", "--set", "trainer.steps=10"]
    assert _main_no_interrupt(["run", "configs/tiny.yaml", *sets, "--run-dir", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "stopping (Ctrl-C): finishing the current update" in out, out
    assert (
        "laminar: stopped at version 3 of 10; its final checkpoint is written: continue it "
        f"from its last checkpoint (version-000003) with `laminar run --resume {run.resolve()}`"
    ) in err, err


def test_a_walltime_stop_says_what_continues_it_once(tmp_path, monkeypatch, capsys):
    """A walltime stop is told what continues it in new jobs (exit 124); the clean
    stop's line ("stopped at version 3 of 10 ... --resume") came before it as well, two
    continuations that did not agree."""
    from storage.audit import WALLTIME_REASON

    fake_cluster(monkeypatch)
    reason = f"{WALLTIME_REASON}: Slurm job 7 (driver) reaches its walltime in 290 s"

    def stopped(handle):
        (handle.run_dir / "checkpoints" / "version-000003").mkdir(parents=True)
        return _summary(str(handle.run_dir), reason)

    _stopping_handle(monkeypatch, True, stopped)
    sets = ["--set", "task.num_prompts=50", "--set", "trainer.steps=10"]
    run = tmp_path / "run"
    code = _main_no_interrupt(["run", "configs/tiny.yaml", *sets, "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 124, err
    assert "laminar: stopped at version" not in err, err
    assert err.count("laminar run --resume") == 1, err


def test_a_completed_run_says_nothing_of_continuing_it(tmp_path, monkeypatch, capsys):
    fake_cluster(monkeypatch)
    _stopping_handle(monkeypatch, True, lambda h: _summary(str(h.run_dir), "completed"))
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50"]
    assert _main_no_interrupt([*argv, "--run-dir", str(tmp_path / "run")]) == 0
    assert "laminar: stopped" not in capsys.readouterr().err


def test_a_stop_during_the_setup_says_so_and_names_the_command_that_starts_it_again(
    tmp_path, monkeypatch, capsys
):
    """Stopped at `[starting actors]`, it said "finishing the current update and flushing
    the store" (there was none), then "start it again when ready" with no command."""
    from laminar.errors import RunStopped
    from pipelines.driver import stopped_in_setup

    fake_cluster(monkeypatch)

    def setup_stopped(handle):
        raise RunStopped(stopped_in_setup(handle.run_dir, "relays"))

    _stopping_handle(monkeypatch, False, setup_stopped)
    run = tmp_path / "run"
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
    assert _main_no_interrupt(argv) == 130
    out, err = capsys.readouterr()
    assert "stopping (Ctrl-C): ending its setup, before anything is generated" in out, out
    assert "finishing the current update" not in out, out
    assert f"start it again when ready with `laminar run {run.resolve()}/config.yaml`" in err


def test_the_abort_message_is_the_last_thing_said_after_the_cluster_closed(
    tmp_path, monkeypatch, capsys, caplog, logging_put_back
):
    """After the second Ctrl-C's 'laminar: aborted; … --resume …' came ~34 lines: a
    worker's forwarded 'trainer failed:' traceback, 'no checkpoint at version 41',
    warnings of the driver's thread, as the cluster was torn down under the run. The
    abort's message now comes once the cluster has closed, and laminar's loggers (the
    forwarded records too, handled whatever their level) are silenced before it."""
    import contextlib
    import logging
    import sys

    from conftest import FakeClient

    said: list[str] = []
    ran: list = []

    class Client(FakeClient):
        def run(self, function, wait=True):  # (on every worker: their own logs)
            ran.append((function, wait))

    @contextlib.contextmanager
    def closing_cluster(cfg, run_dir=None):
        try:
            yield Client()
        finally:  # what the teardown logs: a worker's record forwarded, the driver's own
            forwarded = logging.makeLogRecord(
                {"name": "laminar", "levelno": logging.ERROR, "levelname": "ERROR"}
                | {"msg": "trainer failed: stopped while the buffer was lost"}
            )
            logging.getLogger(forwarded.name).handle(forwarded)  # (as distributed does)
            logging.getLogger("laminar").warning("metrics rows not written")
            print("CLUSTER CLOSED", file=sys.stderr)
            said.append(capsys.readouterr().err)

    monkeypatch.setattr("laminar.deploy.open_cluster", closing_cluster)
    ctrl_c_every_poll(monkeypatch, "version-000001")
    import pipelines.api

    class Handle(pipelines.api.RunHandle):  # (ctrl_c_every_poll's stand-in, with its client)
        def __init__(self, cfg, client, run_dir, resume=None):
            super().__init__(cfg, client, run_dir, resume)
            self.client, self.config = client, cfg

    monkeypatch.setattr("pipelines.api.RunHandle", Handle)
    run = tmp_path / "run"
    argv = ["run", "configs/tiny.yaml", "--set", "task.num_prompts=50", "--run-dir", str(run)]
    with caplog.at_level(logging.WARNING):
        assert _main_no_interrupt(argv) == 130
    assert "laminar: aborted" not in said[0], said  # (not before the close)
    assert "aborting; closing the cluster" in said[0], said
    err = capsys.readouterr().err.strip()
    assert err.startswith("laminar: aborted; ") and "\n" not in err, err
    assert f"laminar run --resume {run.resolve()}" in err
    assert "trainer failed" not in caplog.text and "rows not written" not in caplog.text
    # the workers' own logs (a local cluster's write to this terminal) silenced too, with
    # no wait on a worker that may not answer
    import asyncio

    [(quiet, wait)] = ran
    assert wait is False
    asyncio.run(quiet())  # (here: as a worker would)
    assert not logging.getLogger("laminar.trainer").isEnabledFor(logging.CRITICAL)
    # Workers of a cluster the user started (cluster.kind=address) outlive the run and
    # serve the resume the message names: their logs are theirs (it silenced them for good)
    ran.clear()
    capsys.readouterr()
    other = tmp_path / "other"
    assert (
        _main_no_interrupt(
            [
                *argv[:-1],
                str(other),
                "--set",
                "cluster.kind=address",
                "--set",
                "cluster.address=tcp://127.0.0.1:1",
            ]
        )
        == 130
    )
    assert ran == []


def test_a_run_without_a_warm_start_says_it_was_off_not_cached(capsys):
    """sft.enabled=false: the summary said `warm start 0.2 s (cached)` of a warm start
    that never was."""
    from laminar.config import RunConfig, with_overrides
    from laminar.sft import warm_start

    cfg = with_overrides(RunConfig(), ["sft.enabled=false"])
    _, info = warm_start(cfg, [])
    cli._print_summary(_summary() | {"sft": {**info, "wall_s": 0.2}})
    out = capsys.readouterr().out
    assert "; warm start off (sft.enabled=false or sft.steps=0)\n" in out and "cached" not in out


def test_the_printed_summary_says_reward_errors_and_that_the_mean_leaves_them_out(capsys):
    """A reward failing on 99% of responses: the summary's reward line read 1.000 -> 1.000
    and nothing said the rest failed. It says the errors are left out of it, and a line
    counts them; a run without any says neither."""
    errors = {"failed": 41551, "scored": 378, "groups_discarded": 5190, "latest": "m:f raised"}
    cli._print_summary(_summary() | {"reward_errors": errors})
    out = capsys.readouterr().out
    assert "(gain +0.250); reward errors left out\n" in out
    assert (
        "reward errors      41551 of 41929 responses (99%), 5190 groups discarded; "
        "latest: m:f raised\n"
    ) in out
    cli._print_summary(_summary() | {"reward_errors": {**errors, "failed": 0}})
    out = capsys.readouterr().out
    assert "left out" not in out and "reward errors" not in out
