"""The `laminar` command's own behaviour: what a user's mistake gets (an exit code and a
message on stderr that names the fix, never a traceback), flags that conflict, Ctrl-C.
Everything here runs in-process with no cluster (`pipelines.cli.main` returns the exit
code); the end-to-end CLI runs are in tests/test_end_to_end.py."""

from __future__ import annotations

import pytest

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
        (["pacing", "--contexts", "x"], "--contexts"),
        (["schedules", "--splits", "laminar"], "--splits"),
        (["schedules", "--splits", "laminar=x"], "--splits"),
        (["engine", "--repeats", "0"], "--repeats"),
        (["engine", "--new-tokens", "-5"], "--new-tokens"),
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


@pytest.fixture
def no_cluster(monkeypatch):
    """A run that got past its pre-start checks would start a cluster: fail instead."""

    def refuse(*a, **k):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr("laminar.deploy.open_cluster", refuse)


def test_scheduler_and_scheduler_file_are_refused_together(tmp_path, capsys, no_cluster):
    f = tmp_path / "scheduler.json"
    argv = ["run", "configs/tiny.yaml", "--scheduler", "tcp://h:8786", "--scheduler-file", str(f)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # named as the user typed them (not as the --set overrides they become)
    assert "argument --scheduler-file: not allowed with argument --scheduler" in err
    assert "--set" not in err.splitlines()[-1]
