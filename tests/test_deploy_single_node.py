"""deploy/slurm/single-node's state folder, without root or a real Slurm: the function
that clears it before a start, called directly."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
from conftest import REPO

SINGLE_NODE = REPO / "deploy" / "slurm" / "single-node"


def _script():
    loader = importlib.machinery.SourceFileLoader("single_node", str(SINGLE_NODE))
    spec = importlib.util.spec_from_loader("single_node", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_root_that_holds_other_files_is_refused_not_emptied(tmp_path, capsys):
    """`start --root DIR` ran shutil.rmtree(DIR), as root: `--root /tmp` or `--root .`
    wiped it. A root holding files a start did not write, without its marker, is refused,
    naming the flag; nothing in it is removed."""
    sentinel = tmp_path / "thesis.tex"
    sentinel.write_text("years of work")
    (tmp_path / "log").mkdir()  # (a name of ours among them does not make it ours)
    node = _script().Node(tmp_path)
    with pytest.raises(SystemExit) as e:
        node.clear_state()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"--root {tmp_path}" in err and "thesis.tex" in err and "new or empty" in err, err
    assert sentinel.read_text() == "years of work" and (tmp_path / "log").is_dir()


def test_a_start_removes_only_the_state_it_keeps(tmp_path):
    """A root a previous start wrote (its marker, or nothing but its state): its state
    folders and files go (a restart on old state reuses job ids); anything else stays."""
    mod = _script()
    (tmp_path / mod.MARKER).write_text("")
    for d in mod.STATE_DIRS:
        (tmp_path / d).mkdir()
        (tmp_path / d / "old").write_text("state")
    (tmp_path / "slurm.conf").write_text("old")
    (tmp_path / "owned.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    mod.Node(tmp_path).clear_state()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mod.MARKER, "notes.txt"])
    # A root from before the marker, holding only our state, is ours too.
    legacy = tmp_path / "legacy"
    (legacy / "ctld").mkdir(parents=True)
    (legacy / "slurm.conf").write_text("old")
    mod.Node(legacy).clear_state()
    assert list(legacy.iterdir()) == []
