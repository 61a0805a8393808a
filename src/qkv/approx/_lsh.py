"""Pieces of the fast LSH attention in :mod:`qkv.approx.reformer`: hashing, windows, masks, chunk attention.

Shape legend: ``b`` batch, ``h`` heads, ``i`` length, ``d`` query/key size, ``e`` value size
(``w = max(d, e)`` the common width), ``r`` hash rounds, ``s`` chunks of a slab, ``x``
queries of a chunk (``chunk_size``), ``y`` keys a chunk sees (``2 · chunk_size``).

Everything here works on *sorted slots*: within a round, the positions of a ``(b, h)`` row
sorted by ``(bucket, position)``, cut into chunks of ``x``; chunk ``c`` sees the slots
``[(c − 1) x, (c + 1) x)`` (its own chunk and the one before). See the reformer module for
the paper and the overall algorithm.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from ..backends.tiling import flash_cpu
from ._common import needs_grad

INT16_CODES = 2**15  # window codes (times 4, the largest arithmetic on them) below this are int16
HASH_ROWS = 1 << 12  # rows per projection block: one (r · Σ f/2, rows) score buffer that stays in cache

def hash_buckets(x: Tensor, rotations: Tensor, factors: tuple[int, ...]) -> Tensor:
    """Angular LSH bucket of each row of ``x (n, d)`` in each round -> ``(r, n)`` long.

    ``rotations (r, d, Σ f/2)`` holds one block of ``f/2`` columns per factor ``f`` of
    ``factors``. A factor's index is ``argmax([xR_f; −xR_f])`` (the paper's hash; the first
    maximum wins, as ``argmax`` over the concatenation picks it: the ``+`` half when
    ``max(xR) >= −min(xR)``, else ``f/2`` plus the first column holding the minimum). Several
    factors give the bucket ``Σ_k idx_k · Π_{k' < k} f_k'`` (the factorised buckets of the
    authors' trax code and of HF's Reformer): ``Π f`` buckets for ``Σ f/2`` columns, so the
    hash of ``i/64`` buckets costs ``O(i √i)``, not ``O(i²)``. ``factors == ()``: bucket 0.

    Scores are made ``HASH_ROWS`` rows at a time as ``(r, Σ f/2, rows)``: the reductions then
    run over a middle axis, vectorised along the rows (a reduction over a short last axis is
    several times slower).
    """
    n, d = x.shape
    rounds, _, width = rotations.shape
    out = torch.zeros(rounds, n, dtype=torch.long, device=x.device)
    if width == 0:
        return out
    if sum(f // 2 for f in factors) != width:
        raise ValueError(f"factors: expected halves summing to the rotations' {width} columns, got {factors}")
    flat = rotations.permute(0, 2, 1).reshape(rounds * width, d)
    scores = x.new_empty(rounds * width * min(n, HASH_ROWS))
    earlier_first = {f: torch.arange(f // 2 - 1, -1, -1, dtype=torch.int16, device=x.device)[:, None] for f in factors}
    for start in range(0, n, HASH_ROWS):
        stop = min(n, start + HASH_ROWS)
        rows = stop - start
        proj = torch.mm(flat, x[start:stop].T, out=scores[: rounds * width * rows].view(rounds * width, rows))
        proj = proj.view(rounds, width, rows)
        col, stride = 0, 1
        for f in factors:
            k = f // 2
            part = proj[:, col : col + k]
            top, low = part.amax(1, keepdim=True), part.amin(1, keepdim=True)
            plus = top >= -low
            hits = part == torch.where(plus, top, low)
            first = (k - 1) - (hits * earlier_first[f]).amax(1)  # r rows
            index = first.long().add_((~plus[:, 0]).long(), alpha=k)
            out[:, start:stop].add_(index, alpha=stride)
            col, stride = col + k, stride * f
    return out


def sort_buckets(buckets: Tensor) -> tuple[Tensor, Tensor]:
    """``buckets (..., length)`` sorted along the last axis, stably: ``(sorted, order)``, order long.

    On the CPU with buckets below ``2**15`` this is numpy's stable argsort of int16, a radix
    sort (linear; about 12× faster than ``torch.sort`` at 2 × 16K, two threads); otherwise
    ``torch.sort(stable=True)``. Stable means ``(bucket, position)`` order.
    """
    if buckets.device.type != "cpu" or buckets.numel() == 0 or int(buckets.max()) >= 2**15:
        return buckets.sort(dim=-1, stable=True)
    order = torch.from_numpy(np.argsort(buckets.to(torch.int16).numpy(), axis=-1, kind="stable")).long()
    return buckets.gather(-1, order), order


def interval_bounds(sorted_buckets: Tensor, size: int, causal: bool, n_values: int) -> tuple[Tensor, Tensor]:
    """For each sorted slot, the keys it may see as ``[lo, hi)`` in its window's ``2 · size`` slots.

    ``sorted_buckets (..., length)`` non-decreasing, values in ``[0, n_values)``. Same bucket
    and inside the window: ``[max(bucket start, window start), min(bucket end, window end))``;
    causal stops at the slot itself (inside a bucket, slots are in position order). The
    first chunk's window starts at its own chunk (no wrap-around). A bucket's start and end
    are its counts summed (one ``bincount`` over all rows, linear, where a binary search per
    slot would be ``O(length log length)``).
    """
    length = sorted_buckets.shape[-1]
    rows = sorted_buckets.reshape(-1, length)
    device = sorted_buckets.device
    key = (torch.arange(rows.shape[0], device=device)[:, None] * n_values + rows).reshape(-1)
    count = torch.bincount(key, minlength=rows.shape[0] * n_values)
    end = count.cumsum(0)
    # rows are sorted, so (row, bucket) groups follow each other: a group's place in the
    # whole flat order, less the row's first slot, is its place in the row
    first = (torch.arange(rows.shape[0], device=device) * length)[:, None]
    slots = torch.arange(length, device=device)
    window = (slots // size - 1) * size  # first slot of the window (negative for the first chunk)
    start = (end - count)[key].view(rows.shape) - first
    lo = torch.maximum(start, window) - window
    if causal:
        hi = (slots + 1 - window).expand_as(lo)
    else:
        hi = torch.minimum(end[key].view(rows.shape) - first, window + 2 * size) - window
    return lo.view(sorted_buckets.shape), hi.reshape(sorted_buckets.shape)


def window_codes(sorted_buckets: Tensor, order: Tensor, size: int) -> Tensor:
    """``code (..., r, length)`` by position: ``p`` sees ``t`` in round ``r`` iff ``code(p) − code(t) ∈ {0, 1}``.

    Along each round's sorted order the code grows by 2 at a bucket change and by 1 at a
    chunk start: same bucket and same chunk differ by 0, same bucket and the previous chunk
    by 1, anything else by at least 2 in absolute value. int16 when it fits.
    """
    length = sorted_buckets.shape[-1]
    changes = int((sorted_buckets[..., 1:] != sorted_buckets[..., :-1]).sum(-1).max()) if length > 1 else 0
    dtype = torch.int16 if 4 * (2 * changes + length // size) + 4 < INT16_CODES else torch.int32
    step = torch.zeros(sorted_buckets.shape, dtype=dtype, device=sorted_buckets.device)
    step[..., ::size] = 1
    step[..., 1:].masked_fill_(sorted_buckets[..., 1:] != sorted_buckets[..., :-1], 2)
    step[..., 0] = 0
    return torch.empty_like(step).scatter_(-1, order, step.cumsum(-1, dtype=dtype))


def windows(rows: Tensor, size: int, chunks: int, first: int, cols: slice) -> Tensor:
    """``(s, y, f)`` view of ``rows`` (slot-ordered, after ``size`` leading rows): chunk ``first + s``'s window.

    Overlapping windows share storage (no copy): window ``g`` starts at row ``g · size``,
    which is the chunk before ``g`` once the ``size`` leading rows are counted.
    """
    part = rows[:, cols]
    stride = part.stride(0)
    return part.as_strided(
        (chunks, 2 * size, part.shape[-1]), (size * stride, stride, 1), part.storage_offset() + first * size * stride
    )


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention per chunk with an additive mask -> ``(out (s, x, w), lse (s, x))``.

    ``q (s, x, w)``, ``k, v (s, y, w)``, ``bias (s, x, y)``. On CPU this is PyTorch's fused
    flash kernel (which returns the log-sum-exp the rounds are combined with), under
    autograd with :class:`_FlashChunks`' backward, where ``backends.tiling.flash_cpu``
    allows it (CPU tensors, not tracing, the kernel present and checked for this dtype);
    elsewhere :func:`plain_chunk_attention`.
    """
    if flash_cpu.unusable(q) is None:
        if needs_grad(q, k, v):
            out, lse = _FlashChunks.apply(q, k, v, bias, scale)
        else:
            out, lse = (t[0] for t in flash_cpu.forward(q[None], k[None], v[None], attn_mask=bias[None], scale=scale))
        return out, lse.to(torch.promote_types(q.dtype, torch.float32))
    return plain_chunk_attention(q, k, v, bias, scale)


class _FlashChunks(torch.autograd.Function):
    """The flash kernel's forward, with a backward that also carries the log-sum-exp's gradient.

    PyTorch's own backward treats the kernel's log-sum-exp as a constant, but the rounds are
    weighted by it, so its gradient reaches the queries and keys (``∂lse/∂S = P``). The
    backward recomputes ``P = exp(S − lse)`` of the slab, ``S = scale · QKᵀ + bias``::

        dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O) + d lse),   dQ = scale · dS K,
        dK = scale · dSᵀ Q,                          dV = Pᵀ dO.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        out, lse = (t[0] for t in flash_cpu.forward(q[None], k[None], v[None], attn_mask=bias[None], scale=scale))
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        p = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=ctx.scale).sub_(lse[..., None].to(q.dtype)).exp_()
        row = (d_out * out).sum(-1, keepdim=True) - d_lse[..., None].to(q.dtype)
        ds = p * (d_out @ v.transpose(1, 2) - row)
        return (ds @ k) * ctx.scale, (ds.transpose(1, 2) @ q) * ctx.scale, p.transpose(1, 2) @ d_out, None, None


def plain_chunk_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """:func:`chunk_attention` with batched matmuls and a softmax (any device; the tests' twin of the kernel)."""
    logits = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    lse = logits.logsumexp(-1)
    return (logits - lse[..., None]).exp() @ v, lse


def combine_rounds(outs, lses, kept, into: Tensor | None = None):
    """Rounds -> ``(out (m, n, w), share (r, m, n))``: each round weighted by its share of the mass.

    ``kept[r] (m, n)``: rows that saw anything in round ``r`` (None: all); rows that saw
    nothing in any round give zeros (and shares 0). ``into``: where ``out`` is written (no
    autograd), else a new tensor.
    """
    lse = torch.stack(lses)  # r m n
    seen = None
    if kept[0] is not None:
        seen_r = torch.stack(kept)
        lse = lse.masked_fill(~seen_r, torch.finfo(lse.dtype).min)
        seen = seen_r.any(0)
    share = (lse - lse.amax(0)).exp_()
    share = (share / share.sum(0)).to(outs[0].dtype)
    if into is not None:
        out = torch.mul(outs[0], share[0, ..., None], out=into)
    else:
        out = outs[0] * share[0, ..., None]
    for r in range(1, len(outs)):
        out = out.addcmul_(outs[r], share[r, ..., None]) if not out.requires_grad else out + outs[r] * share[r, ..., None]
    if seen is not None:
        out = out.masked_fill_(~seen[..., None], 0) if into is not None else out.masked_fill(~seen[..., None], 0)
        share = share.masked_fill(~seen, 0)
    return out, share


def dense_weights(parts, rows, n, length, size) -> Tensor:
    """Scatter every round's weights ``share_r · exp(logit − lse_r)`` into ``(rows, n, n)`` (inspection only).

    ``parts``: per block, ``(i0, order_r, logit − lse_r (c, x, y))`` for each round, then
    ``(i0, None, share (r, m, n))``.
    """
    dense, block = None, []
    for i0, order, part in parts:
        if order is not None:
            block.append((order, part))
            continue
        m = part.shape[1]
        share = torch.cat([part, part.new_zeros(part.shape[0], m, length - n)], 2)  # padding: weight 0
        # summed over rounds in float32 (at least): half-precision shares meet float32 log-weights
        acc = torch.promote_types(share.dtype, torch.float32)
        dense = share.new_zeros(rows, length * length, dtype=acc) if dense is None else dense
        for r, (order_r, logp) in enumerate(block):
            qpos = order_r.view(m, -1, size)  # m c x
            kpos = torch.cat([order_r.new_zeros(m, size), order_r], 1).unfold(1, 2 * size, size)  # m c y
            weight = logp.view(m, -1, size, 2 * size).exp() * share[r].gather(1, order_r).view(m, -1, size, 1)
            flat = qpos[..., :, None] * length + kpos[..., None, :]
            dense[i0 : i0 + m].scatter_add_(1, flat.reshape(m, -1), weight.reshape(m, -1).to(acc))
        block = []
    return dense.view(rows, length, length)[:, :n, :n].to(share.dtype)
