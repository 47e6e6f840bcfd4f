"""Typed, frozen run configuration, loaded from YAML with ``a.b=value`` overrides.

One pydantic model per role; unknown keys are rejected; cross-field checks say the reason
and the fix. Every error is a :class:`~laminar.errors.ConfigError` naming the field.

>>> cfg = RunConfig.model_validate({"trainer": {"steps": 3}})
>>> cfg.trainer.steps, cfg.rollout.group_size
(3, 8)
>>> with_overrides(cfg, ["trainer.lr=1e-4"]).trainer.lr
0.0001

The sections live in :mod:`laminar.config_sections` (the role sections and their base)
and :mod:`laminar.config_cluster` (the cluster and its deployment); this module holds
the run as a whole (:class:`RunConfig`, the checks across sections) and reading it
(YAML, overrides, error messages), and re-exports every section, so ``from
laminar.config import X`` works for each.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from laminar.config_cluster import MIN_JOB_MEMORY as MIN_JOB_MEMORY
from laminar.config_cluster import ClusterConfig, vllm_gpu_problem
from laminar.config_cluster import SlurmConfig as SlurmConfig
from laminar.config_cluster import SlurmRole as SlurmRole
from laminar.config_cluster import TLSConfig as TLSConfig
from laminar.config_sections import FLOAT32_MAX as FLOAT32_MAX
from laminar.config_sections import (
    BufferConfig,
    FaultsConfig,
    MetricsConfig,
    ModelConfig,
    PipelineConfig,
    RelayConfig,
    RepackConfig,
    RolloutConfig,
    SFTConfig,
    TaskConfig,
    TrainerConfig,
    _Section,
)
from laminar.config_sections import PacingConfig as PacingConfig
from laminar.config_sections import TrainerPacingConfig as TrainerPacingConfig
from laminar.errors import ConfigError


class RunConfig(_Section):
    """A whole run."""

    seed: int = Field(0, ge=0, lt=2**32)  # numpy's and torch's seeds take [0, 2**32)
    _unset_means: ClassVar[dict[str, str]] = {"run_dir": "for runs/<timestamp>"}

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
        if r.max_new_tokens >= r.max_seq_len:  # (with task.prompt_file: found here too)
            raise ValueError(
                f"rollout.max_new_tokens ({r.max_new_tokens}) must be below "
                f"rollout.max_seq_len ({r.max_seq_len}): a sequence holds its prompt and "
                "the generated tokens, so no prompt would fit; lower rollout.max_new_tokens "
                "or raise rollout.max_seq_len"
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
        if (why := vllm_gpu_problem(self.cluster, r.engine)) is not None:
            raise ValueError(why)  # (at load: the cluster's open checks it again)
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
        eta, room, per_step = self.pipeline.eta, b.max_outstanding_groups, t.groups_per_step
        if schedule == "partial_rollout" and room < (eta + 1) * per_step:
            # Both count the groups dispatched and not yet consumed: back-pressure would
            # hold dispatch before η does, and the run keep a bound it does not report.
            # (η 0 is refused above; so is room for less than one batch: bound ≥ 0.)
            bound = room // per_step - 1
            lower = f", or pipeline.eta={bound}" if bound >= 1 else ""
            raise ValueError(
                f"pipeline.schedule=partial_rollout with pipeline.eta={eta}: "
                f"(pipeline.eta + 1) × trainer.groups_per_step = {(eta + 1) * per_step} "
                f"groups may be out, but buffer.max_outstanding_groups={room} stops "
                f"dispatch first (the bound in force would be eta={bound}): set "
                f"buffer.max_outstanding_groups to at least {(eta + 1) * per_step}{lower}"
            )
        return self

    def doomed_dispatch(self) -> str | None:
        """Why the configured staleness bound will evict much of what is generated, and
        the setting that stops it, or ``None``.

        ``buffer.max_train_staleness=k`` evicts a group trained more than k versions
        after the one that generated it, after it was generated. Under ``laminar`` up to
        ``max_outstanding_groups`` groups are out at once: past ``max(k, 1)`` global
        batches' worth, the ones that finish last (the longest responses) wait longer
        than k versions, every time. ``tiny.yaml`` with k=1 (32 groups out, 16 a batch)
        evicted 1920 of 6016 trajectories (32%), and trained the shorter, likelier-right
        ones (mean response 9.0 tokens and reward 0.77, against 11.1 and 0.70 evicted);
        with 16 out, none, in the same RL wall time (29.9 s against 28.9 s) and at the
        same mean s_train (0.97). Under ``partial_rollout`` the η rule lets groups out
        η versions ahead: past k, the same."""
        k, b = self.buffer.max_train_staleness, self.buffer
        if k is None:
            return None
        schedule, per_step = self.pipeline.schedule, self.trainer.groups_per_step
        if schedule == "laminar" and b.max_outstanding_groups > max(k, 1) * per_step:
            room = max(k, 1) * per_step
            return (
                f"buffer.max_train_staleness={k} with buffer.max_outstanding_groups="
                f"{b.max_outstanding_groups} ({b.max_outstanding_groups / per_step:g} global "
                f"batches of trainer.groups_per_step={per_step}) out at once: the groups "
                f"that finish last, the longest responses, wait past {k} version(s) and are "
                "evicted, generated for nothing, and what is trained is the shorter ones "
                f"(configs/tiny.yaml with k=1: 32% evicted). Set buffer.max_outstanding_"
                f"groups={room} to generate only what the bound lets train (tiny.yaml: "
                "none evicted, the same wall time), or raise the bound (docs/schedules.md)"
            )
        if schedule == "partial_rollout" and self.pipeline.eta > k:
            return (
                f"buffer.max_train_staleness={k} with pipeline.eta={self.pipeline.eta}: the "
                f"η rule dispatches groups up to {self.pipeline.eta} versions ahead, and those "
                f"past {k} are evicted, generated for nothing, the longest responses first; "
                f"set pipeline.eta={k} (or raise the bound)"
            )
        return None

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


def _is_section(path: tuple) -> bool:
    """Whether ``path`` names a section that is always on (``trainer``, ``cluster.slurm``),
    not an optional one (``repack``) nor a key."""
    parent = _section_at(path[:-1])
    field = parent.model_fields.get(path[-1]) if parent is not None else None
    a = None if field is None else field.annotation
    return isinstance(a, type) and issubclass(a, BaseModel)


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _unknown_key(loc: tuple) -> str:
    """What to say of an unknown key: the nearest known one of its section, if any."""
    section = _section_at(loc[:-1])
    if section is not None and isinstance(loc[-1], str) and "." in loc[-1]:
        head, *rest = loc[-1].split(".")
        if _section_at((*loc[:-1], head)) is not None:
            keys = [head, *rest]
            under = " under ".join(f"`{k}:`" for k in reversed(keys[:-1]))
            return (
                "a dotted key is not read as a path in a config file (dots are for "
                f"--set); nest it: `{keys[-1]}:` indented under {under}"
            )
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
        if e["type"] == "invalid_key":
            # (YAML 1.1 reads an unquoted on/off/yes/no/y/n as true/false: a key too)
            parent = ".".join(str(p) for p in e["loc"][:-1]) or "(top level)"
            lines.append(
                f"  {parent}: a key is {given!r}, not a name"
                + (
                    "; YAML reads an unquoted on, off, yes, no, y or n as true/false: "
                    "quote that key ('on': ...)"
                    if isinstance(given, bool)
                    else "; quote it"
                )
            )
            continue
        if e["type"] in ("model_type", "dict_type") and not isinstance(given, dict):
            section = _section_at(tuple(e["loc"]))
            if section is not None:
                fixes = [f"set its keys ({loc}.KEY=VALUE)"]
                if "enabled" in section.model_fields:
                    fixes.append(f"{loc}.enabled=false turns it off")
                elif _section_at(tuple(e["loc"][:-1])) is not None and not _is_section(
                    tuple(e["loc"])
                ):
                    fixes.append(f"{loc}=null switches it off")
                shown += f"; {loc} is a section: " + "; ".join(fixes)
        if e["type"] == "string_type" and given is not None:
            # (YAML, in the file or a --set, read it as a number, a boolean or a mapping:
            # an unquoted "2024", "true" or "a: b")
            what = "a mapping (a ': ' in it)" if isinstance(given, dict) else repr(given)
            shown = f" (got {what}); quote it to give a string, e.g. {loc}='...'"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if value is None and _is_section(tuple(keys)):
        # (a section can be off only where it is optional: null would put every key of
        # it back to its default, the config file's settings and all, without a word)
        raise ConfigError(
            f"override {dotted!r}: {dotted} is a section, which cannot be null or empty "
            f"(that would reset all of its keys to their defaults); set its keys one by "
            f"one (--set {dotted}.KEY=VALUE). Only an optional section (repack, "
            "rollout.pacing, trainer.pacing, cluster.security) is switched off by null"
        )
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if child is None:  # an optional section that is off (rollout.pacing): switch it on
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = child
    if (
        isinstance(value, dict)
        and isinstance(node.get(keys[-1]), dict)
        and all(isinstance(k, str) for k in value)
        and _is_section(tuple(keys))
    ):
        # A mapping for a section that is always on sets the keys it names, one by one
        # (`--set 'trainer={steps: 3}'` is `--set trainer.steps=3`): it replaced the
        # section, putting every other key of it, the config file's too, back to its
        # default without a word. An optional section's (cluster.security, repack,
        # rollout.pacing, trainer.pacing) is the section whole, as null is its absence:
        # its keys may exclude each other (security's generate and its files).
        for k, v in value.items():
            _set_path(data, f"{dotted}.{k}", v)
        return
    node[keys[-1]] = value


def override_list(overrides: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Overrides as a list: one string alone is one override (not its characters); None
    is none. Anything else (a dict, a number) is a :class:`ConfigError` saying what they
    are."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(
            "overrides must be a list of 'section.key=value' strings (e.g. "
            f"['trainer.steps=20']), not {_cut(repr(overrides))}"
        )
    return list(overrides)


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
                f"override {_cut(repr(item))}: the value {_cut(repr(raw))} is not valid YAML "
                f"({_cut(reason, 160)}); quote a string, and write lists as [a, b]"
            ) from None
        parsed.append((key.strip(), value))
    return parsed


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """A config from a dict of sections, as a YAML file holds them
    (``{"trainer": {"steps": 20}}``), checked as a file's is."""
    return _validate(data, "the config dict")


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


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer as YAML 1.2 reads it: ``010`` is ten, as it reads to anyone but a YAML
    1.1 parser (which takes a leading 0 for octal: ``seed: 010`` was 8, ``steps: 0100``
    64, while ``09`` was 9). ``0o10``, ``0x1f`` and ``0b101`` keep their bases."""
    value = loader.construct_scalar(node)
    digits = value.replace("_", "").lstrip("+-")
    try:
        if len(digits) > 1 and digits.startswith("0") and digits.isdigit():
            return int(value.replace("_", ""), 10)
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError as e:  # (Python's limit on the digits of an int: a bare ValueError)
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(digits)} digits ({e})", node.start_mark
        ) from None


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


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
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    except UnicodeDecodeError as e:  # (a binary file, or another encoding's text)
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
            "save it as UTF-8 YAML"
        ) from None
    except OSError as e:  # (unreadable: permissions, EIO)
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    if data is None:  # (empty, or only comments: a truncated or wrong file, most likely)
        raise ConfigError(
            f"config file {str(path)!r} is empty (or only comments); write the sections "
            "to set (e.g. `trainer: {steps: 20}`), or `{}` for every default"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (it holds "
            f"{_cut(repr(data))}), e.g. `trainer: {{steps: 20}}`"
        )
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    return _validate(data, str(path) + (f" with --set {' '.join(overrides)}" if overrides else ""))
