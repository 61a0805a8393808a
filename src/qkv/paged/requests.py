"""One request at a time, a tile of its pages at a time: prefill chunks, and calls with a score_mod.

Shape legend: ``t`` the request's queries, ``L`` keys in a tile, ``h`` query heads, ``g`` KV
heads, ``d`` key size, ``e`` value size, ``P`` page size.

A request's queries ``q (t, h, d)`` sit at positions ``kv_len - t .. kv_len - 1``. Its pages
are read :data:`TILE_KEYS` keys at a time (views where its pages are consecutive ids, as a
ragged batch's rows or a reserved run are; else one copy of those pages; never its whole cache),
each tile runs as an ordinary :func:`qkv.attention` call with its causal and window limits
as an offset mask and ALiBi, the soft cap and the score_mod as one score_mod reading the
tile's true positions, and the tiles' ``(out, lse)`` are merged exactly (``qkv.merge``'s rule).

Where every such request's pages are one range of a contiguous pool (FlashInfer's ragged
wrapper's one-row pages, reserved runs) and nothing but causal limits and a window applies,
:func:`packed` runs them as one segmented call instead (``backends.segments``, as
``qkv.varlen_attention`` runs its sequences): the pool read as one key matrix, each request a
segment of its rows against its range of keys, every output written once into one buffer
(a request at a time, each output was copied from the kernel's head-major layout into the
call's rows, and each call went through ``qkv.attention``'s checks: 1.03-1.16x the varlen call
on an AMD EPYC Zen 5, four causal chunks of 96-704 tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import checks
from ..backends.segments import Segment, run_segments
from ..backends.tiling.framing import Block
from ..backends.tiling.lse import merge_all
from ..functional import attention
from ..masks import offsets
from ..masks.positions import window_mask
from .options import Options
from .pages import FloatPages
from .table import PageTable

#: Keys per tile of one request.
TILE_KEYS = 4096


def request(q: Tensor, kv_len: int, page_ids: Tensor, pages, opts: Options, r: int,
            first: int | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (t, h, e), lse (t, h))`` of request ``r``'s queries against its ``kv_len`` keys in ``page_ids``;
    ``first``: the first of them where they are consecutive ids (read as views), else None (copied)."""
    t, h, _ = q.shape
    P = pages.page_size
    qpos0 = kv_len - t
    per_tile = max(1, TILE_KEYS // P)
    # several tiles are merged by their log-sum-exp: half-precision ones run in float32, rounded once by the caller
    dtype = torch.promote_types(q.dtype, torch.float32) if page_ids.numel() > per_tile else q.dtype
    q = q.to(dtype)
    outs, lses = [], []
    for start in range(0, page_ids.numel(), per_tile):  # (K, V below: (n, P, g, d))
        k0 = start * P
        L = min(per_tile * P, kv_len - k0)
        if opts.window_left >= 0 and k0 + L - 1 < qpos0 - opts.window_left:
            continue  # the tile ends before the first query's window begins
        K, V = tile(pages, page_ids, first, start, min(per_tile, page_ids.numel() - start), L, dtype)
        out, lse = attention(
            q.permute(1, 0, 2)[None], K, V, mask=_mask(opts, qpos0, t, k0, L), scale=opts.scale,
            score_mod=score_mod(opts, torch.arange(qpos0, kv_len, device=q.device), k0, r), return_lse=True,
        )  # fmt: skip
        outs.append(out[0].permute(1, 0, 2))  # (t, h, e)
        lses.append(lse[0].permute(1, 0))  # (t, h)
    if not outs:
        e = pages.value_dim
        return q.new_zeros(t, h, e), torch.full((t, h), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    out, lse = merge_all(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
    return out, lse


def tile(pages, page_ids: Tensor, first: int | None, start: int, n: int, L: int,
         dtype: torch.dtype) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(K (1, g, L, d), V (1, g, L, e))`` in ``dtype``: the first ``L`` keys of pages ``start .. start + n - 1`` of
    ``page_ids``, views of the pool from page ``first + start`` where the ids are consecutive (``first`` not None),
    else one copy (or dequantisation) of those pages."""
    K, V = pages.take(page_ids[start : start + n]) if first is None else pages.range(first + start, first + start + n)
    K = K.reshape(-1, *K.shape[2:])[:L].permute(1, 0, 2)[None]
    V = V.reshape(-1, *V.shape[2:])[:L].permute(1, 0, 2)[None]
    return K.to(dtype), V.to(dtype)


def packed(q: Tensor, table: PageTable, chunks: list[int], pages, opts: Options,
           lse: bool = True) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """``(out (T, h, e), lse (T, h) | None)`` of requests ``chunks`` (each with queries and not a decoding step) in
    one segmented call, other rows 0 and -inf; None where it does not apply: pages that are not one contiguous pool
    in ``q``'s dtype, a request whose pages are not one range, or a soft cap, ALiBi or score_mod. Without ``lse``
    none is computed: each segment may then run on PyTorch's public kernel, as ``qkv.varlen_attention`` does."""
    if opts.soft_cap > 0 or opts.alibi_slopes is not None or opts.score_mod is not None:
        return None
    if type(pages) is not FloatPages or not pages.views or pages.converts or pages.dtype != q.dtype:
        return None
    firsts = [table.first_of_range(r) if table.kv_len[r] else 0 for r in chunks]
    if any(first is None for first in firsts):
        return None
    P, g = pages.page_size, pages.kv_heads
    K, V = (pool.view(-1, g, pool.shape[-1]).transpose(0, 1)[None] for pool in (pages.keys, pages.values))  # (1, g, N·P, ·)
    req = checks.request(q.transpose(0, 1)[None], K, V, score="scaled_dot", mask=None, bias=None, causal=False,
                         scale=opts.scale, dropout=0.0, return_weights=False, return_lse=lse)  # fmt: skip
    left, right = (opts.window_left if opts.window_left >= 0 else None), (0 if opts.causal else None)
    segments = [Segment(0, Block(table.qo_start[r], table.qo_len[r], first * P, table.kv_len[r], req.i, req.j),
                        window_mask(left, right, table.qo_len[r], table.kv_len[r]), None, None)
                for r, first in zip(chunks, firsts)]  # fmt: skip
    out, lse_t = run_segments(req, segments, packed=True)  # (T, h, e), (h, T) | None
    return out, None if lse_t is None else lse_t.transpose(0, 1).contiguous()


def _mask(opts: Options, qpos0: int, t: int, k0: int, L: int):
    """Key ``c`` of the tile (position ``k0 + c``) for query ``r`` (position ``qpos0 + r``), as qkv's offsets.

    An offset is ``c - r - (L - t)``: ``kp <= qp`` is ``offset <= qpos0 - k0 - (L - t)``, and
    ``kp >= qp - w`` is ``offset >= qpos0 - k0 - w - (L - t)``.
    """
    top = qpos0 - k0 - (L - t)
    hi = top if opts.causal else None
    lo = top - opts.window_left if opts.window_left >= 0 else None
    return None if hi is None and lo is None else offsets(lo, hi)  # (a Window where it holds the diagonal)


def score_mod(opts: Options, qpos: Tensor, k0: int, r: int | Tensor):
    """The soft cap, ALiBi and the caller's score_mod at true positions; None when none is asked.

    Query ``q_idx`` of the call sits at ``qpos[q_idx]`` and belongs to request ``r`` (an int,
    or ``(t,)`` per query); key ``kv_idx`` sits at ``k0 + kv_idx``.
    """
    if opts.soft_cap <= 0 and opts.alibi_slopes is None and opts.score_mod is None:
        return None
    cap, slopes, user = opts.soft_cap, opts.alibi_slopes, opts.score_mod

    def paged(score, b, h, q_idx, kv_idx):
        qp, kp = qpos[q_idx], kv_idx + k0
        if cap > 0:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score + slopes[h] * (kp - qp)
        if user is not None:
            score = user(score, r[q_idx] if isinstance(r, Tensor) else b * 0 + r, h, qp, kp)
        return score

    return paged
