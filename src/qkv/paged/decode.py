"""One query per request, every request in one pass over the pages: the decoding step.

Shape legend: ``n`` requests in the step, ``h`` query heads, ``g`` KV heads, ``x = h / g``,
``d`` key size, ``e`` value size, ``C`` items in a tile, ``L`` keys of an item, ``I`` items
of the step.

The step's pages are read as items (runs of one request's pages, ``qkv.paged.items``), a tile
of items at a time. Each item gets its own ``(out, lse)`` from one of two kernels: PyTorch's
fused CPU kernel where it can compute the logits (``qkv.paged.decode_fused``), else the
products written out here::

    s[c, x, p] = q[owner(c), x] · K[c, p]        (C, g, x, L)   batched over items
    lse_c = log Σ_p e^s,   out_c = Σ_p e^(s - lse_c) V[c, p]

Then every request's items merge by their log-sum-exp, once for the step (FlashInfer's
cascade merge, ``qkv.merge``'s rule)::

    m_r = max_c lse_c;   w_c = e^(lse_c - m_owner)
    out_r = Σ_c w_c out_c / Σ_c w_c;   lse_r = m_r + log Σ_c w_c

A request with no visible key gets ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .._trace import concrete
from ..backends.tiling import tile_math
from . import decode_fused
from .items import Items, Layout, layout, tile_keys
from .options import Options
from .table import PageTable


def decode(q: Tensor, qpos: Callable[[], Tensor], plan: Items, table: PageTable, pages, opts: Options,
           memo: dict | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of queries ``q (n, h, d)`` at positions ``qpos() (n,)`` over the items ``plan``,
    both in float32 (or wider).

    ``memo`` keeps what the table alone decides (the layout, the masks of unfilled slots) for
    the next layer of the same step. A score_mod is not applied here (the front sends such
    calls one request at a time). The positions are asked for only where an option reads them.
    """
    n, h, d = q.shape
    g = pages.kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    memo = {} if memo is None else memo
    key = ("layout", pages.page_size, tile_keys(pages), str(q.device))
    if key not in memo:
        memo[key] = layout(plan, table, pages.page_size, tile_keys(pages), n, q.device), {}
    where, masks = memo[key]
    if not where.tiles:
        return q.new_zeros(n, h, pages.value_dim), torch.full((n, h), float("-inf"), dtype=acc, device=q.device)
    q_at = q.view(n, g, h // g, d).index_select(0, where.row)
    fused = decode_fused.usable(q, pages, opts)
    qpos_at = qpos().index_select(0, where.row) if not (fused and decode_fused.plain(opts)) else None
    if fused:
        items_out, items_lse = decode_fused.attend(q_at, qpos_at, where, pages, opts, masks)
        out, lse = merge_by_owner(items_out, items_lse.to(acc), where.owner, n, where)
        # the step's output, a fifth of the items', is what is checked: right after the kernel's pass
        # over the pages every operation runs from cold caches (0.07 ms to sum the items' outputs)
        if not math.isfinite(float(out.sum())):  # unseen slots that held nan or inf, or a merge whose shift overflowed
            items_out, items_lse = decode_fused.repair(q_at, qpos_at, where, pages, opts, masks, items_out, items_lse)
            out, lse = merge_by_owner(items_out, items_lse.to(acc), where.owner, n)
    else:
        parts = [attend(q_at[a:b], qpos_at[a:b], *where.read((a, b, src), pages), where.base[a:b], where.keys[a:b], opts)
                 for a, b, src in where.tiles]  # fmt: skip
        out, lse = torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])
        out, lse = merge_by_owner(out, lse.to(acc), where.owner, n)
    return out.reshape(n, h, -1), lse.reshape(n, h)  # in float32 for half q: the caller may merge it with a prefix


def merge_by_owner(out: Tensor, lse: Tensor, owner: Tensor, n: int, where: Layout | None = None) -> tuple[Tensor, Tensor]:
    """``(out (n, g, x, e), lse (n, g, x))``: items' ``out (I, g, x, e)``, ``lse (I, g, x)`` merged per owner
    ``(I,)`` (owner ``n``: dropped); an owner with no finite ``lse`` gets 0 and -inf.

    Each item's weight is ``e^(lse_c - m)`` with ``m`` its owner's largest ``lse``; given
    ``where`` (the step's :class:`Layout`, every request with an item), ``m`` is instead the
    ``lse`` of the owner's last item, which holds the query's own key and so is finite: three
    operations fewer (a step's merge ran as long as a tenth of its kernel call from cold caches,
    where each operation costs 15-25 µs). Weights are then ``e^(lse_c - lse_last)``, the last
    item's exactly 1: any shift keeps the quotient's relative accuracy, and one that overflows
    (an item whose ``lse`` exceeds the last's by more than ``log(float max)``, 88 in float32)
    makes the output inf or nan, which the caller checks and then merges here without it.

    Sums go by ``index_add_``, row by row, so a nan in one request's items stays in its
    own row (a batched product with one-hot rows would carry ``0 · nan`` into every row, and
    measured 3x slower besides). The largest ``lse`` is clamped to the dtype's lowest (not
    -inf), so an owner without a seen key gets weights ``e^-inf = 0``, ``out = 0 / tiny = 0``
    and ``lse = lowest + log 0 = -inf`` without a test.
    """
    info = torch.finfo(lse.dtype)
    # the kernel's lse comes transposed ((I, g, x) with strides (g·x, 1, g)); PyTorch's scatter and
    # index_add ran this merge 2.5x slower on that layout than on a contiguous copy (0.36 ms
    # against 0.15 for a 32-request step)
    lse = lse.contiguous()
    if where is not None and where.final is not None:
        w = torch.exp(lse - lse.index_select(0, where.shift))  # (I, g, x)
        top = lse.index_select(0, where.final)
    else:
        top = torch.full((n + 1, *lse.shape[1:]), float("-inf"), dtype=lse.dtype, device=lse.device)
        top = top.scatter_reduce_(0, owner.view(-1, 1, 1).expand_as(lse), lse, "amax").clamp_(min=info.min)
        w = torch.exp(lse - top.index_select(0, owner))
        top = top[:n]
    den = torch.zeros((n + 1, *lse.shape[1:]), dtype=lse.dtype, device=lse.device).index_add_(0, owner, w)[:n]
    num = torch.zeros((n + 1, *out.shape[1:]), dtype=lse.dtype, device=out.device)
    num = num.index_add_(0, owner, w[..., None] * out)[:n]
    return num / den.clamp(min=info.tiny)[..., None], top + torch.log(den)


def attend(q: Tensor, qpos: Tensor, K: Tensor, V: Tensor, base: Tensor, keys: Tensor, opts: Options) -> tuple[Tensor, Tensor]:
    """Per item ``(out (C, g, x, e), lse (C, g, x))``: queries ``q (C, g, x, d)`` at ``qpos (C,)`` against
    ``K, V (C, g, L, d)`` from position ``base (C,)``, the first ``keys (C,)`` filled; the products written out."""
    C, L = K.shape[0], K.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    # float32 logits whatever the pages' dtype: a bfloat16 product rounds its output to 8 bits (a soft cap's
    # step was 2x the flash rule's bound)
    s = torch.matmul(q.to(acc), K.to(acc).transpose(-1, -2))  # (C, g, x, L)
    kpos = (base[:, None] + torch.arange(L, device=K.device)).view(C, 1, 1, L)
    qpos = qpos.view(C, 1, 1, 1)
    s = opts.logits(s, qpos, kpos)
    seen = (torch.arange(L, device=K.device) < keys[:, None]).view(C, 1, 1, L)
    by_position = opts.seen(qpos, kpos)
    if by_position is not None:
        seen = seen & by_position
    s = s.masked_fill(~seen, float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isneginf(top), 0.0, top)
    e = tile_math.exp_floored(s - top)  # masked keys: exp(-inf) = 0; no subnormals
    den = e.sum(-1)
    # an unseen slot may hold nan or inf (torch.empty), and 0 · nan would reach the sum: on the CPU the
    # sum is read and such items run again; elsewhere (a host read stalls a GPU's stream; traced, none
    # can be made) unseen slots are zeroed first, branch-free
    host = K.device.type == "cpu" and concrete(K)
    if not host:
        V = torch.where(seen.view(C, 1, L, 1), V, 0)
    num = torch.matmul(e, V.to(acc))  # (C, g, x, e), in float32: an item's output is merged with its request's others
    if host and not math.isfinite(float(num.sum())):
        at = (~torch.isfinite(num.sum((1, 2, 3)))).nonzero().flatten()
        Vz = torch.where(seen.index_select(0, at).view(-1, 1, L, 1), V.index_select(0, at), 0)
        num = num.index_copy(0, at, torch.matmul(e.index_select(0, at), Vz.to(acc)))
    live = den > 0
    den = torch.where(live, den, 1.0)
    return num / den[..., None], torch.where(live, top[..., 0] + torch.log(den), float("-inf"))
