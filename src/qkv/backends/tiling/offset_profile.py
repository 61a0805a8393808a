"""A whole call's bias and window mask as one profile over query-key offsets, cut into blocks as views.

Shape legend: ``h`` heads, ``i`` query length, ``j`` key length, ``L = i + j - 1`` the number
of query-key offsets; ``it``/``jt`` the sides of a block.

When a call's mask is an offset range (causal, windows, ``offsets``) and its bias is
shift-invariant (ALiBi, T5 buckets), :class:`DiagonalMask` holds both as an ``(h|1, L)``
profile from which each block's additive mask is a zero-copy strided view that PyTorch's
fused kernel reads directly (the ``fused_blocks`` and ``alibi_column`` engines). Checked against the reference mask and bias in the test suite.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ...masks import Mask, Offsets, Tile
from ...positional import LazyBias
from .tiles import NEG_INF, BiasSource, offset_live_rows, shift_invariant

#: How far (in logits) below its row's largest a term must lie to be dropped: ``e^-40 ≈ 4e-18``.
NEGLIGIBLE = 40.0


class DiagonalMask:
    """Bias and window mask of a whole call as one ``(h|1, L)`` profile over query-key offsets.

    When the mask is an offset range (``Offsets``: causal, sliding windows, ``offsets(lo, hi)``)
    or absent and the bias is shift-invariant
    (ALiBi, T5 buckets) or absent, every logit's additive term depends only on the offset
    ``c - r - (j - i)``. A block's ``(it, jt)`` mask is then the profile read along shifted
    windows; with the block's query rows taken in reverse order it is even a plain
    ``as_strided`` view (row stride 1, column stride 1: no copy, no ``(h, it, jt)``
    tensor), which the fused kernel reads directly. Outputs are un-reversed afterwards.
    """

    def __init__(self, mask: Offsets | None, bias: LazyBias | None, i_len: int, j_len: int, dtype: torch.dtype, device):
        self.window, self.i_len, self.j_len = mask, i_len, j_len
        self.shift = j_len - i_len
        self.offset0 = -(i_len - 1) - self.shift
        offsets = torch.arange(self.offset0, self.offset0 + i_len + j_len - 1, device=device)
        if bias is not None:
            with torch.no_grad():  # a learned bias's gradient is rebuilt apart (tiling.bias_grad)
                prof = BiasSource(bias, i_len, j_len, device).profile.to(dtype)
        else:
            prof = torch.zeros(1, offsets.numel(), dtype=dtype, device=device)
        w = self.window
        if w is not None:
            allowed = torch.ones_like(offsets, dtype=torch.bool)
            if w.hi is not None:
                allowed &= offsets <= w.hi
            if w.lo is not None:
                allowed &= offsets >= w.lo
            prof = prof.masked_fill(~allowed, NEG_INF)
        self.profile = prof.contiguous()

    @staticmethod
    def applies(mask: Mask | None, bias: object) -> bool:
        """True when ``mask`` is an offset range or None and ``bias`` shift-invariant or None (not both None)."""
        if mask is None and bias is None:
            return False  # nothing to add to the logits: plain kernel calls, no zero profile or row flips
        lazy_ok = bias is None or (isinstance(bias, LazyBias) and shift_invariant(bias))
        return lazy_ok and (mask is None or isinstance(mask, Offsets))

    def base(self, t: Tile) -> int:
        """Profile index of the reversed block's row 0, column 0 (query ``i1 - 1``, key ``j0``)."""
        return t.j0 - t.i0 - self.shift - self.offset0 - (t.i1 - t.i0) + 1

    def reversed_block(self, t: Tile) -> Tensor:
        """``(1, h|1, it, jt)`` mask of tile ``t`` with its rows in reverse order (a view)."""
        h, length = self.profile.shape
        shape = (1, h, t.i1 - t.i0, t.j1 - t.j0)
        return self.profile.as_strided(shape, (0, length, 1, 1), self.profile.storage_offset() + self.base(t))

    def live(self, t: Tile) -> Tensor | None:
        """Bool ``(it, 1)``: rows with at least one key in the window; None if all are."""
        if self.window is None:
            return None
        first, stop = offset_live_rows(self.window, self.i_len, self.j_len)  # arithmetic: no sync
        return None if first <= t.i0 and t.i1 <= stop else self.sees(t)[:, None]

    def sees(self, t: Tile, lo: int | None = None, hi: int | None = None) -> Tensor:
        """Bool ``(it,)``: rows of ``t`` with a key in the window whose offset lies in ``[lo, hi]``."""
        rows = torch.arange(t.i0, t.i1, device=self.profile.device) + self.shift
        first, last = -rows, self.j_len - 1 - rows  # offsets of key 0 and of the last key
        w = self.window
        for bound in (lo, None if w is None else w.lo):
            if bound is not None:
                first = first.clamp(min=bound)
        for bound in (hi, None if w is None else w.hi):
            if bound is not None:
                last = last.clamp(max=bound)
        return first <= last

    def row_maxima(self) -> Tensor:
        """``(h|1, i)``: each query row's largest profile value over the offsets it may see (``-inf`` if none).

        A sparse table of maxima over windows of ``2^k`` offsets, each row's range covered
        by two of them: ``O(h · L · log L)``, no ``(i, j)`` tensor.
        """
        rows = torch.arange(self.i_len, device=self.profile.device) + self.shift
        first, last = -rows, self.j_len - 1 - rows
        w = self.window
        if w is not None and w.lo is not None:
            first = first.clamp(min=w.lo)
        if w is not None and w.hi is not None:
            last = last.clamp(max=w.hi)
        a, e = first - self.offset0, last - self.offset0  # profile indices, a > e on rows that see nothing
        dead = a > e
        a, e = a.masked_fill(dead, 0), e.masked_fill(dead, 0)  # read anything in range; -inf at the end
        width = e - a + 1
        level = torch.floor(torch.log2(width.double())).long()
        table, out = [self.profile], torch.full((self.profile.shape[0], self.i_len), NEG_INF, dtype=self.profile.dtype,
                                                device=self.profile.device)  # fmt: skip
        for k in range(int(level.max()) + 1 if self.i_len else 0):
            if k:
                prev, half = table[-1], 1 << (k - 1)
                table.append(torch.maximum(prev[:, :-half], prev[:, half:]))
            pick = (level == k).nonzero().flatten()
            if pick.numel():
                lo, hi = a[pick], e[pick] - (1 << k) + 1
                out[:, pick] = torch.maximum(table[k][:, lo], table[k][:, hi])
        return out.masked_fill(dead, NEG_INF)

    def without_negligible(self, logit_bound: float) -> DiagonalMask:
        """The same mask with every term too small to change any row's softmax sent to ``-inf`` (a copy).

        ``logit_bound`` bounds ``|scale · qᵀk|`` (Cauchy–Schwarz: ``scale · max‖q‖ · max‖k‖``).
        Row ``r``'s largest logit is then at least ``B_r - S``, with ``B_r`` its largest
        profile value (:meth:`row_maxima`), so a term below ``min_r B_r - 2S - K`` has a
        weight below ``e^-K`` of its row's largest: with ``K =`` :data:`NEGLIGIBLE` (40), all
        such terms together move a row by less than float32's rounding for up to ``2^31``
        keys. Why drop them: ALiBi's far keys give the fused kernel weights in float32's
        subnormal range, where every product that reads one takes a microcode assist on
        x86 (an ALiBi fwd+bwd at i = 4096 ran 3.3 times slower on an Intel Xeon). Float64
        profiles are returned as they are (their subnormals start at ``e^-708``).
        """
        if self.profile.dtype == torch.float64 or not self.i_len:
            return self
        finite = self.profile[torch.isfinite(self.profile)]
        if not finite.numel():
            return self
        low, high = torch.aminmax(finite)
        if float(high - low) <= 2.0 * logit_bound + NEGLIGIBLE:
            return self  # no term lies that far below any other (T5's buckets): none can be under the floor below
        best = self.row_maxima()  # (h|1, i)
        live = torch.isfinite(best)
        if not bool(live.any()):
            return self
        floor_ = best.masked_fill(~live, float("inf")).amin(-1, keepdim=True) - 2.0 * logit_bound - NEGLIGIBLE  # (h|1, 1)
        out = copy.copy(self)
        out.profile = self.profile.masked_fill(self.profile < floor_, NEG_INF)
        return out

    def clipped(self, lo: int | None = None, hi: int | None = None) -> DiagonalMask:
        """The same mask with every offset outside ``[lo, hi]`` masked too (a copy of the profile)."""
        out = copy.copy(self)
        offsets = torch.arange(self.offset0, self.offset0 + self.profile.shape[-1], device=self.profile.device)
        outside = torch.zeros_like(offsets, dtype=torch.bool)
        if lo is not None:
            outside |= offsets < lo
        if hi is not None:
            outside |= offsets > hi
        out.profile = self.profile.masked_fill(outside, NEG_INF)
        return out
