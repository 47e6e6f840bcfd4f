import pydantic
import pytest
from conftest import REPO

from laminar.config import RunConfig, load_config, with_overrides
from laminar.errors import ConfigError


def test_tiny_config_loads_and_records_every_section():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.task.name == "count" and cfg.rollout.replicas == 2
    again = RunConfig.model_validate(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again == cfg  # the stored config reproduces the run's config exactly


def test_overrides_are_typed():
    cfg = with_overrides(
        RunConfig(), ["trainer.lr=1e-4", "sft.enabled=false", "task.prompt_file=p.jsonl"]
    )
    assert cfg.trainer.lr == 1e-4 and cfg.sft.enabled is False and cfg.task.prompt_file == "p.jsonl"


@pytest.mark.parametrize(
    "override, message",
    [
        (["trainer.lrr=1"], r"trainer.lrr: unknown key"),
        (["bogus.x=1"], r"bogus: unknown key"),
        (["trainer.steps=abc"], r"trainer.steps: .*valid integer.*'abc'"),
        (["trainer.steps=0"], r"trainer.steps: .*greater than 0"),
        (["task.name=poetry"], r"task.name: .*'count'.*'poetry'"),
        (["rollout.max_seq_len=20"], r"raise rollout.max_seq_len to at least"),
        (["model.num_heads=3"], r"not divisible by num_heads"),
        (["buffer.max_outstanding_groups=2"], r"raise max_outstanding_groups"),
        (["trainer"], r"not of the form key=value \(section.key=value"),
        (["trainer.steps.x=1"], r"'steps' is not a section"),
        (["task.name=count_range"], r"use task.name=count_range with task.reward=count_in_range"),
        (["task.reward=count_in_range"], r"only its own reward checks"),
        (["task.length_share=2"], r"task.length_share: .*less than or equal to 1"),
        (["trainer.steps=[1"], r"override 'trainer.steps=\[1': the value '\[1' is not valid YAML"),
        # lax pydantic would read these as 1 and 0.0: a number was meant, say so
        (["trainer.lr=true"], r"trainer.lr: takes a number, not true/false \(got True\)"),
        (["trainer.steps=yes"], r"trainer.steps: takes a number, not true/false"),
        (["repack.max_batch=false"], r"repack.max_batch: takes a number, not true/false"),
        (["trainer.betas=[true, 0.9]"], r"trainer.betas: takes numbers, not true/false"),
        # refused by the config, not by numpy or torch on a worker after the warm start
        (["seed=-1"], r"seed: .*greater than or equal to 0"),
        (["seed=4294967296"], r"seed: .*less than 4294967296"),
        (["trainer.betas=[1.5, 2]"], r"trainer.betas: each of AdamW's betas lies in \[0, 1\)"),
        # no field means anything by inf or nan: they would reach the loss or the clock
        (["trainer.lr=.inf"], r"trainer.lr: Input should be a finite number"),
        (["task.truncated_reward=.nan"], r"task.truncated_reward: .*finite number"),
        # rewards are stored as float32: beyond it, inf in the store
        (["task.truncated_reward=-1e39"], r"task.truncated_reward: .*greater than or equal to"),
        (["rollout.pacing.dilation=.inf"], r"rollout.pacing.*finite number"),
        # one real token standing for less than one: the pacing would go negative
        (["rollout.pacing.length_scale=0.5"], r"length_scale: .*greater than or equal to 1"),
        (["cluster.slurm.walltime=forever"], r"walltime: is no time sbatch takes; give minutes"),
        (["cluster.slurm.walltime=1:2:3:4"], r"walltime: is no time sbatch takes"),
        # YAML read an unquoted value as a number or a mapping where a string is meant
        (["run_dir=2024"], r"run_dir: .*\(got 2024\); quote it to give a string"),
        (["task.prompt_file=d/x: y.jsonl"], r"prompt_file: .*got a mapping.*quote it"),
        # settings that used to be clamped without a word
        (
            ["trainer.mini_batches=32", "trainer.groups_per_step=16"],
            r"trainer.mini_batches \(32\) exceeds trainer.groups_per_step \(16\)",
        ),
        (["task.median_len=100", "task.max_len=10"], r"task.median_len \(100\) must be below"),
        (["repack.max_batch=999"], r"repack.max_batch \(999\) exceeds what an engine decodes"),
        (["trainer.clip_c=1"], r"trainer.clip_c: .*must be > 1 \(got 1.0\).*null to turn"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(with_overrides(RunConfig(), ["trainer.steps=5"]), override)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*\n  trainer.stepz: unknown key"):
        load_config(bad)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.step=5", r"trainer.step: unknown key; did you mean trainer.steps\?"),
        ("cluster.slurm.walltme=1", r"cluster.slurm.walltme: .*mean cluster.slurm.walltime\?"),
        ("rollout.pacing.dilaton=1", r"rollout.pacing.dilaton: .*mean rollout.pacing.dilation"),
        ("trainr.steps=1", r"trainr: unknown key; did you mean trainer\?"),
        ("trainer.zzz=5", r"trainer.zzz: unknown key; remove it or check its spelling"),
    ],
)
def test_a_misspelt_key_gets_the_nearest_one(override, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), [override])


def test_config_file_mistakes_are_named(tmp_path):
    """A directory for a file, a section left empty (all its lines commented out: its
    defaults), a key given twice (refused, with both lines: which one was meant?)."""
    with pytest.raises(ConfigError, match=r"is a directory; pass a YAML file"):
        load_config(tmp_path)
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  # steps: 5\ncluster:\n  slurm:\nrepack:\n")
    cfg = load_config(f)
    assert cfg.trainer == RunConfig().trainer and cfg.cluster == RunConfig().cluster
    assert cfg.repack is None  # (an optional section left empty stays off)
    f.write_text("seed: 1\ntrainer:\n  steps: 5\n  lr: 1.0e-4\n  steps: 7\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*'steps' appears twice .*\(lines 3 and 5\)"):
        load_config(f)
    f.write_text("trainer:\n  steps: 5\nrollout:\n  replicas: 2\ntrainer:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"'trainer' appears twice .*\(lines 1 and 5\)"):
        load_config(f)


@pytest.mark.parametrize(
    "value, ok",
    [
        ("4GiB", True),
        ("500 MB", True),
        ("auto", True),
        ("0.5", True),
        (0.5, True),
        (4000000000, True),
        (0, True),
        ("lots", False),
        ("GB", False),
        ("", False),
        ("-5GB", False),
        (-1, False),
        ("inf", False),
        # what a worker cannot run in: Dask reads a number above 1 as bytes
        (100, False),
        (2.0, False),
        ("1KB", False),
        (0.0000001, False),  # (a fraction of this machine's memory: a few kB)
    ],
)
def test_memory_limit_is_what_dask_takes(value, ok):
    """Checked with the config (a run directory is not made for a value the cluster
    would refuse); numbers are fractions of the machine's memory (<= 1) or bytes."""
    from distributed.worker_memory import parse_memory_limit

    override = f"cluster.memory_limit={value!r}"  # (a string quoted: YAML keeps it one)
    if not ok:
        with pytest.raises(ConfigError, match=r"cluster.memory_limit: .*e.g. 4GiB.*\(got "):
            with_overrides(RunConfig(), [override])
        return
    limit = with_overrides(RunConfig(), [override]).cluster.memory_limit
    parse_memory_limit(limit, 1, logger=__import__("logging").getLogger("test"))


@pytest.mark.parametrize(
    "value, ok",
    [
        ("4GB", True),
        ("16GiB", True),
        ("500MB", True),
        (2_000_000_000, True),  # (YAML reads a number: bytes, as dask-jobqueue takes it)
        ("four", False),
        ("GB", False),
        ("-1GB", False),
        (4, False),  # (4 bytes: meant 4GB)
        ("100MB", False),
        (4.0e9, True),  # (YAML reads 4.0e+9 as a float)
    ],
)
def test_a_slurm_jobs_memory_is_a_size_a_worker_can_run_in(value, ok):
    """dask-jobqueue parses it when the jobs are made (after the run directory); a bare
    number is bytes, and Slurm would start the job with --mem=1K."""
    from dask.utils import parse_bytes

    override = f"cluster.slurm.rollout.memory={value!r}"
    if not ok:
        with pytest.raises(ConfigError, match=r"cluster.slurm.rollout.memory: .*e.g. 4GB"):
            with_overrides(RunConfig(), [override])
        return
    memory = with_overrides(RunConfig(), [override]).cluster.slurm.rollout.memory
    assert parse_bytes(memory) >= 256 * 2**20


@pytest.mark.parametrize(
    "written, meant",
    [
        ("10:00:00", "10:00:00"),  # (YAML 1.1 alone reads these as base-60 numbers:
        ("1:30", "1:30"),  # 36000 and 90, and 90 is 90 minutes to sbatch)
        ("90", "90"),  # bare minutes
        ("2-12:00:00", "2-12:00:00"),
        ("'04:00:00'", "04:00:00"),
        ("UNLIMITED", "UNLIMITED"),
    ],
)
def test_a_walltime_is_read_as_written(tmp_path, written, meant):
    f = tmp_path / "c.yaml"
    f.write_text(f"cluster:\n  slurm:\n    walltime: {written}\n")
    assert load_config(f).cluster.slurm.walltime == meant
    cfg = with_overrides(RunConfig(), [f"cluster.slurm.walltime={written}"])
    assert cfg.cluster.slurm.walltime == meant
    # a run's recorded config reads back the same
    (tmp_path / "r.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "r.yaml").cluster.slurm.walltime == meant


def test_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.trainer.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("repack", {"warmup": 3}, "laminar bench repack does not take --warmup; it takes"),
        ("soak", {"overrides": ("a=b",)}, "laminar bench soak does not take --set"),
        ("engine", {"gpus": 64}, "it takes --batches, --new-tokens, --repeats"),
        ("schedules", {"model": "32B"}, "laminar bench schedules does not take --model"),
        ("relay", {"model": "32B"}, "laminar bench relay does not take --model"),
    ],
)
def test_a_bench_refuses_an_option_it_does_not_take_naming_those_it_does(name, options, message):
    """Refused before anything starts: the message names the flags that do apply."""
    from pipelines.bench import run_bench

    with pytest.raises(ConfigError, match=message):
        run_bench(name, **options)


def test_a_schedules_bench_override_with_a_bad_key_fails_before_the_cluster_starts():
    """`laminar bench schedules --set` goes to every arm: a misspelt key is refused at
    once, naming it (a 64- or 128-GPU bench would otherwise start its workers first)."""
    from pipelines.bench import run_bench

    with pytest.raises(ConfigError, match=r"rollout\.groups_per_bach: unknown key"):
        run_bench("schedules", arms=("laminar",), overrides=("rollout.groups_per_bach=4",))


def test_one_override_given_as_a_string_is_one_override():
    """submit(..., overrides="trainer.steps=5"): one key=value, not its characters."""
    assert with_overrides(RunConfig(), "trainer.steps=5").trainer.steps == 5
    assert load_config("configs/tiny.yaml", "seed=3").seed == 3


@pytest.mark.parametrize(
    ("field", "means"),
    [
        ("task.prompt_file", "to use the synthetic task"),
        ("model.path", "to build the built-in tiny model"),
        ("trainer.resume_from", "to start from model.path"),
        ("sft.cache_dir", "to cache in \\$LAMINAR_CACHE"),
        ("run_dir", "for runs/<timestamp>"),
    ],
)
@pytest.mark.parametrize("empty", ["''", "' '"])
def test_an_empty_path_is_refused_naming_the_field(field, means, empty):
    """'' read as unset where a check tests `is None` and as set where one tests
    truthiness: task.prompt_file='' with task.name=count_range passed the pre-start
    checks, skipped the synthetic task's cross-checks and trained the synthetic task."""
    with pytest.raises(
        ConfigError, match=rf"{field}: is empty: remove the key \(or set it to null\) {means}"
    ):
        load_config(REPO / "configs/tiny.yaml", [f"{field}={empty}", "task.name=count_range"])
    # null, or nothing after '=', is unset as before
    assert _field(load_config(REPO / "configs/tiny.yaml", [f"{field}="]), field) is None


def _field(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.correction=tis", "trainer.clip_c=2"], ["clip_c"]),
        (["trainer.correction=tis"], []),  # (clip_c at its default, 3: nothing set)
        (["trainer.correction=tis", "trainer.clip_high=0.3"], ["clip_high"]),
        (["trainer.is_cap=3"], ["is_cap"]),  # (correction none: no importance weights)
        (["trainer.correction=tis", "trainer.is_cap=3"], []),
        (["trainer.correction=decoupled", "trainer.is_cap=3", "trainer.clip_c=3"], []),
        (["trainer.clip_c=3"], []),
        # (clip_c is on by default; null under tis, which clips nothing, is no setting)
        (["trainer.correction=tis", "trainer.clip_c=null"], []),
    ],
)
def test_a_setting_the_correction_ignores_is_warned_of_by_name(caplog, tmp_path, overrides, named):
    """trainer.clip_c (and the clip range) under correction=tis, which clips nothing, and
    trainer.is_cap under none, which has no importance weights, did nothing, silently.
    Warned, naming the field, not refused: a base config run under each correction, or
    saved by a run to be resumed, must still load. Once, by the start's pre-start check:
    not by every load of the config (the driver's, a tool's reading config.yaml)."""
    from pipelines.api import preflight

    with caplog.at_level("WARNING", logger="laminar"):
        cfg = with_overrides(RunConfig(), [*overrides, f"sft.cache_dir={tmp_path}"])
        assert "is ignored under" not in caplog.text  # (loading says nothing)
        preflight(cfg)
    warned = [r.getMessage() for r in caplog.records if "is ignored under" in r.getMessage()]
    assert len(warned) == len(named), warned
    for field, message in zip(named, warned, strict=True):
        assert message.startswith(f"trainer.{field}=") and cfg.trainer.correction in message
