"""Gradient of a learned positional bias that the fused kernel cannot give: ``dL/d profile``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``it``/``jt`` a block's rows and keys, ``L``
the number of query-key offsets.

A shift-invariant bias (T5 buckets, Raffel et al. 2020) enters the logits as
``s_rc += p[h, c - r - (j - i)]``, so its gradient is the sum of the logits' gradient
``dS = P ∘ (dO Vᵀ - D)`` (FlashAttention's backward, ``D = rowsum(dO ∘ O)``) along each
diagonal, and over the batch. The fused kernel's backward returns dq, dk and dv but not
dS, so dS is recomputed here one block of rows at a time (two matmuls and an exponential
per block) and folded into the ``(h, L)`` profile gradient.

The blocks come in the reversed-row order of ``fused_blocks.DiagonalMask`` (block row
``a'`` is query ``i1 - 1 - a'``), where offsets run along anti-diagonals: row ``a'``,
column ``c`` has profile index ``base + a' + c``. Anti-diagonal sums use the skew trick:
pad each row with ``it`` zeros, read the ``(it, jt + it)`` buffer as ``(it, jt + it - 1)``
so that row ``a'`` shifts right by ``a'``, and sum the columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import Tile

#: Query rows per block in :func:`saturating_profile_grad` (twice that for the kernel calls):
#: few blocks, because on a busy machine every small parallel op waits for a free core.
BAND_ROWS = 512
#: Elements of one block of logits (batch x heads x rows x keys) in the bias gradient.
BLOCK_ELEMENTS = 2**21


def antidiagonal_sums(x: Tensor) -> Tensor:
    """``(..., it, jt) -> (..., it + jt - 1)``: entry ``s`` is ``Σ_{a + c = s} x[..., a, c]``."""
    it, jt = x.shape[-2:]
    skew = F.pad(x, (0, it)).flatten(-2)[..., : it * (jt + it - 1)]
    return skew.unflatten(-1, (it, jt + it - 1)).sum(-2)


def add_profile_grad(
    d_profile: Tensor,
    q_rev: Tensor,
    k: Tensor,
    v: Tensor,
    d_out_rev: Tensor,
    lse_rev: Tensor,
    delta_rev: Tensor,
    mask_rev: Tensor,
    base: int,
    scale: float,
) -> None:
    """Add one block's contribution to ``d_profile (h|1, L)``, in place.

    ``q_rev (b, h, it, d)``, ``d_out_rev (b, h, it, e)``, ``lse_rev``/``delta_rev (b, h, it)``
    and ``mask_rev (1, h|1, it, jt)`` are the block's rows in reverse order; ``k (b, g, jt, d)``,
    ``v (b, g, jt, e)`` its keys; ``base`` the profile index of reversed row 0, key 0.
    """
    b, h, it, _ = q_rev.shape
    acc = torch.promote_types(q_rev.dtype, torch.float32)
    g, jt = k.shape[-3], k.shape[-2]
    step = max(1, BLOCK_ELEMENTS // max(1, b * h * jt))
    for a0 in range(0, it, step):
        a1 = min(a0 + step, it)
        q5 = q_rev[..., a0:a1, :].unflatten(1, (g, h // g))
        s = (q5 @ k.unsqueeze(2).transpose(-1, -2)).flatten(1, 2).to(acc)
        # in place: these (b, h, rows, jt) blocks are the bulk of the extra work
        p = s.mul_(scale).add_(mask_rev[..., a0:a1, :]).sub_(lse_rev[..., a0:a1, None]).exp_()
        dp = (d_out_rev[..., a0:a1, :].unflatten(1, (g, h // g)) @ v.unsqueeze(2).transpose(-1, -2)).flatten(1, 2)
        ds = dp.to(acc).sub_(delta_rev[..., a0:a1, None]).mul_(p)
        ds = ds.sum(0)  # (h, rows, jt): the bias is shared by the batch
        if d_profile.shape[0] == 1:
            ds = ds.sum(0, keepdim=True)
        sums = antidiagonal_sums(ds)
        start = base + a0
        d_profile[:, start : start + sums.shape[-1]] += sums.to(d_profile.dtype)


def saturating_profile_grad(d_profile: Tensor, diagonal, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                            lse: Tensor, delta: Tensor, scale: float, reach: int, forward_op) -> None:  # fmt: skip
    """``dL/d profile`` of a bias that is one value per side beyond ``|offset| >= reach``.

    T5's buckets saturate at ``max_distance``: every key at least that far in the future
    shares one bucket, and so does every key that far in the past. Only the sums of ``dS``
    over those two regions are needed there, not ``dS`` itself:

    * the band ``|offset| < reach`` is done exactly (:func:`add_profile_grad`), costing
      ``O(i · reach)``;
    * for the far future ``C``, ``Σ_{c∈C} dS_rc = Σ_C P_rc (dO_r·v_c) - D_r Σ_C P_rc
      = e^{lse^C_r - lse_r} (dO_r · out^C_r - D_r)``, where ``out^C, lse^C`` are the fused
      kernel's output and log-sum-exp with the keys restricted to ``C``: one forward call;
    * for the far past, each row of ``dS`` sums to zero (``Σ_c P(dP - D) = D - D``), so its
      sum is minus everything else.

    ``q, k, v, d_out (b, h|g, ·, ·)``, ``lse`` with ``+inf`` on rows that see no key, ``delta =
    rowsum(dO ∘ O)``; ``diagonal`` is the call's ``fused_blocks.DiagonalMask``.
    """
    i_len, j_len = q.shape[-2], k.shape[-2]
    rows = BAND_ROWS
    shift, off0, device = diagonal.shift, diagonal.offset0, q.device
    prof = diagonal.profile
    heads, length = prof.shape
    # 1. the band |offset| < reach
    for i0 in range(0, i_len, rows):
        i1 = min(i0 + rows, i_len)
        jlo, jhi = max(0, i0 + shift - reach + 1), min(j_len, i1 - 1 + shift + reach)
        if jlo >= jhi:
            continue
        t = Tile(i0, i1, jlo, jhi, i_len, j_len, device)
        back = torch.arange(i1 - i0, device=device)[:, None]  # reversed row a' is query i1 - 1 - a'
        offset = jlo + torch.arange(jhi - jlo, device=device)[None, :] - (i1 - 1 - back) - shift
        band = torch.zeros((), dtype=prof.dtype, device=device).masked_fill(offset.abs() >= reach, float("-inf"))
        r = slice(i0, i1)
        add_profile_grad(d_profile, q[..., r, :].flip(-2), k[..., jlo:jhi, :], v[..., jlo:jhi, :], d_out[..., r, :].flip(-2),
                         lse[..., r].flip(-1), delta[..., r].flip(-1), diagonal.reversed_block(t) + band, diagonal.base(t), scale)  # fmt: skip
    # 2. the far future, offset >= reach, through the kernel
    far_index = reach - off0
    if far_index < length:
        far = prof.clone()
        far[:, :far_index] = float("-inf")
        total = torch.zeros(heads, dtype=d_profile.dtype, device=device)
        w = diagonal.window
        for i0 in range(0, i_len, 2 * rows):
            i1 = min(i0 + 2 * rows, i_len)
            jlo = max(0, i0 + shift + reach)
            if jlo >= j_len:
                continue
            t = Tile(i0, i1, jlo, j_len, i_len, j_len, device)
            view = far.as_strided((1, heads, i1 - i0, j_len - jlo), (0, length, 1, 1), far.storage_offset() + diagonal.base(t))
            r = slice(i0, i1)
            o, m = forward_op(q[..., r, :].flip(-2), k[..., jlo:, :], v[..., jlo:, :], 0.0, False, attn_mask=view, scale=scale)
            o, m = o.flip(-2).to(d_profile.dtype), m.flip(-1).to(d_profile.dtype)
            # rows with at least one allowed key in the region (else the kernel's o, m mean nothing)
            row = torch.arange(i0, i1, device=device)
            lo = torch.clamp(-row - shift, min=reach)
            if w is not None and w.left is not None:
                lo = torch.clamp(lo, min=-w.left)
            hi = j_len - 1 - row - shift
            if w is not None and w.right is not None:
                hi = torch.clamp(hi, max=w.right)
            part = torch.exp(m - lse[..., r]) * ((d_out[..., r, :].to(o.dtype) * o).sum(-1) - delta[..., r])
            part = torch.where(lo <= hi, part, 0.0).sum(-1)  # (b, h)
            total += part.sum(0) if heads > 1 else part.sum()
        d_profile[:, far_index] += total
    # 3. the far past, offset <= -reach: rows of dS sum to zero
    past_index = -reach - off0
    if past_index >= 0:
        d_profile[:, past_index] -= d_profile.sum(-1)
