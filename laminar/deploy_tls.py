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


def _protocol(cfg: ClusterConfig) -> str:
    return "tls" if cfg.security is not None else cfg.protocol
