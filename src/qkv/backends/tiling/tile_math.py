"""In-place tile arithmetic of the score-modifier engine (``mod_tiles``): reused buffers, products, tanh, exp.

Shape legend: any shape; these helpers work elementwise or on batched ``(n, rows, cols)``
matrices.

The soft-capped tile loop spends most of its time outside the matrix products, in passes
over tile-sized buffers, so each pass is written in place into a buffer reused by every
tile, and the two transcendental functions it needs are written in the cheapest form that
stays accurate to a few ulp (``tests/test_backends_mod_tiles.py`` checks both against
float64).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..._probe import best_times
from ..._trace import tracing

class Scratch:
    """Tile-sized buffers reused by every tile of a call: a fresh 2 MiB tensor per op costs page faults.

    (Measured: the allocating ``add`` of two tile-sized operands took 9% of a soft-capped
    fwd+bwd, the same op into a reused buffer a third of that.)
    """

    def __init__(self, device):
        self.device, self.bufs = device, {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.bufs[name] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(shape)


def mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``a @ b`` batched, in the operands' dtype (float32 accumulation inside), written into ``out``."""
    b = b.to(a.dtype)
    if out.dtype == a.dtype:
        return torch.bmm(a, b, out=out)
    return out.copy_(torch.bmm(a, b))


def add_mm(target: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """``target += alpha · a @ b`` in place; ``a @ b`` runs in ``a``'s dtype."""
    b = b.to(a.dtype)
    if target.dtype == a.dtype:
        target.baddbmm_(a, b, alpha=alpha)
    else:
        target.add_(torch.bmm(a, b), alpha=alpha)


def expm1_(z: Tensor, clamp: bool) -> Tensor:
    """``E = expm1(z)`` in place; ``z`` clamped at 40 first unless it is known to stay below (``mod_tiles._needs_clamp``)."""
    return torch.expm1_(z.clamp_(max=40.0) if clamp else z)


def tanh_(z: Tensor, den: Tensor, clamp: bool = True) -> Tensor:
    """``tanh(z / 2)`` in place, as ``E / (E + 2)`` with ``E = expm1(z)``.

    Accurate to a few ulp everywhere (no cancellation: ``E`` keeps its relative precision
    near 0, and ``E + 2 >= 1``), and about twice as fast as ``torch.tanh`` on the benchmark
    machine. ``2σ(z) - 1`` would be faster still but loses all relative precision as
    ``z → 0``: an absolute error of ``c·2⁻²⁴`` on every capped logit. ``z`` is clamped at
    40, where ``tanh(20)`` is 1 in float64 already, so ``E`` never overflows. ``den`` is a
    buffer of ``z``'s shape for ``E + 2``.
    """
    e = expm1_(z, clamp)
    return e.div_(torch.add(e, 2.0, out=den))


def exp_nonpositive_(a: Tensor, tmp: Tensor) -> Tensor:
    """``exp(a)`` in place for ``a <= 0`` (``-inf`` allowed), as ``σ(a) / (1 - σ(a))``; ``tmp`` a buffer like ``a``.

    ``torch.sigmoid`` ran twice to three times as fast as ``torch.exp`` on the benchmark
    machine, and for ``a <= 0`` nothing cancels (``1 - σ(a) >= 1/2``): within 3 ulp of the
    float64 ``exp`` over ``[-87, 0]`` (``tests/test_backends_mod_tiles.py``). Every
    exponential of an online softmax has such an argument: a logit minus a maximum, or
    minus the log-sum-exp.
    """
    sig = torch.sigmoid_(a)
    return sig.div_(torch.sub(1.0, sig, out=tmp))


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a tile's matrix products run in, for inputs of ``dtype`` on ``device``.

    Elementwise work and accumulators are float32 (or wider) either way. bfloat16 products
    (float32 accumulation inside) are the fast choice where the CPU has bfloat16 dot-product
    instructions (AVX-512 BF16, AMX: 3x float32's speed on the benchmark machine), and a slow
    one without them: with the kernels held to AVX2, a soft-capped fwd+bwd spent 2.7x SDPA's
    time in its bfloat16 products alone. So the first bfloat16 call on a CPU times a tile's
    product both ways and keeps the faster; float16 always runs float32 (CPUs lack fast
    float16 products); other devices and traced calls keep bfloat16.
    """
    acc = torch.promote_types(dtype, torch.float32)
    if dtype != torch.bfloat16:
        return acc
    if device.type != "cpu" or tracing():
        return dtype
    return dtype if _bf16_products_faster() else acc


@functools.cache
def _bf16_products_faster() -> bool:
    """Time a tile's two products, ``q kᵀ`` and ``P v`` (256 × 256 tiles, head size 64, 16 heads), both ways."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 256, 64, generator=gen) for _ in range(3))
    p = torch.rand(16, 256, 256, generator=gen)

    def products(dtype: torch.dtype):
        q_, k_, p_, v_ = (x.to(dtype) for x in (q, k, p, v))
        return lambda: (torch.bmm(q_, k_.transpose(1, 2)), torch.bmm(p_, v_))

    with torch.no_grad():
        bf16, f32 = best_times(products(torch.bfloat16), products(torch.float32))
    return bf16 < f32
