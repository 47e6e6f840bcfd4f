"""`laminar audit` and `laminar report` of a damaged trajectory store: a missing array
is named (as a resume names it), not a bare KeyError, and a damaged array's zarr.json
is named without a screen of asyncio's "Task was destroyed but it is pending!"."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from test_storage import record

from pipelines.report import build_report
from storage import TrajectoryWriter
from storage.audit import audit_run
from storage.trajectories import StoreError


def test_a_store_missing_an_array_is_named_by_the_audit_and_the_report(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    shutil.rmtree(w.path / "status")
    said = r"trajectories.zarr' has no array 'status'; it is damaged .* restore the run"
    with pytest.raises(StoreError, match=said):
        audit_run(tmp_path)
    with pytest.raises(StoreError, match=said):
        build_report([tmp_path], tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_a_damaged_array_is_named_without_asyncios_pending_tasks(tmp_path):
    """(asyncio reports zarr's reads left pending as the process ends: one is run.)"""
    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    meta = tmp_path / "trajectories.zarr" / "uid" / "zarr.json"  # (the first one read)
    meta.write_text("{\n")
    with pytest.raises(StoreError, match=r"cannot read .*trajectories.zarr.*damaged"):
        audit_run(tmp_path)
    code = (
        "import sys\n"
        "from storage.audit import audit_run\n"
        "from storage.trajectories import StoreError\n"
        "try:\n"
        "    audit_run(sys.argv[1])\n"
        "except StoreError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "refused: cannot read" in out.stdout, out
    assert "Task was destroyed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
