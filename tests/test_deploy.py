"""Deployment without Slurm: cluster configs, TLS, and runs that cannot be placed.

The Slurm paths are in test_slurm.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import SMALL_RUN
from runs import check_store, cli_run, laminar_cli

from laminar.config import RunConfig, with_overrides
from laminar.deploy import generate_tls, role_needs, run_workers, security_for, wait_for_roles
from laminar.errors import ClusterError, ConfigError


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.kind=address"], "needs cluster.address"),
        (["cluster.address=tcp://h:8786"], "set cluster.kind=address"),
        (
            ["cluster.kind=address", "cluster.address=tcp://h:1", "cluster.scheduler_file=f"],
            "both set",
        ),
        (["cluster.protocol=tls"], "protocol=tls needs cluster.security"),
        (["cluster.security.cert=c.pem"], r"missing: \['ca_file', 'key'\]"),
        (
            ["cluster.security.generate=true", "cluster.security.key=k.pem"],
            "drop one or the other",
        ),
        (["cluster.security.generate=true", "cluster.protocol=ucx"], "don't combine"),
        (["cluster.kind=yarn"], "cluster.kind"),
    ],
)
def test_cluster_config_errors_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), overrides)


def test_role_needs_follow_the_config():
    cfg = with_overrides(RunConfig(), ["rollout.replicas=3", "relay.relays=2", "trainer.ranks=2"])
    assert role_needs(cfg) == {"data": 1, "trainer": 2, "rollout": 3, "relay": 2}
    apart = with_overrides(cfg, ["cluster.data_apart=true"])
    assert run_workers(apart)["data"] == {"data": 1}  # a worker (a Slurm job) of its own
    assert run_workers(apart)["trainer"] == {"trainer": 1}
    assert role_needs(apart) == role_needs(cfg)


def test_new_certificates_keep_an_existing_key_file_private(tmp_path):
    """`laminar certs DIR` again, over a key.pem someone made readable: the new key is
    written 0600 all the same (docs/deploy.md: the key readable by you only)."""
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "key.pem").write_text("old")
    (tmp_path / "tls" / "key.pem").chmod(0o644)
    generate_tls(tmp_path / "tls")
    assert oct((tmp_path / "tls" / "key.pem").stat().st_mode & 0o777) == "0o600"


def test_certs_does_not_replace_a_set_in_use_unless_forced(tmp_path, capsys):
    """A scheduler started with the old CA would refuse every client given the new one:
    `laminar certs DIR` over an existing set refuses, naming the files, unless --force."""
    from pipelines.cli import main

    assert main(["certs", str(tmp_path / "tls")]) == 0
    ca = (tmp_path / "tls" / "ca.pem").read_text()
    assert main(["certs", str(tmp_path / "tls")]) == 2
    assert "already holds ca.pem, cert.pem, key.pem" in capsys.readouterr().err
    assert (tmp_path / "tls" / "ca.pem").read_text() == ca
    assert main(["certs", str(tmp_path / "tls"), "--force"]) == 0
    assert (tmp_path / "tls" / "ca.pem").read_text() != ca


def test_certificate_files_must_exist(tmp_path):
    paths = generate_tls(tmp_path / "tls")
    assert oct((tmp_path / "tls" / "key.pem").stat().st_mode & 0o777) == "0o600"
    cfg = with_overrides(
        RunConfig(),
        [f"cluster.security.{k}={v}" for k, v in {**paths, "cert": tmp_path / "no.pem"}.items()],
    )
    with pytest.raises(ConfigError, match=r"cluster.security.cert: no file at .*no.pem"):
        security_for(cfg.cluster, tmp_path)
    ok = with_overrides(RunConfig(), [f"cluster.security.{k}={v}" for k, v in paths.items()])
    sec = security_for(ok.cluster, tmp_path)
    assert sec.require_encryption and sec.tls_worker_cert == paths["cert"]


# Run as a separate client process: a Client refused in the test's own process leaves its
# IO-loop thread behind (distributed does not stop it), and on a loaded 2-core CI machine
# the next Client's loop then missed distributed's 10 s start-up wait.
_PLAINTEXT_CLIENTS = """
import sys
from distributed import Client

address = sys.argv[1]
attempts = [
    ("tcp", address.replace("tls://", "tcp://"), (OSError, TimeoutError)),
    ("tls-no-cert", address, (OSError, TimeoutError, TypeError)),  # no certificate to offer
]
for kind, to, refusals in attempts:  # any other error: a traceback and no line
    try:
        Client(to, timeout="3s")
    except refusals as e:
        print(kind, "refused", type(e).__name__, flush=True)
    else:
        print(kind, "CONNECTED", flush=True)
"""


@pytest.mark.slow
def test_a_tls_cluster_refuses_plaintext_clients(tmp_path):
    from distributed import Client

    from laminar.cluster import role_cluster

    cfg = with_overrides(RunConfig(), ["cluster.security.generate=true"])
    sec = security_for(cfg.cluster, tmp_path)
    with role_cluster({"w": {"rollout": 1}}, protocol="tls", security=sec) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://")
        # A plaintext client: to the same port over tcp, and over tls without certificates.
        # Plaintext: no TLS settings reach it from DASK_ variables of the test's environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        out = subprocess.run(
            [sys.executable, "-c", _PLAINTEXT_CLIENTS, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        refused = [line.split()[:2] for line in out.stdout.splitlines()]
        assert refused == [["tcp", "refused"], ["tls-no-cert", "refused"]], out.stdout + out.stderr
        with Client(address, security=sec, timeout="10s") as client:
            assert client.submit(sum, [1, 2]).result(timeout=10) == 3


@pytest.mark.slow
def test_a_run_on_a_tls_cluster(tmp_path):
    """Every connection of the run over TLS, with certificates made for it: the relay
    chain's bulk sends too, which open connections of their own (``relay.sender``)."""
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL_RUN,
        # (the warm start on one torch thread: on two, beside other work on a 2-core
        # machine, it took 5-10 times as long; not in its cache key)
        "sft.torch_threads=1",
        "cluster.security.generate=true",
        "relay.relays=1",
        "relay.audit_weights=true",
    ]
    out, summary = cli_run(run_dir, overrides)
    assert "scheduler          tls://" in out
    assert summary["reason"] == "completed"
    relay = summary["relay"]
    assert [r["sender"] for r in relay["relays"]] == ["thread", None]
    assert relay["fingerprints"]["mismatched"] == 0 and relay["fingerprints"]["loads_checked"]
    assert {p.name for p in (run_dir / "tls").iterdir()} == {"ca.pem", "cert.pem", "key.pem"}
    check_store(run_dir, expect_consumed_groups=4 * 4)


@pytest.mark.parametrize("apart", [False, True])
def test_the_placement_advice_starts_the_data_module_beside_trainer_rank_0(monkeypatch, apart):
    """A cluster of rollout workers alone: the advice was a `data=1` worker and a
    `trainer=1` one, where docs/deploy.md (and README) start one `data=1,trainer=1`
    worker; now that, and the two workers of cluster.data_apart beside it. The trainer's
    line counts rank 0 in the shared worker; extra ranks are `trainer=1` workers."""
    from laminar.deploy_placement import role_needs, wait_for_roles
    from laminar.errors import ClusterError

    monkeypatch.setattr(
        "laminar.deploy_placement.workers_with",
        lambda client, role: ["r0", "r1"] if role == "rollout" else [],
    )
    for ranks, trainer_line in [
        (1, "the data=1,trainer=1 worker above is it"),
        (
            3,
            "start 2 more with `dask worker ADDRESS --resources trainer=1` besides the "
            "data=1,trainer=1 one above (or lower trainer.ranks)",
        ),
    ]:
        cfg = with_overrides(
            RunConfig(),
            ["rollout.replicas=2", f"trainer.ranks={ranks}", f"cluster.data_apart={apart}"],
        )
        with pytest.raises(ClusterError) as e:
            wait_for_roles(None, role_needs(cfg), timeout_s=0)
        data, trainer = str(e.value).splitlines()[1:]
        assert "start one `dask worker ADDRESS --resources data=1,trainer=1`" in data, data
        assert "(with cluster.data_apart: true, a `--resources data=1` worker and a " in data
        assert trainer.endswith(trainer_line), trainer


def test_a_cluster_without_a_role_fails_fast_naming_it(tmp_path, caplog, monkeypatch):
    """... and says it waits: at INFO first (jobs just submitted, workers starting: a
    wait, not a problem; it was a warning at once, on every Slurm start: helper 188),
    a warning once the wait is past QUIET_WAIT_S."""
    import logging

    from distributed import Client, LocalCluster

    from laminar import deploy_placement

    monkeypatch.setattr(deploy_placement, "QUIET_WAIT_S", 0.5)
    caplog.set_level(logging.INFO, logger="laminar.deploy")
    cfg = with_overrides(RunConfig(), ["rollout.replicas=2"])
    with (
        LocalCluster(
            n_workers=1,
            processes=False,
            resources={"data": 1, "trainer": 1},
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as e:
            wait_for_roles(client, role_needs(cfg), timeout_s=1.0, poll_s=0.1)
        assert 1.0 <= time.monotonic() - t0 < 5
        message = str(e.value)
        assert "rollout: 0 worker(s) with resource 'rollout', the run needs 2" in message
        assert "--resources rollout=1" in message and "trainer" not in message.split("\n", 1)[1]
    said = [r.levelno for r in caplog.records if "waiting for workers: rollout 0/2" in r.message]
    assert said == [logging.INFO, logging.WARNING]


@pytest.mark.slow
def test_the_cli_reports_an_unplaceable_run_and_exits(tmp_path):
    """`laminar run --scheduler ADDR` on a cluster with no rollout workers: exit 2 and a
    message that names the role, after cluster.placement_timeout_s, not a hang."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1,
        processes=False,
        resources={"data": 1, "trainer": 1},
        dashboard_address=":0",
        protocol="tcp",
        host="127.0.0.1",
    ) as cluster:
        proc = laminar_cli(
            "run",
            "configs/tiny.yaml",
            "--scheduler",
            cluster.scheduler_address,
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "cluster.placement_timeout_s=2",
        )
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "cannot place this run" in out and "rollout: 0 worker(s)" in out


def test_a_missing_scheduler_file_says_how_to_start_one(tmp_path):
    from laminar.deploy import open_cluster

    missing = tmp_path / "scheduler.json"
    cfg = with_overrides(
        RunConfig(),
        [
            "cluster.kind=address",
            f"cluster.scheduler_file={missing}",
            "cluster.placement_timeout_s=0",
        ],
    )
    with pytest.raises(ClusterError, match=r"dask scheduler --scheduler-file .*scheduler.json"):
        with open_cluster(cfg, tmp_path):
            pass


def test_a_wrong_slurm_interface_names_the_field(tmp_path):
    """The scheduler of `cluster.kind: slurm` starts in this process: an interface it does
    not have is a config error naming `cluster.slurm.interface`, before any job."""
    pytest.importorskip("dask_jobqueue")
    from laminar.deploy import open_cluster

    cfg = with_overrides(RunConfig(), ["cluster.kind=slurm", "cluster.slurm.interface=no-such-if0"])
    with pytest.raises(ConfigError, match=r"cluster.slurm.interface='no-such-if0': .*not a valid"):
        with open_cluster(cfg, tmp_path / "run"):
            pass


def test_the_docs_name_every_slurm_job_section():
    """docs/deploy.md, path A, lists the per-role job sections of `cluster.slurm`: all of
    them (`data` is the one a user of `cluster.data_apart` needs)."""
    from pathlib import Path

    from laminar.config import SlurmConfig, SlurmRole

    text = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
    sections = [n for n, f in SlurmConfig.model_fields.items() if f.annotation is SlurmRole]
    assert sections and "`cluster.slurm.trainer`" in text
    assert [s for s in sections if s != "trainer" and f"`.{s}`" not in text] == []
