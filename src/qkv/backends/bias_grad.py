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

#: Elements of one block of logits (batch x heads x rows x keys) in the bias gradient.
BLOCK_ELEMENTS = 2**22


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
