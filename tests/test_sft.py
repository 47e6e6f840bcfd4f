"""The warm start is cached by a content hash of everything that shapes it."""

import json

from laminar.config import with_overrides
from laminar.prompt_pool import load_prompts
from laminar.sft import warm_start


def test_warm_start_is_cached_by_its_inputs(small_config, tmp_path):
    cfg = with_overrides(small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=3"])
    prompts = load_prompts(cfg)
    path, info = warm_start(cfg, prompts)
    assert info["cached"] is False and 0 <= info["eval_reward"] <= 1
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    again, info2 = warm_start(cfg, prompts)
    assert again == path and info2["cached"] is True
    (scored,) = json.loads((path / "sft_info.json").read_text())["eval_rewards"].values()
    assert info2["eval_reward"] == info["eval_reward"] == scored
    # Another reward scores the same weights (no training), once; sampling counts too.
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    credit = with_overrides(cfg, ["task.reward=prefix_credit"])
    path3, info3 = warm_start(credit, prompts)
    assert path3 == path and info3["cached"] is True and 0 <= info3["eval_reward"] <= 1
    assert info3["eval_reward"] != info["eval_reward"]  # partial credit: a different figure
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert warm_start(credit, prompts)[1]["eval_reward"] == info3["eval_reward"]
    cooler = with_overrides(cfg, ["rollout.temperature=0.5"])
    assert warm_start(cooler, prompts)[0] == path
    scorings = json.loads((path / "sft_info.json").read_text())["eval_rewards"]
    assert len(scorings) == 3 and warm_start(cfg, prompts)[1]["eval_reward"] == scored
    # Anything that changes the result changes the entry; threads and micro-batching do not.
    assert warm_start(with_overrides(cfg, ["sft.demo_error_rate=0.2"]), prompts)[0] != path
    assert (
        warm_start(
            with_overrides(cfg, ["sft.torch_threads=3", "sft.micro_batch_tokens=64"]), prompts
        )[0]
        == path
    )
    assert warm_start(cfg, prompts[:-1])[0] != path


def test_disabled_warm_start_uses_the_base_policy(small_config, tiny_policy, tmp_path):
    cfg = with_overrides(
        small_config,
        [f"sft.cache_dir={tmp_path}", "sft.enabled=false", f"model.path={tiny_policy}"],
    )
    path, info = warm_start(cfg, load_prompts(cfg))
    assert path == tiny_policy and info["cached"] is True


def test_count_range_warm_start_learns_from_its_demonstrations(small_config, tmp_path):
    """count_range trains on a demonstration drawn anew per draw and is evaluated with
    its own reward; a run of it shares no cache entry with count's."""
    base = with_overrides(small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=3"])
    cfg = with_overrides(base, ["task.name=count_range", "task.reward=count_in_range"])
    path, info = warm_start(cfg, load_prompts(cfg))
    assert info["cached"] is False and 0 <= info["eval_reward"] <= 1
    assert warm_start(base, load_prompts(base))[0] != path


def test_an_unreadable_cache_entry_is_set_aside_and_trained_again(small_config, tmp_path, caplog):
    """A truncated ``sft_info.json`` (a crash while it was written) neither fails every
    later run nor is deleted: the entry moves aside, named in a warning, and is rebuilt."""
    cfg = with_overrides(small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=2"])
    prompts = load_prompts(cfg)
    path, _ = warm_start(cfg, prompts)
    (path / "sft_info.json").write_text('{"cached": fal')
    with caplog.at_level("WARNING", logger="laminar.sft"):
        again, info = warm_start(cfg, prompts)
    assert again == path and info["cached"] is False
    (aside,) = tmp_path.glob(f"{path.name}.unreadable-*")
    assert (aside / "sft_info.json").read_text() == '{"cached": fal'  # kept as it was
    assert str(aside) in caplog.text and "cannot be read" in caplog.text
    assert warm_start(cfg, prompts)[1]["cached"] is True
    # a folder with no info file at all (not laminar's, or half-copied by hand): likewise
    (path / "sft_info.json").unlink()
    assert warm_start(cfg, prompts)[1]["cached"] is False
    assert len(list(tmp_path.glob(f"{path.name}.unreadable-*"))) == 2


def test_a_cache_entry_whose_weights_changed_is_set_aside_and_trained_again(
    small_config, tmp_path, caplog
):
    """An entry records each file's size and digest (but sft_info.json, where scorings
    are added): one flipped bit in the weights (the safetensors header intact, so they
    load) would start every run from weights no warm start made. It moves aside, named
    with the file in a warning, and is trained again; an entry with no manifest (written
    before entries had one) is used as it is."""
    cfg = with_overrides(small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=2"])
    prompts = load_prompts(cfg)
    path, _ = warm_start(cfg, prompts)
    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert "model.safetensors" in listed and "sft_info.json" not in listed
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="laminar.sft"):
        again, info = warm_start(cfg, prompts)
    assert again == path and info["cached"] is False
    (aside,) = tmp_path.glob(f"{path.name}.unreadable-*")
    assert (aside / "model.safetensors").read_bytes() == bytes(data)  # kept as it was
    assert "model.safetensors" in caplog.text and "its bytes changed" in caplog.text
    (path / "manifest.json").unlink()
    assert warm_start(cfg, prompts)[1]["cached"] is True


def test_a_prompt_file_of_other_rows_joining_to_the_same_text_is_trained_anew(
    small_config, tmp_path
):
    """The cache key's prompt hash must tell rows apart: one prompt whose answer holds a
    newline and a tab is not the two prompts the same text would make if joined with
    those characters (the second file reused the first one's warm start)."""
    f = tmp_path / "p.jsonl"
    cfg = with_overrides(
        small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=1", f"task.prompt_file={f}"]
    )
    one = [{"prompt": "n 2 >", "answer": "1 2\nn 3 >\t1 2 3"}]
    two = [{"prompt": "n 2 >", "answer": "1 2"}, {"prompt": "n 3 >", "answer": "1 2 3"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in one))
    first, _ = warm_start(cfg, load_prompts(cfg))
    f.write_text("".join(json.dumps(r) + "\n" for r in two))
    second, info = warm_start(cfg, load_prompts(cfg))
    assert info["cached"] is False and second != first


def test_a_prompt_file_is_keyed_by_its_prompts_not_its_path(small_config, tmp_path, monkeypatch):
    """The key held the prompt file's path: a run that named it relative, resumed once
    runs recorded it absolute, trained its warm start again (as did the same file
    copied elsewhere). The same prompts at two paths share an entry; other prompts at
    the same path do not."""
    rows = [{"prompt": f"n {n} >", "answer": " ".join(map(str, range(1, n + 1)))} for n in (2, 3)]
    a, b = tmp_path / "a" / "p.jsonl", tmp_path / "b" / "q.jsonl"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = with_overrides(small_config, [f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=1"])
    at = {f: with_overrides(base, [f"task.prompt_file={f}"]) for f in (a, b)}
    first, info = warm_start(at[a], load_prompts(at[a]))
    assert info["cached"] is False
    again, info = warm_start(at[b], load_prompts(at[b]))
    assert again == first and info["cached"] is True
    monkeypatch.chdir(tmp_path)  # (named relative: as older runs recorded it)
    relative = with_overrides(base, ["task.prompt_file=a/p.jsonl"])
    assert warm_start(relative, load_prompts(relative))[0] == first
    # other contents at the same path: trained anew
    b.write_text(json.dumps(rows[0]) + "\n")
    other, info = warm_start(at[b], load_prompts(at[b]))
    assert other != first and info["cached"] is False


def test_an_entry_keyed_by_a_prompt_files_path_is_adopted(small_config, tmp_path, monkeypatch):
    """An entry written when the key held the path (named relative, as runs recorded
    it then) is found by a resume that names the file absolute, from the directory the
    run started in, and renamed to the key of its prompts: nothing is trained again."""
    from laminar import sft

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text(json.dumps({"prompt": "n 2 >", "answer": "1 2"}))
    monkeypatch.chdir(tmp_path)
    overrides = [f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=1"]
    cfg = with_overrides(small_config, [*overrides, "task.prompt_file=data/p.jsonl"])
    # the entry as laminar keyed it then: by the path's text
    monkeypatch.setattr(sft, "PROMPT_FILE_KEY", "data/p.jsonl")
    old, info = warm_start(cfg, load_prompts(cfg))
    assert info["cached"] is False
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    absolute = with_overrides(cfg, [f"task.prompt_file={tmp_path / 'data' / 'p.jsonl'}"])

    def read_only(*a):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:  # (a cache this user cannot write: served as it is)
        m.setattr(sft.os, "rename", read_only)
        assert warm_start(absolute, load_prompts(absolute))[0] == old
    new, info = warm_start(absolute, load_prompts(absolute))
    assert info["cached"] is True and new != old and not old.exists()
    assert warm_start(absolute, load_prompts(absolute))[0] == new


def test_a_reward_that_fails_on_everything_is_given_up_on_by_the_runs_rule(
    small_config, tmp_path, recwarn, caplog
):
    """The run's rule (64 failures, none scored) ends the warm start's scoring with the
    run's message, not after each of its 256 responses (a reward that hangs till its
    timeout stalled it 256 times that); the score is nan, not kept, and the run goes on
    (its rollouts' failures stop it by the same rule over a window that lets a late
    reward service catch up). The trained weights are kept: the run after the fix scores
    them without training again."""
    import logging
    import math

    cfg = with_overrides(
        small_config,
        [f"sft.cache_dir={tmp_path}", "sft.steps=3", "task.reward=laminar.rewards:_broken"],
    )
    prompts = load_prompts(cfg)
    with caplog.at_level(logging.WARNING, logger="laminar.sft"):
        _, info = warm_start(cfg, prompts)
    assert math.isnan(info["eval_reward"])
    said = caplog.text
    assert "failed on all 64 responses it was given" in said, said
    assert "scoring the warm start" in said and "ZeroDivisionError" in said
    # (and what happens next: the run's ~60 s of generating looked like a hang)
    # (every rule that may stop the run, as pipelines.driver_polls has them)
    assert (
        "the run goes on, and its rollouts' reward failures stop it: on every response for "
        "60 s (time for a reward service that starts late to come up), on 90% or more of "
        "them over 120 s once some have scored, or on more than "
        "task.reward_max_failure_share of them over 300 s from the first score"
    ) in said
    # (a nan is not kept: the same reward, once fixed, is scored again)
    assert math.isnan(warm_start(cfg, prompts)[1]["eval_reward"])
    fixed = with_overrides(cfg, ["task.reward=exact_match"])
    again = warm_start(fixed, prompts)[1]
    assert again["cached"] is True and math.isfinite(again["eval_reward"])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_sharded_warm_start_is_reused_and_its_shards_checked(
    small_config, tmp_path, monkeypatch, caplog
):
    """A model past save_pretrained's max_shard_size is saved as an index and shards,
    without model.safetensors: the entry read as damaged, was moved aside and trained
    again on every run. Its shards are checked against the manifest like the one file."""
    from transformers import LlamaForCausalLM

    save = LlamaForCausalLM.save_pretrained
    monkeypatch.setattr(
        LlamaForCausalLM,
        "save_pretrained",
        lambda self, d, **k: save(self, d, **{**k, "max_shard_size": "500KB"}),
    )
    cfg = with_overrides(
        small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=1", "task.num_prompts=16"]
    )
    prompts = load_prompts(cfg)
    path, info = warm_start(cfg, prompts)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert warm_start(cfg, prompts)[1]["cached"] is True
    assert not list(tmp_path.glob("*.unreadable-*"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:-8])  # one shard cut short
    with caplog.at_level("WARNING", logger="laminar.sft"):
        assert warm_start(cfg, prompts)[1]["cached"] is False
    assert shards[-1].name in caplog.text


def test_a_damaged_entry_in_a_cache_this_user_cannot_write_names_the_setting(
    small_config, tmp_path, monkeypatch
):
    """It could not be moved aside: a bare PermissionError from mkdtemp, on the
    trainer's worker. Now a ConfigError naming the entry, sft.cache_dir and the fix."""
    import tempfile

    import pytest

    from laminar.errors import ConfigError

    cfg = with_overrides(
        small_config, [f"sft.cache_dir={tmp_path}", "sft.steps=1", "task.num_prompts=16"]
    )
    prompts = load_prompts(cfg)
    path, _ = warm_start(cfg, prompts)
    (path / "sft_info.json").write_text('{"cached": fal')

    def refused(*a, dir=None, **k):  # (as root, a chmod does not refuse: stand in)
        raise PermissionError(13, "Permission denied", dir)

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(ConfigError, match=r"entry .*sft-.*cannot be moved aside.*sft.cache_dir"):
        warm_start(cfg, prompts)


def test_a_damaged_built_in_model_is_built_again(small_config, tmp_path, caplog):
    """Its error said to point model.path at another HF folder, though the run never set
    model.path: the built-in model is made by laminar, so it is set aside and rebuilt."""
    from laminar.sft import base_policy

    cfg = with_overrides(small_config, [f"sft.cache_dir={tmp_path}"])
    built = base_policy(cfg)
    good = (built / "config.json").read_bytes()
    (built / "config.json").write_text('{"model_type": ')
    with caplog.at_level("WARNING", logger="laminar.sft"):
        assert base_policy(cfg) == built
    assert (built / "config.json").read_bytes() == good and "moved to" in caplog.text
    assert len(list(tmp_path.glob(f"{built.name}.unreadable-*"))) == 1
