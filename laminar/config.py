"""Typed, frozen run configuration, loaded from YAML with ``a.b=value`` overrides.

One pydantic model per role; unknown keys are rejected; cross-field checks say the reason
and the fix. Every error is a :class:`~laminar.errors.ConfigError` naming the field.

>>> cfg = RunConfig.model_validate({"trainer": {"steps": 3}})
>>> cfg.trainer.steps, cfg.rollout.group_size
(3, 8)
>>> with_overrides(cfg, ["trainer.lr=1e-4"]).trainer.lr
0.0001
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from laminar.errors import ConfigError

# The largest float32 (numpy's finfo): rewards are stored as float32.
FLOAT32_MAX = 3.4028234663852886e38


def _is_number(annotation: Any) -> bool:
    """Whether a field takes a number: ``int``, ``float`` or an optional one."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return bool(args) and all(_is_number(a) for a in args)
    return annotation in (int, float)


def _is_numbers(annotation: Any) -> bool:
    """Whether a field takes a tuple or list of numbers (``tuple[float, float]``)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_numbers(a) for a in get_args(annotation))
    if get_origin(annotation) not in (tuple, list):
        return False
    args = [a for a in get_args(annotation) if a is not Ellipsis]
    return bool(args) and all(_is_number(a) for a in args)


class _Section(BaseModel):
    # No field means anything by inf or nan (no limit is null, where a field has one):
    # `lr: .inf` or `truncated_reward: .nan` would reach the loss.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_is_its_defaults(cls, data: Any) -> Any:
        # `trainer:` with every line under it commented out reads as null: the user
        # meant the defaults. (An optional section, `repack:`, stays off: null is off.)
        if not isinstance(data, dict):
            return data
        empty = {
            k: {}
            for k, v in data.items()
            if v is None
            and k in cls.model_fields
            and isinstance(cls.model_fields[k].annotation, type)
            and issubclass(cls.model_fields[k].annotation, _Section)
        }
        return {**data, **empty} if empty else data

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and 1.0: `lr: true` would train at lr 1.
        # (It stays lax otherwise: PyYAML reads 1e-4 as a string, which floats take.)
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _is_number(annotation):
            raise ValueError("takes a number, not true/false")
        if (
            isinstance(value, list | tuple)
            and any(isinstance(v, bool) for v in value)
            and _is_numbers(annotation)
        ):
            raise ValueError("takes numbers, not true/false")
        return value


class ModelConfig(_Section):
    """The policy. ``path`` names a local HF folder; empty builds the built-in tiny Llama."""

    path: str | None = None
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(512, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}; pick num_heads among the divisors of hidden_size"
            )
        return self


class TaskConfig(_Section):
    """Where prompts come from and how responses are scored."""

    name: Literal["count", "copy", "reverse", "sort", "count_range"] = "count"
    prompt_file: str | None = None  # JSONL with "prompt" and "answer" on every line
    reward: str = "exact_match"  # a name in laminar.rewards.REWARDS or "module:function"
    num_prompts: int = Field(20000, gt=0)
    median_len: float = Field(6.0, gt=0)
    tail_ratio: float = Field(10.0, ge=1)  # P99 / median of the answer length
    max_len: int = Field(64, gt=0)
    # count_range: the fraction of the length's log-variance a prompt fixes; the rest
    # varies between the responses to it (the shared cluster model's half)
    length_share: float = Field(0.5, ge=0, le=1)
    # reward of a response cut at max_new_tokens (stored as float32, as every reward)
    truncated_reward: float = Field(0.0, ge=-FLOAT32_MAX, le=FLOAT32_MAX)
    # Seconds one call of the reward function may take (a judge service that hangs): a
    # later answer is not waited for, and that trajectory is marked as a reward error.
    # null: no limit.
    reward_timeout_s: float | None = Field(300.0, gt=0)


class SFTConfig(_Section):
    """Supervised warm start on task demonstrations, cached by a hash of its inputs."""

    enabled: bool = True
    steps: int = Field(250, ge=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(3e-3, gt=0)
    # Probability that a demonstration token is replaced by a random one. Imperfect
    # demonstrations leave the policy at a middling sampled reward that RL can raise.
    demo_error_rate: float = Field(0.1, ge=0, lt=1)
    micro_batch_tokens: int = Field(4096, gt=0)  # padded tokens per forward/backward
    torch_threads: int = Field(2, gt=0)
    cache_dir: str | None = None  # default: ~/.cache/laminar


_TIME_MODEL_FIELDS = ("t_fix", "bw_efficiency", "kv_efficiency", "decode_mfu", "prefill_mfu")


class PacingConfig(_Section):
    """Emulated accelerator timing for every rollout engine (see docs/pacing.md)."""

    accelerator: str = "H800"  # a name in laminar.pacing.ACCELERATORS
    model: str = "7B"  # a name in laminar.pacing.MODELS
    tp: int = Field(4, gt=0)  # devices per replica
    dilation: float = Field(1.0, gt=0)  # every modelled time × this
    strict: bool = True  # stop with an error if real compute exceeds the model
    # How a step's prefill is charged: added to the decode step, or fused into its
    # forward pass as a chunked-prefill engine does (docs/pacing.md).
    prefill: Literal["additive", "fused"] = "additive"
    # A scaled-down workload: each real token stands for length_scale modelled tokens,
    # each real request for request_scale modelled requests; modelled time runs
    # length_scale times faster (docs/pacing.md, "Scaled workloads"). (Below 1 the
    # model's decode steps after each real one would weigh negative.)
    length_scale: float = Field(1.0, ge=1)
    request_scale: float = Field(1.0, gt=0)
    # Modelled seconds a rollout waits when it loads a version from its relay (host to
    # device over PCIe; the shared cluster model: 1 s for a 7B model). 0: only real time.
    pull_s: float = Field(0.0, ge=0)
    # The time model's constants (docs/pacing.md), e.g. as `laminar bench pacing` measured
    # them on a GPU; None: laminar.pacing.TimeModel's defaults.
    t_fix: float | None = Field(None, ge=0)  # seconds per decode step
    bw_efficiency: float | None = Field(None, gt=0, le=1)  # of HBM bandwidth, weights
    kv_efficiency: float | None = Field(None, gt=0, le=1)  # of HBM bandwidth, KV reads
    decode_mfu: float | None = Field(None, gt=0, le=1)  # of peak FLOPs, decode
    prefill_mfu: float | None = Field(None, gt=0, le=1)  # of peak FLOPs, prefill

    def time_model(self):
        """The :class:`~laminar.pacing.TimeModel` of one replica, with the constants set."""
        from laminar.pacing import TimeModel

        kw = {k: getattr(self, k) for k in _TIME_MODEL_FIELDS if getattr(self, k) is not None}
        return TimeModel.named(self.accelerator, self.model, self.tp, **kw)

    @model_validator(mode="after")
    def _known(self) -> PacingConfig:
        from laminar.errors import LaminarError

        try:
            _ = self.time_model().kv_capacity_tokens
        except LaminarError as e:
            raise ValueError(str(e)) from None
        return self


class RolloutConfig(_Section):
    """Rollout replicas and their engines."""

    replicas: int = Field(2, gt=0)
    group_size: int = Field(8, ge=2)  # GRPO responses per prompt
    groups_per_batch: int = Field(8, gt=0)  # prompt groups in one local batch
    # Requests an engine decodes at once (its KV cache rows); more wait in its queue.
    # None: one local batch, groups_per_batch × group_size.
    max_concurrency: int | None = Field(None, gt=0)
    # Laminar: while the trainer has published no version newer than the one a rollout
    # decodes with, its draining local batch takes new groups whenever the engine has room
    # for a whole group (they are generated by that version, the newest, as the next batch
    # would be); from the first newer publication on it drains as before, then pulls.
    # (docs/schedules.md, "Topping up a local batch")
    top_up: bool = False
    max_new_tokens: int = Field(80, gt=0)
    max_seq_len: int = Field(160, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    engine: Literal["torch", "vllm"] = "torch"
    # KV tokens an engine may hold (default: max_seq_len × the requests it decodes at once:
    # max_concurrency when set, else the local batch's)
    kv_capacity_tokens: int | None = Field(None, gt=1)
    pacing: PacingConfig | None = None
    # Every this many local batches, check the engine's behavior logprobs against the
    # trainer's forward on 8 of the batch's responses (0: never).
    parity_every: int = Field(10, ge=0)

    @property
    def max_batch(self) -> int:
        """Requests an engine decodes at once: ``max_concurrency``, else one local batch."""
        return self.max_concurrency or self.groups_per_batch * self.group_size

    def sampling_params(self, seed: int | None = None):
        """The :class:`~laminar.engine.SamplingParams` of every rollout request."""
        from laminar.engine import SamplingParams

        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
        )


class BufferConfig(_Section):
    """The experience buffer and prompt dispatch."""

    # fifo: groups in completion order (the paper's); oldest_version: lowest behavior
    # version first; same_version: every batch from one behavior version.
    sampler: Literal["fifo", "oldest_version", "same_version"] = "fifo"
    # Evict groups whose training would exceed this many versions of staleness
    # (sample_version - behavior_version); stored with status "evicted". None: no bound.
    max_train_staleness: int | None = Field(None, ge=0)
    # DAPO dynamic sampling: drop groups whose rewards are all equal (status "filtered").
    dynamic_sampling: bool = False
    # Back-pressure: prompt groups dispatched but not yet consumed never exceed this.
    max_outstanding_groups: int = Field(48, gt=0)
    flush_records: int = Field(512, gt=0)  # store append size
    flush_interval_s: float = Field(5.0, gt=0)


class TrainerPacingConfig(_Section):
    """Emulated trainer GPUs and weight-movement costs (docs/pacing.md), on the scale and
    dilation of ``rollout.pacing``: an update lasts at least its modelled time, and each
    way of moving weights to the rollouts costs what the shared cluster model says. All
    times are modelled seconds of the full-size cluster."""

    gpus: int = Field(16, gt=0)  # trainer GPUs (colocated: the whole cluster)
    tok_s_per_gpu: float = Field(5000.0, gt=0)  # training tokens/s of one GPU
    update_s: float = Field(2.0, ge=0)  # per update besides: optimizer, all-reduce
    publish_s: float = Field(0.5, ge=0)  # Laminar: the copy into the master relay
    global_sync_s: float = Field(3.0, ge=0)  # global NCCL broadcast: 3 s ...
    global_sync_log2_s: float = Field(0.25, ge=0)  # ... + 0.25 s · log2(replicas)
    colocated_switch_s: float = Field(8.0, ge=0)  # colocated: training -> generation
    # OS priority (nice) of the training thread. On a machine that many paced replicas
    # share with the trainer, the replicas have slack against their model and the trainer
    # little: a negative value (it needs the privilege to raise priority, e.g. root) keeps
    # its real compute at its pace. Refused by the OS: a warning, and the run goes on.
    nice: int = Field(0, ge=-20, le=19)


class PipelineConfig(_Section):
    """Which schedule drives the run (docs/schedules.md): what it keeps global."""

    # laminar: nothing global (the paper); sync: generate the whole batch, train, update
    # every rollout (verl); one_step: generation of batch i+1 overlaps training of batch
    # i; stream: mini-batches train as trajectories finish, global update; partial_rollout:
    # every update interrupts all rollouts, which resume with the new weights (AReaL).
    schedule: Literal["laminar", "sync", "one_step", "stream", "partial_rollout"] = "laminar"
    # partial_rollout: AReaL's staleness bound η — prompt groups dispatched never exceed
    # (trainer version + η + 1) × trainer.groups_per_step. (2: what the default
    # buffer.max_outstanding_groups, 3 × groups_per_step, lets out; a larger η needs
    # more room there, or back-pressure binds first, and the run refuses it. At 0 nothing
    # overlaps training: sync without colocation, refused.)
    eta: int = Field(2, ge=0)


class TrainerConfig(_Section):
    """GRPO with clip-higher; one published version per global batch."""

    steps: int = Field(60, gt=0)  # global batches, i.e. published versions
    groups_per_step: int = Field(16, gt=0)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW's, each in [0, 1)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    clip_c: float | None = Field(None, gt=1)  # dual-clip bound for negative advantages
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    # GRPO's advantage: (r - group mean) / group std; false keeps the centring only
    # (Dr. GRPO: the std favours groups whose rewards barely differ).
    norm_adv_by_std: bool = True
    max_grad_norm: float = Field(1.0, gt=0)
    # Padded tokens per forward/backward; the global batch is split into length-sorted
    # micro-batches (same gradient, far less padding with long-tailed lengths).
    micro_batch_tokens: int = Field(4096, gt=0)
    # Off-policy correction (docs/losses.md): none (clip around the behavior policy, the
    # paper's), tis (truncated-IS policy gradient), decoupled (AReaL: clip around the
    # proximal policy, truncated IS for the behavior gap).
    correction: Literal["none", "tis", "decoupled"] = "none"
    is_cap: float = Field(2.0, ge=1)  # truncation of importance weights
    kl_coef: float = Field(0.0, ge=0)  # KL penalty to the warm-started policy
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus
    # Optimizer steps per global batch (whole groups each); still one version per batch.
    # Stream trains them as they arrive: it needs 2 or more (in one, it is sync).
    mini_batches: int = Field(1, gt=0)
    # Data-parallel ranks, one `trainer` worker each (gloo on CPU, NCCL on GPU).
    ranks: int = Field(1, gt=0)
    # A checkpoints/version-N folder to continue from (weights, optimizer, RNG, version).
    resume_from: str | None = None
    # Also checkpoint every this many versions (0: only when the run ends), so a lost
    # run can be resumed (`laminar run --resume RUN_DIR`) losing at most these updates.
    checkpoint_every: int = Field(0, ge=0)
    pacing: TrainerPacingConfig | None = None  # needs rollout.pacing (its scale)

    @field_validator("betas")
    @classmethod
    def _betas_adamw_takes(cls, value: tuple[float, float]) -> tuple[float, float]:
        # (torch's AdamW refuses them too, but in the trainer actor, after the warm start)
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each of AdamW's betas lies in [0, 1), e.g. [0.9, 0.99]")
        return value


class RelayConfig(_Section):
    """The relay tier that carries weights from the trainer to rollouts (docs/relay.md)."""

    # Relays below the master (which lives in the trainer's process). None: one per host
    # that runs rollouts, other than the trainer's host. A number places that many on
    # workers with the `relay` resource (the local cluster starts them).
    relays: int | None = Field(None, ge=0)
    keep_versions: int = Field(2, ge=1)  # complete versions each relay keeps (recovery)
    # Per relay; default exactly keep_versions + 1 snapshots (the arriving one).
    memory_budget_mb: float | None = Field(None, gt=0)
    chunks: int | None = Field(None, gt=0)  # chunks per broadcast; None: the model's k*
    # Receive buffers above glibc's mmap threshold (<= 32 MiB) are fresh mappings that
    # page-fault on every transfer; smaller ones are recycled warm from the heap.
    max_chunk_mb: float = Field(8.0, gt=0)
    # Link model T(p,k) = (p+k-2)(M*t_byte/k + t_start); None: measured at start.
    t_byte: float | None = Field(None, gt=0)  # seconds per byte, one hop
    t_start: float | None = Field(None, ge=0)  # seconds per chunk call, one hop
    timeout_s: float = Field(60.0, gt=0)  # every relay-to-relay and rollout-to-relay call
    # Where a relay's sends to its successor run: "thread", a thread of their own, so a
    # relay receives and sends at once (tcp/tls; other protocols stay on the loop);
    # "loop", the worker's event loop, where receiving and sending take turns.
    sender: Literal["thread", "loop"] = "thread"
    # Rollouts and the trainer fingerprint every version they load/publish (xxh3-64 of the
    # weights; one extra pass over them) so a run proves the loaded weights are the
    # published ones (summary.json `relay.fingerprints`).
    audit_weights: bool = False


class RepackConfig(_Section):
    """Dynamic repack of draining batches (docs/repack.md); absent: off."""

    interval_s: float = Field(5.0, gt=0)  # planning period (the paper: 5 s)
    on_publish: bool = True  # plan again right after each trainer publication
    c_max: float = Field(0.9, gt=0, le=1)  # KV fraction a destination may reach
    # Requests a destination may hold; None: the pacing roofline's memory-bound batch
    # when paced (in real requests), capped by what an engine decodes at once.
    max_batch: int | None = Field(None, gt=1)


class FaultsConfig(_Section):
    """Fault tolerance (docs/faults.md): the partial-response log and rollout recovery."""

    # A rollout logs its unfinished trajectories' new tokens when any has this many
    # unlogged, or this long after its last log: a loss regenerates at most that much.
    flush_tokens: int = Field(16, gt=0)
    flush_s: float = Field(2.0, gt=0)
    # The partial-response pool writes what it holds to RUN_DIR/partial.zarr this often,
    # so that it outlives the pool's worker (a write costs tens of ms on a busy machine).
    log_interval_s: float = Field(2.0, gt=0)
    # How often the manager checks that every rollout's worker is alive.
    detect_interval_s: float = Field(0.5, gt=0)
    # A rollout that neither answers nor advances its generation loop (a step, a pulled
    # chunk, an idle poll) for this long, a downstream relay or data module that does not
    # answer, or a trainer that does not answer or whose loop makes no progress (keep it
    # above the longest update), is hung: its worker is restarted (the nanny kills the
    # process), then handled as lost.
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    # Resume a lost rollout's unfinished trajectories on healthy rollouts.
    recover: bool = True
    # Start a new rollout on a `rollout` worker that hosts none (the nanny restarted the
    # lost one's worker, or a new worker joined), so capacity comes back after a loss.
    replace: bool = True
    # A lost trainer restarts within the run, from its newest checkpoint, on a `trainer`
    # worker that comes back or joins, while the rollouts keep generating (with the data
    # module when they shared the lost worker, which needs restart_data too; all ranks of
    # a data-parallel trainer when one is lost). Off, or under another schedule than
    # laminar, a lost trainer fails the run (continue it with `laminar run --resume`).
    restart_trainer: bool = True
    # How long the run waits for a `trainer` worker to restart the trainer on, and then
    # for the new trainer to be created there (its checkpoint loaded), before it fails (a
    # local worker's nanny brings it back in seconds; a Slurm job may queue).
    trainer_restart_timeout_s: float = Field(120.0, gt=0)
    # A lost data module (buffer, prompt pool, partial-response pool and rollout manager)
    # is rebuilt within the run from the stores, the trainer's record of what it consumed
    # (its newest checkpoint, when the trainer was lost with it) and what the rollouts
    # hold, on a `data` worker that comes back or joins. Off, a lost data module fails
    # the run (continue it with `laminar run --resume RUN_DIR`).
    restart_data: bool = True
    # How long the run (and each rollout and the trainer, waiting) waits for a `data`
    # worker to rebuild the data module on before it fails; also how long that worker may
    # send nothing while it creates the data module's actors, at a run's start too (hung).
    data_restart_timeout_s: float = Field(120.0, gt=0)


class MetricsConfig(_Section):
    """The run's time series (docs/analysis.md): always ``metrics.zarr``; optionally also
    TensorBoard scalars under ``RUN_DIR/tensorboard``."""

    tensorboard: bool = False
    # How often the driver polls every actor for a row of the cluster and rollouts tables
    # (and the progress line). Each poll calls every rollout: on a busy machine with many
    # replicas, poll less often.
    poll_s: float = Field(0.5, gt=0)

    def check_writer(self) -> None:
        """Refuse ``tensorboard: true`` where tensorboardX is missing (before a run starts;
        not when a config is read: a run's recorded config must load for analysis on a
        machine without it)."""
        import importlib.util

        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ConfigError(
                "metrics.tensorboard is true but tensorboardX (its writer) is not installed: "
                "pip install tensorboardX (in a checkout: pip install -e '.[tensorboard]'), or "
                "set metrics.tensorboard=false"
            )


class TLSConfig(_Section):
    """TLS for every connection of the run (docs/deploy.md, "Security").

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


class SlurmRole(_Section):
    """One Slurm job per worker of a role: what it asks for."""

    cores: int = Field(1, gt=0)  # --cpus-per-task
    memory: str = "4GB"  # --mem and the worker's memory limit (4GB, 500MB, 16GiB)
    gpus: int = Field(0, ge=0)  # --gres=gpu:N

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


class SlurmConfig(_Section):
    """dask-jobqueue ``SLURMCluster``: one job per worker, each with its role resources."""

    partition: str | None = None  # -p
    account: str | None = None  # -A
    # -t, as sbatch takes it: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or unlimited
    walltime: str = "01:00:00"
    # Shell lines run before the worker starts (modules, a virtual environment).
    job_prologue: list[str] = []
    job_directives: list[str] = []  # extra `#SBATCH` lines, e.g. "--constraint=a100"
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
    torch_threads: int = Field(1, gt=0)  # per worker process (cores are shared)
    actor_timeout_s: float = Field(60.0, gt=0)
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
        if self.protocol == "tls" and self.security is None:
            raise ValueError(
                "cluster.protocol=tls needs cluster.security (certificate files, or generate: true)"
            )
        if self.security is not None and self.protocol == "ucx":
            raise ValueError(
                "cluster.security (TLS) and protocol=ucx don't combine; use protocol=tls"
            )
        return self


class RunConfig(_Section):
    """A whole run."""

    seed: int = Field(0, ge=0, lt=2**32)  # numpy's and torch's seeds take [0, 2**32)
    run_dir: str | None = None  # default: runs/<timestamp>
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    relay: RelayConfig = RelayConfig()
    pipeline: PipelineConfig = PipelineConfig()
    repack: RepackConfig | None = None
    faults: FaultsConfig = FaultsConfig()
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        r, b, t, task = self.rollout, self.buffer, self.trainer, self.task
        longest_prompt = task.max_len + 3  # <bos>, tag and '>' around the symbols
        if task.prompt_file is None and longest_prompt + r.max_new_tokens > r.max_seq_len:
            raise ValueError(
                f"rollout.max_seq_len ({r.max_seq_len}) is shorter than the longest prompt "
                f"({longest_prompt}, from task.max_len) plus rollout.max_new_tokens "
                f"({r.max_new_tokens}); raise rollout.max_seq_len to at least "
                f"{longest_prompt + r.max_new_tokens}"
            )
        if task.prompt_file is None and task.median_len >= task.max_len:
            raise ValueError(
                f"task.median_len ({task.median_len:g}) must be below task.max_len "
                f"({task.max_len}), which cuts every longer answer: lower task.median_len "
                "or raise task.max_len"
            )
        rp = self.repack
        if rp is not None and rp.max_batch is not None and rp.max_batch > r.max_batch:
            raise ValueError(
                f"repack.max_batch ({rp.max_batch}) exceeds what an engine decodes at once "
                f"(rollout.max_concurrency, else groups_per_batch × group_size: "
                f"{r.max_batch}): moved requests past it would wait in the destination's "
                f"queue while their freed source takes new prompts; set repack.max_batch to "
                f"at most {r.max_batch}, or raise rollout.max_concurrency"
            )
        if b.sampler == "same_version" and b.max_train_staleness is None:
            raise ValueError(
                "buffer.sampler=same_version needs buffer.max_train_staleness: without it, "
                "groups of a version too rare to fill a batch would wait forever"
            )
        cap = r.kv_capacity_tokens
        if cap is not None and not r.max_seq_len <= cap <= r.max_batch * r.max_seq_len:
            raise ValueError(
                f"rollout.kv_capacity_tokens ({cap}) must be between rollout.max_seq_len "
                f"({r.max_seq_len}: one whole request) and max_seq_len × the requests an "
                f"engine decodes at once (rollout.max_concurrency, else groups_per_batch × "
                f"group_size): {r.max_batch * r.max_seq_len}, every cache slot"
            )
        counting = task.prompt_file is None and task.name in ("count", "count_range")
        if counting and task.max_len > 255:
            raise ValueError(
                f"task.max_len ({task.max_len}) exceeds 255, the largest number the built-in "
                f"vocabulary holds for the {task.name} task"
            )
        ranged = task.name == "count_range"
        one_answer = task.reward in ("exact_match", "prefix_credit")
        if task.prompt_file is None and (
            (ranged and one_answer) or (not ranged and task.reward == "count_in_range")
        ):
            raise ValueError(
                f"task.name={task.name} with task.reward={task.reward}: the count_range task "
                "has many right answers (a band of lengths), which only its own reward "
                "checks; use task.name=count_range with task.reward=count_in_range"
            )
        if t.pacing is not None and r.pacing is None:
            raise ValueError(
                "trainer.pacing needs rollout.pacing: the trainer is paced on its dilation "
                "and scales; set rollout.pacing (e.g. --set rollout.pacing.dilation=16)"
            )
        schedule = self.pipeline.schedule
        if self.repack is not None and schedule != "laminar":
            raise ValueError(
                f"repack is Laminar's (it moves batches between rollouts of one version); "
                f"pipeline.schedule is {schedule!r}: remove the repack section or use "
                "pipeline.schedule=laminar"
            )
        if r.top_up and schedule != "laminar":
            raise ValueError(
                f"rollout.top_up is Laminar's (a local batch takes new groups while its "
                f"version is the newest); pipeline.schedule is {schedule!r}: drop "
                "rollout.top_up (partial_rollout refills its engines anyway)"
            )
        if schedule == "one_step" and b.max_train_staleness == 0:
            raise ValueError(
                "pipeline.schedule=one_step trains every batch one version after the one "
                "that generated it, so buffer.max_train_staleness=0 would evict them all; "
                "set it to 1 or more (or leave it unset)"
            )
        if schedule == "stream" and t.ranks > 1:
            raise ValueError(
                "pipeline.schedule=stream trains each mini-batch as it arrives, on one "
                "trainer rank; set trainer.ranks=1"
            )
        if schedule == "stream" and t.correction == "decoupled":
            raise ValueError(
                "pipeline.schedule=stream with trainer.correction=decoupled: the proximal "
                "policy of a global batch's later mini-batches is gone by the time they "
                "arrive; use trainer.correction none or tis"
            )
        # A schedule that would run as another is refused, as a spec's meaningless option
        # is (laminar/schedule.py): its benchmark would carry the wrong name.
        if schedule == "stream" and min(t.mini_batches, t.groups_per_step) < 2:
            short, value = (
                ("mini_batches", t.mini_batches)
                if t.mini_batches < 2
                else ("groups_per_step", t.groups_per_step)
            )
            raise ValueError(
                f"pipeline.schedule=stream trains a global batch in parts of whole groups "
                f"(trainer.mini_batches of them, at most trainer.groups_per_step), the first "
                f"while rollouts still generate the rest; trainer.{short} is {value}, so "
                f"the batch is one part and nothing overlaps: that is the sync schedule "
                f"without colocation. Set trainer.{short} to 2 or more (e.g. "
                f"trainer.{short}=4), or use pipeline.schedule=sync"
            )
        if t.mini_batches > t.groups_per_step:
            raise ValueError(
                f"trainer.mini_batches ({t.mini_batches}) exceeds trainer.groups_per_step "
                f"({t.groups_per_step}): each optimizer step takes whole groups, so a batch "
                f"makes at most {t.groups_per_step}; set trainer.mini_batches to at most "
                f"{t.groups_per_step}"
            )
        if schedule == "partial_rollout" and self.pipeline.eta == 0:
            raise ValueError(
                "pipeline.schedule=partial_rollout with pipeline.eta=0: no group of the "
                "next batch goes out before the version that generates it is published, "
                "so rollouts idle while the trainer trains and no publication interrupts "
                "a response: that is the sync schedule without colocation. Set "
                "pipeline.eta to 1 or more, or use pipeline.schedule=sync"
            )
        if b.max_outstanding_groups < t.groups_per_step:
            raise ValueError(
                f"buffer.max_outstanding_groups ({b.max_outstanding_groups}) is smaller than "
                f"trainer.groups_per_step ({t.groups_per_step}): the trainer could never "
                "fill a batch; raise max_outstanding_groups"
            )
        return self

    def fingerprint(self, *sections: str) -> str:
        """A short content hash of the named sections (all when none are named)."""
        data = self.model_dump(mode="json")
        if sections:
            data = {k: data[k] for k in sections}
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _section_at(path: tuple) -> type[BaseModel] | None:
    """The config section at a dotted path (``("cluster", "slurm")``), or None."""
    section: type[BaseModel] = RunConfig
    for name in path:
        field = section.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        a = field.annotation  # a section, or an optional one (`PacingConfig | None`)
        found = [t for t in (a, *get_args(a)) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not found:
            return None
        section = found[0]
    return section


def _unknown_key(loc: tuple) -> str:
    """What to say of an unknown key: the nearest known one of its section, if any."""
    section = _section_at(loc[:-1])
    if section is not None and isinstance(loc[-1], str):
        near = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1)
        if near:
            return f"unknown key; did you mean {'.'.join(map(str, (*loc[:-1], near[0])))}?"
    return "unknown key; remove it or check its spelling"


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: {_unknown_key(e['loc'])}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        if e["type"] == "string_type" and given is not None:
            # (YAML, in the file or a --set, read it as a number, a boolean or a mapping:
            # an unquoted "2024", "true" or "a: b")
            what = "a mapping (a ': ' in it)" if isinstance(given, dict) else repr(given)
            shown = f" (got {what}); quote it to give a string, e.g. {loc}='...'"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if child is None:  # an optional section that is off (rollout.pacing): switch it on
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = child
    node[keys[-1]] = value


def override_list(overrides: str | list[str] | tuple[str, ...]) -> list[str]:
    """Overrides as a list: one string alone is one override (not its characters)."""
    return [overrides] if isinstance(overrides, str) else list(overrides)


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Split ``a.b=value`` strings; values are parsed as YAML scalars (``1e-4``, ``true``).
    One string alone is one override (not its characters)."""
    parsed = []
    for item in override_list(overrides):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not of the form key=value (section.key=value, e.g. "
                "trainer.steps=200, or a top-level key: seed=1)"
            )
        # YAML scalars: ints, floats, booleans, null; pydantic coerces "1e-4" for floats.
        try:
            value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None
        except yaml.YAMLError as e:
            reason = str(e).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: the value {raw!r} is not valid YAML ({reason}); quote "
                "a string, and write lists as [a, b]"
            ) from None
        parsed.append((key.strip(), value))
    return parsed


def _validate(data: dict[str, Any], source: str) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def with_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """A new config with ``a.b=value`` overrides applied and validated."""
    overrides = override_list(overrides)
    data = cfg.model_dump(mode="json")
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    return _validate(data, f"--set {' '.join(overrides)}")


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the
    last silently: a `steps:` further down a long section would undo the first), and
    reading ``10:00:00`` as the string it means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # (`<<: *base` then a key of base: an override, as YAML means)
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error says so
                break
            if first is not None:
                raise _DuplicateKey(
                    f"the key {key!r} appears twice in one section (lines {first} and "
                    f"{line}); keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        # YAML 1.1 reads 10:00:00 as the base-60 number 36000 (and 1:30 as 90): only a
        # walltime is written so, and Slurm reads 1:30 as 1 minute 30, 90 as 90 minutes.
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and ":" in value and tag in _NUMBER_TAGS:
            return "tag:yaml.org,2002:str"
        return tag


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML run config, apply overrides, validate.

    Raises :class:`ConfigError` for a missing file, bad YAML, unknown keys, wrong types
    and inconsistent fields, naming each.
    """
    overrides = override_list(overrides)
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config file {str(path)!r} is a directory; pass a YAML file (e.g. "
            "configs/tiny.yaml), or `laminar run --resume RUN_DIR` to continue a run"
        )
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    return _validate(data, str(path) + (f" with --set {' '.join(overrides)}" if overrides else ""))
