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

# Claims ``RUN`` at the wall time it is given once every claimer has started, says whether
# it got it, and holds it until told (how="killed": then leaves as if killed outright).
CLAIMER = """
import os, sys, time
from storage.live import RunGoing, claim
run, how = sys.argv[1], sys.argv[2]
print("ready", flush=True)
at = float(sys.stdin.readline())
time.sleep(max(0.0, at - time.time()))
try:
    claim(run)
except RunGoing:
    print("refused", flush=True)
    sys.exit(0)
print("claimed", flush=True)
sys.stdin.readline()
if how == "killed":
    os._exit(0)  # (no atexit: as a process killed outright leaves its claim)
"""


def _claimers(run: Path, n: int, *, how: str = "ends") -> list[str]:
    """What each of ``n`` claimers started at one moment said. The moment is set once
    every interpreter is up (on a busy machine their imports take seconds apart), and
    the claim is held until every claimer has answered: a late claimer must not find the
    directory already given back."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(run), how],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * n
    at = time.time() + 0.5
    for p in procs:
        p.stdin.write(f"{at}\n")
        p.stdin.flush()
    said = [p.stdout.readline().strip() for p in procs]
    for p in procs:
        p.communicate("go\n", timeout=60)  # (gives the claim back, or leaves it killed)
    return said


def test_of_starts_at_the_same_moment_exactly_one_claims_the_directory(tmp_path):
    """A check for a live driver followed by a write let two through; the claim is an
    exclusive create."""
    said = _claimers(tmp_path, 6)
    assert sorted(said) == ["claimed"] + ["refused"] * 5, said
    assert not (tmp_path / LIVE_FILE).exists()  # (given back when its process ended)


def test_a_driver_killed_on_this_host_frees_the_directory_at_once(tmp_path):
    assert _claimers(tmp_path, 1, how="killed") == ["claimed"]
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


def test_a_stalled_driver_on_this_host_keeps_the_directory(tmp_path, monkeypatch):
    """A driver stopped with Ctrl-Z (or swapping) renews nothing: past LIVE_STALE_S its
    claim was taken over although it lives, and once continued it went on writing in a
    directory another run now used. Its process started before its claim: still it."""
    import signal

    import storage.live

    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(tmp_path), "ends"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write(f"{time.time()}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "claimed"
        os.kill(proc.pid, signal.SIGSTOP)
        monkeypatch.setattr(storage.live, "LIVE_STALE_S", 0.2)
        time.sleep(0.5)  # (its claim now older than that)
        with pytest.raises(RunGoing) as e:
            claim(tmp_path)
        assert e.value.live["pid"] == proc.pid
        assert running_driver(tmp_path)["pid"] == proc.pid
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.communicate("go\n", timeout=60)
    assert running_driver(tmp_path) is None


def test_a_claim_naming_a_pid_reused_since_is_taken_over_at_once(tmp_path):
    """The claim's process died and its pid went to a process started after the claim
    (here: a process claimed for an hour before it started): not the driver, however
    fresh the file."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        now = time.time()
        live = {"pid": other.pid, "host": socket.gethostname(), "since": now - 3600, "seen": now}
        (tmp_path / LIVE_FILE).write_text(json.dumps(live))
        assert running_driver(tmp_path) is None
        held = claim(tmp_path)
        held.release()
    finally:
        other.kill()
        other.wait()
