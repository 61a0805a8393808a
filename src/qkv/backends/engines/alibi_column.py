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
(``tiling.offset_profile.DiagonalMask``, a strided view). The parts' partial softmaxes are merged by
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
the test suite.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._probe import best_times
from ...masks import Offsets, Tile
from ...positional import ALiBi
from ..request import Request
from ..tiling import flash_cpu
from ..tiling import lse as row_lse
from ..tiling.flash_cpu import same_head_size
from ..tiling.offset_profile import DiagonalMask
from ..tiling.tiles import NEG_INF
from . import fused_blocks
from .contract import Grads

name = "alibi_column"

#: Query rows per block: the masked square is ``BLOCK_ROWS / j`` of the work; smaller blocks
#: mean more kernel calls, each reading every key of its side.
BLOCK_ROWS = 256
#: The column path is kept when its time is below this share of the masked path's.
MARGIN = 0.9


def refuses(req: Request) -> str | None:
    if not isinstance(req.bias, ALiBi):
        return "the bias is not ALiBi"
    if req.mask is not None and not req.is_causal_only:
        return "ALiBi's key column needs no mask or the plain causal one"
    if req.q.dtype not in (torch.float32, torch.float64):
        return f"the column's key positions would round in {req.q.dtype}"
    if req.i <= BLOCK_ROWS:
        return f"i = {req.i} is one block of {BLOCK_ROWS} rows: nothing to take off the mask"
    if not req.score.dot_form or req.dropout > 0 or req.score_mod is not None:
        return "it runs the fused kernel on plain dot products (no other score, dropout or score_mod)"
    if (reason := flash_cpu.unusable(req.q)) is not None:
        return reason
    grad = req.differentiated
    if not preferred(req.q.dtype, grad):
        return f"the masked kernel was timed faster on this CPU ({'forward + backward' if grad else 'forward'})"
    return None


def forward(req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
    """The contract's forward (``engines.contract``), with the kernel's head sizes made equal."""
    e = req.v.shape[-1]
    out, lse = column_forward(_Parts(*same_head_size(req.q, req.k, req.v), req.bias, req.scale, req.mask is not None))
    return out[..., :e], lse, None


def backward(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: None, dtype: torch.dtype) -> Grads:
    """The contract's backward: each part's share of the gradients from the final ``out`` and ``lse``."""
    q, k, v = req.q, req.k, req.v
    d, e = q.shape[-1], v.shape[-1]
    qf, kf, vf = same_head_size(q, k, v)
    pad = vf.shape[-1] - e
    out_f, d_out_f = (F.pad(x.to(q.dtype), (0, pad)) if pad else x.to(q.dtype) for x in (out, d_out))
    dq, dk, dv = column_backward(_Parts(qf, kf, vf, req.bias, req.scale, req.mask is not None), out_f, lse, d_out_f)
    return Grads(q=dq[..., :d], k=dk[..., :d], v=dv[..., :e], bias=None, params=[])


@functools.cache
def preferred(dtype: torch.dtype, grad: bool) -> bool:
    """True when the column path was the faster on this CPU (timed once per mode and dtype)."""
    with torch.inference_mode(False), torch.no_grad():  # the first call may come from a decoding loop
        return _column_faster(dtype, grad)


def _column_faster(dtype: torch.dtype, grad: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 8, 2 * BLOCK_ROWS, 64, generator=gen, dtype=dtype) for _ in range(4))
    bias, scale = ALiBi(8), 0.125
    masked_plan = fused_blocks.FusedPlan(None, bias, scale, causal_square=False, diagonal=True, learned=False)

    def masked():
        out, lse, _ = fused_blocks.fused_forward(masked_plan, q, k, v)
        if grad:
            fused_blocks.fused_backward(masked_plan, q, k, v, out, lse, d_out)

    def column():
        parts = _Parts(q, k, v, bias, scale, False)
        out, lse = column_forward(parts)
        if grad:
            column_backward(parts, out, lse, d_out)

    t_column, t_masked = best_times(column, masked)
    return t_column < MARGIN * t_masked


def _blocks(i_len: int, j_len: int, causal: bool):
    """:class:`_Block` per :data:`BLOCK_ROWS` rows: its square keys, and whether keys right of it are seen."""
    shift = j_len - i_len
    for i0 in range(0, i_len, BLOCK_ROWS):
        i1 = min(i0 + BLOCK_ROWS, i_len)
        a = min(j_len, max(0, i0 + shift))
        e = max(a, min(j_len, i1 + shift))
        yield _Block(i0, i1, a, e, not causal and e < j_len)


def _row_terms(slopes: Tensor, i0: int, i1: int, a: int, e: int, shift: int) -> tuple[Tensor, Tensor]:
    """``(h, it)`` row terms of the left (keys ``< a``) and right (keys ``>= e``) parts."""
    r = torch.arange(i0, i1, device=slopes.device, dtype=slopes.dtype)
    m = slopes[:, None]
    return -m * (r + shift - a), -m * (e - 1 - r - shift)


def column_forward(parts: _Parts) -> tuple[Tensor, Tensor]:
    """``(out (b, h, i, d), lse (b, h, i))`` of ALiBi without a mask or causal, ``parts`` its inputs; no graph."""
    q = parts.q
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype, device=q.device)  # rows before the first key: no mass
    for block in _blocks(q.shape[-2], parts.k.shape[-2], parts.causal):
        acc_out = acc_lse = None
        for o, m in parts.forward(block):
            acc_out, acc_lse = (o, m) if acc_lse is None else row_lse.merge(acc_out, acc_lse, o, m)
        if acc_lse is not None:
            out[..., block.i0 : block.i1, :], lse[..., block.i0 : block.i1] = acc_out, acc_lse
    return out, lse


def column_backward(parts: _Parts, out: Tensor, lse: Tensor, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the row's final ``out`` and ``lse`` (``±inf``: a row that sees no key)."""
    q, k, v = parts.q, parts.k, parts.v
    dead = torch.isinf(lse)  # rows that see no key: no gradient, and a finite lse for the kernel
    rows = _Rows(d_out.masked_fill(dead[..., None], 0.0).contiguous(), out, lse.masked_fill(dead, 0.0))
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for block in _blocks(q.shape[-2], k.shape[-2], parts.causal):
        parts.backward(block, rows, grads)
    return grads


@dataclass(frozen=True)
class _Block:
    """Rows ``i0:i1``; keys ``a:e`` are their diagonal square; ``right``: keys right of it are seen."""

    i0: int
    i1: int
    a: int
    e: int
    right: bool


class _Rows:
    """What the backward reads of every row: ``d_out``, ``out``, a finite ``lse``, and the first two padded by one column."""

    def __init__(self, d_out: Tensor, out: Tensor, lse: Tensor):
        self.d_out, self.out, self.lse = d_out, out, lse
        self.d_out_aug, self.out_aug = F.pad(d_out, (0, 1)), F.pad(out, (0, 1))  # the column parts' head size


class _Parts:
    """One call's augmented inputs and the three parts (left column, square, right column) of a block."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, bias: ALiBi, scale: float, causal: bool):
        slopes = bias.slopes.to(device=q.device, dtype=torch.float64)
        self.q, self.k, self.v, self.slopes, self.scale, self.causal = q, k, v, slopes, scale, causal
        b, h, i_len, d = q.shape
        self.shift = k.shape[-2] - i_len
        column = (slopes / scale).to(q.dtype)[None, :, None, None].expand(b, h, i_len, 1)
        self.q_aug = torch.cat((q, column), dim=-1)  # (b, h, i, d + 1)
        self.k_aug = F.pad(k, (0, 1))  # the last column is written per block (key terms)
        self.v_aug = F.pad(v, (0, 1))  # a zero column: the kernel needs one head size
        self.keys = torch.arange(k.shape[-2], device=q.device, dtype=q.dtype)
        window = Offsets(None, 0) if causal else None
        self.square = DiagonalMask(window, bias, i_len, k.shape[-2], q.dtype, q.device)  # the exact bias where |o| bends

    def _columns(self, a: int, e: int, right: bool) -> None:
        self.k_aug[..., :a, -1] = self.keys[:a] - a
        if right:
            self.k_aug[..., e:, -1] = (e - 1) - self.keys[e:]

    def _sides(self, block: _Block):
        """``(keys, row term (h, it))`` of the column parts of a block."""
        left_term, right_term = _row_terms(self.slopes, block.i0, block.i1, block.a, block.e, self.shift)
        sides = [(slice(0, block.a), left_term)] if block.a > 0 else []
        return sides + ([(slice(block.e, None), right_term)] if block.right else [])

    def forward(self, block: _Block):
        """Yield ``(out (b, h, it, d), lse (b, h, it))`` of each part of the block, lse with its row term."""
        i0, i1, a, e = block.i0, block.i1, block.a, block.e
        rows, d = slice(i0, i1), self.q.shape[-1]
        self._columns(a, e, block.right)
        for keys, term in self._sides(block):
            o, m = flash_cpu.forward(self.q_aug[..., rows, :], self.k_aug[..., keys, :], self.v_aug[..., keys, :],
                                   0.0, False, scale=self.scale)  # fmt: skip
            yield o[..., :d], m + term.to(m.dtype)
        if e > a:
            t = Tile(i0, i1, a, e, self.q.shape[-2], self.k.shape[-2], self.q.device)
            o, m = flash_cpu.forward(self.q[..., rows, :].flip(-2), self.k[..., a:e, :], self.v[..., a:e, :], 0.0, False,
                                   attn_mask=self.square.reversed_block(t), scale=self.scale)  # fmt: skip
            live = self.square.sees(t)  # the kernel gives a row with no key lse 0
            yield o.flip(-2), torch.where(live, m.flip(-1), NEG_INF)

    def backward(self, block: _Block, given: _Rows, grads: tuple[Tensor, Tensor, Tensor]) -> None:
        """Add the block's parts' shares of ``(dq, dk, dv)`` into ``grads``."""
        i0, i1, a, e = block.i0, block.i1, block.a, block.e
        d_out, out, lse, (dq, dk, dv) = given.d_out, given.out, given.lse, grads
        rows, d = slice(i0, i1), self.q.shape[-1]
        self._columns(a, e, block.right)
        do_aug, out_aug = given.d_out_aug[..., rows, :], given.out_aug[..., rows, :]
        for keys, term in self._sides(block):
            gq, gk, gv = flash_cpu.backward(do_aug, self.q_aug[..., rows, :], self.k_aug[..., keys, :],
                                          self.v_aug[..., keys, :], out_aug, lse[..., rows] - term.to(lse.dtype),
                                          0.0, False, scale=self.scale)  # fmt: skip
            dq[..., rows, :] += gq[..., :d]
            dk[..., keys, :] += gk[..., :d]
            dv[..., keys, :] += gv[..., :d]
        if e > a:
            t = Tile(i0, i1, a, e, self.q.shape[-2], self.k.shape[-2], self.q.device)
            flip = [x[..., rows, :].flip(-2) for x in (d_out, self.q, out)]
            gq, gk, gv = flash_cpu.backward(flip[0], flip[1], self.k[..., a:e, :], self.v[..., a:e, :], flip[2],
                                          lse[..., rows].flip(-1), 0.0, False, attn_mask=self.square.reversed_block(t),
                                          scale=self.scale)  # fmt: skip
            dq[..., rows, :] += gq.flip(-2)
            dk[..., a:e, :] += gk
            dv[..., a:e, :] += gv

