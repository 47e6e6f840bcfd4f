"""The `laminar` command's own behaviour: what a user's mistake gets (an exit code and a
message on stderr that names the fix, never a traceback), flags that conflict, Ctrl-C.
Everything here runs in-process with no cluster (`pipelines.cli.main` returns the exit
code); the end-to-end CLI runs are in tests/test_end_to_end.py."""

from __future__ import annotations

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
