"""Damaged inputs found before the cluster starts, each named with its fix: a
checkpoint's tokenizer and data position, a checkpoint's file changed since it was
written (its manifest's size and digest), a run's metrics store, a reward function that
exits or returns beyond float32."""

from __future__ import annotations

import shutil

import pytest
from learner_cases import CFG

from laminar.errors import ModelError
from laminar.learner import CheckpointError, Learner, check_checkpoint


@pytest.fixture(scope="module")
def saved(tiny_policy, tmp_path_factory):
    """A checkpoint of a tiny learner, written once; tests damage a copy (``ckpt``)."""
    return Learner(CFG, tiny_policy).save(tmp_path_factory.mktemp("saved") / "version-000000")


@pytest.fixture
def ckpt(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "version-000000")


@pytest.fixture(scope="module")
def model_config(tiny_policy):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_policy)


@pytest.mark.parametrize("text", ["{", "[]", "{}"])
def test_a_damaged_tokenizer_json_is_refused_before_the_cluster_starts(ckpt, model_config, text):
    """Not checked, it failed once the trainer loaded it, after the cluster started: a
    bare JSONDecodeError ('{'), or tokenizers' 'Model missing' ('{}')."""
    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"tokenizer.json' is damaged.*move this one aside"):
        check_checkpoint(ckpt, model_config, CFG)


@pytest.mark.parametrize("text", ["{", "{}"])
def test_a_tokenizer_that_does_not_load_names_its_folder(ckpt, text):
    """The load itself (where no check ran first: a model.path folder, a rollout's); its
    folder check (check_policy_dir) names the file since it reads it."""
    from laminar.model import load_tokenizer

    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(ModelError, match=rf"'{ckpt}/tokenizer.json' is damaged.*restore the"):
        load_tokenizer(ckpt)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_checkpoint_without_its_tokenizer_files_is_refused(ckpt, model_config, name):
    """Without tokenizer_config.json the tokenizer loaded, silently, with no EOS token."""
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=rf"lacks \['{name}'\]"):
        check_checkpoint(ckpt, model_config, CFG)


def test_a_damaged_tokenizer_config_is_refused(ckpt, model_config):
    (ckpt / "tokenizer_config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json' is damaged"):
        check_checkpoint(ckpt, model_config, CFG)


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        "{}",
        '{"dispatched": "abc"}',
        '{"dispatched": -5}',
        '{"dispatched": 2.5}',
        '{"dispatched": true}',
    ],
)
def test_a_damaged_data_position_is_refused_naming_the_file(ckpt, model_config, text):
    """Each was a bare error on the worker (JSONDecodeError, KeyError, ValueError), or
    (-5) a position before the first prompt, taken."""
    from laminar.prompt_pool import DATA_STATE, data_position

    (ckpt / DATA_STATE).write_text(text)
    with pytest.raises(CheckpointError, match=r"data_state.json' is damaged.*delete it"):
        data_position(str(ckpt))
    with pytest.raises(CheckpointError, match=r"data_state.json' is damaged"):
        check_checkpoint(ckpt, model_config, CFG)


def test_a_data_position_that_does_not_read_is_refused_naming_the_file(ckpt):
    """A folder where data_state.json belongs (a copy gone wrong) ended the resume in a
    raw IsADirectoryError."""
    from laminar.prompt_pool import DATA_STATE, data_position

    (ckpt / DATA_STATE).mkdir()
    with pytest.raises(CheckpointError, match=r"data_state.json' is damaged \(IsADirectory"):
        data_position(str(ckpt))


def test_a_data_position_is_read_and_none_is_the_first_prompt(ckpt, model_config):
    from laminar.prompt_pool import DATA_STATE, data_position

    assert data_position(str(ckpt)) == 0 and data_position(None) == 0
    (ckpt / DATA_STATE).write_text('{"dispatched": 7, "released": 5}')
    assert data_position(str(ckpt)) == 7
    assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0


def _flip(path, at=None):
    """Flip one bit of one byte of ``path`` (by default in its middle: a weight, past
    the safetensors header and before a zip's directory, where no format check looks)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_checkpoint_records_the_size_and_digest_of_every_file_it_wrote(saved):
    import json

    import xxhash

    manifest = json.loads((saved / "manifest.json").read_text())
    on_disk = {p.name for p in saved.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (saved / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "config.json"])
def test_a_flipped_byte_is_refused_naming_the_file_before_any_weights_load(
    ckpt, model_config, tiny_policy, name
):
    """One bit flipped in the tensors' data (the safetensors header and the zip
    directory intact: every format check passed) loaded silently, and the resumed run
    trained from those weights with no error. In config.json: a digit of a number."""
    if name == "config.json":
        text = (ckpt / name).read_text()
        _flip(ckpt / name, text.index('"rms_norm_eps"') + len('"rms_norm_eps": 1e-0'))
    else:
        _flip(ckpt / name)
    said = rf"'{ckpt / name}' is damaged \(its bytes changed since it was written: xxh3_128 "
    fix = r"laminar run --resume RUN_DIR.*move this one aside.*trainer.resume_from"  # (no run)
    with pytest.raises(CheckpointError, match=said + ".*" + fix):
        check_checkpoint(ckpt, model_config, CFG)
    with pytest.raises(CheckpointError, match=said):  # (the trainer's own load, too)
        Learner(CFG, tiny_policy, resume_from=ckpt)


@pytest.mark.parametrize(
    ("name", "cut"),
    [("model.safetensors", 1), ("model.safetensors", 4096), ("generation_config.json", 2)],
)
def test_a_file_cut_short_is_refused_naming_its_size(ckpt, model_config, name, cut):
    """The safetensors header check refused a cut file, as a SafetensorError; a cut
    generation_config.json (which no check read) went through. In a run's checkpoints
    folder, the fix names the run and the checkpoint before."""
    ckpt = shutil.copytree(ckpt, ckpt.parent / "run" / "checkpoints" / "version-000003")
    (ckpt.parent / "version-000002").mkdir()
    path = ckpt / name
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(
        CheckpointError,
        match=rf"'{path}' is damaged \({size - cut:,} bytes, written as {size:,} "
        r"\(manifest.json\): cut short or replaced since\); resume from an earlier "
        rf"checkpoint \(version-000002, beside it\): .*laminar run --resume "
        rf"{ckpt.parent.parent}`\), move this one aside first, renaming it, e.g. to "
        r"version-000003.damaged",
    ):
        check_checkpoint(ckpt, model_config, CFG)


def test_a_checkpoint_written_before_manifests_loads_with_one_warning(
    ckpt, model_config, tiny_policy, caplog
):
    """No manifest: nothing to check against. It loads as before, and the pre-start
    check says once that its files are taken unchecked; the trainer's own check of it
    (after that one) does not say it again."""
    import logging

    (ckpt / "manifest.json").unlink()
    with caplog.at_level(logging.INFO, logger="laminar"):
        assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1
        assert f"{str(ckpt)!r} has no manifest.json" in warned[0].getMessage()
        assert "loaded unchecked" in warned[0].getMessage()
        caplog.clear()
        assert Learner(CFG, tiny_policy, resume_from=ckpt).version == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "no manifest.json" in caplog.text  # (said at INFO: the worker's log)


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"format": 1}',
        '{"format": 9, "files": {}}',
        '{"format": 1, "files": {"config.json": {"size": 3}}}',
        '{"format": 1, "files": {"../x": {"size": 3, "xxh3_128": "%s"}}}' % ("0" * 32),
        '{"format": 1, "files": {"config.json": {"size": -1, "xxh3_128": "%s"}}}' % ("0" * 32),
        '{"format": 1, "files": {}}',  # (every file unchecked)
    ],
)
def test_a_damaged_manifest_is_refused_naming_it(ckpt, model_config, text):
    """A manifest is written with its folder, in the same rename: one that does not read
    says the folder changed since, and no file of it can be vouched for."""
    (ckpt / "manifest.json").write_text(text)
    with pytest.raises(
        CheckpointError,
        match=rf"'{ckpt / 'manifest.json'}' is damaged.*move this one aside.*delete "
        r"manifest.json",
    ):
        check_checkpoint(ckpt, model_config, CFG)


def test_a_file_the_manifest_lists_and_the_folder_lacks_is_refused(ckpt, model_config):
    import json

    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    optional = sorted(
        set(listed)
        - {
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
            "optimizer.pt",
            "rng.pt",
            "trainer_state.json",
        }
    )
    assert optional  # (generation_config.json, special_tokens_map.json, ...)
    (ckpt / optional[0]).unlink()
    with pytest.raises(
        CheckpointError, match=rf"'{ckpt / optional[0]}' is damaged \(missing: the manifest"
    ):
        check_checkpoint(ckpt, model_config, CFG)


def test_a_file_added_since_the_write_is_named_in_a_warning(ckpt, model_config, caplog):
    """Not refused: a note beside the weights changes no weight; but it was not checked."""
    import logging

    (ckpt / "NOTES.txt").write_text("the good one")
    with caplog.at_level(logging.WARNING, logger="laminar"):
        assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0
    assert "['NOTES.txt']" in caplog.text and "not checked" in caplog.text


def test_the_data_position_is_left_out_as_the_driver_rewrites_it(ckpt, model_config, caplog):
    """data_state.json is rewritten at the run's stop (where the prompt order stood)
    and may be deleted to take the prompts from the first again: the manifest leaves it
    out, and its own check reads it (above)."""
    import logging

    from laminar.prompt_pool import DATA_STATE

    (ckpt / DATA_STATE).write_text('{"dispatched": 7}')
    with caplog.at_level(logging.WARNING, logger="laminar"):
        assert check_checkpoint(ckpt, model_config, CFG)["version"] == 0
    assert not caplog.text


@pytest.mark.parametrize(
    "damage",
    ["zarr.json", "updates/zarr.json", "updates/loss/zarr.json", "updates/n_committed"],
)
def test_a_damaged_metrics_store_is_named_before_the_cluster_starts(tmp_path, damage):
    """A resume took it, and the run failed after the cluster started with a bare
    JSONDecodeError (or ValueError) where the driver opened its writer or appended:
    the read-only check says so first, and the writer's open says the same."""
    import json

    from storage.metrics import MetricsWriter, check_metrics_store
    from storage.trajectories import StoreError

    w = MetricsWriter(tmp_path)
    w.append("updates", [{"version": 1, "loss": 0.5}])
    check_metrics_store(tmp_path)  # (a store whole, or none, passes)
    check_metrics_store(tmp_path / "elsewhere")
    store = tmp_path / "metrics.zarr"
    if damage == "updates/n_committed":  # (its commit count, not a count)
        meta = json.loads((store / "updates" / "zarr.json").read_text())
        meta["attributes"]["n_committed"] = "abc"
        (store / "updates" / "zarr.json").write_text(json.dumps(meta))
    else:
        (store / damage).write_text("{")
    fix = r"metrics store '.*metrics.zarr' is damaged.*restore it from a copy, or move it aside"
    with pytest.raises(StoreError, match=fix):
        check_metrics_store(tmp_path)
    with pytest.raises(StoreError, match=fix):
        MetricsWriter(tmp_path)


def exits(response: str, answer: str) -> float:
    """A reward function that calls ``sys.exit(3)`` for the response ``exit``."""
    import sys

    if response == "exit":
        sys.exit(3)
    return float(response == answer)


def interrupts(response: str, answer: str) -> float:
    """A reward function that raises ``KeyboardInterrupt`` (no Ctrl-C: its own raise)."""
    raise KeyboardInterrupt


def huge(response: str, answer: str) -> float:
    """A reward of ``float(response)``: finite in float64, beyond float32 for 1e39."""
    return float(response)


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_reward_function_that_exits_marks_its_item(timeout_s):
    """sys.exit in a reward function escaped the Dask task (no timeout), or ended the
    reward thread, so that each later call waited out task.reward_timeout_s and was
    reported as not returning."""
    import time

    from laminar.rewards import score_batch

    items = [("exit", "1", True), ("1", "1", True), ("exit", "1", True)]
    t0 = time.monotonic()
    scores = score_batch("test_damaged_inputs:exits", items, timeout_s=timeout_s)
    assert [s.error for s in scores] == [
        "reward test_damaged_inputs:exits raised SystemExit: 3",
        None,
        "reward test_damaged_inputs:exits raised SystemExit: 3",
    ]
    assert scores[1].reward == 1.0
    assert time.monotonic() - t0 < 10  # (no call waited for the timeout)


def test_a_reward_functions_keyboard_interrupt_is_its_error_off_the_main_thread():
    """Off the main thread (the reward thread; a Dask worker's task thread) no Ctrl-C
    arrives: a KeyboardInterrupt there is the function's. On the main thread it may be
    Ctrl-C, and goes on up."""
    import threading

    from laminar.rewards import score_batch

    said = "reward test_damaged_inputs:interrupts raised KeyboardInterrupt"
    scores = score_batch("test_damaged_inputs:interrupts", [("1", "1", True)], timeout_s=30.0)
    assert scores[0].error == said
    out = []
    task = threading.Thread(
        target=lambda: out.extend(score_batch("test_damaged_inputs:interrupts", [("1", "1", True)]))
    )
    task.start()
    task.join()
    assert out[0].error == said
    with pytest.raises(KeyboardInterrupt):
        score_batch("test_damaged_inputs:interrupts", [("1", "1", True)])


def test_a_reward_beyond_float32_is_an_error_naming_it():
    """1e39 is finite as a float64 but inf as the float32 it is stored as (and a group's
    variance overflows): marked, as a non-finite reward is."""
    import math

    from laminar.rewards import score_batch

    items = [("1e39", "", True), ("-1e39", "", True), ("3e38", "", True)]
    scores = score_batch("test_damaged_inputs:huge", items)
    assert scores[0].error.startswith(
        "reward test_damaged_inputs:huge returned 1e+39, beyond float32"
    )
    assert "scale it down" in scores[0].error and math.isnan(scores[0].reward)
    assert "returned -1e+39" in scores[1].error
    assert scores[2] == type(scores[2])(3e38)


@pytest.fixture
def policy(tiny_policy, tmp_path):
    return shutil.copytree(tiny_policy, tmp_path / "policy")


def _truncate(path):
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("config.json", lambda p: p.write_text("{")),
        ("config.json", lambda p: p.write_text("[]")),
        ("tokenizer.json", lambda p: p.write_text("{}")),
        ("tokenizer_config.json", lambda p: p.write_text("{")),
        ("model.safetensors", _truncate),
    ],
)
def test_a_damaged_file_of_a_model_path_folder_is_named_before_the_cluster_starts(
    policy, small_config, name, damage
):
    """The pre-start check looked only for the files: a bad config.json was a traceback
    (JSONDecodeError), a bad tokenizer.json a KeyError 'added_tokens', a truncated
    model.safetensors a SafetensorError once the cluster had started, naming no file."""
    from laminar.config import with_overrides
    from pipelines.api import preflight

    damage(policy / name)
    cfg = with_overrides(small_config, [f"model.path={policy}", "sft.enabled=false"])
    with pytest.raises(ModelError, match=rf"'{policy / name}' is damaged.*restore the folder"):
        preflight(cfg)


@pytest.mark.parametrize("chunk", ["updates/loss/c/0", "updates/version/c/0"])
def test_a_damaged_last_chunk_of_the_metrics_is_named_before_the_cluster_starts(tmp_path, chunk):
    """The chunk a resumed run's first append rewrites: the run trained, then failed at
    its stop ("Zstd decompression error") and lost the resumed segment's update rows."""
    from storage.metrics import MetricsWriter, check_metrics_store
    from storage.trajectories import StoreError

    MetricsWriter(tmp_path).append("updates", [{"version": 1, "loss": 0.5}])
    f = tmp_path / "metrics.zarr" / chunk
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(StoreError, match=r"metrics store '.*metrics.zarr' is damaged.*copy"):
        check_metrics_store(tmp_path)
