"""TLS for a run's cluster: :func:`generate_tls` writes a new CA, certificate and key
(``laminar certs DIR``, ``cluster.security.generate``); :func:`security_for` makes the
run's :class:`distributed.Security` of ``cluster.security``.

Apart from :mod:`laminar.deploy` because the files and their checks are the same
whichever kind of cluster opens.
"""

from __future__ import annotations

from pathlib import Path

from laminar.config import ClusterConfig
from laminar.errors import ConfigError

# The file names of `cluster.security.generate` and of `laminar certs DIR`.
TLS_FILES = {"ca_file": "ca.pem", "cert": "cert.pem", "key": "key.pem"}


def generate_tls(directory: str | Path) -> dict[str, str]:
    """Write a new self-signed CA, certificate and key (one for every role) to
    ``directory`` (``ca.pem``, ``cert.pem``, ``key.pem``; the key readable by its owner
    only) and return their paths as ``cluster.security`` fields."""
    from distributed.security import Security

    try:
        made = Security.temporary()
    except ImportError as e:  # pragma: no cover - cryptography is a dependency
        raise ConfigError(
            "cluster.security.generate needs the `cryptography` package; pip install "
            "cryptography, or give certificate files"
        ) from e
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    contents = {
        "ca_file": made.tls_ca_file,
        "cert": made.tls_client_cert,
        "key": made.tls_client_key,
    }
    paths = {}
    for field, name in TLS_FILES.items():
        path = directory / name
        mode = 0o600 if field == "key" else 0o644
        path.touch(mode=mode)
        path.chmod(mode)  # (touch leaves an existing file's mode: a 0644 key.pem stayed so)
        path.write_text(contents[field])
        paths[field] = str(path)
    return paths


def security_for(cfg: ClusterConfig, run_dir: str | Path | None):
    """The run's :class:`distributed.Security`, or ``None`` without ``cluster.security``.

    ``generate: true`` writes new certificates to ``RUN_DIR/tls`` (so a second client, a
    notebook say, can join the run's cluster with them).
    """
    from distributed.security import Security

    tls = cfg.security
    if tls is None:
        return None
    if tls.generate:
        if run_dir is None:
            raise ConfigError("cluster.security.generate needs a run directory to hold them")
        paths = generate_tls(Path(run_dir) / "tls")
    else:
        paths = {"ca_file": tls.ca_file, "cert": tls.cert, "key": tls.key}
        for field, path in paths.items():
            if not Path(path).expanduser().is_file():
                raise ConfigError(
                    f"cluster.security.{field}: no file at {path!r}; give the path of a "
                    "PEM file, or generate: true (`laminar certs DIR` writes a set)"
                )
        paths = {k: str(Path(v).expanduser()) for k, v in paths.items()}
        check_tls_files(paths)
    ca, cert, key = paths["ca_file"], paths["cert"], paths["key"]
    return Security(
        tls_ca_file=ca,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


_FIX = "(`laminar certs DIR` writes a matching set)"


def check_tls_files(paths: dict[str, str]) -> None:
    """Refuse ``cluster.security``'s files as Dask would use them, naming the field: each
    readable, PEM of the right kind (a certificate, an unencrypted key), the key the
    certificate's, and the certificate issued by the CA.

    Dask loads them only as the scheduler starts or the client connects, and says
    ``[SSL] PEM lib`` or ``TLS certificate does not match`` without naming a file; a
    Slurm run would have submitted its jobs by then.
    """
    import ssl

    text = {}
    for field, path in paths.items():
        try:
            text[field] = Path(path).read_text(errors="replace")
        except OSError as e:  # (no permission: the workers read it too, as the same user)
            raise ConfigError(
                f"cluster.security.{field}: cannot read {path!r} ({e.strerror or e}); make "
                "it readable by the user that runs laminar and its workers"
            ) from None
    cert_in_key, key_in_cert = "CERTIFICATE-----" in text["key"], "PRIVATE KEY-----" in text["cert"]
    if cert_in_key and key_in_cert and "CERTIFICATE-----" not in text["cert"]:
        raise ConfigError(
            f"cluster.security.cert ({paths['cert']!r}) holds a private key and "
            f"cluster.security.key ({paths['key']!r}) a certificate: swap the two"
        )
    for field in ("ca_file", "cert"):
        if "-----BEGIN CERTIFICATE-----" not in text[field]:
            held = "a private key" if "PRIVATE KEY-----" in text[field] else _held(text[field])
            raise ConfigError(
                f"cluster.security.{field}: {paths[field]!r} holds {held}, not a PEM "
                "certificate (a -----BEGIN CERTIFICATE----- block); give the "
                f"{'CA' if field == 'ca_file' else 'certificate'}'s PEM file {_FIX}"
            )
    if "ENCRYPTED" in text["key"]:
        raise ConfigError(
            f"cluster.security.key: {paths['key']!r} is encrypted, and Dask's workers "
            "cannot ask for its passphrase; give an unencrypted key (`openssl pkey -in "
            "KEY -out NEW`, kept readable by you only) " + _FIX
        )
    if "PRIVATE KEY-----" not in text["key"]:
        held = "a certificate" if cert_in_key else _held(text["key"])
        raise ConfigError(
            f"cluster.security.key: {paths['key']!r} holds {held}, not a PEM private key "
            f"(a -----BEGIN PRIVATE KEY----- block); give the certificate's key {_FIX}"
        )

    def no_passphrase():  # (OpenSSL would ask for one on the terminal)
        raise ValueError("the key is encrypted")

    try:
        context = ssl.create_default_context(cafile=paths["ca_file"])
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(
            f"cluster.security.ca_file: {paths['ca_file']!r} is no CA certificate Python's "
            f"ssl can load ({e}); give the CA's PEM file {_FIX}"
        ) from None
    try:
        context.load_cert_chain(paths["cert"], paths["key"], password=no_passphrase)
    except (ssl.SSLError, ValueError) as e:
        if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":
            what = "is not the key of the certificate cluster.security.cert"
        else:
            what = "and cluster.security.cert do not load as a certificate and its key"
        raise ConfigError(
            f"cluster.security.key: {paths['key']!r} {what} ({paths['cert']!r}: {e}); give "
            f"the key the certificate was made with {_FIX}"
        ) from None
    issuer = _not_issued_by(paths["cert"], paths["ca_file"])
    if issuer is not None:
        raise ConfigError(
            f"cluster.security.ca_file: the certificate cluster.security.cert "
            f"({paths['cert']!r}, issued by {issuer}) is not signed by the CA in "
            f"{paths['ca_file']!r}, so no process of the cluster would trust another; give "
            f"the CA that signed it, or a certificate and key that CA signed {_FIX}"
        )


def _held(text: str) -> str:
    """What a file that is not the PEM it should be holds, in a few words."""
    if not text.strip():
        return "nothing (it is empty)"
    first = text.strip().splitlines()[0]
    return f"{first[:40] + ('...' if len(first) > 40 else '')!r} and so on"


def _not_issued_by(cert_path: str, ca_path: str) -> str | None:
    """The issuer of the certificate if no CA certificate of ``ca_path`` signed it (also
    through intermediates given after it in ``cert_path``), else ``None``; ``None`` too
    where the `cryptography` package cannot tell (absent, or a key type it cannot check:
    then the connection will)."""
    try:
        from cryptography import x509
    except ImportError:  # pragma: no cover - a dependency of laminar (and of generate)
        return None
    try:
        chain = x509.load_pem_x509_certificates(Path(cert_path).read_bytes())
        cas = x509.load_pem_x509_certificates(Path(ca_path).read_bytes())
    except ValueError:  # (ssl loaded them: a PEM cryptography cannot read is ssl's to judge)
        return None
    current, rest = chain[0], chain[1:]
    for _ in range(len(chain)):
        if any(_issued(current, ca) for ca in cas):
            return None
        up = next((c for c in rest if _issued(current, c)), None)
        if up is None:
            break
        current, rest = up, [c for c in rest if c is not up]
    unsure = [ca for ca in cas if _issued(current, ca) is None]
    return None if unsure else current.issuer.rfc4514_string() or "an unnamed issuer"


def _issued(cert, by) -> bool | None:
    """Whether ``by`` signed ``cert`` (None: cannot tell, a key type not checked here)."""
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(by)
    except (ValueError, InvalidSignature):
        return False
    except (TypeError, AttributeError):  # (an unsupported key type; cryptography < 40)
        return None
    return True


def _protocol(cfg: ClusterConfig) -> str:
    return "tls" if cfg.security is not None else cfg.protocol
