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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (256, 1024, 4096)  # KV tokens per sequence
PREFILLS = (512, 2048, 8192)
TRAIN_TOKENS = 8192  # 2 sequences of 4,096
# A CPU does a GPU's prefill and training work a thousand times slower: less of it there.
CPU_PREFILLS = (64, 256)
CPU_TRAIN_TOKENS = 256
KV_SHARE = 0.6  # of the device memory free after the weights, given to the KV cache


@dataclass(frozen=True)
class Arch:
    """A decoder's shape: what a forward pass reads and computes (Qwen2.5 layout)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool = False

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2)

    def with_layers(self, layers: int) -> Arch:
        return replace(self, layers=layers)

    def narrow(self, f: int) -> Arch:
        """The same layers and kernels with an MLP and vocabulary ``f`` times narrower:
        a decode step reads less, launches as much (:func:`split_fixed`)."""
        return replace(self, intermediate=-(-self.intermediate // f), vocab=-(-self.vocab // f))

    @property
    def decode_read_elements(self) -> int:
        """Weight elements a decode step reads: every layer and the LM head (the
        embedding only at the batch's rows)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def shard(self, tp: int) -> Arch:
        """One device's part of a ``tp``-way tensor-parallel replica: attention heads,
        the MLP's width and the vocabulary split ``tp`` ways (KV heads too, down to one
        per device, replicated beyond).

        >>> ARCHS["7B"].shard(4).heads, ARCHS["7B"].shard(4).kv_heads
        (7, 1)
        """
        from laminar.errors import ConfigError

        kv = max(self.kv_heads // tp, 1)
        for what, n in (("heads", self.heads), ("intermediate", self.intermediate)):
            if n % tp:
                raise ConfigError(f"laminar bench pacing: --tp {tp} does not divide {what} {n}")
        if (self.heads // tp) % kv:
            raise ConfigError(f"laminar bench pacing: --tp {tp} splits KV heads unevenly")
        return replace(
            self,
            intermediate=self.intermediate // tp,
            heads=self.heads // tp,
            kv_heads=kv,
            vocab=-(-self.vocab // tp),
        )

    def shape(self, name: str, bytes_per_value: int = 2):
        """The :class:`~laminar.pacing.ModelShape` the time model takes for this decoder."""
        from laminar.pacing import ModelShape

        return ModelShape(
            name, self.params, self.layers, self.kv_heads, self.head_dim, bytes_per_value
        )


# The Qwen2.5 configurations behind laminar.pacing.MODELS (params agree to 1%).
ARCHS = {
    "1.5B": Arch(1536, 8960, 12, 2, 128, 28, 151936, tied=True),
    "7B": Arch(3584, 18944, 28, 4, 128, 28, 152064),
    "32B": Arch(5120, 27648, 40, 8, 128, 64, 152064),
    "72B": Arch(8192, 29568, 64, 8, 128, 80, 152064),
}

# torch.cuda.get_device_name() fragment -> laminar.pacing.ACCELERATORS name
_DEVICE_NAMES = (
    ("H200", "H200"),
    ("H800", "H800"),
    ("H100", "H100"),
    ("A100", "A100"),
    ("L40S", "L40S"),
)


def accelerator_of(device_name: str) -> str | None:
    """The ``ACCELERATORS`` entry a torch device name stands for, if any.

    >>> [accelerator_of(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "cpu")]
    ['H200', 'H100', None]
    """
    for fragment, name in _DEVICE_NAMES:
        if fragment in device_name:
            return name
    return None


# --------------------------------------------------------------------------- the fit


def split_fixed(t0: float, t0_narrow: float, elements: int, elements_narrow: int, size: int):
    """``(t_fix, bytes/s)`` from the smallest step of two decoders that launch the same
    kernels but read ``elements`` and ``elements_narrow`` weights: ``t0 = t_fix +
    bytes / BW``. ``None`` for both if the narrower step was not faster.

    >>> t_fix, bw = split_fixed(5.6e-3, 3.4e-3, 7_000_000_000, 2_400_000_000, 2)
    >>> round(t_fix * 1e3, 2), round(bw / 1e12, 2)
    (2.25, 4.18)
    """
    if t0 <= t0_narrow or elements <= elements_narrow:
        return None, None
    bw = (elements - elements_narrow) * size / (t0 - t0_narrow)
    t_fix = t0 - elements * size / bw
    return (t_fix, bw) if t_fix >= 0 else (None, None)


@dataclass(frozen=True)
class DecodeFit:
    """Constants of ``decode(b, S) = T0 + max(0, b·c − T0) + S·k`` fitted to step times.

    ``t0``: a step of one request with no context (the weight read and every fixed cost);
    ``k``: seconds per KV token of context; ``c``: seconds per request once the batch's
    compute outgrows the weight read (``None`` if the largest batch never got there);
    ``batch_limit``: the batch where it does, ``T0 / c``.
    """

    t0: float
    k: float
    c: float | None
    compute_bound: bool

    @property
    def batch_limit(self) -> float | None:
        return self.t0 / self.c if self.c else None


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def fit_decode(times: dict[tuple[int, int], float]) -> DecodeFit:
    """Fit :class:`DecodeFit` to ``{(batch, context per sequence): seconds}``.

    ``k`` is the median over batches of the slope of step time against the batch's
    context ``S = batch × context``; what is left once ``S·k`` is taken off is a function
    of the batch alone, ``R(b)``; ``T0`` is ``R`` at the smallest batch, and ``c`` the
    slope of ``R`` over the batches where it has grown past 1.5 ``T0``.

    >>> t = {(b, s): 3e-3 + max(0, b * 20e-6 - 3e-3) + b * s * 5e-9
    ...      for b in (1, 64, 256, 512, 1024) for s in (256, 1024)}
    >>> f = fit_decode(t)
    >>> round(f.t0 * 1e3, 3), round(f.k * 1e9, 2), round(f.c * 1e6, 2), round(f.batch_limit)
    (3.0, 5.0, 20.0, 150)
    """
    batches = sorted({b for b, _ in times})
    slopes = []
    for b in batches:
        points = sorted((b * s, t) for (bb, s), t in times.items() if bb == b)
        if len(points) >= 2:
            slopes.append(_slope([p[0] for p in points], [p[1] for p in points]))
    if not slopes:
        raise ValueError("fit_decode needs two contexts or more at some batch size")
    k = max(statistics.median(slopes), 0.0)
    rest = {
        b: statistics.median(t - k * b * s for (bb, s), t in times.items() if bb == b)
        for b in batches
    }
    t0 = rest[batches[0]]
    grown = [b for b in batches if rest[b] > 1.5 * t0]
    if len(grown) >= 2:
        c = _slope(grown, [rest[b] for b in grown])
    elif grown:
        c = rest[grown[0]] / grown[0]
    else:  # never compute-bound: the largest batch bounds c from above
        c = None
    return DecodeFit(t0=t0, k=k, c=c if c and c > 0 else None, compute_bound=bool(grown))


# ----------------------------------------------------------------------- the decoder


def _flash_with_lse(q, k, v):
    """Flash attention's output and log-sum-exp per query row (float32)."""
    import torch

    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out[0], out[1]


def split_kv_attention(q, k, v, n: int):
    """Decode attention with each sequence's KV split into ``n`` chunks attended at once
    (split-KV, "flash-decoding", as serving engines' decode kernels do) and merged by
    their log-sum-exp. It gives a kernel ``n`` times the blocks when few sequences and
    KV heads leave the device's multiprocessors idle. ``q`` ``(b, h, rows, d)``,
    ``k``/``v`` ``(b, h, s, d)`` contiguous, ``s`` a multiple of ``n``: the chunks are
    views, nothing of the KV is copied.

    >>> import torch, torch.nn.functional as F
    >>> q, k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 64, 16), torch.randn(2, 3, 64, 16)
    >>> whole = F.scaled_dot_product_attention(q, k, v)
    >>> bool(torch.allclose(split_kv_attention(q, k, v, 4), whole, atol=1e-5))
    True
    """
    b, h, rows, d = q.shape
    s = k.shape[2]
    qn = q.unsqueeze(2).expand(b, h, n, rows, d).reshape(b, h * n, rows, d)
    # (b, h, s, d) -> (b, h·n, s/n, d): a contiguous split of s, a view
    out, lse = _flash_with_lse(qn, k.view(b, h * n, s // n, d), v.view(b, h * n, s // n, d))
    out, lse = out.view(b, h, n, rows, d), lse.view(b, h, n, rows)
    weight = (lse - lse.amax(dim=2, keepdim=True)).exp()
    weight = weight / weight.sum(dim=2, keepdim=True)
    return (out.float() * weight.unsqueeze(-1)).sum(dim=2).to(out.dtype)


class _Decoder:
    """Random weights of ``arch`` on ``device``, and its forward passes."""

    def __init__(self, arch: Arch, device, dtype, seed: int = 0, split_kv: int = 1):
        import torch

        self.arch, self.device, self.dtype = arch, device, dtype
        self.split_kv = split_kv
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*shape):
            w = torch.empty(shape, device=device, dtype=dtype)
            return w.normal_(0.0, shape[0] ** -0.5, generator=gen)

        a = arch
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        self.embed = weight(a.vocab, a.hidden)
        self.layers = [
            {
                "ln1": torch.ones(a.hidden, device=device, dtype=dtype),
                "wqkv": weight(a.hidden, q + 2 * kv),
                "wo": weight(q, a.hidden),
                "ln2": torch.ones(a.hidden, device=device, dtype=dtype),
                "wgu": weight(a.hidden, 2 * a.intermediate),
                "wdown": weight(a.intermediate, a.hidden),
            }
            for _ in range(a.layers)
        ]
        self.norm = torch.ones(a.hidden, device=device, dtype=dtype)
        self.lm_head = self.embed.t() if a.tied else weight(a.hidden, a.vocab)

    @staticmethod
    def _rms(x, w):
        import torch

        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

    def _layer(self, w, x, attend):
        import torch.nn.functional as F

        a = self.arch
        q_n, kv_n = a.heads * a.head_dim, a.kv_heads * a.head_dim
        q, k, v = (self._rms(x, w["ln1"]) @ w["wqkv"]).split([q_n, kv_n, kv_n], dim=-1)
        x = x + attend(q, k, v) @ w["wo"]
        g, u = (self._rms(x, w["ln2"]) @ w["wgu"]).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ w["wdown"]

    def decode(self, ids, caches):
        """One decode step of ``len(ids)`` requests; ``caches[l] = (k, v)``, each
        ``(batch, kv_heads, context, head_dim)``. The new token's K/V go to the last slot
        (the step reads a cache of that length either way)."""
        import torch.nn.functional as F

        a = self.arch
        b, group = ids.shape[0], a.heads // a.kv_heads
        x = self.embed[ids]
        for w, (kc, vc) in zip(self.layers, caches, strict=True):

            def attend(q, k, v, kc=kc, vc=vc):
                kc[:, :, -1] = k.view(b, a.kv_heads, a.head_dim)
                vc[:, :, -1] = v.view(b, a.kv_heads, a.head_dim)
                # GQA at one query position: a KV head's group of query heads are its
                # query rows, so a plain (flash) attention call does it.
                q = q.view(b, a.kv_heads, group, a.head_dim)
                if self.split_kv > 1 and kc.shape[2] % self.split_kv == 0:
                    o = split_kv_attention(q, kc, vc, self.split_kv)
                else:
                    o = F.scaled_dot_product_attention(q, kc, vc)
                return o.reshape(b, a.heads * a.head_dim)

            x = self._layer(w, x, attend)
        return (self._rms(x, self.norm) @ self.lm_head).argmax(-1)

    def forward(self, ids):
        """A causal forward of sequences ``ids`` ``(batch, n)``; the final hidden states."""
        attend = _causal_attention(self.arch, ids.shape)
        x = self.embed[ids]
        for w in self.layers:
            x = self._layer(w, x, attend)
        return x


# ---------------------------------------------------------------------- measurements


class _Timer:
    """Wall seconds of ``fn`` on ``device``: CUDA events on a GPU, perf_counter else."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object], n: int) -> float:
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n


def _step_fn(model: _Decoder, ids, caches, timer: _Timer) -> tuple[Callable[[], object], str]:
    """A callable that runs one decode step: a CUDA-graph replay where it can be
    captured, the eager step otherwise (and on a CPU)."""
    import torch

    def eager():
        return model.decode(ids, caches)

    if not timer.cuda:
        return eager, "eager"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
    except RuntimeError:
        return eager, "eager"
    return graph.replay, "graph"


def _kv_capacity(arch: Arch, device, dtype, want: int) -> int:
    """KV tokens the cache pool may hold: ``want``, or what fits in ``KV_SHARE`` of the
    device memory left free on a GPU."""
    import torch

    if device.type != "cuda":
        return want
    free, _ = torch.cuda.mem_get_info(device)
    per_token = arch.shape("", torch.finfo(dtype).bits // 8).kv_bytes_per_token
    return min(want, int(free * KV_SHARE // per_token))


def measure_decode(model: _Decoder, batches, contexts, repeats: int, steps: int, timer):
    """``{(batch, context): [seconds per step, one per repeat]}``, ``skipped`` points
    (the KV would not fit) and how the steps ran (graph/eager)."""
    import torch

    a, dev, dt = model.arch, model.device, model.dtype
    want = max(b * s for b in batches for s in contexts)
    capacity = _kv_capacity(a, dev, dt, want)
    per_layer = capacity * a.kv_heads * a.head_dim
    pool = torch.zeros((a.layers, 2, per_layer), device=dev, dtype=dt)
    times, skipped, modes = {}, [], set()
    with torch.inference_mode():
        for b in batches:
            ids = torch.zeros(b, dtype=torch.long, device=dev)
            for s in contexts:
                if b * s > capacity:
                    skipped.append((b, s))
                    continue
                n = b * a.kv_heads * s * a.head_dim
                caches = [
                    tuple(pool[i, j, :n].view(b, a.kv_heads, s, a.head_dim) for j in (0, 1))
                    for i in range(a.layers)
                ]
                step, mode = _step_fn(model, ids, caches, timer)
                modes.add(mode)
                step()
                timer.sync()
                times[(b, s)] = [timer(step, steps) for _ in range(repeats)]
                del step
    del pool
    return times, skipped, modes


def measure_prefill(model: _Decoder, lengths, repeats: int, timer) -> dict[int, list[float]]:
    import torch

    out = {}
    with torch.inference_mode():
        for n in lengths:
            ids = torch.zeros((1, n), dtype=torch.long, device=model.device)

            def run(ids=ids):
                return model._rms(model.forward(ids)[:, -1], model.norm) @ model.lm_head

            run()
            timer.sync()
            out[n] = [timer(run, 1) for _ in range(repeats)]
    return out


def measure_train(model: _Decoder, layers: int, tokens: int, repeats: int, timer):
    """Seconds for the forward and backward of ``layers`` layers, and of the LM head with
    its loss, on ``tokens`` tokens (sequences of at most 4,096)."""
    import torch
    import torch.nn.functional as F

    a = model.arch
    seq = min(tokens, 4096)
    rows = max(tokens // seq, 1)
    trained = [
        {k: w.detach().requires_grad_() for k, w in lw.items()} for lw in model.layers[:layers]
    ]
    head = model.lm_head.detach().requires_grad_()
    hidden = torch.randn((rows, seq, a.hidden), device=model.device, dtype=model.dtype)
    hidden.requires_grad_()
    labels = torch.zeros(rows * seq, dtype=torch.long, device=model.device)

    attend = _causal_attention(a, (rows, seq))

    def layers_step():
        x = hidden
        for w in trained:
            x = model._layer(w, x, attend)
        x.float().pow(2).mean().backward()

    def head_step():
        logits = model._rms(hidden, model.norm) @ head
        F.cross_entropy(logits.view(-1, a.vocab).float(), labels).backward()

    out = {}
    for name, fn in (("layers", layers_step), ("head", head_step)):
        fn()
        timer.sync()
        out[name] = [timer(fn, 1) for _ in range(repeats)]
    return out


def _causal_attention(a: Arch, shape):
    import torch.nn.functional as F

    b, n = shape
    group = a.heads // a.kv_heads

    def attend(q, k, v):
        q = q.view(b, n, a.heads, a.head_dim).transpose(1, 2)
        k = k.view(b, n, a.kv_heads, a.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        v = v.view(b, n, a.kv_heads, a.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, n, a.heads * a.head_dim)

    return attend


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
