"""The run config's sections, one frozen pydantic model per role, and their base.

:class:`_Section` is what every section shares: unknown keys rejected, frozen, no inf or
nan, no true/false for a number, and an empty section read as its defaults. Then the
role sections :class:`~laminar.config.RunConfig` is made of: model, task, SFT, rollout
(with its pacing), buffer, pipeline, trainer (with its pacing), relay, repack, faults
and metrics, each with the checks that involve only its own fields.

Apart from the run as a whole (:mod:`laminar.config`: cross-section checks, YAML loading,
overrides) and from the cluster sections (:mod:`laminar.config_cluster`): what a role
takes is read one section at a time. Import these from :mod:`laminar.config`, which
re-exports every one.
"""

from __future__ import annotations

import types
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
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

    # The section's path fields that null leaves unset, each with what null does: ''
    # would read as unset to a check that tests `is None` and as set to one that tests
    # truthiness (a prompt_file of '' skipped the synthetic task's checks, then trained
    # it), so it is refused, naming the field.
    _unset_means: ClassVar[dict[str, str]] = {}

    @field_validator("*", mode="after")
    @classmethod
    def _no_empty_path(cls, value: Any, info: ValidationInfo) -> Any:
        means = cls._unset_means.get(info.field_name)
        if means is not None and isinstance(value, str) and not value.strip():
            raise ValueError(
                f"is empty: remove the key (or set it to null) {means}, or give a path"
            )
        return value

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
    """The policy. ``path`` names a local HF folder; null builds the built-in tiny Llama."""

    _unset_means: ClassVar[dict[str, str]] = {"path": "to build the built-in tiny model"}

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
    _unset_means: ClassVar[dict[str, str]] = {"prompt_file": "to use the synthetic task"}

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
    # The share of the responses given to the reward that may fail (a raise, a value that
    # is not a finite number, a timeout) over the last 300 s of the run (REWARD_SHARE_
    # WINDOW_S): more, on 64 or more, stops the run, since every failure discards its
    # whole group (a reward failing on half discards 99.6% of groups of 8); 90% or more
    # over the last 120 s stops it sooner. 1.0: only a reward that never scores stops it.
    reward_max_failure_share: float = Field(0.25, gt=0, le=1)


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
    _unset_means: ClassVar[dict[str, str]] = {
        "cache_dir": "to cache in $LAMINAR_CACHE, else ~/.cache/laminar"
    }

    cache_dir: str | None = None  # default: $LAMINAR_CACHE, else ~/.cache/laminar


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
    # more room there, or back-pressure binds first, and the config refuses it on load. At 0 nothing
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
    # Dual-clip (docs/losses.md): a negative-advantage token's loss is capped at
    # clip_c·|A|. On by default (verl's clip_ratio_c): the input is stale by design, and
    # one token the behavior policy found unlikely (ratio ~1e4) would otherwise take all
    # but all of a clipped gradient. null turns it off.
    clip_c: float | None = 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    # GRPO's advantage: (r - group mean) / group std; false keeps the centring only
    # (Dr. GRPO: the std favours groups whose rewards barely differ).
    norm_adv_by_std: bool = True
    max_grad_norm: float = Field(1.0, gt=0)
    # Updates skipped in a row (a non-finite loss or gradient in every step: the batch is
    # consumed, nothing published) before the trainer fails the run: past a few, every
    # update is non-finite (a learning rate that blew the weights up, broken rewards) and
    # the trainer would consume the buffer forever without training.
    max_skipped_updates_in_a_row: int = Field(5, ge=1)
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
    # Overlong filtering (DAPO): a response cut at rollout.max_new_tokens takes no part in
    # the loss (its tokens masked); it still counts in its group's advantages, with its
    # reward (task.truncated_reward).
    mask_truncated: bool = False
    # Optimizer steps per global batch (whole groups each); still one version per batch.
    # Stream trains them as they arrive: it needs 2 or more (in one, it is sync).
    mini_batches: int = Field(1, gt=0)
    # Data-parallel ranks, one `trainer` worker each (gloo on CPU, NCCL on GPU).
    ranks: int = Field(1, gt=0)
    # A checkpoints/version-N folder to continue from (weights, optimizer, RNG, version).
    _unset_means: ClassVar[dict[str, str]] = {"resume_from": "to start from model.path"}

    resume_from: str | None = None
    # Also checkpoint every this many versions (0: only when the run ends), so a lost
    # run can be resumed (`laminar run --resume RUN_DIR`) losing at most these updates.
    checkpoint_every: int = Field(0, ge=0)
    # Keep only the newest this many checkpoints of the run, removing older ones once a
    # newer is in place (null: every one; a 7B's, with AdamW, is ~100 GB).
    keep_checkpoints: int | None = Field(None, ge=1)
    pacing: TrainerPacingConfig | None = None  # needs rollout.pacing (its scale)

    @field_validator("clip_c")
    @classmethod
    def _clip_c_above_1(cls, value: float | None) -> float | None:
        if value is not None and value <= 1:
            raise ValueError(
                f"dual-clip caps a negative-advantage token's loss at clip_c·|A|, above the "
                f"clipped surrogate's own bound, so clip_c must be > 1 (got {value!r}): "
                "e.g. 3, or null to turn dual-clip off"
            )
        return value

    @field_validator("betas")
    @classmethod
    def _betas_adamw_takes(cls, value: tuple[float, float]) -> tuple[float, float]:
        # (torch's AdamW refuses them too, but in the trainer actor, after the warm start)
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each of AdamW's betas lies in [0, 1), e.g. [0.9, 0.99]")
        return value

    def ignored_by_correction(self) -> list[str]:
        """The trainer fields set (off their defaults) that ``correction`` does not use.

        Warned of by the run's pre-start check (:func:`pipelines.preflight.preflight`, once per
        start), not refused: one base config is naturally run under each correction (a
        sweep of trainer.correction), and a config saved by an earlier run must still
        load to be resumed. A field at its default is not named (a saved config holds
        every field, so one set to the default cannot be told from one left so), nor one
        set to null (off)."""
        fields = type(self).model_fields
        # (None is off: clip_c=null under tis turns off what tis does not do anyway)
        return [
            f
            for f in IGNORED_BY_CORRECTION[self.correction]
            if getattr(self, f) not in (fields[f].default, None)
        ]


def ignored_by_correction_message(trainer: TrainerConfig, field: str) -> str:
    """The warning that ``trainer.<field>`` does nothing under its correction."""
    why = IGNORED_BY_CORRECTION[trainer.correction][field]
    return (
        f"trainer.{field}={getattr(trainer, field)} is ignored under trainer.correction="
        f"{trainer.correction} ({why}); remove it, or choose a correction that uses it "
        "(docs/losses.md)"
    )


# What each trainer.correction leaves unused: tis has no trust region to clip (its
# weights are truncated at is_cap instead); none has no importance weights to truncate.
IGNORED_BY_CORRECTION: dict[str, dict[str, str]] = {
    "none": {"is_cap": "it truncates the importance weights of tis and decoupled"},
    "tis": {
        f: "tis has no clipped ratio: it truncates its weights at trainer.is_cap"
        for f in ("clip_c", "clip_low", "clip_high")
    },
    "decoupled": {},
}


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
    # At least MIN_CHUNK_MB: a cap that rounds to no bytes divided by zero in the relay.
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

    @field_validator("max_chunk_mb")
    @classmethod
    def _chunks_of_some_bytes(cls, value: float) -> float:
        # (a chunk is a call: below 64 KiB the per-call cost dominates any link)
        if value < MIN_CHUNK_MB:
            raise ValueError(
                f"the largest chunk must be at least {MIN_CHUNK_MB} MiB (64 KiB), got "
                f"{value!r}: e.g. 8 (the default), or set relay.chunks for a fixed count"
            )
        return value


MIN_CHUNK_MB = 0.0625  # relay.max_chunk_mb's floor: 64 KiB


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
    # How long after a hung actor's worker is restarted the scheduler may take to drop it
    # before the restart is taken to have failed: a rollout or downstream relay is then
    # given up as lost (its process left running: stop it yourself), a trainer or data
    # module fails the run. Keep it above the nanny's restart (it kills a process that
    # does not stop within seconds).
    fence_wait_s: float = Field(60.0, gt=0)
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

    def data_wait(self) -> tuple[float, str]:
        """How long a rollout or the trainer waits for a rebuilt data module, counted from
        its own first call that found the module gone, and the settings that make it.
        The driver counts ``data_restart_timeout_s`` from when it begins the rebuild:
        after it has found the module silent (up to ``heartbeat_timeout_s``) and fenced
        its worker (up to ``fence_wait_s``). Waiting ``data_restart_timeout_s`` alone, a
        rollout gave up, failing the run, while the rebuild was still within its time.

        >>> FaultsConfig().data_wait()
        (240.0, 'faults.data_restart_timeout_s + heartbeat_timeout_s + fence_wait_s')
        """
        total = self.data_restart_timeout_s + self.heartbeat_timeout_s + self.fence_wait_s
        return total, "faults.data_restart_timeout_s + heartbeat_timeout_s + fence_wait_s"


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
