"""Laminar on a real Slurm: dask-jobqueue jobs, and the `dask scheduler` + `sbatch` recipe.

The session starts its own single-node Slurm with ``deploy/slurm/single-node`` (installing
Debian's packages when missing) unless ``SLURM_CONF`` already points at a controller that
answers. Where neither is possible (no root, no apt) the tests skip, except under CI,
where they fail: CI must run them.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL_RUN
from runs import check_store, cli_run, laminar_cli, sets

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SINGLE_NODE = REPO / "deploy" / "slurm" / "single-node"
# SMALL_RUN with its warm start on one torch thread (the trainer's job has one core; on
# two threads, beside other work on a 2-core machine, it took 5-10 times as long; not in
# the warm start's cache key, so the second run here finds the first one's entry).
RUN = [*SMALL_RUN, "sft.torch_threads=1", "cluster.placement_timeout_s=120"]


def _answers(env) -> bool:
    try:
        r = subprocess.run(
            ["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "is UP" in r.stdout


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment of a running Slurm (``SLURM_CONF`` set in ``os.environ`` too)."""
    if os.environ.get("SLURM_CONF") and _answers(os.environ):
        yield dict(os.environ)
        return
    root = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(
        [str(SINGLE_NODE), "start", "--root", str(root)], capture_output=True, text=True
    )
    if r.returncode != 0:
        reason = f"no Slurm here and single-node could not start one: {r.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(root / "slurm.conf")
    try:
        yield dict(os.environ)
    finally:
        subprocess.run([str(SINGLE_NODE), "stop", "--root", str(root)], check=False)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _jobs(env, name: str) -> list[str]:
    r = subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%i %T"], env=env, capture_output=True, text=True
    )
    return r.stdout.splitlines()


def _wait_no_jobs(env, name: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _jobs(env, name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_a_run_through_slurmcluster(slurm, tmp_path):
    """`cluster.kind: slurm`: laminar submits one job per worker and cancels them at the
    end; each job runs the role the config gives it."""
    run_dir = tmp_path / "jq-run"
    out, summary = cli_run(run_dir, RUN, config="configs/slurm.yaml")
    assert summary["reason"] == "completed" and summary["versions"] == 4
    check_store(run_dir, expect_consumed_groups=4 * 4)
    logs = sorted((run_dir / "slurm").glob("*.err"))
    assert len(logs) == 3  # data+trainer, two rollouts: one job each
    assert _wait_no_jobs(slurm, f"laminar-{run_dir.name}") == []


def test_a_run_through_the_sbatch_recipe(slurm, tmp_path):
    """docs/deploy.md's recipe as written: the scheduler and one worker per role as
    sbatch jobs, then `laminar run --scheduler-file`."""
    sched_file = tmp_path / "scheduler.json"
    scripts = REPO / "deploy" / "slurm"

    def sbatch(*args) -> str:
        r = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={tmp_path}", *args],
            env=slurm,
            capture_output=True,
            text=True,
            check=True,
        )
        return r.stdout.strip().split(";")[0]

    jobs = [sbatch(str(scripts / "scheduler.sbatch"), str(sched_file))]
    try:
        jobs.append(sbatch(str(scripts / "worker.sbatch"), str(sched_file), "data=1,trainer=1"))
        for _ in range(2):
            jobs.append(sbatch(str(scripts / "worker.sbatch"), str(sched_file), "rollout=1"))
        run_dir = tmp_path / "recipe-run"
        out, summary = cli_run(
            run_dir,
            # (the recipe's scheduler speaks plaintext: configs/slurm.yaml's TLS is dropped)
            [*RUN, "cluster.security=null"],
            config="configs/slurm.yaml",
            args=("--scheduler-file", str(sched_file)),
        )
        assert summary["reason"] == "completed" and summary["versions"] == 4
        check_store(run_dir, expect_consumed_groups=4 * 4)
        workers = sorted(p.name for p in tmp_path.glob("laminar-worker-*.out"))
        assert len(workers) == 3, workers
        assert not (run_dir / "slurm").exists()  # laminar submitted nothing itself
    finally:
        subprocess.run(["scancel", *jobs], env=slurm, check=False)
    assert _wait_no_jobs(slurm, "laminar-worker,laminar-scheduler") == []


def test_a_refused_job_cancels_the_accepted_ones_and_names_the_role(slurm, tmp_path):
    """sbatch refuses the rollouts' jobs (more memory than any node has) after it took the
    trainer's: the error names the role's section and sbatch's words, and the trainer's
    job is cancelled at once, not when the interpreter exits (a notebook's kernel lives on
    with the scheduler it started)."""
    from laminar.config import load_config
    from laminar.deploy import open_cluster
    from laminar.errors import ClusterError

    run_dir = tmp_path / "refused"
    cfg = load_config(
        REPO / "configs" / "slurm.yaml", [*SMALL_RUN, "cluster.slurm.rollout.memory=100000TB"]
    )
    with pytest.raises(ClusterError) as e:
        with open_cluster(cfg, run_dir):
            pass
    message = str(e.value)
    assert "rollout-0, rollout-1 (cluster.slurm.rollout;" in message, message
    assert "sbatch: error:" in message and "cancelled" in message, message
    assert _wait_no_jobs(slurm, f"laminar-{run_dir.name}", timeout=15) == []


def test_a_job_that_ends_before_its_worker_joins_fails_the_run_at_once(slurm, tmp_path):
    """A wrong `cluster.slurm.python`: every job exits in a second. laminar submits no
    second job, so waiting out cluster.placement_timeout_s (600 s in configs/slurm.yaml)
    could only end in advice to start `dask worker` by hand: the run fails as soon as
    squeue shows a job ended, quoting the job's log, and its jobs are cancelled."""
    run_dir = tmp_path / "crashed"
    t0 = time.monotonic()
    proc = laminar_cli(
        "run",
        "configs/slurm.yaml",
        "--run-dir",
        str(run_dir),
        *sets(
            [
                *SMALL_RUN,
                "cluster.slurm.python=/no/such/venv/bin/python",
                "cluster.placement_timeout_s=120",
            ]
        ),
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out
    assert time.monotonic() - t0 < 60, out
    assert "(cluster.slurm." in out and "before its worker joined" in out, out
    assert "/no/such/venv/bin/python: No such file or directory" in out, out
    assert _wait_no_jobs(slurm, f"laminar-{run_dir.name}") == []


def test_a_placement_timeout_says_what_the_jobs_wait_for(slurm, tmp_path):
    """Rollout jobs that cannot all start (each asks for every CPU of the node): the
    timeout names their Slurm state, not a `dask worker` command the user need not run."""
    run_dir = tmp_path / "queued"
    cpus = subprocess.run(
        ["sinfo", "-h", "-o", "%c"], env=slurm, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    proc = laminar_cli(
        "run",
        "configs/slurm.yaml",
        "--run-dir",
        str(run_dir),
        *sets([*SMALL_RUN, f"cluster.slurm.rollout.cores={cpus}", "cluster.placement_timeout_s=8"]),
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out
    assert "cannot place this run" in out and "PENDING (" in out, out
    assert "dask worker ADDRESS" not in out, out
    assert _wait_no_jobs(slurm, f"laminar-{run_dir.name}") == []


def test_single_node_stop_leaves_no_job_process(slurm, tmp_path):
    """`single-node stop` on a node whose job ignores SIGTERM: scancel's SIGKILL comes
    only after KillWait (30 s), past stop's wait, and the daemons it then stops leave the
    job's process behind unless stop ends it too. A node of its own, beside `slurm`."""
    root = tmp_path / "node"
    r = subprocess.run(
        [str(SINGLE_NODE), "start", "--root", str(root)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"single-node could not start a second node: {r.stderr.strip()}")
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    pid_file = tmp_path / "job.pid"
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    try:
        subprocess.run(
            [
                "sbatch",
                f"--chdir={tmp_path}",
                "-o",
                "/dev/null",
                "--wrap",
                f'exec python3 -c "{stubborn}"',
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int(pid_file.read_text())
    finally:
        subprocess.run([str(SINGLE_NODE), "stop", "--root", str(root)], check=False)
    time.sleep(0.5)
    state = (
        Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        if Path(f"/proc/{pid}").exists()
        else "gone"
    )
    if state != "gone" and state != "Z":
        os.kill(pid, 9)  # (the test's own leftover)
    assert state in ("gone", "Z"), f"job process {pid} still running ({state})"


def test_a_run_directory_with_a_space_gets_its_jobs_and_logs(slurm, tmp_path):
    """A run directory "my run": sbatch refused the jobs (`#SBATCH -J laminar-my run`,
    "Invalid directive found in batch script: run"). The job name replaces the blank,
    the log lines are quoted, and the logs land in RUN_DIR/slurm as documented."""
    from laminar.config import load_config
    from laminar.deploy import open_cluster

    run_dir = tmp_path / "my run"
    cfg = load_config(
        REPO / "configs" / "slurm.yaml", [*SMALL_RUN, "cluster.placement_timeout_s=60"]
    )
    with open_cluster(cfg, run_dir) as client:
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 3
        assert len(_jobs(slurm, "laminar-my_run")) == 3
    logs = sorted(p.name for p in (run_dir / "slurm").glob("laminar-my_run-*.err"))
    assert len(logs) == 3, logs
    assert _wait_no_jobs(slurm, "laminar-my_run") == []


def _wait(predicate, timeout: float, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (got := predicate()) and time.monotonic() < deadline:
        time.sleep(poll)
    return got


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_lost_or_fenced_worker_gets_a_new_job_with_its_resources(slurm, tmp_path):
    """Path A's workers have no nanny: a worker whose job is scancelled (a node lost)
    gets a new job, and its role's worker comes back with the same resources, which is
    what a restart or replacement within the run waits for. A hung worker that the driver
    fences has its job cancelled, its stopped process with it, and a new one submitted
    (`restart_workers` refuses a worker without a nanny: `fence_workers` removes it)."""
    import signal

    from laminar.cluster import workers_with
    from laminar.config import load_config
    from laminar.deploy import fence_workers, open_cluster

    run_dir = tmp_path / "lost"
    name = f"laminar-{run_dir.name}"
    cfg = load_config(
        REPO / "configs" / "slurm.yaml", [*SMALL_RUN, "cluster.placement_timeout_s=60"]
    )
    with open_cluster(cfg, run_dir) as client:
        before = set(_jobs(slurm, name))
        rollouts = workers_with(client, "rollout")
        assert len(before) == 3 and len(rollouts) == 2, (before, rollouts)
        lost, fenced = rollouts
        # A lost node: the first rollout's job is cancelled.
        job = client.run(os.getenv, "SLURM_JOB_ID", workers=[lost])[lost]
        t0 = time.monotonic()
        subprocess.run(["scancel", job], env=slurm, check=True)
        back = _wait(lambda: len(set(workers_with(client, "rollout")) - {lost, fenced}), 40)
        assert back, f"no new rollout worker 40 s after scancel of job {job}: {_jobs(slurm, name)}"
        print(f"scancel -> a new rollout worker in {time.monotonic() - t0:.1f} s")
        # A hung worker, fenced: SIGSTOP, then what the driver does.
        pid = client.run(os.getpid, workers=[fenced])[fenced]
        job = client.run(os.getenv, "SLURM_JOB_ID", workers=[fenced])[fenced]
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="requires a nanny"):
            client.restart_workers([fenced], timeout=10)  # (what the driver called)
        assert fence_workers(client, [fenced]) == {fenced: "removed"}
        back = _wait(lambda: len(set(workers_with(client, "rollout")) - {lost, fenced}) == 2, 40)
        assert back, f"no new worker 40 s after the fence of job {job}: {_jobs(slurm, name)}"
        print(f"fence -> a new rollout worker in {time.monotonic() - t0:.1f} s")
        gone = _wait(
            lambda: not _alive(pid) and not any(j.split()[0] == job for j in _jobs(slurm, name)), 40
        )
        if not gone and _alive(pid):
            os.kill(pid, signal.SIGKILL)  # (the test's own leftover)
        assert gone, f"the fenced job {job} (pid {pid}) still holds its node: {_jobs(slurm, name)}"
        assert len(workers_with(client, "rollout")) == 2
        assert len(workers_with(client, "trainer")) == 1
        assert len(_jobs(slurm, name)) == 3
    assert _wait_no_jobs(slurm, name) == []


def test_a_run_stops_in_order_before_its_jobs_walltime(slurm, tmp_path):
    """Jobs of 6 minutes, a run that would take far longer, and
    `cluster.stop_before_walltime_s=300`: once squeue says the trainer's job has less than
    300 s left (a minute in, its setup included: placement more than a minute after the
    job began would refuse it), the run stops in order — its final checkpoint written,
    its store intact, the audit reading it as ended — and `laminar run` exits 124, where
    Slurm's end would have failed it and lost every update since the last checkpoint.
    The reason names the
    job, which is one of the run's."""
    import json
    import re

    from laminar.deploy_walltime import WALLTIME_EXIT
    from storage.audit import WALLTIME_REASON, _ended

    run_dir = tmp_path / "walltime"
    name = f"laminar-{run_dir.name}"
    overrides = [
        *RUN,
        "trainer.steps=100000",
        "cluster.slurm.walltime=6",
        "cluster.stop_before_walltime_s=300",
    ]
    proc = laminar_cli("run", "configs/slurm.yaml", "--run-dir", str(run_dir), *sets(overrides))
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == WALLTIME_EXIT, out
    summary = json.loads((run_dir / "summary.json").read_text())
    reason = summary["reason"]
    assert reason.startswith(WALLTIME_REASON), reason
    got = re.search(r"Slurm job (\d+) \(([^)]*)\) reaches its walltime in (\d+) s", reason)
    assert got, reason
    job, roles, left = got[1], got[2], int(got[3])
    assert "trainer" in roles and 0 <= left <= 300, reason
    assert (run_dir / "slurm" / f"{name}-{job}.err").exists(), "not one of the run's jobs"
    assert "--resume" in out, out  # (how to go on, in new jobs)
    assert "walltime stop in " in out, out  # (the progress said when, as it went)
    # stopped in order: its final checkpoint, at the version it reached
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == f"version-{summary['versions']:06d}" and ckpt.exists(), summary
    check_store(run_dir)
    assert _ended(run_dir)  # (the audit's: a problem it finds is one, not a note)
    assert _wait_no_jobs(slurm, name) == []


def test_the_walltime_watch_reads_a_jobs_time_left_and_follows_its_limit(
    slurm, tmp_path, monkeypatch
):
    """A driver in a job of 10 minutes: the watch reads about 600 s left from squeue; a
    limit raised while the job runs (`scontrol update TimeLimit=`) is seen at the next
    reading; a job that ended is no longer watched (its loss is the fault handling's),
    even where the user's SQUEUE_STATES=all would list it. An salloc shell on a login
    node (the allocation's SLURM_JOB_ID, no SLURMD_NODENAME) is not in the job."""
    from laminar.deploy_walltime import WalltimeWatch
    from laminar.errors import ClusterError

    r = subprocess.run(
        ["sbatch", "--parsable", "-t", "10", f"--chdir={tmp_path}", "--wrap", "sleep 600"],
        env=slurm,
        capture_output=True,
        text=True,
        check=True,
    )
    job = r.stdout.strip().split(";")[0]
    try:
        assert _wait(lambda: any(j == f"{job} RUNNING" for j in _jobs(slurm, "wrap")), 30), _jobs(
            slurm, "wrap"
        )
        in_job = {"SLURM_JOB_ID": job, "SLURMD_NODENAME": "n1"}
        watch = WalltimeWatch(None, dict, 300, environ=in_job)
        watch.refresh()
        end, roles = watch.ends[job]
        assert roles == ["driver"] and 540 < end - time.monotonic() <= 600, watch.ends
        assert watch.due() is None and 240 < watch.stop_in() <= 300
        watch.stop_before_s = 700  # (as if 10 minutes were within the margin)
        assert f"Slurm job {job} (driver) reaches its walltime in" in watch.due()
        assert watch.stop_in() == 0
        # a run is not started in a job already within the margin (a resume loop's)
        with pytest.raises(ClusterError, match=f"not starting the run: Slurm job {job}"):
            WalltimeWatch(None, dict, 700, environ=in_job).check_start()
        WalltimeWatch(None, dict, 300, environ=in_job).check_start()
        salloc_shell = WalltimeWatch(None, dict, 700, environ={"SLURM_JOB_ID": job})
        salloc_shell.check_start()
        assert salloc_shell.ends == {}
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", "TimeLimit=30"], env=slurm, check=True
        )
        watch.refresh()
        assert 1740 < watch.ends[job][0] - time.monotonic() <= 1800, watch.ends
        assert watch.due() is None
    finally:
        subprocess.run(["scancel", job], env=slurm, check=False)
    assert _wait(lambda: not any(j.startswith(f"{job} ") for j in _jobs(slurm, "wrap")), 30)
    monkeypatch.setenv("SQUEUE_STATES", "all")  # (lists the cancelled job, 0:00 left)
    watch.refresh()
    assert watch.ends == {} and watch.due() is None and watch.stop_in() is None
