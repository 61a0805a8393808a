"""Gradient of a learned positional bias that the fused kernel cannot give: ``dL/d profile``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``it``/``jt`` a block's rows and keys, ``L``
the number of query-key offsets.

A shift-invariant bias (T5 buckets, Raffel et al. 2020) enters the logits as
``s_rc += p[h, c - r - (j - i)]``, so its gradient is the sum of the logits' gradient
``dS = P ∘ (dO Vᵀ - D)`` (FlashAttention's backward, ``D = rowsum(dO ∘ O)``) along each
diagonal, and over the batch. The fused kernel's backward returns dq, dk and dv but not
dS, so dS is recomputed here one block of rows at a time (two matmuls and an exponential
per block) and folded into the ``(h, L)`` profile gradient. For T5's saturating buckets
only a band of ``2 · max_distance - 1`` diagonals is recomputed; the two far regions are a
sum each, the future one from what the forward pass kept (:func:`far_profile_grad`) and
the past one from rows of ``dS`` summing to zero.

Checked against the float64 reference backend in the test suite.

The blocks come in the reversed-row order of ``fused_blocks.DiagonalMask`` (block row
``a'`` is query ``i1 - 1 - a'``), where offsets run along anti-diagonals: row ``a'``,
column ``c`` has profile index ``base + a' + c``. Anti-diagonal sums use the skew trick:
pad each row with ``it`` zeros, read the ``(it, jt + it)`` buffer as ``(it, jt + it - 1)``
so that row ``a'`` shifts right by ``a'``, and sum the columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...masks import Tile
from .tile_math import exp_floored

#: Query rows per block in :func:`saturating_profile_grad`. Each block recomputes ``dS`` on
#: ``BAND_ROWS + 2·max_distance`` keys, so smaller blocks waste less; but every block is a
#: dozen small parallel ops, each of which waits for a free core on a busy machine.
BAND_ROWS = 256
#: Elements of one block of logits (batch x heads x rows x keys) in the bias gradient: 8 MiB
#: per float32 buffer, against 512 MiB for the (h, i, j) bias of 8 heads at i = j = 4096.
BLOCK_ELEMENTS = 2**21


def antidiagonal_sums(x: Tensor) -> Tensor:
    """``(..., it, jt) -> (..., it + jt - 1)``: entry ``s`` is ``Σ_{a + c = s} x[..., a, c]``."""
    it, jt = x.shape[-2:]
    skew = F.pad(x, (0, it)).flatten(-2)[..., : it * (jt + it - 1)]
    return skew.unflatten(-1, (it, jt + it - 1)).sum(-2)


@dataclass(frozen=True)
class Rows:
    """What the gradient reads of some query rows: ``q (b, h, it, d)``, ``d_out (b, h, it, e)``,
    their log-sum-exp ``lse`` and ``delta = rowsum(dO ∘ O)`` ``(b, h, it)``."""

    q: Tensor
    d_out: Tensor
    lse: Tensor
    delta: Tensor

    def reversed(self, rows: slice) -> Rows:
        """Rows ``rows``, last first (the order of ``DiagonalMask.reversed_block``)."""
        return Rows(*(x[..., rows, :].flip(-2) for x in (self.q, self.d_out)), *(x[..., rows].flip(-1) for x in (self.lse, self.delta)))


def add_profile_grad(
    d_profile: Tensor, rows: Rows, k: Tensor, v: Tensor, mask_rev: Tensor, base: int, scale: float,
    keep: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """Add one block's contribution to ``d_profile (h|1, L)``, in place.

    ``rows`` and ``mask_rev (1, h|1, it, jt)`` are the block's rows in reverse order
    (:meth:`Rows.reversed`); ``k (b, g, jt, d)``, ``v (b, g, jt, e)`` its keys; ``base`` the
    profile index of reversed row 0, key 0; only profile indices in ``keep = (first,
    last)`` (inclusive) are updated when it is given.
    """
    q_rev, d_out_rev, lse_rev, delta_rev = rows.q, rows.d_out, rows.lse, rows.delta
    b, h, it, _ = q_rev.shape
    acc = torch.promote_types(q_rev.dtype, torch.float32)
    g, jt = k.shape[-3], k.shape[-2]
    step = max(1, BLOCK_ELEMENTS // max(1, b * h * jt))
    k5, v5 = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    for a0 in range(0, it, step):
        a1 = min(a0 + step, it)
        # In place and as few passes as possible: these (b, h, rows, jt) blocks are the bulk of
        # the extra work, and on a busy machine each pass also waits for a free core. The
        # scale goes on the (rows, d) queries. Both products in acc: a half-precision one
        # rounds its output, the logits and dP that the softmax's gradient reads.
        q5 = (q_rev[..., a0:a1, :].to(acc) * scale).unflatten(1, (g, h // g))
        s = (q5 @ k5.transpose(-1, -2)).flatten(1, 2)
        p = exp_floored(s.add_(mask_rev[..., a0:a1, :]).sub_(lse_rev[..., a0:a1, None]), in_place=True)  # no subnormal weights
        dp = (d_out_rev[..., a0:a1, :].to(acc).unflatten(1, (g, h // g)) @ v5.transpose(-1, -2)).flatten(1, 2)
        ds = dp.sub_(delta_rev[..., a0:a1, None]).mul_(p)
        ds = ds[0] if b == 1 else ds.sum(0)  # (h, rows, jt): the bias is shared by the batch
        if d_profile.shape[0] == 1:
            ds = ds.sum(0, keepdim=True)
        sums = antidiagonal_sums(ds)
        start, stop = base + a0, base + a0 + sums.shape[-1]
        if keep is not None:  # entries outside are counted elsewhere (saturating_profile_grad)
            lo, hi = max(start, keep[0]), min(stop, keep[1] + 1)
            if lo >= hi:
                continue
            sums, start, stop = sums[..., lo - start : hi - start], lo, hi
        d_profile[:, start:stop] += sums.to(d_profile.dtype)


def far_profile_grad(d_profile: Tensor, d_out: Tensor, delta: Tensor, reach: int, offset0: int, far: tuple[Tensor, Tensor]) -> None:
    """Add the far future's share of ``dL/d profile`` (offsets ``>= reach``) to ``d_profile``.

    For the far future ``C`` of row ``r``, ``Σ_{c∈C} dS_rc = Σ_C P_rc (dO_r·v_c) - D_r Σ_C P_rc
    = share_r (dO_r · own_r - D_r)``, with ``share = Σ_C P_rc`` the far keys' part of the
    row's mass and ``own = Σ_C P_rc v_c / share`` their own softmax-normalised output, both
    kept by the forward pass (``fused_blocks._split_block``). All offsets of ``C`` share one
    bucket, so the sum goes to the profile entry of offset ``reach``.
    ``d_out (b, h, i, e)``, ``delta (b, h, i)``, ``far = (own (b, h, i, e), share (b, h, i))``.
    """
    own, share = far
    acc = d_profile.dtype
    # einsum contracts through bmm: no (b, h, i, e) product in memory
    part = share.to(acc) * (torch.einsum("...e,...e->...", d_out.to(acc), own.to(acc)) - delta)
    part = part.flatten(0, -3).sum(0)  # (h, i): the bias is shared by the batch
    d_profile[:, reach - offset0] += part.sum(-1) if d_profile.shape[0] > 1 else part.sum()


def saturating_profile_grad(d_profile: Tensor, diagonal, rows: Rows, k: Tensor, v: Tensor, scale: float, reach: int,
                            row_sums: Tensor | None = None) -> None:  # fmt: skip
    """``dL/d profile`` of a bias that is one value per side beyond ``|offset| >= reach``.

    T5's buckets saturate at ``max_distance``: every key at least that far in the future
    shares one bucket, and so does every key that far in the past. Only the sums of ``dS``
    over those two regions are needed there, not ``dS`` itself:

    * the band ``|offset| < reach`` is done exactly (:func:`add_profile_grad` on blocks of
      :data:`BAND_ROWS` rows and the keys around their diagonal), costing ``O(i · reach)``;
    * the far future is :func:`far_profile_grad`, which the caller must have added already;
    * for the far past, each row of ``dS`` sums to zero (``Σ_c P(dP - D) = D - D``), so its
      sum is minus everything else. With attention sinks a row's keys hold only part of its
      mass and its ``dS`` sums to ``row_sums = P_sink · D`` ``(b, h, i)`` instead.

    ``rows`` are every query row (``lse`` ``+inf`` on rows that see no key), ``k, v (b, g, j,
    ·)``; ``diagonal`` is the call's ``tiling.offset_profile.DiagonalMask``.
    """
    i_len, j_len = rows.q.shape[-2], k.shape[-2]
    step = BAND_ROWS
    shift, off0, device = diagonal.shift, diagonal.offset0, rows.q.device
    band = (-reach + 1 - off0, reach - 1 - off0)  # profile indices of the band, inclusive
    # 1. the band |offset| < reach: every key of a block of rows that is that close to one of them
    for i0 in range(0, i_len, step):
        i1 = min(i0 + step, i_len)
        jlo, jhi = max(0, i0 + shift - reach + 1), min(j_len, i1 - 1 + shift + reach)
        if jlo >= jhi:
            continue
        t = Tile(i0, i1, jlo, jhi, i_len, j_len, device)
        add_profile_grad(d_profile, rows.reversed(slice(i0, i1)), k[..., jlo:jhi, :], v[..., jlo:jhi, :],
                         diagonal.reversed_block(t), diagonal.base(t), scale, keep=band)  # fmt: skip
    # 2. the far past, offset <= -reach: rows of dS sum to zero
    past_index = -reach - off0
    if past_index >= 0:
        d_profile[:, past_index] -= d_profile.sum(-1)
        if row_sums is not None:
            per_head = row_sums.flatten(0, -3).sum(0).sum(-1).to(d_profile.dtype)  # (h,)
            d_profile[:, past_index] += per_head if d_profile.shape[0] > 1 else per_head.sum()
