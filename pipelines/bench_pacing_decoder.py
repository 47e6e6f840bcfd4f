"""The decoder ``laminar bench pacing`` times, and the timing: random weights of a model's
shape with its decode step (a KV cache per layer; split-KV attention, as serving engines'
kernels do) and causal forward (:class:`_Decoder`), a timer on the device's clock (CUDA
events or perf_counter), and the measurements of decode steps, prefills and a training
step's forward and backward (:func:`measure_decode`, :func:`measure_prefill`,
:func:`measure_train`).

Apart from the bench because this is the one part that runs torch on the device: the
bench fits the model's constants to what it returns (:mod:`pipelines.bench_pacing_fit`)
and reports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pipelines.bench_pacing_arch import Arch

KV_SHARE = 0.6  # of the device memory free after the weights, given to the KV cache


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
