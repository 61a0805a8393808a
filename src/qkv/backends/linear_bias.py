"""ALiBi as one more query/key column, through the fused CPU kernel without a mask on most keys.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` head size (``d = e``, as the kernel needs); ``it`` the rows of one block.

ALiBi (Press et al. 2022) adds ``-m_h |o|`` to the logits, ``o = c - r - (j - i)`` the
query-key offset. For the rows ``i0 .. i1 - 1`` of a block, every key left of the block's
diagonal square (``c < a = i0 + j - i``) has ``o < 0`` for all of them, so its bias is

    -m (r + j - i - c) = m (c - a)  +  [-m (r + j - i - a)]
                         key term      row term: one constant per row, which the softmax cancels

and likewise right of the square (``c >= e = i1 + j - i``, ``o > 0``), ``-m (c - r - (j-i)) =
m (e - 1 - c) + [-m (e - 1 - r - (j - i))]``. A key term is one extra column: ``q`` gets
``m_h / scale`` and ``k`` gets ``c - a`` (left) or ``e - 1 - c`` (right), so the kernel runs
these keys with no ``attn_mask`` at all, forward and backward. Only the block's own
``it x it`` square, where ``|o|`` bends, is attended with the exact bias as a mask
(``fused_blocks.DiagonalMask``, a strided view). The parts' partial softmaxes are merged by
their log-sum-exp, each shifted by its row term. The backward calls the kernel's backward
per part with the merged output and log-sum-exp (less the part's row term), which gives
each part's share of dq, dk and dv exactly (the usual split-key flash backward).

Precision: the column values are small integers where the weights are large (keys near
the block), so float32 keeps them; the key terms run up to ``m·j`` only where the weights
are ``e^{-m·distance}``-small. In half precision the column (integers beyond 256) would
round, so those calls keep the masked path.

Whether this beats the masked kernel depends on the CPU: here the extra column costs the
kernel 20-40% (its head size leaves the vector width), while a masked call costs 5-20%.
:func:`preferred` times both once per process (``(1, 8, 512, 64)``, forward and backward
apart) and keeps the faster. Checked against the float64 reference in
``tests/test_backends_linear_bias.py``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import Offsets, Tile
from ..positional import ALiBi
from . import kernels
from .diagonal import DiagonalMask, FusedPlan
from .fused_blocks import FusedBlocks
from .tiles import NEG_INF

#: Query rows per block: the masked square is ``BLOCK_ROWS / j`` of the work; smaller blocks
#: mean more kernel calls, each reading every key of its side.
BLOCK_ROWS = 256
#: The column path is kept when its time is below this share of the masked path's.
MARGIN = 0.9

_choice: dict[tuple[bool, torch.dtype], bool] = {}


def applies(bias: object, mask: object, q: Tensor) -> bool:
    """True for ALiBi without a mask or with the plain causal one, in float32 or float64, with ``i > BLOCK_ROWS``."""
    if not isinstance(bias, ALiBi) or q.dtype not in (torch.float32, torch.float64) or q.shape[-2] <= BLOCK_ROWS:
        return False
    return mask is None or (isinstance(mask, Offsets) and mask.lo is None and mask.hi == 0)


def preferred(q: Tensor, grad: bool) -> bool:
    """True when the column path was the faster on this CPU (timed once per mode and dtype)."""
    key = (grad, q.dtype)
    if key not in _choice:
        _choice[key] = _probe(q.dtype, grad)
    return _choice[key]


def _probe(dtype: torch.dtype, grad: bool) -> bool:
    with torch.inference_mode(False):  # the first call may come from a decoding loop
        return _timed(dtype, grad)


def _timed(dtype: torch.dtype, grad: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 8, 2 * BLOCK_ROWS, 64, generator=gen, dtype=dtype) for _ in range(4))
    bias, scale = ALiBi(8), 0.125

    def masked():
        x = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out, _ = FusedBlocks.apply(FusedPlan(mask=None, bias=bias, scale=scale, causal_square=False), *x, None, None)
        if grad:
            torch.autograd.grad(out, x, d_out)

    def column():
        x = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out, _ = ColumnBlocks.apply(x[0], x[1], x[2], bias, scale, False)
        if grad:
            torch.autograd.grad(out, x, d_out)

    best = {masked: float("inf"), column: float("inf")}
    with torch.set_grad_enabled(grad):
        for round_ in range(4):  # the first round warms up (allocations, kernel set-up)
            for fn in (masked, column) if round_ % 2 else (column, masked):
                start = time.perf_counter()
                fn()
                if round_:
                    best[fn] = min(best[fn], time.perf_counter() - start)
    return best[column] < MARGIN * best[masked]


def _blocks(i_len: int, j_len: int, causal: bool):
    """Per block of rows ``(i0, i1, a, e, right)``: square keys ``a:e``, and whether keys right of it are seen."""
    shift = j_len - i_len
    for i0 in range(0, i_len, BLOCK_ROWS):
        i1 = min(i0 + BLOCK_ROWS, i_len)
        a = min(j_len, max(0, i0 + shift))
        e = max(a, min(j_len, i1 + shift))
        yield i0, i1, a, e, not causal and e < j_len


def _row_terms(slopes: Tensor, i0: int, i1: int, a: int, e: int, shift: int) -> tuple[Tensor, Tensor]:
    """``(h, it)`` row terms of the left (keys ``< a``) and right (keys ``>= e``) parts."""
    r = torch.arange(i0, i1, device=slopes.device, dtype=slopes.dtype)
    m = slopes[:, None]
    return -m * (r + shift - a), -m * (e - 1 - r - shift)


class ColumnBlocks(torch.autograd.Function):
    """``(q, k, v) -> (out, lse)`` for ALiBi without a mask or causal; ``q (b, h, i, d)``, ``k, v (b, g, j, d)``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: ALiBi, scale: float, causal: bool):
        i_len, j_len = q.shape[-2], k.shape[-2]
        parts = _Parts(q, k, v, bias, scale, causal)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
        for i0, i1, a, e, right in _blocks(i_len, j_len, causal):
            acc_out = acc_lse = None
            for o, m in parts.forward(i0, i1, a, e, right):
                if acc_lse is None:
                    acc_out, acc_lse = o, m
                    continue
                new = torch.logaddexp(acc_lse, m)
                ref = torch.where(torch.isinf(new), 0.0, new)
                acc_out = acc_out * torch.exp(acc_lse - ref)[..., None] + o * torch.exp(m - ref)[..., None]
                acc_lse = new
            if acc_lse is None:  # causal rows before the first key: no part at all
                out[..., i0:i1, :], lse[..., i0:i1] = 0.0, float("inf")
                continue
            out[..., i0:i1, :] = acc_out
            lse[..., i0:i1] = torch.where(torch.isneginf(acc_lse), float("inf"), acc_lse)  # no key: +inf
        ctx.bias, ctx.scale, ctx.causal = bias, scale, causal
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dead = torch.isinf(lse)  # rows that see no key: no gradient, and a finite lse for the kernel
        d_out = d_out.masked_fill(dead[..., None], 0.0).contiguous()
        lse = lse.masked_fill(dead, 0.0)
        parts = _Parts(q, k, v, ctx.bias, ctx.scale, ctx.causal)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        padded = F.pad(d_out, (0, 1)), F.pad(out, (0, 1))  # the column parts' head size, once per call
        for i0, i1, a, e, right in _blocks(q.shape[-2], k.shape[-2], ctx.causal):
            parts.backward(i0, i1, a, e, right, d_out, out, lse, padded, dq, dk, dv)
        return dq, dk, dv, None, None, None


class _Parts:
    """One call's augmented inputs and the three parts (left column, square, right column) of a block."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, bias: ALiBi, scale: float, causal: bool):
        slopes = bias.slopes.to(device=q.device, dtype=torch.float64)
        self.q, self.k, self.v, self.slopes, self.scale = q, k, v, slopes, scale
        b, h, i_len, d = q.shape
        self.shift = k.shape[-2] - i_len
        column = (slopes / scale).to(q.dtype)[None, :, None, None].expand(b, h, i_len, 1)
        self.q_aug = torch.cat((q, column), dim=-1)  # (b, h, i, d + 1)
        self.k_aug = F.pad(k, (0, 1))  # the last column is written per block (key terms)
        self.v_aug = F.pad(v, (0, 1))  # a zero column: the kernel needs one head size
        self.keys = torch.arange(k.shape[-2], device=q.device, dtype=q.dtype)
        window = Offsets(None, 0) if causal else None
        plan = FusedPlan(mask=window, bias=bias, scale=scale, causal_square=False)
        self.square = DiagonalMask(plan, i_len, k.shape[-2], q.dtype, q.device)  # the exact bias where |o| bends

    def _columns(self, a: int, e: int, right: bool) -> None:
        self.k_aug[..., :a, -1] = self.keys[:a] - a
        if right:
            self.k_aug[..., e:, -1] = (e - 1) - self.keys[e:]

    def _sides(self, i0, i1, a, e, right):
        """``(keys, row term (h, it))`` of the column parts of a block."""
        left_term, right_term = _row_terms(self.slopes, i0, i1, a, e, self.shift)
        sides = [(slice(0, a), left_term)] if a > 0 else []
        return sides + ([(slice(e, None), right_term)] if right else [])

    def forward(self, i0, i1, a, e, right):
        """Yield ``(out (b, h, it, d), lse (b, h, it))`` of each part of the block, lse with its row term."""
        rows, d = slice(i0, i1), self.q.shape[-1]
        self._columns(a, e, right)
        for keys, term in self._sides(i0, i1, a, e, right):
            o, m = kernels.forward(self.q_aug[..., rows, :], self.k_aug[..., keys, :], self.v_aug[..., keys, :],
                                   0.0, False, scale=self.scale)  # fmt: skip
            yield o[..., :d], m + term.to(m.dtype)
        if e > a:
            t = Tile(i0, i1, a, e, self.q.shape[-2], self.k.shape[-2], self.q.device)
            o, m = kernels.forward(self.q[..., rows, :].flip(-2), self.k[..., a:e, :], self.v[..., a:e, :], 0.0, False,
                                   attn_mask=self.square.reversed_block(t), scale=self.scale)  # fmt: skip
            live = self.square.sees(t)  # the kernel gives a row with no key lse 0
            yield o.flip(-2), torch.where(live, m.flip(-1), NEG_INF)

    def backward(self, i0, i1, a, e, right, d_out, out, lse, padded, dq, dk, dv):
        rows, d = slice(i0, i1), self.q.shape[-1]
        self._columns(a, e, right)
        do_aug, out_aug = padded[0][..., rows, :], padded[1][..., rows, :]
        for keys, term in self._sides(i0, i1, a, e, right):
            gq, gk, gv = kernels.backward(do_aug, self.q_aug[..., rows, :], self.k_aug[..., keys, :],
                                          self.v_aug[..., keys, :], out_aug, lse[..., rows] - term.to(lse.dtype),
                                          0.0, False, scale=self.scale)  # fmt: skip
            dq[..., rows, :] += gq[..., :d]
            dk[..., keys, :] += gk[..., :d]
            dv[..., keys, :] += gv[..., :d]
        if e > a:
            t = Tile(i0, i1, a, e, self.q.shape[-2], self.k.shape[-2], self.q.device)
            flip = [x[..., rows, :].flip(-2) for x in (d_out, self.q, out)]
            gq, gk, gv = kernels.backward(flip[0], flip[1], self.k[..., a:e, :], self.v[..., a:e, :], flip[2],
                                          lse[..., rows].flip(-1), 0.0, False, attn_mask=self.square.reversed_block(t),
                                          scale=self.scale)  # fmt: skip
            dq[..., rows, :] += gq.flip(-2)
            dk[..., a:e, :] += gk
            dv[..., a:e, :] += gv

