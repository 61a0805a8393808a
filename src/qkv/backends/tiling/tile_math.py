"""In-place tile arithmetic of the score-modifier engine (``mod_tiles``): reused buffers, products, tanh, exp.

Shape legend: any shape; these helpers work elementwise or on batched ``(n, rows, cols)``
matrices.

The soft-capped tile loop spends most of its time outside the matrix products, in passes
over tile-sized buffers, so each pass is written in place into a buffer reused by every
tile, and the two transcendental functions it needs run in the cheaper of two forms that
both stay accurate to a few ulp (the test suite checks both against
float64): PyTorch's own ``tanh`` and ``exp``, or rewritten through ``expm1`` and
``sigmoid``. Which is cheaper depends on the CPU's kernels, not on the code: on the AMD EPYC
the tile loop was tuned on, ``torch.tanh`` cost 4 to 8 ns per element and ``sigmoid``
half of ``exp``; on an Intel Xeon (AVX-512, AMX) ``torch.tanh`` costs 0.6 ns, ``exp`` 0.4
and ``expm1`` 2. So :func:`forms` times both once per process (:class:`Forms`). For
half-precision inputs a third ``tanh``, ``2σ(z) - 1``, is timed too: less accurate near 0
than float32 inputs allow, far more than half-precision ones need.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._probe import best_times
from ..._trace import concrete, tracing
from .threads import one_intra_op_thread
from .tiles import NEG_INF


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
            # a normal tensor even when made in inference mode: a buffer kept between calls (Int8Pages' runs) is
            # written in place by a later call outside it, which an inference tensor refuses
            with torch.inference_mode(False):
                buf = self.bufs[name] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(shape)


def cast(x: Tensor, dtype: torch.dtype, scratch: Scratch, name: str) -> Tensor:
    """``x`` in ``dtype``: ``x`` itself, or a copy in ``scratch``'s buffer ``name`` (no fresh tile-sized tensor)."""
    return x if x.dtype == dtype else scratch.take(name, x.shape, dtype).copy_(x)


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


@dataclass(frozen=True)
class Forms:
    """How a tile's ``tanh`` and ``exp`` are computed: PyTorch's kernels (True) or the rewritten forms (False).

    ``half_tanh``: ``tanh(z / 2) = 2σ(z) - 1`` instead (for half-precision inputs only, see
    :func:`forms`); it overrides ``library_tanh``.
    """

    library_tanh: bool
    library_exp: bool
    half_tanh: bool = False

    @property
    def stretch(self) -> float:
        """What the argument of :func:`tanh_` is stretched by: ``tanh(z / stretch)`` is computed.

        2 for the ``expm1`` and ``sigmoid`` forms (they read ``z = 2y``, and the 2 rides on
        the tile's product for free), 1 for ``torch.tanh``.
        """
        return 1.0 if self.library_tanh and not self.half_tanh else 2.0

    @property
    def expm1_tanh(self) -> bool:
        """Whether ``tanh`` goes through ``expm1`` (whose argument may need a clamp against overflow)."""
        return not self.library_tanh and not self.half_tanh


#: The rewritten form must beat PyTorch's kernel by this much to be chosen: near-ties go to
#: the library, and a probe disturbed by other work rarely flips a clear answer.
FORMS_MARGIN = 1.1


def forms(device: torch.device, dtype: torch.dtype = torch.float32) -> Forms:
    """The forms for tiles of inputs in ``dtype`` on ``device``: timed once per process on a CPU, PyTorch's kernels
    elsewhere or while tracing.

    For half-precision inputs (bfloat16, float16) ``tanh(z / 2) = 2σ(z) - 1`` is a third
    choice where it is faster still (one ``sigmoid``, 0.2 ns per element on the AMD EPYC
    Zen 5, against 0.7 for ``expm1`` and 2.0 for ``torch.tanh``). It cancels as ``z → 0``:
    a capped logit ``c·tanh`` is off by up to ``c·2⁻²³`` absolutely (6·10⁻⁶ for Gemma's
    ``c = 50``), which float32 inputs do not tolerate (their logits are exact to ``2⁻²⁴``
    relatively) and half-precision ones do, many times over: their output carries
    ``2⁻⁸`` (bfloat16) or ``2⁻¹¹`` (float16) relative rounding, and the attention written
    out in their dtype rounds every logit and weight so.
    """
    if device.type != "cpu" or tracing():
        return Forms(library_tanh=True, library_exp=True)
    timed = _timed_forms()
    if dtype in (torch.bfloat16, torch.float16) and _sigmoid_tanh_faster(timed.library_tanh):
        return replace(timed, half_tanh=True)
    return timed


@functools.cache
def _timed_forms() -> Forms:
    """Time each function both ways on a 1 MiB tile (the size of the loop's passes) and keep the faster.

    Timed as the tile loop runs them: in place into buffers made once, on one intra-op
    thread (``tiling.threads`` gives each tile task one). Timed with torch's default threads
    and an allocating ``exp``, the probe chose the sigmoid form for 4 in 5 processes on an
    Intel Xeon (AVX-512) where, in the loop, PyTorch's ``exp`` made a soft-capped fwd+bwd 10%
    faster in float32 and 20% in bfloat16.
    """
    with torch.inference_mode(False), torch.no_grad(), one_intra_op_thread():  # (the first call may come from
        return _time_forms()  # inference mode: normal tensors)


def _time_forms() -> Forms:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 128, 256, generator=gen) * 4
    a = -torch.rand(8, 128, 256, generator=gen) * 20
    out, den = torch.empty_like(z), torch.empty_like(z)

    def expm1_form():
        torch.expm1(z, out=out)
        out.div_(torch.add(out, 2.0, out=den))

    # both exponentials overwrite a tile in place, as exp_nonpositive_ does: the same copy first in each
    def library_exp():
        exp_floored(out.copy_(a), in_place=True)

    def sigmoid_form():
        sig = torch.sigmoid_(out.copy_(a))
        sig.div_(torch.sub(1.0, sig, out=den))

    tanh_lib, tanh_own, exp_lib, exp_own = best_times(
        lambda: torch.tanh(z, out=out), expm1_form, library_exp, sigmoid_form
    )
    return Forms(library_tanh=tanh_own * FORMS_MARGIN >= tanh_lib, library_exp=exp_own * FORMS_MARGIN >= exp_lib)


@functools.cache
def _sigmoid_tanh_faster(library_tanh: bool) -> bool:
    """Whether ``2σ(z) - 1`` (with its scaling pass, as :func:`capped_` runs it) beats the chosen full-precision form."""
    with torch.inference_mode(False), torch.no_grad(), one_intra_op_thread():  # (as _timed_forms)
        return _time_sigmoid_tanh(library_tanh)


def _time_sigmoid_tanh(library_tanh: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 128, 256, generator=gen) * 4
    out, den = torch.empty_like(z), torch.empty_like(z)
    base = torch.zeros(8, 128, 1)

    def chosen():
        capped_(out.copy_(z), base, 30.0, den, Forms(library_tanh, False), clamp=True)

    def sigmoid_form():
        capped_(out.copy_(z), base, 30.0, den, Forms(library_tanh, False, half_tanh=True), clamp=False)

    full, half = best_times(chosen, sigmoid_form)
    return half * FORMS_MARGIN < full


def expm1_(z: Tensor, clamp: bool) -> Tensor:
    """``E = expm1(z)`` in place; ``z`` clamped at 40 first unless it is known to stay below (``cap_range.needs_clamp``)."""
    return torch.expm1_(z.clamp_(max=40.0) if clamp else z)


def tanh_(z: Tensor, den: Tensor, form: Forms, clamp: bool = True) -> Tensor:
    """``tanh(z / form.stretch)`` in place; ``den`` a buffer of ``z``'s shape.

    PyTorch's ``tanh``, or ``tanh(z / 2) = E / (E + 2)`` with ``E = expm1(z)``. Both are
    accurate to a few ulp everywhere (the second has no cancellation: ``E`` keeps its
    relative precision near 0, and ``E + 2 >= 1``). ``2σ(z) - 1`` would be faster still but
    loses all relative precision as ``z → 0``: an absolute error of ``c·2⁻²⁴`` on every
    capped logit. The ``expm1`` form clamps ``z`` at 40 (unless ``clamp`` is False), where
    ``tanh(20)`` is 1 in float64 already, so ``E`` never overflows.
    """
    if form.half_tanh:  # 2σ(z) - 1: for half-precision inputs (forms)
        return torch.sigmoid_(z).mul_(2.0).sub_(1.0)
    if form.library_tanh:
        return torch.tanh_(z)
    e = expm1_(z, clamp)
    return e.div_(torch.add(e, 2.0, out=den))


def capped_(z: Tensor, base: Tensor, cap: float, den: Tensor, form: Forms, clamp: bool) -> Tensor:
    """``c · tanh(z / form.stretch) - base`` in place (``base`` broadcasts), in two passes either way."""
    if form.half_tanh:  # c·(2σ(z) - 1) - base = 2c·σ(z) - (c + base)
        return torch.add((base + cap).neg(), torch.sigmoid_(z), alpha=2 * cap, out=z)
    if form.library_tanh:
        return torch.add(base.neg(), torch.tanh_(z), alpha=cap, out=z)
    e = expm1_(z, clamp)
    return torch.addcdiv(base.neg(), e, torch.add(e, 2.0, out=den), value=cap, out=z)


def exp_nonpositive_(a: Tensor, tmp: Tensor | None, form: Forms, hide: Tensor | None = None,
                     low: float = float("-inf")) -> Tensor:  # fmt: skip
    """``exp(a)`` in place for ``a <= 0`` (``-inf`` allowed), and 0 where ``hide`` is ``-inf``; ``tmp`` a buffer like ``a``.

    ``hide`` (``0`` or ``-inf``, broadcasting to ``a``) is the tile's mask, None on a full
    tile. ``low`` is a lower bound the caller knows for ``a``'s finite entries (a capped
    logit is at least ``-c`` minus its row's maximum); at or above :func:`floor` the floor's
    pass is skipped. Two forms, both within 3 ulp of the float64 ``exp`` where it matters
    (checked in the test suite):

    * PyTorch's ``exp``, with arguments below :func:`floor` sent to ``-inf`` first (one
      ``threshold_`` pass). Without it ``exp`` gives float32 subnormal numbers on
      ``(-104, -87.3)``, and products read them: on x86 every operation that makes or reads
      a subnormal takes a microcode assist, about a hundred times an ordinary element.
      ALiBi's logits fill that band; the tile products of an ALiBi backward ran 20 times
      slower. What the floor drops is below ``e^floor ≈ 3.6e-35`` per key, where the row's
      largest term is 1 (``a`` is a logit minus its row's maximum or log-sum-exp).
    * ``σ(a) / (1 - σ(a))``, which flushes below ``-88.7`` by itself. ``torch.sigmoid`` ran
      two to three times as fast as ``torch.exp`` on the AMD EPYC, and for ``a <= 0``
      nothing cancels (``1 - σ(a) >= 1/2``).
    """
    if hide is not None:
        a.add_(hide)
    if form.library_exp:
        return torch.exp_(a) if low >= floor(a.dtype) else exp_floored(a, in_place=True)
    sig = torch.sigmoid_(a)
    return sig.div_(torch.sub(1.0, sig, out=tmp))


def exp_floored(x: Tensor, *, in_place: bool = False) -> Tensor:
    """``exp(x)``, with arguments below :func:`floor` giving 0 (out of place and differentiable, or in place).

    For a tile's weights (a logit minus its row's maximum or log-sum-exp) that products read
    next: a subnormal weight makes every product that reads it take a microcode assist on
    x86 (1.6% subnormal weights made a ``(8, 256, 256) @ (256, 64)`` product 4.5 times
    slower, and their ``exp`` 5 times). ALiBi's logits, far from the diagonal, land there.
    """
    if in_place:
        return F.threshold_(x, floor(x.dtype), NEG_INF).exp_()
    return torch.exp(F.threshold(x, floor(x.dtype), NEG_INF))


def logit_bound(q: Tensor, k: Tensor, scale: float) -> float | None:
    """``|scale| · max‖q_i‖ · max‖k_j‖``, at least every ``|scale · q_iᵀk_j|`` (Cauchy–Schwarz); None where unreadable.

    The values cannot be read on ``meta`` tensors or while ``torch.compile`` / ``torch.export``
    trace the call; an empty input bounds nothing and gives 0.
    """
    if not concrete(q, k):
        return None
    if not (q.numel() and k.numel()):
        return 0.0
    return abs(scale) * float(q.float().norm(dim=-1).amax()) * float(k.float().norm(dim=-1).amax())


def floor(dtype: torch.dtype) -> float:
    """The smallest argument whose ``exp`` the tiles keep: ``ln`` of ``dtype``'s smallest normal number, plus 8.

    ``e^8 ≈ 3000``: a kept weight times anything above ``3·10⁻⁴`` is still a normal number.
    """
    return math.log(torch.finfo(dtype).tiny) + 8.0


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a backward tile's products of weights (``Pᵀ dO``, ``dS k``, ``dSᵀ q``) run in, for inputs of
    ``dtype`` on ``device``.

    Elementwise work and accumulators are float32 (or wider) either way, and so are the
    logits ``q kᵀ``, the forward's ``P v`` and a backward's ``dO vᵀ``, whose outputs the
    softmax or the backward's ``D`` read (``engines.mod_tiles_parts.operands``). bfloat16 products (float32 accumulation inside)
    are the fast choice where the CPU has bfloat16 dot-product instructions (AVX-512 BF16,
    AMX: 2-3x float32's speed), and a slow one without them: with the kernels held to AVX2,
    a soft-capped fwd+bwd spent 2.7x SDPA's time in its bfloat16 products alone. So the
    first bfloat16 call on a CPU times such products both ways and keeps the faster; float16
    always runs float32 (CPUs lack fast float16 products); other devices and traced calls
    keep bfloat16.
    """
    acc = torch.promote_types(dtype, torch.float32)
    if dtype != torch.bfloat16:
        return acc
    if device.type != "cpu" or tracing():
        return dtype
    return dtype if _bf16_products_faster() else acc


@functools.cache
def _bf16_products_faster() -> bool:
    """Time two products of weights, ``P v`` and ``Pᵀ dO`` (256 × 256 tiles, head size 64, 16 heads), both ways."""
    gen = torch.Generator().manual_seed(0)
    v, d_o = (torch.randn(16, 256, 64, generator=gen) for _ in range(2))
    p = torch.rand(16, 256, 256, generator=gen)

    def products(dtype: torch.dtype):
        p_, v_, d_o_ = (x.to(dtype) for x in (p, v, d_o))
        return lambda: (torch.bmm(p_, v_), torch.bmm(p_.transpose(1, 2), d_o_))

    with torch.no_grad(), one_intra_op_thread():  # as the tile loops run them
        bf16, f32 = best_times(products(torch.bfloat16), products(torch.float32))
    return bf16 < f32
