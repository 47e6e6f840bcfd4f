"""``RUN_DIR/driver.json``: one driver per run directory, however close two starts come."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.live import LIVE_FILE, LIVE_STALE_S, RunGoing, claim, running_driver

REPO = Path(__file__).resolve().parents[1]

# Claims ``RUN`` at wall time ``AT`` and says whether it got it; holds it ``HOLD_S``.
CLAIMER = """
import os, sys, time
from storage.live import RunGoing, claim
run, at, hold, how = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
time.sleep(max(0.0, at - time.time()))
try:
    claim(run)
except RunGoing:
    print("refused", flush=True)
    sys.exit(0)
print("claimed", flush=True)
time.sleep(hold)
if how == "killed":
    os._exit(0)  # (no atexit: as a process killed outright leaves its claim)
"""


def _claimers(run: Path, n: int, *, hold_s: float, how: str = "ends") -> list[str]:
    at = time.time() + 3.0  # (every interpreter started and waiting by then)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(run), str(at), str(hold_s), how],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    return [p.communicate(timeout=60)[0].strip() for p in procs]


def test_of_starts_at_the_same_moment_exactly_one_claims_the_directory(tmp_path):
    """A check for a live driver followed by a write let two through; the claim is an
    exclusive create."""
    said = _claimers(tmp_path, 6, hold_s=1.0)
    assert sorted(said) == ["claimed"] + ["refused"] * 5, said
    assert not (tmp_path / LIVE_FILE).exists()  # (given back when its process ended)


def test_a_driver_killed_on_this_host_frees_the_directory_at_once(tmp_path):
    assert _claimers(tmp_path, 1, hold_s=0.0, how="killed") == ["claimed"]
    left = json.loads((tmp_path / LIVE_FILE).read_text())
    assert time.time() - left["seen"] < LIVE_STALE_S  # (fresh, but its process is gone)
    assert running_driver(tmp_path) is None
    held = claim(tmp_path)
    try:
        assert running_driver(tmp_path)["pid"] == os.getpid()
    finally:
        held.release()
    assert not (tmp_path / LIVE_FILE).exists()


def test_another_hosts_driver_holds_the_directory_until_it_goes_stale(tmp_path):
    live = {"pid": 4242, "host": "node7", "since": time.time(), "seen": time.time()}
    (tmp_path / LIVE_FILE).write_text(json.dumps(live))
    with pytest.raises(RunGoing) as e:
        claim(tmp_path)
    assert e.value.live["host"] == "node7"
    (tmp_path / LIVE_FILE).write_text(json.dumps(live | {"seen": time.time() - LIVE_STALE_S}))
    held = claim(tmp_path)  # (stale: taken over)
    try:
        assert running_driver(tmp_path)["pid"] == os.getpid()
    finally:
        held.release()


def test_a_claim_this_process_holds_is_its_own_until_a_run_drives_it(tmp_path):
    """prepare_run_dir claims, the RunHandle takes the claim over; a second RunHandle in
    the same process is refused; a claim given back frees the directory."""
    held = claim(tmp_path)
    try:
        assert claim(tmp_path) is held
        held.driving = True
        with pytest.raises(RunGoing) as e:
            claim(tmp_path)
        assert e.value.here
    finally:
        held.release()
    assert running_driver(tmp_path) is None
    claim(tmp_path).release()


def test_a_claim_is_renewed_while_held(tmp_path, monkeypatch):
    import storage.live

    monkeypatch.setattr(storage.live, "LIVE_EVERY_S", 0.2)
    monkeypatch.setattr(storage.live, "_renewer", None)  # (one that reads the new period)
    held = claim(tmp_path)
    try:
        first = json.loads((tmp_path / LIVE_FILE).read_text())["seen"]
        deadline = time.time() + 10
        while json.loads((tmp_path / LIVE_FILE).read_text())["seen"] == first:
            assert time.time() < deadline, "not renewed"
            time.sleep(0.1)
    finally:
        held.release()


def test_a_claim_taken_over_while_its_process_stalled_is_not_renewed_over(tmp_path, monkeypatch):
    """This process stalled past LIVE_STALE_S and another host's driver took the
    directory: the renewer drops the claim instead of writing over theirs."""
    import storage.live

    monkeypatch.setattr(storage.live, "LIVE_EVERY_S", 0.1)
    monkeypatch.setattr(storage.live, "_renewer", None)
    held = claim(tmp_path)
    theirs = {"pid": 4242, "host": "node7", "since": time.time(), "seen": time.time()}
    (tmp_path / LIVE_FILE).write_text(json.dumps(theirs))
    time.sleep(0.5)  # (several renewals' worth)
    assert running_driver(tmp_path)["host"] == "node7"
    assert tmp_path.resolve() not in storage.live._held
    held.release()  # (gives up nothing of theirs)
    assert running_driver(tmp_path)["host"] == "node7"
