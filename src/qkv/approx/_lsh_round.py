"""One hash round of Reformer's LSH attention: the additive mask of each chunk and the kernel call.

Shape legend: ``m`` (b, h) rows of a block, ``length`` sorted slots per row (the sequence
padded to whole chunks), ``w`` the common head width, ``r'`` earlier rounds, ``s`` chunks
of a slab, ``x`` queries of a chunk (``size``), ``y`` keys a chunk sees (``2 · size``).

Inputs are by *sorted slot* (see :mod:`qkv.approx._lsh`); outputs go back *by position*.
The mask of a chunk has, for query ``p`` and window key ``t``:

- ``0`` when ``t`` is in ``p``'s bucket and window (``lo ≤ t < hi``, an interval because
  slots are sorted by bucket; causal already cut to ``t ≤ p``) and no earlier round paired them;
- ``lowest / 2`` when an earlier round paired them (each pair is counted once, in its first
  round: the paper's ``N_pt`` de-duplication with the same result, see the reformer module);
- ``lowest / 16`` for ``p`` itself (used only when nothing else is there);
- ``lowest`` outside the interval or where the caller's mask says no.

``lowest`` is the dtype's most negative number; each level is so far below the next that
``exp`` of the gap is 0, and all are far below real logits. Only the order of the levels
matters: a row whose best entry is below ``lowest / 4`` sees nothing at all.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ._common import Scratch
from ._lsh import chunk_attention, windows

INTERVAL_TABLE = 1 << 22  # largest table of all (lo, hi) mask rows, in entries (chunk_size <= 80)


@lru_cache(maxsize=4)
def interval_rows(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
    """Additive mask rows ``(above, below, intervals)`` for windows of ``2 · size`` keys.

    ``above[lo]`` keeps ``y >= lo``, ``below[hi]`` keeps ``y < hi``; ``intervals[lo · (2 size + 1) + hi]``
    is both at once, built only when the table has at most ``INTERVAL_TABLE`` entries (one
    ``index_select`` per slab instead of two and a minimum). Cached: the table is rebuilt per
    size and dtype, not per call.
    """
    lowest = torch.finfo(dtype).min
    y = torch.arange(2 * size + 1, device=device)
    above = y.new_zeros(2 * size + 1, 2 * size, dtype=dtype).masked_fill_(y[None, :-1] < y[:, None], lowest)
    below = y.new_zeros(2 * size + 1, 2 * size, dtype=dtype).masked_fill_(y[None, :-1] >= y[:, None], lowest)
    intervals = None
    if (2 * size + 1) ** 2 * 2 * size <= INTERVAL_TABLE:
        intervals = torch.minimum(above[:, None], below[None]).view(-1, 2 * size)
    return above, below, intervals


class RoundSetup:
    """What every round of one call shares: sizes, the caller's mask, the buffers, the mask rows."""

    def __init__(self, *, size, w, scale, n, heads, dtype, device, per_slab, bufs: Scratch, mask):
        self.size, self.w, self.scale, self.n, self.heads = size, w, scale, n, heads
        self.per_slab, self.bufs, self.mask = per_slab, bufs, mask
        self.lowest = torch.finfo(dtype).min
        self.self_logit = self.lowest / 16
        self.above, self.below, self.intervals = interval_rows(size, dtype, device)


def attend_round(setup: RoundSetup, rows, lo, hi, earlier, order, heads, flat, name, keep_logits):
    """One hash round of a block: ``(out (m length, w), lse (m length), empty or None, logits or None)``.

    ``rows``: ``(q, k, v)``, each ``(size + m length, w)`` by sorted slot after ``size`` zero
    rows (the first chunk's empty window half); ``lo, hi (m, length)``: the interval each slot
    may see; ``earlier (r', m length)``: window codes of the earlier rounds (None in the first);
    ``order (m, length)``: slot -> position; ``heads (m,)``: the block's flat (b, h) rows;
    ``flat (m length)``: slot -> flat position row; ``name``: the buffer ``out`` is written to.
    ``out``, ``lse`` and ``empty`` (rows that may see no key, not even themselves; None without
    a caller's mask) are by position, ``logits`` by sorted slot.

    Results are made by slot and moved to positions at the end by one gather with the
    inverse permutation: ``index_select`` is about five times faster than the scatter
    (``index_copy_``) that would write each slab to its positions directly.
    """
    size, w, bufs = setup.size, setup.w, setup.bufs
    qs, ks, vs = rows
    total = qs.shape[0] - size
    dtype = qs.dtype
    lse_dtype = torch.promote_types(dtype, torch.float32)  # a bf16 log-sum-exp would blur the rounds' shares
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    slabs = range(0, total // size, setup.per_slab)
    out, lse, empty = [], [], None if setup.mask is None else []
    kept_logits = []
    if earlier is not None:
        rounds = earlier.shape[0]
        cq = 2 * earlier - 1
        ck = torch.cat([earlier.new_zeros(rounds, size), 2 * earlier], 1)
    if setup.mask is not None:
        positions = torch.cat([order.new_zeros(size), order.reshape(-1)]).clamp_(max=setup.n - 1)
        chunks_per_row = order.shape[1] // size
    for g0 in slabs:
        s = min(setup.per_slab, total // size - g0)
        part = slice(g0 * size, (g0 + s) * size)
        bias = bufs.take("bias", (s, size, 2 * size), qs)
        if setup.intervals is not None:  # one row per (lo, hi) pair
            torch.index_select(setup.intervals, 0, lo[part] * (2 * size + 1) + hi[part], out=bias.view(-1, 2 * size))
        else:
            other = bufs.take("other", (s, size, 2 * size), qs)
            torch.index_select(setup.above, 0, lo[part], out=bias.view(-1, 2 * size))
            torch.index_select(setup.below, 0, hi[part], out=other.view(-1, 2 * size))
            torch.minimum(bias, other, out=bias)
        if earlier is not None:
            # |2 code(p) − 1 − 2 code(t)| is 1 exactly when an earlier round paired p and t (else >= 3)
            cqs = cq[:, part].view(rounds, s, size, 1)
            cks = ck.as_strided((rounds, s, 1, 2 * size), (ck.stride(0), size, 0, 1), ck.storage_offset() + g0 * size)
            gap = torch.sub(cqs, cks, out=bufs.take("gaps", (rounds, s, size, 2 * size), ck)).abs_()
            if rounds > 1:
                gap = torch.amin(gap, 0, out=bufs.take("closest", (s, size, 2 * size), ck))
            else:
                gap = gap[0]
            # gap == 1 -> −1, else 0 (an arithmetic shift of gap − 3), then lowest/2 or 0 as a float:
            # integer passes and one conversion, several times faster than a bool mask and masked_fill
            gap.sub_(3).bitwise_right_shift_(8 * gap.element_size() - 1)
            other = bufs.take("other", (s, size, 2 * size), qs)
            other.copy_(gap).mul_(-setup.lowest / 2)
            torch.minimum(bias, other, out=bias)  # a `lowest` entry stays lowest
        bias[:, :, size:].diagonal(dim1=1, dim2=2).fill_(setup.self_logit)
        if setup.mask is not None:
            qpos = positions[size:][part].view(s, 1, size, 1)
            kpos = windows(positions[:, None], size, s, g0, slice(None)).view(s, 1, 1, 2 * size)
            row = torch.div(torch.arange(g0, g0 + s, device=qs.device), chunks_per_row, rounding_mode="floor")
            at = heads[row].view(s, 1, 1, 1)
            allowed = setup.mask[at // setup.heads, at % setup.heads, qpos, kpos].view(s, size, 2 * size)
            bias.masked_fill_(~allowed, setup.lowest)
            empty.append((bias.amax(-1) < setup.lowest / 4).view(-1))
        q_s = qs[size:][part].view(s, size, w)
        k_s, v_s = windows(ks, size, s, g0, slice(None)), windows(vs, size, s, g0, slice(None))
        o, l = chunk_attention(q_s, k_s, v_s, bias, setup.scale)
        if bufs.enabled and len(slabs) > 1:  # the kernel's outputs, by slot, in one buffer
            by_slot = bufs.take(name + "_slots", (total, w), qs)
            by_slot[part].view(s, size, w).copy_(o)
            out = [by_slot]
        else:
            out.append(o.reshape(-1, w))
        lse.append(l.reshape(-1).to(lse_dtype))
        if keep_logits:
            kept_logits.append(torch.baddbmm(bias, q_s, k_s.transpose(1, 2), alpha=setup.scale))
    # by sorted slot -> by position: gather with the inverse permutation
    back = torch.empty_like(flat).scatter_(0, flat, torch.arange(total, device=flat.device))
    out = out[0] if len(out) == 1 else torch.cat(out)
    out = torch.index_select(out, 0, back, out=bufs.take(name, (total, w), qs)) if bufs.enabled else out[back]
    lse = torch.cat(lse)[back]
    if empty is not None:
        empty = torch.cat(empty)[back]
    return out, lse, empty, (torch.cat(kept_logits) if keep_logits else None)
