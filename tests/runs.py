"""Whole runs for end-to-end tests: the real CLI in a subprocess, and the store check
every such test ends with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import REPO

from storage import open_run


def check_store(run_dir, expect_consumed_groups=None, moved=False):
    ds = open_run(run_dir)
    assert ds.laminar.audit() == []
    consumed = ds["status"].values == "consumed"
    if expect_consumed_groups is not None:
        assert len(set(ds["prompt_uid"].values[consumed])) == expect_consumed_groups
    assert (ds["versions_len"].values == 0).all()  # one weight version per trajectory
    paths = [r.split(",") for r in ds["rollout_ids"].values]
    # one rollout per trajectory, or (repack) one more per move
    assert [len(p) - 1 for p in paths] == ds["n_migrations"].values.tolist()
    if not moved:
        assert (ds["n_migrations"].values == 0).all()
    assert (ds["t_submit"].values <= ds["t_start"].values).all()
    assert (ds["t_start"].values <= ds["t_finish"].values).all()
    assert (ds["t_finish"].values <= ds["t_insert"].values).all()
    assert (ds["t_insert"].values[consumed] <= ds["t_sample"].values[consumed]).all()
    return ds


def laminar_cli(*args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kw,
    )


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def cli_run(run_dir, overrides, timeout: float = 400, config="configs/tiny.yaml", args=()):
    """`laminar run CONFIG` to the end: its output and summary.json."""
    proc = laminar_cli("run", config, "--run-dir", str(run_dir), *sets(overrides), *args)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out, json.loads((run_dir / "summary.json").read_text())


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar of every event file under ``log_dir``: tag -> [(wall, step, value)]."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0})  # 0: keep every point
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    out: dict[str, list] = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, []).extend(
                (e.wall_time, e.step, e.value) for e in mux.Scalars(run, tag)
            )
    return {tag: sorted(points) for tag, points in out.items()}


def wait_for(handle, predicate, timeout: float = 300.0) -> dict:
    """The run's first progress report that ``predicate`` accepts (the run must not end
    before it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        p = handle.progress()
        if predicate(p):
            return p
        assert not handle.done(), handle.wait()
        time.sleep(0.2)
    raise TimeoutError(f"no progress matched within {timeout} s: {p}")


def rollout_threads(client) -> list[str]:
    """The rollout generation and relay threads still alive on the rollout workers."""
    from laminar.cluster import workers_with

    def names(dask_worker=None) -> list[str]:
        # nested, so that it is pickled by value: workers cannot import the test modules
        import threading

        prefixes = ("gen-", "relay-")
        return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]

    return sum(client.run(names, workers=workers_with(client, "rollout")).values(), [])
