"""The fit of ``laminar bench pacing``: the pacing model's decode constants from measured
step times (:func:`fit_decode`), and the fixed cost per step told from the weight read by
two decoders of different width (:func:`split_fixed`).

Apart from the bench because it is pure arithmetic on measured seconds (no torch), tested
on made-up times by its doctests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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
