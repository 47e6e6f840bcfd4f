"""`laminar report` (and ``open_run``) of a laminar run directory with no trajectory store
yet says so, and why: it said "pass a run directory written by `laminar run`" of one
that was."""

from __future__ import annotations

import json

import pytest

from laminar.config import RunConfig
from pipelines.api import prepare_run_dir
from pipelines.report import build_report
from storage import StoreError, open_run
from storage.live import claim


def test_a_run_that_stored_nothing_yet_is_named_with_its_driver_or_its_end(tmp_path):
    run = prepare_run_dir(RunConfig(), tmp_path / "run")  # (this process's claim: live)
    with pytest.raises(StoreError) as e:
        build_report([run], tmp_path / "out")
    said = str(e.value)
    assert "has stored no trajectory yet" in said and "pass a run directory" not in said
    assert "it is running (driver pid" in said and "rerun this once it has stored" in said
    claim(run).release()  # (this process's claim, given up: no driver)
    (run / "summary.json").write_text(json.dumps({"reason": "failed: RuntimeError: boom"}))
    with pytest.raises(StoreError, match="its summary.json says: failed: RuntimeError: boom"):
        open_run(run)
    (run / "summary.json").unlink()
    with pytest.raises(StoreError, match="before its first batch; rerun this once"):
        open_run(run)


def test_a_folder_that_is_not_a_run_is_still_told_what_to_pass(tmp_path):
    with pytest.raises(StoreError, match="pass a run directory written by `laminar run`"):
        open_run(tmp_path)
