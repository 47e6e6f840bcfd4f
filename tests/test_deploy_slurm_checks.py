"""Checks of the Slurm deployment that need no Slurm (review of 2026-12-06): the sbatch
options job_directives may not take, vLLM rollouts without a GPU, the walltime warning,
a cluster opened from a thread, the jobs cancelled after a slow submission, and the wait
of deploy/slurm's scripts for their scheduler. Stand-ins for sbatch, squeue and scancel
as in test_slurm_stub.py; the real Slurm runs are in test_slurm.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from test_slurm_stub import _fake_dask, _slurm_cfg, _submit_jobs, install_fake_slurm

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError

SCRIPTS = REPO / "deploy" / "slurm"

# scancel records the ids it was given, one call a line; with FAKE_SCANCEL_FAIL, it
# fails as Slurm's does on a job it cannot cancel.
SCANCEL = """#!/bin/bash
echo "$@" >> {d}/scancel.calls
if [ -n "$FAKE_SCANCEL_FAIL" ]; then
    echo "scancel: error: Kill job error on job id $1: Access/permission denied" >&2
    exit 1
fi
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    return install_fake_slurm(tmp_path, monkeypatch, SCANCEL)


# -- job_directives ------------------------------------------------------------------------


@pytest.mark.parametrize("section", ["cluster.slurm", "cluster.slurm.rollout"])
@pytest.mark.parametrize(
    "directive, named",
    [
        ("--clusters=other", "--clusters"),
        ("-M other", "-M"),
        ("--array=1-4", "--array"),
        ("-a 1-4", "-a"),
        ("--output=job.out", "--output"),
        ("--out job.out", "--output"),
        ("-ojob.out", "-o"),
        ("--error=job.err", "--error"),
        ("-e job.err", "-e"),
        ("--wait", "--wait"),
    ],
)
def test_job_directives_refuse_what_laminar_sets(section, directive, named):
    """--clusters sent the jobs where laminar's squeue and scancel did not look (the
    placement wait saw them "gone", nothing cancelled them), --array made several jobs of
    one worker's, -o/-e moved the log the placement wait quotes."""
    with pytest.raises(ConfigError) as e:
        with_overrides(RunConfig(), [f"{section}.job_directives=[{directive!r}]"])
    said = str(e.value)
    assert f"{section}.job_directives" in said and named in said, said
    assert "remove it" in said, said


def test_job_directives_take_the_options_that_look_alike():
    ok = [
        "--exclusive",
        "--export=ALL",
        "-A proj",
        "--cluster-constraint=x",
        "--wait-all-nodes=1",
        "--open-mode=append",
        "--mem-per-cpu=2G",
    ]
    cfg = with_overrides(RunConfig(), [f"cluster.slurm.job_directives={ok!r}"])
    assert cfg.cluster.slurm.job_directives == ok


# -- vLLM and GPUs -------------------------------------------------------------------------


def test_vllm_rollouts_without_a_gpu_are_refused_before_any_job(fake_slurm, tmp_path):
    """configs/slurm.yaml's rollouts ask for no GPU; with rollout.engine=vllm their jobs
    got no --gres, and vLLM failed on the node (or took GPU 0, another job's)."""
    from laminar.deploy import slurm_cluster

    # At load, with the other checks of a config (laminar run refuses before any cluster)
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.rollout\.gpus=1") as e:
        _slurm_cfg("rollout.engine=vllm")
    assert "rollout.engine=vllm" in str(e.value)
    # and again as the cluster opens (a config built in code, not validated again)
    cfg = _slurm_cfg()
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "vllm"})})
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.rollout\.gpus=1") as e:
        slurm_cluster(cfg, tmp_path / "run")
    assert "rollout.engine=vllm" in str(e.value)
    assert not (fake_slurm / "submitted").exists()


def test_jobs_without_a_gpu_see_none_and_vllm_s_get_theirs(fake_slurm, tmp_path):
    cfg = _slurm_cfg("rollout.engine=vllm", "cluster.slurm.rollout.gpus=1")
    scripts = list(_submit_jobs(cfg, tmp_path / "run").values())
    rollouts = [s for s in scripts if "rollout=1" in s]
    others = [s for s in scripts if "rollout=1" not in s]
    assert len(rollouts) == 2 and len(others) == 1, scripts
    for s in rollouts:
        assert "#SBATCH --gres=gpu:1" in s and "CUDA_VISIBLE_DEVICES" not in s, s
    assert "export CUDA_VISIBLE_DEVICES=''" in others[0], others[0]


def test_gpus_asked_for_in_job_directives_count(fake_slurm, tmp_path):
    """A site that gives GPUs by --gpus-per-node (or --gres in a role's lines) is not
    refused, and its jobs keep the GPUs Slurm gives them."""
    cfg = _slurm_cfg("rollout.engine=vllm", "cluster.slurm.job_directives=['--gpus-per-node=1']")
    scripts = list(_submit_jobs(cfg, tmp_path / "run").values())
    assert len(scripts) == 3 and not any("CUDA_VISIBLE_DEVICES" in s for s in scripts), scripts


# -- walltime ------------------------------------------------------------------------------


@pytest.mark.parametrize("walltime, warned", [("1:00", True), ("9", True), ("01:00:00", False)])
def test_a_walltime_under_ten_minutes_is_warned_of(fake_slurm, tmp_path, caplog, walltime, warned):
    """sbatch reads 1:00 as one minute: every job, and the run, ended a minute in."""
    # (a stop margin below one minute: the default, 300 s, refuses 1:00, below)
    cfg = _slurm_cfg(f"cluster.slurm.walltime='{walltime}'", "cluster.stop_before_walltime_s=30")
    with caplog.at_level(logging.WARNING, logger="laminar.deploy"):
        _submit_jobs(cfg, tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "cluster.slurm.walltime" in r.getMessage()]
    assert len(said) == int(warned), caplog.text
    if warned:
        assert f"walltime={walltime} is" in said[0] and "02:00:00" in said[0], said[0]


@pytest.mark.parametrize("walltime", ["5", "1:00"])
def test_a_walltime_within_the_stop_margin_is_refused_before_any_job(
    fake_slurm, tmp_path, walltime
):
    """The run stops in order cluster.stop_before_walltime_s (300 s) before its jobs'
    walltime: with 5 minutes or less it would stop as soon as it started."""
    from laminar.deploy import slurm_cluster

    # At load (laminar run refuses before any cluster)
    with pytest.raises(ConfigError, match=r"cluster\.stop_before_walltime_s=300") as e:
        _slurm_cfg(f"cluster.slurm.walltime='{walltime}'")
    assert f"cluster.slurm.walltime={walltime} " in str(e.value), e.value
    # and again as the jobs are submitted (a config built in code, not validated again)
    cfg = _slurm_cfg()
    slurm = cfg.cluster.slurm.model_copy(update={"walltime": walltime})
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"slurm": slurm})})
    with pytest.raises(ConfigError, match=r"cluster\.stop_before_walltime_s=300"):
        slurm_cluster(cfg, tmp_path / "run")
    assert not (fake_slurm / "submitted").exists()
    # (0: never stops for the walltime, so nothing to refuse)
    _submit_jobs(
        _slurm_cfg(f"cluster.slurm.walltime='{walltime}'", "cluster.stop_before_walltime_s=0"),
        tmp_path / "run2",
    )


# -- a cluster opened from a thread --------------------------------------------------------


def test_a_slurm_cluster_opens_from_a_thread():
    """dask-jobqueue sets a SIGINT handler as it is imported, which Python allows from
    the main thread only: opened from a thread (an application's, a notebook's), the
    cluster failed with a bare ValueError. (A fresh interpreter: the import happens
    once. The interface no0 ends the start at once, after the import.)"""
    pytest.importorskip("dask_jobqueue")
    code = (
        "import signal, sys, threading\n"
        "from laminar.config import RunConfig, with_overrides\n"
        "from laminar.deploy import slurm_cluster\n"
        "cfg = with_overrides(RunConfig(), ['cluster.kind=slurm', 'cluster.slurm.interface=no0'])\n"
        "said = []\n"
        "def open_it():\n"
        "    try:\n"
        "        slurm_cluster(cfg, sys.argv[1])\n"
        "    except Exception as e:\n"
        "        said.append(f'{type(e).__name__}: {e}')\n"
        "t = threading.Thread(target=open_it)\n"
        "t.start(); t.join()\n"
        "print(said[0])\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "no-run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout + r.stderr
    assert lines[0].startswith("ConfigError: cluster.slurm.interface='no0'"), lines[0]
    assert lines[1] == "True", r.stdout


# -- jobs accepted during a slow submission ------------------------------------------------


def _cluster_mid_submission():
    """A SLURMCluster as it is when _submit gave up waiting: cluster.workers still empty
    (dask-jobqueue adds the jobs once all sbatch calls ended), two jobs sbatch accepted,
    one whose sbatch has not answered."""
    from distributed.core import Status

    def job(name, job_id):
        return SimpleNamespace(name=name, job_id=job_id, status=Status.created)

    created = [job("trainer", "41"), job("rollout-0", "42"), job("rollout-1", None)]
    closed = []
    cluster = SimpleNamespace(
        workers={},
        worker_spec={"trainer": {}, "rollout-0": {}, "rollout-1": {}},
        _created=created,  # (a WeakSet in distributed)
        close=lambda timeout: closed.append(timeout),
    )
    return cluster, closed


def test_jobs_sbatch_accepted_are_cancelled_though_the_submission_did_not_end(fake_slurm):
    from laminar.deploy_slurm import _cancel_submitted

    cluster, closed = _cluster_mid_submission()
    refused = _cancel_submitted(cluster)
    assert (fake_slurm / "scancel.calls").read_text().splitlines() == ["41 42"]  # one call
    assert refused == ["rollout-1"] and closed


def test_jobs_scancel_did_not_cancel_are_logged(fake_slurm, monkeypatch, caplog):
    from laminar.deploy_slurm import _cancel_submitted

    monkeypatch.setenv("FAKE_SCANCEL_FAIL", "1")
    cluster, _ = _cluster_mid_submission()
    with caplog.at_level(logging.ERROR, logger="laminar.deploy"):
        _cancel_submitted(cluster)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "41, 42" in said[0] and "scancel 41 42" in said[0], said
    assert "Access/permission denied" in said[0], said


# -- deploy/slurm's scripts ----------------------------------------------------------------


def _worker_job(tmp_path: Path, env_more: dict, squeue: str | None = None):
    """worker.sbatch run by bash with no scheduler file, a dask that records its
    arguments, and a squeue that runs ``squeue``'s lines."""
    env = _fake_dask(tmp_path, "true")
    env = {k: v for k, v in env.items() if not k.startswith("LAMINAR_SCHEDULER_")}
    if squeue is not None:
        fake = Path(env["PATH"].split(os.pathsep)[0]) / "squeue"
        fake.write_text(f"#!/bin/bash\n{squeue}\n")
        fake.chmod(0o755)
    return subprocess.run(
        ["bash", str(SCRIPTS / "worker.sbatch"), str(tmp_path / "scheduler.json"), "rollout=1"],
        env={**env, **env_more},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_worker_job_stops_waiting_for_a_scheduler_file_at_its_bound(tmp_path):
    """A worker waited for the scheduler's file with no bound: when the scheduler's job
    failed or was cancelled, every worker job held its node until its walltime."""
    r = _worker_job(tmp_path, {"LAMINAR_SCHEDULER_WAIT_S": "1"})
    assert r.returncode == 1, r.stderr
    assert "no scheduler file" in r.stderr and "LAMINAR_SCHEDULER_WAIT_S" in r.stderr, r.stderr
    assert not (tmp_path / "dask.args").exists()


@pytest.mark.parametrize(
    "squeue, state",
    [
        ("echo CANCELLED", "CANCELLED"),
        ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", "gone from squeue"),
    ],
)
def test_a_worker_job_stops_waiting_once_the_scheduler_s_job_is_gone(tmp_path, squeue, state):
    r = _worker_job(
        tmp_path, {"LAMINAR_SCHEDULER_WAIT_S": "600", "LAMINAR_SCHEDULER_JOB": "77"}, squeue
    )
    assert r.returncode == 1, r.stderr
    assert f"job 77 (LAMINAR_SCHEDULER_JOB) is {state}" in r.stderr, r.stderr
    assert not (tmp_path / "dask.args").exists()


def test_a_worker_job_waits_as_long_as_the_scheduler_s_job_queues(tmp_path):
    """The bound counts from the scheduler's job's start: a queue longer than it (a busy
    cluster) ended every worker job while the scheduler's still waited to run."""
    calls, sched = tmp_path / "squeue.calls", tmp_path / "scheduler.json"
    squeue = (
        f'echo . >> {calls}; [ "$(wc -l < {calls})" -ge 3 ] && echo "{{}}" > {sched}; echo PENDING'
    )
    r = _worker_job(
        tmp_path, {"LAMINAR_SCHEDULER_WAIT_S": "1", "LAMINAR_SCHEDULER_JOB": "77"}, squeue
    )
    assert r.returncode == 0, r.stderr
    assert len(calls.read_text().split()) >= 3  # (past the bound: about 2 s a call)
    assert (tmp_path / "dask.args").exists()  # the worker started


def test_a_scheduler_job_listens_on_a_free_port_unless_told(tmp_path):
    """scheduler.sbatch started `dask scheduler` on Dask's 8786: a second scheduler on
    the node died with EADDRINUSE. Port 0, which the file carries; a --port given to the
    script comes after it, and click takes the last."""
    env = _fake_dask(tmp_path, "true")
    sched = str(tmp_path / "scheduler.json")
    subprocess.run(
        ["bash", str(SCRIPTS / "scheduler.sbatch"), sched], env=env, check=True, timeout=60
    )
    args = (tmp_path / "dask.args").read_text().splitlines()
    assert args[0] == "scheduler" and args[args.index("--port") + 1] == "0", args
    subprocess.run(
        ["bash", str(SCRIPTS / "scheduler.sbatch"), sched, "--port", "8786"],
        env=env,
        check=True,
        timeout=60,
    )
    args = (tmp_path / "dask.args").read_text().splitlines()
    ports = [args[i + 1] for i, a in enumerate(args) if a == "--port"]
    assert ports == ["0", "8786"], args
