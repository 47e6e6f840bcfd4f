"""Config input that YAML, or the loader, read as something other than what was meant:
each is read as meant, or refused naming the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laminar.config import RunConfig, load_config, with_overrides
from laminar.errors import ConfigError


def test_a_leading_zero_is_decimal_as_yaml_1_2_reads_it(tmp_path):
    """YAML 1.1 (PyYAML) took 010 for octal: `--set seed=010` gave 8, `steps: 0100`
    64 (and `09` was 9)."""
    f = tmp_path / "c.yaml"
    f.write_text("seed: 010\ntrainer:\n  steps: 0100\n  groups_per_step: 1_6\n")
    cfg = load_config(f, ["rollout.replicas=03"])
    assert (cfg.seed, cfg.trainer.steps, cfg.trainer.groups_per_step) == (10, 100, 16)
    assert cfg.rollout.replicas == 3
    cfg = with_overrides(RunConfig(), ["seed=010", "trainer.steps=09", "rollout.top_k=0"])
    assert (cfg.seed, cfg.trainer.steps, cfg.rollout.top_k) == (10, 9, 0)
    # hexadecimal keeps its base; 0o (YAML 1.2's octal, text to PyYAML) is refused, named
    assert with_overrides(RunConfig(), ["seed=0x10"]).seed == 16
    with pytest.raises(ConfigError, match=r"seed: .*integer.*\(got '0o10'\)"):
        with_overrides(RunConfig(), ["seed=0o10"])
    assert with_overrides(RunConfig(), ["run_dir='010'"]).run_dir == "010"


@pytest.mark.parametrize("text", ["", "# all commented out\n", "false\n", "0\n", "hello\n"])
def test_a_config_file_that_is_empty_or_a_scalar_is_refused(tmp_path, text):
    """Read as `{}` (`yaml.load(...) or {}`), it ran every default: a truncated file
    or the wrong one trained the defaults without a word."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    fix = r"write the sections" if not text.strip("#\n al") else r"must hold a mapping"
    with pytest.raises(ConfigError, match=rf"'{f}' (is empty|{fix})"):
        load_config(f)
    f.write_text("{}\n")
    assert load_config(f) == RunConfig()


@pytest.mark.parametrize("section", ["trainer", "rollout", "cluster.slurm", "task"])
@pytest.mark.parametrize("value", ["", "null", "~"])
def test_a_section_set_to_null_is_refused_naming_it(tmp_path, section, value):
    """`--set trainer=` reset every key of the section to its default, the file's too
    (on a resume as well)."""
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  steps: 7\n")
    with pytest.raises(ConfigError, match=rf"override '{section}': {section} is a section"):
        load_config(f, [f"{section}={value}"])
    with pytest.raises(ConfigError, match=rf"--set {section}.KEY=VALUE"):
        with_overrides(load_config(f), [f"{section}={value}"])


def test_a_mapping_for_a_section_sets_the_keys_it_names_and_keeps_the_others(tmp_path):
    """`--set 'trainer={steps: 3}'` replaced the section: the file's `lr` and
    `clip_high` went back to their defaults without a word (and on a resume the
    checkpoint check then named an lr the user never touched; helper 185). An optional
    section's mapping is that section whole, as before."""
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1.0e-3\n  clip_high: 0.5\n  steps: 7\n")
    cfg = load_config(f, ["trainer={steps: 3}"])
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.clip_high) == (3, 1e-3, 0.5)
    assert load_config(f, ["trainer={}"]) == load_config(f)  # (names none: changes none)
    # an optional section's mapping is the section whole: the recipe of docs/deploy.md,
    # certificate files in place of the file's generate: true (helper 188 found it
    # refused while mappings merged into optional sections too)
    g = tmp_path / "g.yaml"
    g.write_text("cluster:\n  security:\n    generate: true\n")
    files = "cluster.security={ca_file: /c/ca.pem, cert: /c/cert.pem, key: /c/key.pem}"
    slurm = Path(__file__).resolve().parents[1] / "configs" / "slurm.yaml"  # (deploy.md's)
    for cfg in (
        load_config(g, [files]),
        with_overrides(load_config(g), [files]),
        load_config(slurm, [files]),
    ):
        assert not cfg.cluster.security.generate and cfg.cluster.security.ca_file == "/c/ca.pem"
    both = ["rollout.pacing={dilation: 3}", "rollout.pacing={tp: 8}"]
    for cfg in (load_config(f, both), with_overrides(load_config(f), both)):
        assert (cfg.rollout.pacing.dilation, cfg.rollout.pacing.tp) == (1.0, 8)
    nested = with_overrides(load_config(f), ["cluster={slurm: {walltime: '2:00:00'}}"])
    assert nested.cluster.slurm.walltime == "2:00:00"
    assert nested.cluster.slurm.partition == RunConfig().cluster.slurm.partition
    with pytest.raises(ConfigError, match="trainer.stepz"):  # (an unknown key: named)
        load_config(f, ["trainer={stepz: 3}"])
    with pytest.raises(ConfigError, match=r"override 'cluster.slurm': cluster.slurm is a sec"):
        with_overrides(load_config(f), ["cluster={slurm: null}"])  # (as --set cluster.slurm=)


def test_an_optional_section_is_still_switched_off_by_null():
    on = with_overrides(RunConfig(), ["repack.max_batch=8", "rollout.pacing.dilation=4"])
    off = with_overrides(on, ["repack=null", "rollout.pacing="])
    assert off.repack is None and off.rollout.pacing is None


def test_a_dotted_key_in_a_file_says_to_nest_it(tmp_path):
    """It said "unknown key; did you mean trainer?"."""
    f = tmp_path / "c.yaml"
    f.write_text("trainer.steps: 3\ncluster:\n  slurm.walltime: '1:00:00'\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    said = str(e.value)
    assert "trainer.steps: a dotted key is not read as a path" in said
    assert "nest it: `steps:` indented under `trainer:`" in said
    assert "cluster.slurm.walltime: a dotted key" in said
    assert "`walltime:` indented under `slurm:`" in said
    assert "did you mean" not in said


def test_max_new_tokens_must_leave_room_for_a_prompt_whatever_the_task(tmp_path):
    """With task.prompt_file set it was found only by preflight, as a prompt too long."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "b"}\n')
    task = f"task.prompt_file={prompts}"
    for new in (160, 200):
        with pytest.raises(ConfigError, match=rf"rollout.max_new_tokens \({new}\) must be"):
            with_overrides(RunConfig(), [task, f"rollout.max_new_tokens={new}"])
        # (the synthetic task's longest prompt is known: the check says how long it is)
        with pytest.raises(ConfigError, match=r"raise rollout.max_seq_len to at least"):
            with_overrides(RunConfig(), [f"rollout.max_new_tokens={new}"])
    cfg = with_overrides(RunConfig(), [task, "rollout.max_new_tokens=159"])
    assert cfg.rollout.max_new_tokens == 159


def test_an_integer_past_pythons_digit_limit_is_named_not_a_traceback(tmp_path):
    """A 5,000-digit integer in the file or a --set raised Python's bare ValueError
    ("Exceeds the limit (4300 digits)"), exit 1 with a traceback (helper 185); the
    message of the --set is cut, not 5,000 digits long."""
    f = tmp_path / "c.yaml"
    f.write_text("seed: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: an integer of 5000 digits"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"not valid YAML \(an integer of 5000 digits") as e:
        with_overrides(RunConfig(), ["seed=" + "9" * 5000])
    assert len(str(e.value)) < 500


def test_a_section_given_a_scalar_or_a_key_read_as_a_boolean_says_the_fix(tmp_path):
    """`--set sft=false` said only "Input should be a valid dictionary or instance of
    SFTConfig"; a key `on:` (YAML 1.1: true) said "trainer.1: Keys should be strings"
    (helper 185)."""
    said = {
        "sft=false": "sft is a section: set its keys (sft.KEY=VALUE); sft.enabled=false turns",
        "repack=false": "repack.KEY=VALUE); repack=null switches it off",
        "trainer=5": "trainer is a section: set its keys (trainer.KEY=VALUE)",
    }
    for override, fix in said.items():
        with pytest.raises(ConfigError, match=re.escape(fix)):
            with_overrides(RunConfig(), [override])
    with pytest.raises(ConfigError) as e:
        with_overrides(RunConfig(), ["trainer=5"])
    assert "null switches" not in str(e.value)  # (an always-on section: null is refused)
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  on: 3\n")
    with pytest.raises(ConfigError, match=r"trainer: a key is True, not a name; YAML reads an "):
        load_config(f)
