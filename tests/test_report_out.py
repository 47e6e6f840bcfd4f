"""`laminar report --out`: a folder under a file is refused first, naming the file (it was
a raw NotADirectoryError after every store had been read)."""

from __future__ import annotations

import re

import pytest
from test_storage import record

from laminar.errors import ConfigError
from pipelines.report import build_report
from storage import TrajectoryWriter


def test_a_report_under_a_file_is_refused_first_naming_the_file(tmp_path):
    (tmp_path / "afile").write_text("")
    said = r"--out '.*afile/sub/deeper' cannot be made: '.*afile' is a file, not a folder"
    with pytest.raises(ConfigError, match=said):  # (before the runs are read)
        build_report([tmp_path / "no-run"], out=tmp_path / "afile" / "sub" / "deeper")


def test_a_run_whose_report_folder_is_a_file_is_refused(tmp_path):
    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    (tmp_path / "report").write_text("mine")
    with pytest.raises(ConfigError, match=r"the report's folder '.*report' is a file"):
        build_report([tmp_path])
    assert (tmp_path / "report").read_text() == "mine"


def test_laminar_report_lists_the_figures_of_this_report_alone(tmp_path, capsys):
    """`laminar report` lists the figures the report it wrote links, not every PNG in its
    folder: an earlier report's there (another run's rollouts-1.png) was listed as one."""
    from pipelines import cli

    TrajectoryWriter(tmp_path / "a").append([record(0), record(1)])
    out = tmp_path / "r"
    out.mkdir()
    (out / "rollouts-1.png").write_bytes(b"an earlier report's")
    assert cli.main(["report", str(tmp_path / "a"), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[1] for line in lines if line.startswith("figure")]
    linked = re.findall(r"\]\(([^)]+)\)", (out / "report.md").read_text())
    assert listed == [str(out / name) for name in linked] and linked
    assert str(out / "rollouts-1.png") not in listed
