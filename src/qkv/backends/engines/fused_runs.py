"""A query block's keys as runs of full and partial tiles, each its own kernel call, merged by log-sum-exp.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``it`` the rows of one query
block, ``jt`` the keys of one run, ``d`` head size (``d = e``, as the kernel needs).

The fused CPU kernel adds a float ``attn_mask`` at a price that depends on the CPU: on the
AVX-512 and AMX Xeons it measured 4.9x the unmasked time forward and backward (9.8x
forward), and its ``is_causal`` flag skips the masked half for free. A lazy mask says which
tiles are "full" (every key allowed) and which "partial", so ``fused_blocks`` cuts each
query block's keys into runs (:func:`runs`, :data:`RUN_STEP` keys at a time): a full run
is one unmasked call, a partial run one masked call, or an ``is_causal`` call when it is
the block's own diagonal square and its mask is exactly the causal triangle (packed
documents, padded causal batches, FlexAttention's block masks: everything but the
boundary tiles runs unmasked). The runs' partial softmaxes merge by their log-sum-exp
(``tiling.lse``); the backward calls the kernel's backward per run with the block's final
``(out, lse)``, which gives each run's exact share. Checked against the reference in
the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._bools import any_along
from ...masks import Mask, Tile
from ..tiling import flash_cpu
from ..tiling import lse as row_lse
from ..tiling.flash_cpu import grouped_backward, mask_dtype
from ..tiling.tiles import NEG_INF, as_heads

#: Keys per step when a block's keys are sorted into runs (FlexAttention's block size).
RUN_STEP = 128
#: Query rows per block: fewer, larger blocks mean fewer kernel calls and merges (each a
#: Python-level step), and a causal square of this side runs with the kernel's flag.
RUN_ROWS = 512
#: Bytes allowed for one partial run's float mask: a wider run is cut into row chunks.
MASK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Run:
    """Keys ``j0:j1`` of a query block, all "full" or all "partial"; ``causal``: the partial run is the causal triangle."""

    j0: int
    j1: int
    full: bool
    causal: bool = False


def runs(mask: Mask, t: Tile) -> list[Run]:
    """The runs of block ``t``'s keys ``t.j0:t.j1`` (empty steps left out, neighbours of one state joined)."""
    found: list[Run] = []
    for j0 in range(t.j0, t.j1, RUN_STEP):
        step = Tile(t.i0, t.i1, j0, min(j0 + RUN_STEP, t.j1), t.i_len, t.j_len, t.device)
        state = mask.state(step)
        if state == "empty":
            continue
        full = state == "full"
        if found and found[-1].full == full and found[-1].j1 == step.j0:
            found[-1] = Run(found[-1].j0, step.j1, full)
        else:
            found.append(Run(step.j0, step.j1, full))
    return [_causal(mask, t, r) for r in found]


def _causal(mask: Mask, t: Tile, run: Run) -> Run:
    """``run`` marked causal when it is the block's diagonal square and its mask is the lower triangle there.

    Checked a :data:`RUN_STEP` square at a time: those below the diagonal must be "full",
    those above "empty" (asked of the mask, which answers from its structure), and only the
    diagonal ones are evaluated and compared with the triangle.
    """
    it = t.i1 - t.i0
    if run.full or run.j1 - run.j0 != it or run.j0 - t.i0 != t.j_len - t.i_len:
        return run
    shift = run.j0 - t.i0
    for a in range(t.i0, t.i1, RUN_STEP):
        for b in range(t.i0, t.i1, RUN_STEP):
            sub = Tile(a, min(a + RUN_STEP, t.i1), b + shift, min(b + RUN_STEP, t.i1) + shift, t.i_len, t.j_len, t.device)
            if a != b:
                if mask.state(sub) != ("full" if b < a else "empty"):
                    return run
                continue
            side = sub.i1 - sub.i0
            triangle = torch.ones(side, side, dtype=torch.bool, device=t.device).tril()
            if not bool((mask.tile(sub) == triangle).all()):
                return run
    return Run(run.j0, run.j1, False, causal=True)


def forward(mask: Mask, t: Tile, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out (b, h, it, d), lse (b, h, it))`` of block ``t`` over its runs; ``-inf`` on rows that see no key."""
    outs, lses = [], []
    found = runs(mask, t)
    # several runs are merged by their log-sum-exp: half-precision ones run in float32 (each output rounded
    # to 8 bits before the merge left 3x the flash rule's bound where runs' outputs cancel, and the backward's
    # D = rowsum(dO ∘ O) reads that output)
    exact = torch.promote_types(q.dtype, torch.float32) if len(found) > 1 else q.dtype
    for run in found:
        cols = slice(run.j0, run.j1)
        pieces = []
        for part in _chunks(t, run, q):  # row chunks of a wide partial run (one chunk otherwise)
            add, live = _mask(mask, part, run, q)
            rows = slice(part.i0, part.i1)
            o, m = flash_cpu.forward(q[..., rows, :].to(exact), k[..., cols, :].to(exact), v[..., cols, :].to(exact), 0.0,
                                     run.causal, attn_mask=add, scale=scale)  # fmt: skip
            if live is not None:  # the kernel gives a row with no key of the run lse 0
                m = torch.where(live.squeeze(-1), m, NEG_INF)
            pieces.append((o, m))
        outs.append(torch.cat([o for o, _ in pieces], -2) if len(pieces) > 1 else pieces[0][0])
        lses.append(torch.cat([m for _, m in pieces], -1) if len(pieces) > 1 else pieces[0][1])
    if not outs:
        shape = (*q.shape[:-2], t.i1 - t.i0)
        return q.new_zeros((*shape, v.shape[-1])), torch.full(shape, NEG_INF, dtype=mask_dtype(q), device=q.device)
    if len(outs) == 1:
        return outs[0] * torch.isfinite(lses[0])[..., None], lses[0]
    acc = mask_dtype(q)  # merged in float32 (or wider): half-precision parts would round twice
    out, lse = row_lse.merge_all([o.to(acc) for o in outs], lses)
    return out.to(q.dtype), lse


def backward(mask: Mask, t: Tile, given: list[Tensor], k: Tensor, v: Tensor, scale: float, grads: tuple[Tensor, Tensor, Tensor]) -> None:
    """Add block ``t``'s runs' shares of ``(dq, dk, dv)`` into ``grads``.

    ``given = [d_out, q, out, lse]`` are the block's rows (``lse`` finite, dead rows' ``d_out`` 0).
    """
    dq, dk, dv = grads
    found = runs(mask, t)
    # several runs' shares are summed: half-precision ones in float32, as in the forward
    exact = torch.promote_types(k.dtype, torch.float32) if len(found) > 1 else k.dtype
    for run in found:
        cols = slice(run.j0, run.j1)
        for part in _chunks(t, run, given[1]):
            add, _ = _mask(mask, part, run, given[1])
            local = slice(part.i0 - t.i0, part.i1 - t.i0)
            d_out, q_rows, out, lse = (x[..., local, :] if x.dim() == 4 else x[..., local] for x in given)
            d_out, q_rows, out = d_out.to(exact), q_rows.to(exact), out.to(exact)
            gq, gk, gv = grouped_backward(d_out, q_rows, k[..., cols, :].to(exact), v[..., cols, :].to(exact), out, lse,
                                          0.0, run.causal, attn_mask=add, scale=scale)  # fmt: skip
            dq[..., part.i0 : part.i1, :] += gq
            dk[..., cols, :] += gk
            dv[..., cols, :] += gv


def _chunks(t: Tile, run: Run, q: Tensor) -> list[Tile]:
    """Row chunks of block ``t`` whose masks for ``run`` stay within :data:`MASK_BYTES` (the block when unmasked)."""
    if run.full or run.causal:
        return [t]
    per_row = max(1, q.shape[0] * q.shape[1] * (run.j1 - run.j0) * mask_dtype(q).itemsize)
    rows = max(16, MASK_BYTES // per_row)
    return [Tile(i0, min(i0 + rows, t.i1), t.j0, t.j1, t.i_len, t.j_len, t.device) for i0 in range(t.i0, t.i1, rows)]


def _mask(mask: Mask, t: Tile, run: Run, q: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The run's float additive mask (None when full or causal) and its live rows (None when all are)."""
    if run.full or run.causal:
        return None, None
    dtype = mask_dtype(q)
    allowed = as_heads(mask.tile(Tile(t.i0, t.i1, run.j0, run.j1, t.i_len, t.j_len, t.device)), 4)
    any_key = any_along(allowed, -1, keepdim=True)
    live = None if bool(any_key.all()) else any_key
    add = torch.zeros((), dtype=dtype, device=allowed.device).expand(allowed.shape).masked_fill(~allowed, NEG_INF)
    return add, live
