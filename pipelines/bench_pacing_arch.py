"""The decoder shapes of ``laminar bench pacing``: :class:`Arch` (what a forward pass reads
and computes, a tensor-parallel shard of it), the Qwen2.5 configurations behind
``laminar.pacing.MODELS`` (:data:`ARCHS`), and the accelerator a torch device name stands
for (:func:`accelerator_of`).

Apart from the bench because it is plain arithmetic on shapes: no torch, nothing timed;
the decoder (:mod:`pipelines.bench_pacing_decoder`) builds what it describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
