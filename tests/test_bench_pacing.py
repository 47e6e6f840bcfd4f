"""`laminar bench pacing`: the fit, the shapes it builds, a run on this machine, and the
config fields that take what it measures."""

import json

import pytest

from laminar.config import PacingConfig, load_config, with_overrides
from laminar.errors import ConfigError
from laminar.manager import repack_max_batch
from laminar.pacing import MODELS, TimeModel
from pipelines.bench import run_bench
from pipelines.bench_pacing import (
    ARCHS,
    BATCHES,
    CONTEXTS,
    Arch,
    calibrated,
    fit_decode,
    split_fixed,
)
from pipelines.cli import main

TINY = Arch(hidden=128, intermediate=256, heads=8, kv_heads=4, head_dim=16, layers=2, vocab=512)


def _quick_run(**options):
    """The bench on the tiny decoder, one repeat of one step per point."""
    return run_bench(
        "pacing",
        None,
        model="tiny",
        arch=TINY,
        accelerator="H200",
        batches=(1, 4),
        contexts=(8, 16),
        prefills=(16,),
        repeats=1,
        steps=1,
        **options,
    )


def _grid(model: TimeModel, batches=BATCHES, contexts=CONTEXTS):
    return {(b, s): model.decode_time(b, b * s) for b in batches for s in contexts}


def test_the_fit_recovers_the_constants_of_the_model_that_made_the_times():
    m = TimeModel.named(
        "H200",
        "7B",
        tp=1,
        t_fix=0.0,
        c_seq=0.0,
        bw_efficiency=0.85,
        kv_efficiency=0.95,
        decode_mfu=0.7,
    )
    fit = fit_decode(_grid(m))
    assert fit.compute_bound
    assert fit.t0 == pytest.approx(m.weight_read_time, rel=1e-6)
    assert fit.k == pytest.approx(m.model.kv_bytes_per_token / m._kv_bw, rel=1e-6)
    assert fit.c == pytest.approx(m.compute_per_sequence, rel=1e-6)
    assert fit.batch_limit == pytest.approx(m.batch_limit, rel=1e-6)


def test_a_grid_that_never_leaves_the_memory_bound_measures_no_compute():
    m = TimeModel.named("H200", "7B", tp=1)
    fit = fit_decode(_grid(m, batches=(1, 8, 32)))
    assert not fit.compute_bound
    assert fit.c is None and fit.batch_limit is None
    with pytest.raises(ValueError, match="two contexts"):
        fit_decode({(1, 256): 1e-3, (8, 256): 1e-3})


def test_the_fixed_cost_is_told_apart_from_the_weight_read():
    t_fix, bw, size = 2e-3, 4.2e12, 2
    full, narrow = 7_000_000_000, 2_000_000_000
    got_fix, got_bw = split_fixed(
        t_fix + full * size / bw, t_fix + narrow * size / bw, full, narrow, size
    )
    assert got_fix == pytest.approx(t_fix) and got_bw == pytest.approx(bw)
    # a narrower decoder that was not faster (noise) gives no split, not a wrong one
    assert split_fixed(5e-3, 5e-3, full, narrow, size) == (None, None)


def test_the_built_shapes_are_the_pacing_models_and_shard_evenly():
    for name, arch in ARCHS.items():
        shape = MODELS[name]
        assert arch.params == pytest.approx(shape.params, rel=0.01), name
        assert (arch.layers, arch.kv_heads, arch.head_dim) == (
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
        )
    shard = ARCHS["7B"].shard(4)
    assert (shard.heads, shard.kv_heads, shard.intermediate) == (7, 1, 18944 // 4)
    assert shard.vocab * 4 == ARCHS["7B"].vocab
    with pytest.raises(ConfigError, match="--tp 3 does not divide heads 28"):
        ARCHS["7B"].shard(3)


def test_the_bench_runs_here_and_its_constants_load_as_config(tmp_path):
    out = tmp_path / "pacing.json"
    result = run_bench(
        "pacing",
        str(out),
        model="tiny",
        arch=TINY,
        accelerator="H200",
        batches=(1, 16),
        contexts=(8, 32),
        # the tiny decoder's prefill is mostly fixed cost: 64 tokens over 16 is ≈ 0.3 ms,
        # less than one scheduling hiccup of a loaded host (CI once read 16 tokens at
        # 2.0 ms, 64 at 1.1, and the fit found no cost per token); 1,024 is ≈ 13 ms more
        prefills=(16, 1024),
        train_tokens=64,
        repeats=3,
        steps=2,
    )
    data = json.loads(out.read_text())
    assert data["bench"] == "pacing" and data["options"]["accelerator"] == "H200"
    for b in (1, 16):
        for s in (8, 32):
            assert data["figures"][f"decode_ms_b{b}_ctx{s}"] > 0
            assert data["figures"][f"model_decode_ms_b{b}_ctx{s}"] > 0
            assert len(data["samples"][f"decode_s_b{b}_ctx{s}"]) == 3
            ratio = data["ratios"][f"decode_b{b}_ctx{s}_measured_vs_model"]
            assert ratio == pytest.approx(
                data["figures"][f"decode_ms_b{b}_ctx{s}"]
                / data["figures"][f"model_decode_ms_b{b}_ctx{s}"]
            )
    assert data["figures"]["train_tok_s_per_gpu"] > 0
    assert data["figures"]["prefill_ms_n1024"] > data["figures"]["prefill_ms_n16"] > 0
    assert "decode_mfu_measured_vs_assumed" in data["ratios"]
    # what it measured is what `--set rollout.pacing.*` takes
    constants = calibrated(result.figures)
    # (which of them a CPU's noise lets the fit measure varies; a prefill 64× longer is
    # slower by more than its noise)
    fields = {"t_fix", "bw_efficiency", "kv_efficiency", "decode_mfu", "prefill_mfu"}
    assert "prefill_mfu" in constants and set(constants) <= fields
    PacingConfig(**constants)
    assert any("--set rollout.pacing." in n for n in result.notes)


def test_split_kv_attention_equals_one_attention_call_and_runs_in_the_bench():
    import torch
    import torch.nn.functional as F

    from pipelines.bench_pacing import split_kv_attention

    q, k, v = torch.randn(3, 2, 7, 16), torch.randn(3, 2, 128, 16), torch.randn(3, 2, 128, 16)
    whole = F.scaled_dot_product_attention(q, k, v)
    for n in (2, 8, 128):
        assert torch.allclose(split_kv_attention(q, k, v, n), whole, atol=1e-5), n
    result = _quick_run(split_kv=4, train_tokens=32)
    assert result.options["split_kv"] == 4
    assert any("split-KV in 4 chunks" in n for n in result.notes)


def test_a_shard_run_times_one_device_and_skips_training():
    result = _quick_run(tp=2)
    assert result.options["tp"] == 2
    assert result.figures["train_tok_s_per_gpu"] is None
    assert any("shard of TP2" in n for n in result.notes)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model": "9B"}, "--model '9B' is unknown"),
        ({"accelerator": "B300"}, "--accelerator 'B300' is unknown"),
        ({"batches": (0, 8)}, "--batches must be positive"),
        ({"tp": 0}, "--tp must be ≥ 1"),
        ({"layers": 0}, "--layers must be ≥ 1"),
        ({"split_kv": 3, "contexts": (256, 1024)}, "--split-kv 3 must be ≥ 1 and divide"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(options, message):
    with pytest.raises(ConfigError, match=message):
        run_bench("pacing", None, **options)


def test_the_command_line_refuses_a_bad_flag_before_building_anything(capsys):
    assert main(["bench", "pacing", "--tp", "0"]) == 2
    assert "--tp must be ≥ 1" in capsys.readouterr().err


def test_measured_constants_set_in_config_reach_the_time_model_and_repack(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    paced = with_overrides(cfg, ["rollout.pacing.request_scale=1"])
    tuned = with_overrides(
        paced, ["rollout.pacing.decode_mfu=0.75", "rollout.max_concurrency=4096"]
    )
    paced = with_overrides(paced, ["rollout.max_concurrency=4096"])
    default, measured = paced.rollout.pacing.time_model(), tuned.rollout.pacing.time_model()
    assert measured.decode_mfu == 0.75 and default.decode_mfu == TimeModel.decode_mfu
    assert measured.batch_limit == pytest.approx(default.batch_limit * 1.5)
    # the planner's B follows the model it is given
    assert repack_max_batch(tuned) == int(measured.batch_limit)
    assert repack_max_batch(paced) == int(default.batch_limit)
    kv = with_overrides(paced, ["rollout.pacing.kv_efficiency=0.45"]).rollout.pacing.time_model()
    assert kv.decode_time(1, 10_000) - kv.decode_time(1, 0) == pytest.approx(
        2 * (default.decode_time(1, 10_000) - default.decode_time(1, 0))
    )
    with pytest.raises(ConfigError, match="decode_mfu"):
        with_overrides(cfg, ["rollout.pacing.decode_mfu=1.5"])
