"""The run config's cluster sections: how the Dask cluster is found or started.

:class:`ClusterConfig` (local, a running scheduler, or Slurm; protocol, timeouts, worker
memory), :class:`TLSConfig` and :class:`SlurmConfig` with one :class:`SlurmRole` per
worker role. Memory sizes and walltimes are checked here as Dask and sbatch would read
them, so a bad one is refused before a run directory is made.

Apart from the role sections (:mod:`laminar.config_sections`): these describe the
deployment, not the training, and carry their own parsing of sizes and times. Import
them from :mod:`laminar.config`, which re-exports every one.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from laminar.config_sections import _Section


class TLSConfig(_Section):
    """TLS for every Dask connection of the run (docs/deploy.md, "Security"): the
    scheduler's, the workers' and the client's, the relays' weights included. Not the
    trainer ranks' gloo group (``trainer.ranks`` > 1), which talks plain TCP.

    Either the three files (one CA, one certificate and key used by the scheduler, the
    workers and the client), or ``generate: true`` for certificates made for this run only
    (written to ``RUN_DIR/tls``). With TLS on, the cluster refuses plaintext connections.
    """

    ca_file: str | None = None
    cert: str | None = None
    key: str | None = None
    generate: bool = False

    @model_validator(mode="after")
    def _files_or_generate(self) -> TLSConfig:
        files = {"ca_file": self.ca_file, "cert": self.cert, "key": self.key}
        given = [k for k, v in files.items() if v]
        if self.generate and given:
            raise ValueError(
                f"cluster.security: generate=true makes new certificates, but {given} "
                "are set too; drop one or the other"
            )
        if not self.generate and len(given) != 3:
            missing = [k for k in files if k not in given]
            raise ValueError(
                f"cluster.security needs ca_file, cert and key (missing: {missing}), "
                "or generate: true for certificates made for this run"
            )
        return self


MIN_JOB_MEMORY = 256 * 2**20  # a Dask worker process alone takes ~150-200 MB


# What an #SBATCH line cannot hold: a line break ends the line, and the rest of the
# value would run as a command of the job script (dask-jobqueue writes the values bare).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _sbatch_name(value: Any) -> Any:
    """A partition or account as dask-jobqueue writes it (``#SBATCH -p NAME``): one word.
    A blank would end it there (sbatch reads the rest as another argument), a ``#`` end
    the line, a quote be taken off, a line break run the rest as a command of the job."""
    if not isinstance(value, str):
        return value  # (None, or pydantic says it takes a string)
    text = value.strip()
    if not text or re.search(r"[\s\"'#\\]", text) or _CONTROL.search(text):
        raise ValueError(
            "is not a name sbatch reads: give one word with no blank, quote, "
            "# or backslash (e.g. gpu; several partitions: gpu,gpu-long), or null"
        )
    return text


def _sbatch_directives(value: Any) -> Any:
    """``job_directives``: each one ``#SBATCH`` line of sbatch options, as sbatch reads
    it (quotes ' and " group, a backslash escapes, an unquoted ``#`` starts a comment)."""
    if not isinstance(value, list):
        return value  # (pydantic says it takes a list)
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            out.append(item)  # (pydantic says it takes a string)
            continue
        text = item.strip()
        if _CONTROL.search(text):
            raise ValueError(
                f"[{i}] {item!r} has a line break or control character: each entry is one "
                "#SBATCH line (the rest would run as a command of the job script); give "
                "each option an entry of its own"
            )
        if not text.startswith("-"):
            raise ValueError(
                f"[{i}] {item!r} is no sbatch option: give it as on sbatch's command line, "
                "without #SBATCH (laminar writes that), e.g. --constraint=a100"
            )
        quote = _unmatched_quote(text)
        if quote is not None:
            raise ValueError(
                f"[{i}] {item!r} has an unmatched {quote} (sbatch refuses the job script): "
                "close it, or escape it with a backslash"
            )
        taken = _laminar_s_option(text)
        if taken is not None:
            raise ValueError(f"[{i}] {item!r}: {taken}; remove it from job_directives")
        out.append(text)
    return out


# sbatch options a job of laminar's cannot take: squeue and scancel, the placement wait
# and the replacer know a job by its id on the default cluster, the placement wait quotes
# the log laminar names, and dask-jobqueue reads the id sbatch prints at once.
_MOVES_THE_LOG = "moves the job's log from where laminar reads it (cluster.slurm.log_directory)"
_LAMINAR_S = {
    "clusters": (
        "M",
        "sends the job to another cluster, where laminar's squeue and scancel "
        "(on this one) do not find it",
    ),
    "array": ("a", "makes several jobs of one worker's, which laminar cannot tell apart"),
    "output": ("o", _MOVES_THE_LOG),
    "error": ("e", _MOVES_THE_LOG),
    "wait": ("W", "makes sbatch wait for the job to end before it answers"),
}


def _laminar_s_option(text: str) -> str | None:
    """Why the sbatch option ``text`` (one job_directives entry) is laminar's to set, or
    None. Long options as sbatch's getopt reads them (an unambiguous prefix counts:
    ``--out`` is ``--output``), short ones with or without their value attached."""
    first = text.split()[0] if text.split() else ""
    if first.startswith("--"):
        name = first[2:].split("=", 1)[0]
        for long, (short, why) in _LAMINAR_S.items():
            if name and long.startswith(name) and len(name) >= 2:
                return f"--{long} (-{short}) {why}"
    elif first.startswith("-") and len(first) >= 2:
        for long, (short, why) in _LAMINAR_S.items():
            if first[1] == short:
                return f"-{short} (--{long}) {why}"
    return None


def gpu_directive(directives: list[str]) -> str | None:
    """The first of ``directives`` (job_directives entries) that asks Slurm for GPUs
    (``--gres=gpu:1``, ``--gpus=1``, ``--gpus-per-node``, ``-G 1``), or None."""
    for text in directives:
        first = text.split()[0] if text.split() else ""
        if first.startswith(("--gres", "--tres")) and "gpu" in text:
            return text
        if first.startswith("--gpus") or first.startswith("-G"):
            return text
    return None


def _unmatched_quote(line: str) -> str | None:
    """The quote left open in ``line``, read as sbatch reads an #SBATCH line, or None."""
    quote, escaped = None, False
    for ch in line:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote is not None:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            break  # (a comment: sbatch reads no further)
    return quote


class _JobPlace(_Section):
    """Where Slurm runs a job: its partition, account and extra ``#SBATCH`` lines, as
    sbatch reads them (:class:`SlurmConfig` for every job, :class:`SlurmRole` a role's)."""

    partition: str | None = None  # -p
    account: str | None = None  # -A
    job_directives: list[str] = []  # extra `#SBATCH` lines, e.g. "--constraint=a100"

    @field_validator("partition", "account", mode="before")
    @classmethod
    def _one_word(cls, value: Any) -> Any:
        return _sbatch_name(value)

    @field_validator("job_directives", mode="before")
    @classmethod
    def _sbatch_lines(cls, value: Any) -> Any:
        return _sbatch_directives(value)


class SlurmRole(_JobPlace):
    """One Slurm job per worker of a role: what it asks for, and where it runs. Its
    ``partition`` and ``account``, null, are ``cluster.slurm``'s (GPUs in a partition, or
    an account, of their own); its ``job_directives`` follow ``cluster.slurm``'s."""

    cores: int = Field(1, gt=0)  # --cpus-per-task
    memory: str = "4GB"  # --mem and the worker's memory limit (4GB, 500MB, 16GiB)
    gpus: int = Field(0, ge=0)  # --gres=gpu:N
    # Torch (and OpenMP, MKL, OpenBLAS) threads of the job's worker; null: its cores.
    torch_threads: int | None = Field(None, gt=0)

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_a_job_holds(cls, value: Any) -> Any:
        # dask-jobqueue reads it with dask's parse_bytes (a bare number is bytes) when
        # the jobs are made: checked here instead, before the run directory is made.
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # (YAML reads 4.0e+9 as a float)
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            return value  # (pydantic says it takes a string)
        from dask.utils import parse_bytes

        text = value.strip()
        try:
            size = parse_bytes(text) if text[:1].isdigit() else None
        except ValueError:
            size = None
        if size is None:
            raise ValueError("is not a memory size; give one with its unit, e.g. 4GB or 16GiB")
        if size < MIN_JOB_MEMORY:
            raise ValueError(
                f"is {size:,} bytes, too little for a Dask worker (a bare number counts "
                f"bytes); give at least {MIN_JOB_MEMORY // 2**20} MiB with a unit, e.g. 4GB"
            )
        return text


class SlurmConfig(_JobPlace):
    """dask-jobqueue ``SLURMCluster``: one job per worker, each with its role resources
    (``partition``, ``account``, ``job_directives``: every job's, :class:`_JobPlace`)."""

    # -t, as sbatch takes it: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or unlimited
    walltime: str = "01:00:00"
    # Shell lines run before the worker starts (modules, a virtual environment).
    job_prologue: list[str] = []
    python: str | None = None  # interpreter on compute nodes; default: this one
    interface: str | None = None  # network interface of workers and scheduler (e.g. ib0)
    log_directory: str | None = None  # default: RUN_DIR/slurm
    trainer: SlurmRole = SlurmRole()  # the trainer job also holds the data module ...
    rollout: SlurmRole = SlurmRole()
    relay: SlurmRole = SlurmRole()
    data: SlurmRole = SlurmRole()  # ... unless cluster.data_apart: then it has this job

    @field_validator("walltime", mode="before")
    @classmethod
    def _walltime_sbatch_takes(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # bare minutes, as sbatch reads them
        if isinstance(value, str) and not _WALLTIME.fullmatch(value.strip()):
            raise ValueError(
                "is no time sbatch takes; give minutes (90), H:M:S (10:00:00), "
                "D-H:M:S (2-00:00:00) or unlimited"
            )
        return value.strip() if isinstance(value, str) else value


_WALLTIME = re.compile(r"\d+(-\d+(:\d+){0,2}|(:\d+){0,2})|(?i:unlimited|infinite)")


def walltime_minutes(text: str) -> float | None:
    """``cluster.slurm.walltime`` in minutes, as sbatch reads it (90: minutes; 1:00:
    minutes and seconds; 1:00:00: hours; 2-12: days and hours), or None for unlimited."""
    text = text.strip()
    if not _WALLTIME.fullmatch(text) or text.lower() in ("unlimited", "infinite"):
        return None
    days, dash, rest = text.partition("-")
    if not dash:
        days, rest = "0", text
    parts = [int(p) for p in rest.split(":")]
    if dash:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # H:M:S
        h, m, sec = parts
    else:  # M, M:S
        h, m, sec = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
    return int(days) * 1440 + h * 60 + m + sec / 60


def walltime_problem(cluster: ClusterConfig) -> str | None:
    """Why the jobs laminar would submit are too short for their run, said as a fix, or
    None: the run stops in order ``stop_before_walltime_s`` before their walltime
    (:mod:`laminar.deploy_walltime`), so with no more than that it would stop as soon
    as it started."""
    if cluster.kind != "slurm" or cluster.stop_before_walltime_s <= 0:
        return None
    s = cluster.slurm
    minutes = walltime_minutes(s.walltime)
    if minutes is None or minutes * 60 > cluster.stop_before_walltime_s:
        return None
    return (
        f"cluster.slurm.walltime={s.walltime} ({minutes * 60:g} s) is no longer than "
        f"cluster.stop_before_walltime_s={cluster.stop_before_walltime_s:g}, before which the "
        "run stops in order: it would stop as soon as it started; give a longer walltime "
        "(H:M:S, e.g. 02:00:00) or a smaller cluster.stop_before_walltime_s (0: the run "
        "never stops for the walltime)"
    )


def vllm_gpu_problem(cluster: ClusterConfig, engine: str) -> str | None:
    """Why ``rollout.engine`` cannot generate in the rollouts' Slurm jobs, said as a fix,
    or None: vLLM needs a GPU, and a job that asks for none gets none (or, where the
    node does not hide the others, takes one of another job's)."""
    if engine != "vllm" or cluster.kind != "slurm":
        return None
    s = cluster.slurm
    if s.rollout.gpus > 0 or gpu_directive([*s.job_directives, *s.rollout.job_directives]):
        return None
    return (
        "rollout.engine=vllm generates on a GPU, but the rollouts' Slurm jobs ask for none "
        "(cluster.slurm.rollout.gpus is 0, and no --gres=gpu or --gpus among "
        "cluster.slurm.job_directives or cluster.slurm.rollout.job_directives): set "
        "cluster.slurm.rollout.gpus=1 (and the rollouts' partition: "
        "cluster.slurm.rollout.partition), or rollout.engine=torch"
    )


def _memory_limit_bytes(text: str) -> int | None:
    """What Dask's workers make of a ``memory_limit`` (``distributed``'s
    ``parse_memory_limit``), in bytes: ``None`` for no limit and for ``auto``; a
    :class:`ValueError` for what it cannot read."""
    from dask.utils import parse_bytes
    from distributed.system import MEMORY_LIMIT

    if text == "auto":
        return None
    try:
        number = float(text)
    except ValueError:  # not a number: a size with a unit
        if not text[:1].isdigit():
            raise
        return parse_bytes(text) or None
    if not math.isfinite(number) or number < 0:
        raise ValueError(text)
    if number == 0:
        return None
    return int(number * MEMORY_LIMIT) if number <= 1 else int(number)


SCHEDULER_SCHEMES = ("tcp", "tls", "ucx")
_HOST_PORT = re.compile(r"(\[[^\]/\s]+\]|[^:/\[\]\s]+):(\d{1,5})")


def address_problem(address: str) -> str | None:
    """What keeps Dask from connecting to a scheduler at ``address``, said as a fix, or
    ``None``: Dask takes ``[scheme://]host:port``, its scheme one it has (no scheme is
    tcp), and a port it cannot guess."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    if sep and scheme not in SCHEDULER_SCHEMES:
        dashboard = " (an http:// address is the dashboard's)" if scheme.startswith("http") else ""
        return (
            f"has the scheme {scheme + '://'!r}{dashboard}; give the scheduler's address, "
            "tcp://host:port (tls://... with cluster.security, ucx://... over UCX)"
        )
    shown = f"{scheme or 'tcp'}://{rest.rstrip(':/') or 'HOST'}:8786"
    no_port = rest.endswith("]") if rest.startswith("[") else ":" not in rest
    if rest and no_port and "/" not in rest:
        return (
            f"has no port; give the scheduler's as host:port, e.g. {shown} (8786 is "
            "`dask scheduler`'s default; it prints the address it listens on)"
        )
    m = _HOST_PORT.fullmatch(rest)
    if m is None or not 0 < int(m.group(2)) < 65536:
        return (
            "is not a scheduler address; give it as scheme://host:port, e.g. "
            "tcp://10.0.0.5:8786 (`dask scheduler` prints the address it listens on)"
        )
    return None


def scheme_problem(address: str, secured: bool) -> str | None:
    """Why a scheduler at ``address`` does not take a client with (``secured``) or
    without ``cluster.security``, said as a fix, or ``None``: a ``tls://`` scheduler
    takes only TLS clients, and a TLS client connects only over ``tls://``."""
    scheme = address.partition("://")[0] if "://" in address else "tcp"
    if scheme == "tls" and not secured:
        return (
            f"{address!r} is a TLS scheduler's, which takes only clients with a certificate "
            "its CA signed: set cluster.security.ca_file, cert and key (the set it was "
            "started with, e.g. from `laminar certs DIR`)"
        )
    if scheme != "tls" and secured:
        return (
            f"{address!r} is a {scheme}:// address, but cluster.security (TLS) is set and "
            "a TLS client connects only over tls://: give the scheduler's tls:// address "
            "(it was started with --protocol tls), or cluster.security=null for a "
            "scheduler without TLS"
        )
    return None


class ClusterConfig(_Section):
    """How the Dask cluster is found or started (docs/deploy.md)."""

    # local: worker processes on this machine; address: a running scheduler (`address`
    # or `scheduler_file`); slurm: a SLURMCluster started for the run.
    kind: Literal["local", "address", "slurm"] = "local"
    address: str | None = None  # tcp://host:8786, tls://..., ucx://...
    scheduler_file: str | None = None  # written by `dask scheduler --scheduler-file`
    # Protocol of a cluster laminar starts (local, slurm); tls with `security` set.
    protocol: Literal["tcp", "tls", "ucx"] = "tcp"
    security: TLSConfig | None = None
    slurm: SlurmConfig = SlurmConfig()
    # How long a run waits for workers of every role to join before failing with what
    # is missing (Slurm jobs queue; a local cluster starts them at once).
    placement_timeout_s: float = Field(60.0, ge=0)
    # Per local worker process (they share the cores), and a worker you start yourself
    # without LAMINAR_TORCH_THREADS; a Slurm job's: cluster.slurm.<role>.torch_threads.
    torch_threads: int = Field(1, gt=0)
    actor_timeout_s: float = Field(60.0, gt=0)
    # The run stops in order (its final checkpoint written; `laminar run` exits 124) this
    # long before the first of the Slurm jobs of its driver, trainer or data module reaches
    # its walltime, as squeue says: give it the time the final stop takes (the
    # checkpoint's write, with its optimizer state) and a margin. 0: the run never stops
    # for a walltime; Slurm's end then fails it (docs/deploy.md, "Walltime").
    stop_before_walltime_s: float = Field(300.0, ge=0)
    # Per local worker: a size (4GiB, 500MB), a number of bytes, a fraction of the
    # machine's memory (0.5), auto (its share of it) or 0 (no limit): what Dask takes.
    memory_limit: str = "4GiB"
    # Give the data module (buffer, prompt pool, partial-response log, rollout manager)
    # a worker of its own instead of sharing the trainer's: a lost trainer, or a lost
    # data module, then restarts alone within the run while the other runs on (shared,
    # they restart together: docs/faults.md).
    data_apart: bool = False

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory_limit_dask_takes(cls, value: Any) -> Any:
        # Checked here, not when the workers start (a Dask traceback, after the run
        # directory was made). YAML reads 0.5 and 4000000000 as numbers: Dask takes them.
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            return value  # (pydantic says it takes a string)

        text = value.strip()
        try:
            size = _memory_limit_bytes(text)
        except ValueError:
            raise ValueError(
                "is not a memory size Dask takes; give a size (e.g. 4GiB, 500MB), a number "
                "of bytes, a fraction of the machine's memory (0.5), auto (the worker's "
                "share of it) or 0 (no limit)"
            ) from None
        if size is not None and size < MIN_JOB_MEMORY:
            raise ValueError(
                f"is {size:,} bytes for each worker, too little for a Dask worker (a number "
                "above 1 counts bytes, one up to 1 a fraction of this machine's memory); "
                f"give at least {MIN_JOB_MEMORY // 2**20} MiB, e.g. 4GiB, or 0 for no limit"
            )
        return text

    @field_validator("address", mode="before")
    @classmethod
    def _address_dask_takes(cls, value: Any) -> Any:
        # Dask's client would say "missing port number", "unknown address scheme" or a
        # TypeError: checked here, naming the field, before anything starts.
        if not isinstance(value, str):
            return value  # (pydantic says it takes a string)
        text = value.strip()
        problem = address_problem(text)
        if problem is not None:
            raise ValueError(problem)
        return text

    @model_validator(mode="after")
    def _kind_is_complete(self) -> ClusterConfig:
        if self.kind == "address" and not (self.address or self.scheduler_file):
            raise ValueError(
                "cluster.kind=address needs cluster.address (tcp://host:8786) or "
                "cluster.scheduler_file (or --scheduler / --scheduler-file on the command line)"
            )
        if self.address and self.scheduler_file:
            raise ValueError("cluster.address and cluster.scheduler_file are both set; give one")
        if self.kind != "address" and (self.address or self.scheduler_file):
            raise ValueError(
                f"cluster.address / cluster.scheduler_file are set but cluster.kind is "
                f"{self.kind!r}; set cluster.kind=address to connect to that scheduler"
            )
        if self.kind == "address" and self.security is not None and self.security.generate:
            raise ValueError(
                "cluster.security.generate=true makes new certificates, which a scheduler "
                "already running (cluster.kind=address) does not trust: give "
                "cluster.security.ca_file, cert and key, the set that scheduler was "
                "started with (`laminar certs DIR` makes one for it), or "
                "cluster.security=null for a scheduler without TLS"
            )
        if self.address:
            problem = scheme_problem(self.address, self.security is not None)
            if problem is not None:
                raise ValueError(f"cluster.address: {problem}")
        if self.protocol == "tls" and self.security is None:
            raise ValueError(
                "cluster.protocol=tls needs cluster.security (certificate files, or generate: true)"
            )
        if self.security is not None and self.protocol == "ucx":
            raise ValueError(
                "cluster.security (TLS) and protocol=ucx don't combine; use protocol=tls"
            )
        if (why := walltime_problem(self)) is not None:
            raise ValueError(why)  # (at load; the jobs' submission checks it again)
        return self
