"""`laminar bench NAME --help`: the flags NAME takes, not every benchmark's."""

from __future__ import annotations

import re

import pytest

from pipelines import cli
from pipelines.bench import _FLAGS, BENCHES, bench_options


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_a_benchmarks_help_lists_the_flags_it_takes_and_no_other(name, capsys):
    """It printed the help of every benchmark's flags (36 of them), each naming the
    benchmarks it is for, under `laminar bench soak --help`."""
    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(["bench", name, "--help"])
    assert ended.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"usage: laminar bench {name} ")
    assert cli.BENCH_ABOUT[name] in " ".join(said.split())
    shown = set(re.findall(r"^  (--[a-z-]+)", said, flags=re.M)) - {"--help"}
    takes = {_FLAGS[o] for o in bench_options(name) if o in _FLAGS} | {"--out"}
    assert shown == takes


def test_the_bench_help_without_a_name_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--help"])
    said = capsys.readouterr().out
    assert "laminar bench NAME --help" in said
    assert set(_FLAGS.values()) <= set(re.findall(r"--[a-z-]+", said))
