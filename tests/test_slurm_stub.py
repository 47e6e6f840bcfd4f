"""laminar.deploy's Slurm paths against stand-ins for sbatch, squeue and scancel (no Slurm
needed): the job scripts it writes, what it cancels, what the placement wait and the
replacer conclude from squeue; and the scripts of deploy/slurm run by bash.

The runs on a real Slurm are in test_slurm.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO

from laminar.config import RunConfig, with_overrides
from laminar.errors import ClusterError

SCRIPTS = REPO / "deploy" / "slurm"

# sbatch keeps each job script and answers with a job id (its pid: unique among calls
# that run at once), or refuses a script that holds FAKE_SBATCH_REFUSE; with
# FAKE_SBATCH_INTERRUPT set, the first call sends the test's
# process a Ctrl-C (SIGINT) and answers a second later, still under way meanwhile.
# scancel records the ids it was given; with FAKE_SCANCEL_SLOW=S, S seconds after it
# started (scancel.started), as a controller that answers slowly.
SBATCH = """#!/bin/bash
d={d}
id=$$
if [ -n "$FAKE_SBATCH_REFUSE" ] && grep -q -- "$FAKE_SBATCH_REFUSE" "$1"; then
    echo "sbatch: error: invalid partition specified: nope" >&2
    exit 1
fi
if [ -n "$FAKE_SBATCH_INTERRUPT" ] && mkdir "$d/interrupted" 2>/dev/null; then
    kill -INT $PPID
    sleep 1
fi
cp "$1" "$d/scripts/$id.sh"
echo "$id" >> "$d/submitted"
echo "Submitted batch job $id"
"""
SCANCEL = """#!/bin/bash
if [ -n "$FAKE_SCANCEL_SLOW" ]; then
    touch {d}/scancel.started
    sleep "$FAKE_SCANCEL_SLOW"
fi
printf '%s\\n' "$@" >> {d}/cancelled
"""
SQUEUE = """#!/bin/bash
echo $$ > {d}/squeue.pid
[ -n "$FAKE_SQUEUE_HANG" ] && exec sleep 600
cat {d}/squeue.out 2>/dev/null
true
"""


def install_fake_slurm(tmp_path, monkeypatch, scancel: str = SCANCEL) -> Path:
    """A folder with bin/ (sbatch, squeue, ``scancel``, first on PATH) and what they
    record: scripts/ID.sh, submitted, cancelled."""
    pytest.importorskip("dask_jobqueue")
    d = tmp_path / "fake-slurm"
    (d / "bin").mkdir(parents=True)
    (d / "scripts").mkdir()
    for name, text in {"sbatch": SBATCH, "scancel": scancel, "squeue": SQUEUE}.items():
        (d / "bin" / name).write_text(text.format(d=d))
        (d / "bin" / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{d / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return d


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    return install_fake_slurm(tmp_path, monkeypatch)


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _slurm_cfg(*overrides: str) -> RunConfig:
    return with_overrides(RunConfig(), ["cluster.kind=slurm", "rollout.replicas=2", *overrides])


def _submit_jobs(cfg, run_dir) -> dict[str, str]:
    """The job scripts laminar submits for ``cfg``: job id -> script (the cluster closed)."""
    from laminar.deploy import security_for, slurm_cluster

    fake = Path(os.environ["PATH"].split(os.pathsep)[0]).parent
    cluster = slurm_cluster(cfg, run_dir, security_for(cfg.cluster, run_dir))
    cluster.close(timeout=30)
    return {p.stem: p.read_text() for p in (fake / "scripts").glob("*.sh")}


def test_a_python_and_certificates_under_paths_with_blanks_reach_the_worker(fake_slurm, tmp_path):
    """cluster.slurm.python '/opt/my env/bin/python', and a run directory "my run" with
    `security: {generate: true}`: dask-jobqueue joins the worker's command with blanks, so
    the job ran `/opt/my` and every worker exited at once. The job script, run by bash,
    starts the python given with the arguments meant, each path whole."""
    out = tmp_path / "started"
    out.mkdir()
    python = tmp_path / "my env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {out}/$$.args\nenv > {out}/$$.env\n')
    python.chmod(0o755)
    run_dir = tmp_path / "my run"
    cfg = _slurm_cfg(f"cluster.slurm.python={python}", "cluster.security.generate=true")
    scripts = _submit_jobs(cfg, run_dir)
    assert len(scripts) == 3
    for script in scripts.values():
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (script, r.stderr)
    started = sorted(out.glob("*.args"))
    assert len(started) == 3, list(scripts.values())
    for f in started:
        args = f.read_text().splitlines()
        assert args[:2] == ["-m", "distributed.cli.dask_worker"], args
        tls = {args[i]: args[i + 1] for i, a in enumerate(args) if a.startswith("--tls-")}
        assert tls == {
            "--tls-ca-file": str(run_dir / "tls" / "ca.pem"),
            "--tls-cert": str(run_dir / "tls" / "cert.pem"),
            "--tls-key": str(run_dir / "tls" / "key.pem"),
        }, args
        env = dict(ln.split("=", 1) for ln in f.with_suffix(".env").read_text().splitlines())
        assert env["OMP_NUM_THREADS"] == "1"


def test_a_percent_in_the_log_folder_reaches_slurm_as_itself(fake_slurm, tmp_path):
    """Slurm reads -o/-e as a pattern: a run directory "lr_5%" (or "x%j") would send the
    logs elsewhere and leave the placement wait with no log to quote. A % is doubled."""
    run_dir = tmp_path / "lr_5%j"
    scripts = _submit_jobs(_slurm_cfg(), run_dir)
    assert scripts
    for script in scripts.values():
        lines = [ln for ln in script.splitlines() if ln.startswith(("#SBATCH -e", "#SBATCH -o"))]
        assert len(lines) == 2, script
        for line in lines:
            assert f'"{tmp_path}/lr_5%%j/slurm/laminar-lr_5_j-%J.' in line, line


def test_ctrl_c_while_jobs_are_submitted_cancels_every_job_submitted(
    fake_slurm, tmp_path, monkeypatch
):
    """A Ctrl-C while sbatch takes the run's jobs: the cluster and the jobs sbatch
    accepted (those under way too) leaked, holding nodes until their walltime."""
    from laminar.deploy import open_cluster

    monkeypatch.setenv("FAKE_SBATCH_INTERRUPT", "1")
    with pytest.raises(KeyboardInterrupt):
        with open_cluster(_slurm_cfg("cluster.placement_timeout_s=0"), tmp_path / "run"):
            pass
    submitted = _lines(fake_slurm / "submitted")
    assert len(submitted) == 3, submitted
    assert set(submitted) <= set(_lines(fake_slurm / "cancelled")), _lines(fake_slurm / "cancelled")


def test_a_joined_worker_whose_job_was_replaced_did_not_end_before_joining(tmp_path, monkeypatch):
    """rollout-0 joined; then its job died and SlurmReplacer submitted rollout-0.2, while
    rollout-1 still queued. The placement wait saw rollout-0's first job CANCELLED and no
    rollout-0 connected, and failed the run: "ended ... before its worker joined"."""
    import laminar.cluster
    from laminar.deploy import SlurmJobs

    workers = {"trainer": {"data": 1, "trainer": 1}, "rollout-0": {"rollout": 1}}
    workers["rollout-1"] = {"rollout": 1}
    cluster = SimpleNamespace(
        workers={n: SimpleNamespace(job_id=str(10 + i)) for i, n in enumerate(workers)}
    )
    jobs = SlurmJobs(cluster, workers, tmp_path)
    now: dict = {}
    monkeypatch.setattr(laminar.cluster, "scheduler_workers", lambda client: now["workers"])
    jobs.states = lambda: now["states"]
    now["workers"] = {"tcp://a": {"name": "trainer"}, "tcp://b": {"name": "rollout-0"}}
    now["states"] = {"10": ("RUNNING", ""), "11": ("RUNNING", ""), "12": ("PENDING", "")}
    jobs.check(client=None)
    now["workers"] = {"tcp://a": {"name": "trainer"}}  # rollout-0.2 still queued
    now["states"] = {"10": ("RUNNING", ""), "11": ("CANCELLED", ""), "12": ("PENDING", "")}
    jobs.check(client=None)
    # One that never joined still fails the wait at once.
    now["states"]["12"] = ("FAILED", "NonZeroExitCode")
    with pytest.raises(ClusterError, match=r"job 12 of worker rollout-1 .* before its worker"):
        jobs.check(client=None)


def test_a_worker_that_came_and_went_between_two_checks_joined(tmp_path, monkeypatch):
    """The names SlurmReplacer's scheduler plugin saw join count as joined for the
    placement wait too: a worker can join and be lost between two of its checks."""
    import laminar.cluster
    from laminar.deploy import SlurmJobs

    plugin = SimpleNamespace(names={"rollout-0"})
    cluster = SimpleNamespace(
        workers={"rollout-0": SimpleNamespace(job_id="11")},
        scheduler=SimpleNamespace(plugins={"laminar-joined": plugin}),
    )
    jobs = SlurmJobs(cluster, {"rollout-0": {"rollout": 1}}, tmp_path)
    monkeypatch.setattr(laminar.cluster, "scheduler_workers", lambda client: {})
    jobs.states = lambda: {"11": ("CANCELLED", "")}
    jobs.check(client=None)
    plugin.names.clear()
    with pytest.raises(ClusterError, match="before its worker joined"):
        jobs.check(client=None)


def test_a_squeue_that_does_not_answer_is_killed(fake_slurm, monkeypatch):
    """SlurmReplacer asks squeue about replacement jobs; one that hangs (a controller that
    does not answer) was left running at every 30 s timeout, one more each time."""
    from laminar.deploy import Replacements, SlurmReplacer

    monkeypatch.setenv("FAKE_SQUEUE_HANG", "1")
    replacer = object.__new__(SlurmReplacer)
    replacer.core = Replacements({"rollout-0": "7"})
    replacer.core.slots["rollout-0"].jobs = 2  # a replacement job whose worker has not joined
    replacer._asked = -float("inf")
    replacer.squeue_timeout_s = 0.5
    assert asyncio.run(replacer._ended_jobs()) == set()
    pid = int((fake_slurm / "squeue.pid").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = Path(f"/proc/{pid}").exists()
    if alive:
        os.kill(pid, signal.SIGKILL)  # (the test's own leftover)
    assert not alive, f"squeue {pid} still running"


def test_a_stale_scheduler_file_is_named_with_its_age(tmp_path):
    from laminar.deploy import _stale_hint

    f = tmp_path / "scheduler.json"
    f.write_text('{"address": "tcp://127.0.0.1:1"}')
    os.utime(f, (time.time() - 3600, time.time() - 3600))
    assert "written 3600 s ago" in _stale_hint(str(f)) and f"rm {f}" in _stale_hint(str(f))
    assert _stale_hint(str(tmp_path / "none.json")) == "" and _stale_hint(None) == ""


def _fake_dask(tmp_path: Path, body: str) -> dict:
    """An environment whose `dask` records its arguments (tmp_path/dask.args), then runs
    ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dask = bin_dir / "dask"
    dask.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/dask.args\n{body}\n')
    dask.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_the_scheduler_job_removes_its_file_as_it_starts_and_ends(tmp_path):
    """`dask scheduler` leaves its file behind: after `scancel --name laminar-scheduler`,
    the docs' recipe again found the old file at once, and laminar and the workers went
    to an address nobody listens on. The job removes it before starting and at its end
    (SIGTERM, as scancel or the walltime sends it)."""
    sched = tmp_path / "scheduler.json"
    sched.write_text('{"address": "tcp://127.0.0.1:1"}')  # an ended scheduler's
    body = (
        f'[ -e "{sched}" ] && echo stale > {tmp_path}/seen\n'
        f'echo \'{{"address": "tcp://127.0.0.1:2"}}\' > {sched}\n'
        "exec sleep 600"
    )
    env = _fake_dask(tmp_path, body)
    proc = subprocess.Popen(["bash", str(SCRIPTS / "scheduler.sbatch"), str(sched)], env=env)
    try:
        deadline = time.monotonic() + 20
        while "127.0.0.1:2" not in (sched.read_text() if sched.exists() else ""):
            assert time.monotonic() < deadline, "the scheduler never wrote its file"
            time.sleep(0.05)
        assert not (tmp_path / "seen").exists(), "dask scheduler started beside a stale file"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not sched.exists(), "the ended scheduler's file is still there"


def test_a_worker_job_gives_up_on_a_scheduler_it_cannot_reach(tmp_path):
    """worker.sbatch's worker retried a dead scheduler's address for as long as its job
    lasted, holding its node: it gets a --death-timeout, after the file is there."""
    sched = tmp_path / "scheduler.json"
    env = _fake_dask(tmp_path, "true")
    proc = subprocess.Popen(
        ["bash", str(SCRIPTS / "worker.sbatch"), str(sched), "rollout=1"], env=env
    )
    try:
        time.sleep(0.5)
        sched.write_text('{"address": "tcp://127.0.0.1:1"}')
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    args = (tmp_path / "dask.args").read_text().splitlines()
    assert args[0] == "worker" and args[args.index("--death-timeout") + 1] == "120", args


def test_slurm_keeps_ctrl_c_a_keyboard_interrupt():
    """Importing dask-jobqueue sets a SIGINT handler that raises SystemExit: `laminar
    run`'s Ctrl-C while the jobs queued exited 0 with no "interrupted" (the CLI catches
    KeyboardInterrupt). laminar imports it for cluster.kind=slurm and puts Python's back."""
    pytest.importorskip("dask_jobqueue")
    code = (
        "import signal, sys\n"
        "from laminar.config import RunConfig, with_overrides\n"
        "from laminar.deploy import slurm_cluster\n"
        "cfg = with_overrides(RunConfig(), ['cluster.kind=slurm', 'cluster.slurm.interface=no0'])\n"
        "try:\n"
        "    slurm_cluster(cfg, sys.argv[1])\n"
        "except Exception:\n"
        "    pass\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    import sys

    r = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "no-run")], capture_output=True, text=True
    )
    assert r.stdout.strip() == "True", r.stdout + r.stderr


def test_the_example_slurm_config_runs_its_scheduler_with_tls(fake_slurm, tmp_path, caplog):
    """configs/slurm.yaml (docs/deploy.md, path A) had no `security`: its scheduler listened
    on every interface in plaintext, and anyone who could reach the port could run code
    as the user (`client.run_on_scheduler(os.system, ...)`). It makes certificates for
    the run; every job's worker gets them."""
    import logging

    from laminar.config import load_config
    from laminar.deploy import security_for, slurm_cluster

    cfg = load_config(REPO / "configs" / "slurm.yaml")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="laminar.deploy"):
        cluster = slurm_cluster(cfg, run_dir, security_for(cfg.cluster, run_dir))
    try:
        assert cluster.scheduler.address.startswith("tls://"), cluster.scheduler.address
    finally:
        cluster.close(timeout=30)
    scripts = [p.read_text() for p in (fake_slurm / "scripts").glob("*.sh")]
    assert len(scripts) == 3
    assert all(f"--tls-ca-file {run_dir}/tls/ca.pem" in s for s in scripts), scripts
    assert "cluster.security" not in caplog.text


def test_a_slurm_cluster_without_tls_says_so(fake_slurm, tmp_path, caplog):
    """`cluster.kind: slurm` with no `cluster.security` starts a plaintext scheduler that
    anyone who reaches it can drive: a warning names the setting and the fix."""
    import logging

    with caplog.at_level(logging.WARNING, logger="laminar.deploy"):
        _submit_jobs(_slurm_cfg(), tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if "cluster.security" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "every interface" in said[0] and "{generate: true}" in said[0], said[0]


def test_a_replacement_racing_the_cluster_s_close_leaves_no_job_behind(
    fake_slurm, tmp_path, monkeypatch
):
    """Both rollouts' workers lost as the run ends: SlurmReplacer cancels rollout-0's job
    (a slow scancel) while the cluster closes. Its close failed on the job being cancelled
    (AssertionError: Status.running), and the replacer then submitted rollout-0.2 into a
    closed cluster, a job nobody cancelled. The close waits for that scancel and the
    replacer submits nothing more."""
    from laminar.deploy import SlurmReplacer, run_workers, slurm_cluster

    monkeypatch.setenv("FAKE_SCANCEL_SLOW", "1")
    cfg = _slurm_cfg()
    cluster = slurm_cluster(cfg, tmp_path / "run")
    replacer = SlurmReplacer(cluster, run_workers(cfg))
    replacer.core.step(0.0, connected={"rollout-0", "rollout-1"}, ended=set())  # joined
    tick = asyncio.run_coroutine_threadsafe(replacer._tick(), cluster.loop.asyncio_loop)
    deadline = time.monotonic() + 20
    while not (fake_slurm / "scancel.started").exists():  # the replacer's scancel
        assert time.monotonic() < deadline and not tick.done(), "no job was cancelled"
        time.sleep(0.02)
    cluster.close(timeout=60)
    tick.result(timeout=30)
    submitted, cancelled = _lines(fake_slurm / "submitted"), _lines(fake_slurm / "cancelled")
    assert len(submitted) >= 3 and set(submitted) <= set(cancelled), (submitted, cancelled)


def test_a_failing_job_prologue_line_ends_the_job_saying_which(fake_slurm, tmp_path):
    """docs/deploy.md: a `job_prologue` line that fails fails the run at once, quoting the
    job's log. The job script (bash, no -e) went on past a failed `module load` and
    started its worker in the wrong environment. It now stops at the line, with its exit
    status and a line in the job's log that names it; a comment, trailing or alone, is
    still a comment."""
    import json

    out = tmp_path / "started"
    out.mkdir()
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/bash\ntouch {out}/worker\n")
    python.chmod(0o755)
    bad = 'test -e "/no/such/it\'s"  # module load cuda'
    prologue = [
        "# the site's modules",
        "export LAMINAR_PROLOGUE=1  # fine",
        bad,
        f"touch {out}/after",
    ]
    cfg = _slurm_cfg(
        f"cluster.slurm.python={python}",
        "rollout.replicas=1",
        f"cluster.slurm.job_prologue={json.dumps(prologue)}",
    )
    scripts = _submit_jobs(cfg, tmp_path / "run")
    assert len(scripts) == 2
    for script in scripts.values():
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, (r.returncode, r.stderr, script)
        assert r.stderr.strip() == f"laminar: job_prologue line failed: {bad}", r.stderr
    assert list(out.iterdir()) == [], "the job went on past the line that failed"


def test_a_log_folder_that_cannot_be_made_names_the_setting(fake_slurm, tmp_path):
    """cluster.slurm.log_directory under a file (or where the user may not write) ended
    the run with a bare NotADirectoryError (PermissionError) from mkdir."""
    from laminar.deploy import slurm_cluster
    from laminar.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = _slurm_cfg(f"cluster.slurm.log_directory={blocker}/logs")
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.log_directory") as e:
        slurm_cluster(cfg, tmp_path / "run")
    assert f"{blocker}/logs" in str(e.value), e.value
    assert not (fake_slurm / "submitted").exists()


def test_a_job_that_can_never_start_fails_the_wait_at_once(tmp_path, monkeypatch):
    """A job that asks for more than its partition, association or QOS allows any job (a
    walltime over the partition's limit) stays PENDING for ever: the run waited out
    cluster.placement_timeout_s (600 s in configs/slurm.yaml) and then said only
    "PENDING (PartitionTimeLimit)". The wait fails at the first such squeue answer,
    naming the job and the setting; a reason that clears in time (nodes down, busy) waits."""
    import laminar.cluster
    from laminar.deploy import SlurmJobs

    workers = {"trainer": {"data": 1, "trainer": 1}, "rollout-0": {"rollout": 1}}
    cluster = SimpleNamespace(
        workers={n: SimpleNamespace(job_id=str(10 + i)) for i, n in enumerate(workers)}
    )
    jobs = SlurmJobs(cluster, workers, tmp_path)
    monkeypatch.setattr(laminar.cluster, "scheduler_workers", lambda client: {})
    states = {"10": ("PENDING", "Resources")}
    jobs.states = lambda: states
    for may_clear in ("Priority", "ReqNodeNotAvail, UnavailableNodes:n1", "PartitionNodeLimit"):
        states["11"] = ("PENDING", may_clear)
        jobs.check(client=None)
    for reason, setting in [
        ("PartitionTimeLimit", "cluster.slurm.walltime"),
        ("QOSMaxWallDurationPerJobLimit", "cluster.slurm.walltime"),
        ("AssocMaxMemPerJob", "cluster.slurm.rollout.memory"),
        # (a role's own setting first, the cluster's it falls back on beside it)
        ("InvalidAccount", "cluster.slurm.rollout.account, else cluster.slurm.account"),
        ("BadConstraints", "cluster.slurm.rollout.job_directives or cluster.slurm.job_directives"),
    ]:
        states["11"] = ("PENDING", reason)
        with pytest.raises(ClusterError) as e:
            jobs.check(client=None)
        said = str(e.value)
        assert "job 11 of worker rollout-0 (cluster.slurm.rollout) can never start" in said
        assert f"PENDING ({reason})" in said and setting in said, said


def test_a_relative_run_directory_gives_the_jobs_absolute_paths(fake_slurm, tmp_path, monkeypatch):
    """`open_cluster(cfg, "runs/x")` (docs/deploy.md's notebook) wrote "runs/x/slurm/..."
    and "runs/x/tls/..." into the job scripts: read from the job's working directory,
    which a `--chdir` of job_directives (or a prologue's `cd`) moves, they sent the logs
    elsewhere and left the workers without their certificates."""
    monkeypatch.chdir(tmp_path)
    scripts = _submit_jobs(_slurm_cfg("cluster.security.generate=true"), "runs/x")
    assert scripts
    for script in scripts.values():
        logs = [
            ln.split(None, 2)[2]
            for ln in script.splitlines()
            if ln[:10] in ("#SBATCH -e", "#SBATCH -o")
        ]
        assert logs == [
            f'"{tmp_path}/runs/x/slurm/laminar-x-%J.err"',
            f'"{tmp_path}/runs/x/slurm/laminar-x-%J.out"',
        ], script
        args = script.split()
        tls = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--tls-")}
        assert tls == {
            f"--tls-{k}": f"{tmp_path}/runs/x/tls/{f}"
            for k, f in [("ca-file", "ca.pem"), ("cert", "cert.pem"), ("key", "key.pem")]
        }, script


def test_slurm_workers_do_not_pause_for_memory(fake_slurm, tmp_path, monkeypatch):
    """A worker with no nanny still pauses at Dask's memory.pause (80%) of its
    --memory-limit, the job's memory, and a paused worker starts no task
    (distributed's WorkerState._ensure_computing) nor gets one: a rollout whose engine
    holds most of its job's memory would run none of the run's reward tasks. Its job
    turns pausing off, unless the user's Dask config sets it."""
    import dask

    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/bash\nenv > {tmp_path}/$$.env\n")
    python.chmod(0o755)
    scripts = _submit_jobs(_slurm_cfg(f"cluster.slurm.python={python}"), tmp_path / "run")
    for script in scripts.values():
        subprocess.run(["bash", "-c", script], check=True, timeout=30)
    envs = [
        dict(ln.split("=", 1) for ln in f.read_text().splitlines() if "=" in ln)
        for f in tmp_path.glob("*.env")
    ]
    assert len(envs) == 3
    for env in envs:
        config = dask.config.collect(paths=[], env=env)
        memory = config.get("distributed", {}).get("worker", {}).get("memory", {})
        assert memory.get("pause") is False, env

    for f in (fake_slurm / "scripts").iterdir():
        f.unlink()
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE", "0.9")  # the user's
    scripts = _submit_jobs(_slurm_cfg(), tmp_path / "run2")
    assert scripts and not any("MEMORY__PAUSE" in s for s in scripts.values())


def _jobs_and_a_replacement(cfg, run_dir) -> dict[str, str]:
    """The job scripts laminar submits for ``cfg``, and the one that replaces rollout-0's
    when its worker, having joined, is lost: worker name -> script."""
    from laminar.deploy import SlurmReplacer, run_workers, slurm_cluster

    fake = Path(os.environ["PATH"].split(os.pathsep)[0]).parent
    cluster = slurm_cluster(cfg, run_dir)
    try:
        replacer = SlurmReplacer(cluster, run_workers(cfg))
        replacer.core.step(0.0, connected={"rollout-0"}, ended=set())  # it joined
        asyncio.run_coroutine_threadsafe(replacer._tick(), cluster.loop.asyncio_loop).result(30)
    finally:
        cluster.close(timeout=30)
    scripts = [p.read_text() for p in (fake / "scripts").glob("*.sh")]
    jobs = {s.split("--name ", 1)[1].split()[0]: s for s in scripts}
    assert sorted(jobs) == ["data-trainer", "rollout-0", "rollout-0.2", "rollout-1"], jobs
    return jobs


def test_each_role_s_jobs_run_where_its_section_says_a_replaced_job_too(fake_slurm, tmp_path):
    """GPUs in a partition (or on an account) of their own: cluster.slurm's partition,
    account and job_directives were every job's, so rollouts on GPU nodes and a trainer
    on CPU nodes could not be asked for. A role's own partition and account replace the
    cluster's for its jobs, its job_directives follow the cluster's; the job that
    replaces a lost worker's asks for the same."""
    import json

    cfg = _slurm_cfg(
        "cluster.slurm.partition=cpu",
        "cluster.slurm.account=main",
        'cluster.slurm.job_directives=["--constraint=x86"]',
        "cluster.slurm.rollout.partition=gpu",
        "cluster.slurm.rollout.account=gpu-hours",
        "cluster.slurm.rollout.gpus=1",
        "cluster.slurm.rollout.job_directives="
        + json.dumps(["--gres-flags=enforce-binding", '--comment="rollout job"']),
    )
    jobs = {
        name: [
            ln[8:]
            for ln in script.splitlines()
            if ln.startswith("#SBATCH ") and not ln.startswith(("#SBATCH -e ", "#SBATCH -o "))
        ]
        for name, script in _jobs_and_a_replacement(cfg, tmp_path / "run").items()
    }
    common = ["-n 1", "--cpus-per-task=1", "--mem=4G", "-t 01:00:00", "--constraint=x86"]
    assert jobs["data-trainer"] == ["-J laminar-run", "-p cpu", "-A main", *common], jobs
    for name in ("rollout-0", "rollout-1", "rollout-0.2"):
        assert jobs[name] == [
            "-J laminar-run",
            "-p gpu",
            "-A gpu-hours",
            *common,
            "--gres-flags=enforce-binding",
            '--comment="rollout job"',
            "--gres=gpu:1",
        ], (name, jobs)


def test_each_role_s_job_computes_on_its_own_threads_a_replaced_job_too(fake_slurm, tmp_path):
    """Every job exported OMP_NUM_THREADS=cluster.torch_threads (1) and its actors set
    torch to that: a trainer job of 16 cores trained on one thread, and a larger
    torch_threads oversubscribed the 1-core rollout jobs. A job's threads are its role's
    torch_threads, or its cores; its actors read them from the job's environment
    (laminar.cluster.actor_threads), whatever cluster.torch_threads says."""
    import sys

    out = tmp_path / "started"
    out.mkdir()
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    probe = (
        "import os, sys; from laminar.cluster import actor_threads; "
        "from laminar.config import RunConfig, with_overrides; "
        "cfg = with_overrides(RunConfig(), ['cluster.torch_threads=3']); "
        "print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'], actor_threads(cfg))"
    )
    python.write_text(
        f'#!/bin/bash\nname=$(printf "%s\\n" "$@" | grep -A1 -x -- --name | tail -1)\n'
        f'{sys.executable} -c "{probe}" > {out}/$name\n'
    )
    python.chmod(0o755)
    cfg = _slurm_cfg(
        f"cluster.slurm.python={python}",
        "cluster.torch_threads=3",
        "cluster.slurm.trainer.cores=16",
        "cluster.slurm.rollout.cores=8",
        "cluster.slurm.rollout.torch_threads=2",
    )
    for script in _jobs_and_a_replacement(cfg, tmp_path / "run").values():
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.stderr, script)
    threads = {f.name: f.read_text().split() for f in out.iterdir()}
    assert threads == {
        "data-trainer": ["16", "16", "16"],
        "rollout-0": ["2", "2", "2"],
        "rollout-1": ["2", "2", "2"],
        "rollout-0.2": ["2", "2", "2"],
    }, threads


@pytest.mark.parametrize("refuse", ["#SBATCH", "rollout-1"], ids=["every_job", "one_job"])
def test_a_refused_submission_says_the_accepted_jobs_are_cancelled_only_when_some_were(
    fake_slurm, tmp_path, monkeypatch, refuse
):
    """sbatch refusing every job still said "the jobs it had accepted are cancelled"
    (helper 188); refusing one, it says so, and they are."""
    from laminar.deploy import open_cluster

    monkeypatch.setenv("FAKE_SBATCH_REFUSE", refuse)
    with pytest.raises(ClusterError, match="invalid partition specified") as e:
        with open_cluster(_slurm_cfg("cluster.placement_timeout_s=0"), tmp_path / "run"):
            pass
    submitted = _lines(fake_slurm / "submitted")
    if refuse == "#SBATCH":
        assert submitted == [] and "accepted" not in str(e.value)
    else:
        assert len(submitted) == 2 and "the jobs it had accepted are cancelled" in str(e.value)
        assert set(submitted) <= set(_lines(fake_slurm / "cancelled"))
