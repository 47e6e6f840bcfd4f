"""``laminar bench pacing``: the pacing model's constants, measured on a real accelerator.

The paced engine's step times (``laminar/pacing.py``, ``docs/pacing.md``) rest on assumed
efficiencies — the share of HBM bandwidth a decode step achieves (``η_bw``), the share of
peak FLOPs its batch's compute achieves (``η_dec``) and a prefill's (``η_pre``) — and the
trainer's on an assumed 5,000 tokens/s per GPU. This bench measures them on the torch
device it runs on. It builds a decoder of a named model's shape (the Qwen2.5
configurations ``laminar.pacing.MODELS`` holds: the same matrices, bf16, random weights)
and times

* **decode steps** over a grid of batch × context per sequence. One step embeds a token
  per request, runs every layer (fused QKV, attention over a KV cache of that context,
  output projection, fused gate/up MLP), the LM head and a greedy pick. On CUDA each step
  is one CUDA-graph replay, as serving engines replay them;
* **prefill** of one sequence of ``n`` tokens (causal attention), for several ``n``;
* **training**: the forward and backward of ``train_layers`` layers and of the LM head
  with its loss, on ``train_tokens`` tokens, scaled to the whole model (no optimizer step,
  no communication, no recompute: a ceiling of the trainer's throughput per GPU).

It then fits the model's constants from the measurements (:func:`fit_decode`; the fixed
cost per step apart from the weight read by a second, narrower decoder with the same
kernels, :func:`split_fixed`), sets the model's prediction beside each measured figure and
prints the ``--set rollout.pacing.…`` line that applies the measured constants. With
``tp`` it times one device's shard of a tensor-parallel replica (:meth:`Arch.shard`).
What it leaves out: rotary embeddings and fused norms (elementwise, a small share), a
serving engine's scheduler, sampling and paged-KV indirection, and the all-reduces of
tensor parallelism, which one device cannot time.

Run it on a GPU machine (``docs/pacing.md``, "Measured on a GPU")::

    laminar bench pacing --model 7B --out pacing.json
    laminar bench pacing --model 32B --tp 4 --out pacing-32B-tp4.json

On a CPU it runs too (float32, no graphs, shorter prefills and training step; try
``--layers 2 --batches 1,8,64 --contexts 64,256``): the figures are then the CPU's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pipelines.bench_pacing_arch import ARCHS, Arch, accelerator_of
from pipelines.bench_pacing_decoder import (
    _Decoder,
    _Timer,
    measure_decode,
    measure_prefill,
    measure_train,
)
from pipelines.bench_pacing_decoder import split_kv_attention as split_kv_attention
from pipelines.bench_pacing_fit import _slope, fit_decode, split_fixed

# (split_kv_attention, imported as itself above, is re-exported: the tests import it from
# here, as they import the shapes and the fit.)

BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (256, 1024, 4096)  # KV tokens per sequence
PREFILLS = (512, 2048, 8192)
TRAIN_TOKENS = 8192  # 2 sequences of 4,096
# A CPU does a GPU's prefill and training work a thousand times slower: less of it there.
CPU_PREFILLS = (64, 256)
CPU_TRAIN_TOKENS = 256


# ------------------------------------------------------------------------- the bench


def _known(what: str, value, known) -> None:
    from laminar.errors import ConfigError

    if value not in known:
        raise ConfigError(
            f"laminar bench pacing: {what} {value!r} is unknown; known: {sorted(known)}"
        )


def bench_pacing(
    model: str = "7B",
    accelerator: str | None = None,
    layers: int | None = None,
    tp: int = 1,
    batches: Sequence[int] = BATCHES,
    contexts: Sequence[int] = CONTEXTS,
    prefills: Sequence[int] | None = None,
    train_layers: int = 2,
    train_tokens: int | None = None,
    repeats: int = 3,
    steps: int = 10,
    split_kv: int = 1,
    arch: Arch | None = None,
):
    """The pacing bench; see the module docstring. ``model``: a name in ``ARCHS``;
    ``accelerator``: the ``laminar.pacing.ACCELERATORS`` entry whose datasheet the
    efficiencies are taken against (default: the one the device's name says; none on a
    CPU: achieved rates only); ``layers``: build that many layers instead of the model's
    (a model too large for the device; the figures are then that decoder's); ``tp``:
    build one device's shard of a ``tp``-way tensor-parallel replica (:meth:`Arch.shard`)
    and compare with the model's ``tp``-device replica — all but the all-reduces, which one
    device cannot time, and no training step;
    ``batches`` × ``contexts``: the decode grid (points whose KV does not fit are
    skipped and reported); ``prefills``: prompt lengths prefilled; ``train_tokens``: the
    training step's tokens (both default to less on a CPU); ``steps``: decode steps timed
    per repeat; ``split_kv``: decode attention splits each sequence's KV into that many
    chunks (:func:`split_kv_attention`, as serving engines' decode kernels do; 1: one
    flash call); ``arch``: a shape of your own (Python only; ``model`` then only names
    it)."""
    import torch

    from laminar.errors import ConfigError
    from laminar.pacing import ACCELERATORS, MODELS, TimeModel, TrainerTimeModel
    from pipelines.bench import BenchResult

    cuda = torch.cuda.is_available()
    prefills = prefills or (PREFILLS if cuda else CPU_PREFILLS)
    train_tokens = train_tokens or (TRAIN_TOKENS if cuda else CPU_TRAIN_TOKENS)
    if arch is None:
        _known("--model", model, ARCHS)
        arch = ARCHS[model]
    if accelerator is not None:
        _known("--accelerator", accelerator, ACCELERATORS)
    for what, values in (("--batches", batches), ("--contexts", contexts), ("prefills", prefills)):
        if not values or min(values) < 1:
            raise ConfigError(
                f"laminar bench pacing: {what} must be positive integers, got {values}"
            )
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"laminar bench pacing: --layers must be ≥ 1, got {layers}")
        arch = arch.with_layers(layers)
    if tp < 1:
        raise ConfigError(f"laminar bench pacing: --tp must be ≥ 1, got {tp}")
    if split_kv < 1 or any(s % split_kv for s in contexts):
        raise ConfigError(
            f"laminar bench pacing: --split-kv {split_kv} must be ≥ 1 and divide every "
            f"context ({', '.join(map(str, contexts))})"
        )
    if min(repeats, steps, train_layers, train_tokens) < 1:
        raise ConfigError("laminar bench pacing: repeats, steps, train_layers, train_tokens ≥ 1")

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    acc = accelerator or accelerator_of(device_name)
    size = torch.finfo(dtype).bits // 8

    shape = arch.shape(model, size)
    timer = _Timer(device)
    built = arch.shard(tp) if tp > 1 else arch
    torch.manual_seed(0)
    dec = _Decoder(built, device, dtype, split_kv=split_kv)
    decode, skipped, modes = measure_decode(dec, batches, contexts, repeats, steps, timer)
    if not decode:
        raise ConfigError(
            f"laminar bench pacing: no decode point fits the device's memory; "
            f"lower --batches/--contexts (smallest asked: {min(batches)} × {min(contexts)})"
        )
    prefill = measure_prefill(dec, prefills, repeats, timer)
    train_layers = min(train_layers, arch.layers)
    train = measure_train(dec, train_layers, train_tokens, repeats, timer) if tp == 1 else {}
    del dec
    if cuda:
        torch.cuda.empty_cache()
    # The same decoder with a 4× narrower MLP and vocabulary: the smallest step of each
    # tells the fixed cost per step from the weight read (split_fixed).
    narrow = built.narrow(4)
    b0, c0 = min(batches), min(contexts)
    probe, _, _ = measure_decode(
        _Decoder(narrow, device, dtype, split_kv=split_kv), [b0], [c0], repeats, steps, timer
    )
    if cuda:
        torch.cuda.empty_cache()

    med = {k: statistics.median(v) for k, v in decode.items()}
    fit = fit_decode(med)
    t0_narrow = statistics.median(probe[(b0, c0)]) - fit.k * b0 * c0
    t_fix, weight_bw = split_fixed(
        fit.t0, t0_narrow, built.decode_read_elements, narrow.decode_read_elements, size
    )
    flops_token = shape.flops_per_token
    read_bytes = built.decode_read_elements * size
    kv_bytes = built.shape(model, size).kv_bytes_per_token  # per token, one device
    train_tok_s, layer_s, head_s = None, None, None
    if train:
        layer_s = statistics.median(train["layers"]) / train_layers
        head_s = statistics.median(train["head"])
        train_tok_s = train_tokens / (arch.layers * layer_s + head_s)
    # The trainer's assumption (a 7B on H800s) at the same MFU for this model's size
    assumed_tok_s = TrainerTimeModel(gpus=1).tok_s_per_gpu * MODELS["7B"].params / arch.params
    figures: dict[str, float | None] = {
        "step0_ms": fit.t0 * 1e3,
        "kv_ns_per_token": fit.k * 1e9,
        "compute_us_per_sequence": fit.c * 1e6 if fit.c else None,
        # where the batch's compute outgrows the weight read (the fixed cost apart, as
        # TimeModel.batch_limit has it)
        "batch_limit": (fit.t0 - (t_fix or 0.0)) / fit.c if fit.c else None,
        "step0_narrow_ms": t0_narrow * 1e3,
        "t_fix_ms": t_fix * 1e3 if t_fix is not None else None,
        "achieved_weight_read_gb_s": weight_bw / 1e9 if weight_bw else None,
        "achieved_kv_read_gb_s": kv_bytes / fit.k / 1e9 if fit.k else None,
        "achieved_decode_tflops": flops_token / tp / fit.c / 1e12 if fit.c else None,
        "train_layer_ms": layer_s * 1e3 if layer_s else None,
        "train_head_ms": head_s * 1e3 if head_s else None,
        "train_tok_s_per_gpu": train_tok_s,
        "assumed_train_tok_s_per_gpu": assumed_tok_s,
    }
    for n, ts in prefill.items():
        figures[f"prefill_ms_n{n}"] = statistics.median(ts) * 1e3
    ratios: dict[str, float | None] = {
        "train_tok_s_measured_vs_assumed": _quotient(train_tok_s, assumed_tok_s),
    }
    rows: list[list] = []
    tm = None
    if acc:
        a = ACCELERATORS[acc]
        tm = TimeModel(a, shape, tp=tp)
        bw, flops = tp * a.mem_bw, tp * a.flops  # the replica's
        # a prefill's cost per token: the slope over the lengths (their fixed cost apart)
        ns = sorted(prefill)
        per_token = (
            _slope(ns, [statistics.median(prefill[n]) for n in ns])
            if len(ns) > 1
            else statistics.median(prefill[ns[0]]) / ns[0]
        )
        eff = {
            # the value of each TimeModel field that reproduces the measurement
            "bw_efficiency": (
                shape.weight_bytes / (bw * (fit.t0 - t_fix)) if t_fix is not None else None
            ),
            "bw_efficiency_whole_step": shape.weight_bytes / (bw * fit.t0),
            "kv_bw_efficiency": shape.kv_bytes_per_token / (bw * fit.k) if fit.k else None,
            "decode_mfu": flops_token / (flops * fit.c) if fit.c else None,
            "prefill_mfu": flops_token / (flops * per_token) if per_token > 0 else None,
            "train_mfu": 3 * flops_token * train_tok_s / a.flops if train_tok_s else None,
        }
        figures.update(eff)
        figures.update(
            assumed_bw_efficiency=tm.bw_efficiency,
            assumed_t_fix_ms=tm.t_fix * 1e3,
            assumed_decode_mfu=tm.decode_mfu,
            assumed_prefill_mfu=tm.prefill_mfu,
            model_step0_ms=tm.decode_time(1, 0) * 1e3,
            model_kv_ns_per_token=shape.kv_bytes_per_token / tm._kv_bw * 1e9,
            model_compute_us_per_sequence=(tm.compute_per_sequence + tm.c_seq) * 1e6,
            model_batch_limit=tm.batch_limit,
        )
        for key, assumed in (
            ("bw_efficiency", "assumed_bw_efficiency"),
            ("kv_bw_efficiency", "assumed_bw_efficiency"),
            ("t_fix_ms", "assumed_t_fix_ms"),
            ("decode_mfu", "assumed_decode_mfu"),
            ("prefill_mfu", "assumed_prefill_mfu"),
        ):
            ratios[f"{key}_measured_vs_assumed"] = _quotient(figures[key], figures[assumed])
        for key in ("step0_ms", "kv_ns_per_token", "compute_us_per_sequence", "batch_limit"):
            ratios[f"{key}_measured_vs_model"] = _quotient(figures[key], figures[f"model_{key}"])
    per_point = []
    for (b, s), t in sorted(med.items()):
        key = f"b{b}_ctx{s}"
        figures[f"decode_ms_{key}"] = t * 1e3
        model_ms = tm.decode_time(b, b * s) * 1e3 if tm else None
        figures[f"model_decode_ms_{key}"] = model_ms
        ratios[f"decode_{key}_measured_vs_model"] = _quotient(t * 1e3, model_ms)
        if model_ms:
            per_point.append(t * 1e3 / model_ms)
        rows.append([f"decode b={b} ctx={s} (ms)", t * 1e3, model_ms, _quotient(t * 1e3, model_ms)])
    for n, ts in prefill.items():
        model_ms = tm.prefill_time(n) * 1e3 if tm else None
        got = statistics.median(ts) * 1e3
        figures[f"model_prefill_ms_n{n}"] = model_ms
        rows.append([f"prefill n={n} (ms)", got, model_ms, _quotient(got, model_ms)])
    for label, key, model_key in (
        ("step of 1, no context (ms)", "step0_ms", "model_step0_ms"),
        ("fixed cost per step t_fix (ms)", "t_fix_ms", "assumed_t_fix_ms"),
        ("KV read per context token (ns)", "kv_ns_per_token", "model_kv_ns_per_token"),
        ("compute per sequence (µs)", "compute_us_per_sequence", "model_compute_us_per_sequence"),
        ("memory-bound batch limit B", "batch_limit", "model_batch_limit"),
        ("η_bw (weights)", "bw_efficiency", "assumed_bw_efficiency"),
        ("η_bw (weights, t_fix counted in)", "bw_efficiency_whole_step", "assumed_bw_efficiency"),
        ("η_bw (KV)", "kv_bw_efficiency", "assumed_bw_efficiency"),
        ("η_dec", "decode_mfu", "assumed_decode_mfu"),
        ("η_pre", "prefill_mfu", "assumed_prefill_mfu"),
        ("train tok/s per GPU (ceiling)", "train_tok_s_per_gpu", "assumed_train_tok_s_per_gpu"),
    ):
        got, want = figures.get(key), figures.get(model_key)
        rows.append([label, got, want, _quotient(got, want)])

    notes = [
        f"{device_name}, {dtype}, torch {torch.__version__}; "
        f"decode steps: {'/'.join(sorted(modes))}"
        + (f", attention split-KV in {split_kv} chunks" if split_kv > 1 else ""),
        f"decoder: {arch.layers} layers, {arch.params / 1e9:.2f} B params"
        + (f", one device's shard of TP{tp}" if tp > 1 else "")
        + f" ({read_bytes / 1e9:.1f} GB read per decode step)",
    ]
    if per_point:
        notes.append(
            f"decode measured/model over {len(per_point)} points: median "
            f"{statistics.median(per_point):.2f}, {min(per_point):.2f}–{max(per_point):.2f} "
            f"(model: TP{tp}, the default t_fix and c_seq)"
        )
    if not fit.compute_bound:
        notes.append(
            f"no batch up to {max(b for b, _ in med)} outgrew the weight read: the compute "
            "per sequence (η_dec, B) is not measured; add larger --batches"
        )
    if skipped:
        notes.append(
            "skipped (KV does not fit): " + ", ".join(f"b={b} ctx={s}" for b, s in skipped)
        )
    if not acc:
        notes.append(
            f"{device_name!r} is no known accelerator: achieved rates only (--accelerator)"
        )
    else:
        notes.extend(_implied_replica(model, figures, tp))
    return BenchResult(
        name="pacing",
        figures=figures,
        ratios=ratios,
        samples={
            **{f"decode_s_b{b}_ctx{s}": v for (b, s), v in decode.items()},
            **{f"prefill_s_n{n}": v for n, v in prefill.items()},
            **{f"train_{k}_s": v for k, v in train.items()},
        },
        columns=["what", "measured", "model", "measured/model"],
        rows=rows,
        options={
            "model": model,
            "accelerator": acc,
            "device": device_name,
            "dtype": str(dtype),
            "layers": arch.layers,
            "tp": tp,
            "split_kv": split_kv,
            "batches": list(batches),
            "contexts": list(contexts),
            "prefills": list(prefills),
            "train_layers": train_layers,
            "train_tokens": train_tokens,
            "repeats": repeats,
            "steps": steps,
            "decode_modes": sorted(modes),
            "skipped": [list(p) for p in skipped],
        },
        notes=notes,
    )


def _quotient(a, b) -> float | None:
    return a / b if a is not None and b else None


def calibrated(figures: dict) -> dict[str, float]:
    """The ``rollout.pacing`` constants the bench measured (those it could), as config
    values: ``t_fix`` in seconds, efficiencies capped at 1."""
    out = {}
    if figures.get("t_fix_ms") is not None:
        out["t_fix"] = float(f"{figures['t_fix_ms'] / 1e3:.3g}")
    for key, field in (
        ("bw_efficiency", "bw_efficiency"),
        ("kv_bw_efficiency", "kv_efficiency"),
        ("decode_mfu", "decode_mfu"),
        ("prefill_mfu", "prefill_mfu"),
    ):
        if figures.get(key) is not None:
            out[field] = float(f"{min(figures[key], 1.0):.3g}")
    return out


def _implied_replica(model: str, figures: dict, tp: int) -> list[str]:
    """The config line that uses the measured constants, and what they make of a
    replica of ``tp`` H800s (the schedules bench's accelerator)."""
    from laminar.pacing import MODELS, TimeModel

    kw = calibrated(figures)
    if not kw:
        return []
    lines = [
        f"measured constants for TP{tp} replicas: --set "
        + " ".join(f"rollout.pacing.{k}={v}" for k, v in kw.items())
    ]
    if model in MODELS:
        base = TimeModel.named("H800", model, tp=tp)
        measured = TimeModel.named("H800", model, tp=tp, **kw)
        ctx = 256 * 4096
        one, one_base = measured.decode_time(1, 0) * 1e3, base.decode_time(1, 0) * 1e3
        lines.append(
            f"with them a TP{tp} H800 {model} replica has B = {measured.batch_limit:.0f} "
            f"(assumed: {base.batch_limit:.0f}); a step of 1: "
            f"{one:.2f} ms (assumed {one_base:.2f}), "
            f"of 256 at 4K context: {measured.decode_time(256, ctx) * 1e3:.1f} ms "
            f"(assumed {base.decode_time(256, ctx) * 1e3:.1f})"
        )
    return lines
