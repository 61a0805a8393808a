"""One query per request, every request in one pass over the pages: the decoding step.

Shape legend: ``n`` requests in the step, ``h`` query heads, ``g`` KV heads, ``x = h / g``,
``d`` key size, ``e`` value size, ``P`` page size, ``C`` pages in a tile, ``N`` page entries
(a request's page, with its owner, its place in the request and its filled length).

The pages are read a tile at a time. Where the tile's entries cover most of a range of page
ids once each (what an allocator hands out), the tile is that range's **views**: the scores
of every page against its owner's query are one batched product over the page axis, and a
page no entry names is computed against nothing and dropped. Otherwise (scattered or shared
pages) the tile is one copy of its entries' pages. Per tile and KV head::

    s[c, x, p] = q[owner(c), x] · K[c, p]                 (C, x, P)    bmm over pages
    m_r = max over r's entries and keys;  e = exp(s - m_owner)
    den_r += Σ e;   num_r += Σ_c e[c] @ V[c]              index_add by owner

with a running maximum rescaling what earlier tiles summed (the online softmax, Milakov &
Gimelshein 2018). The result is each request's ``(out, lse)``: ``out = num / den``,
``lse = m + log den``; a request with no visible key gets ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .options import Options

#: Pages per tile: about 2 MiB of float32 keys and values per KV head at P = 16, d = 64.
TILE_PAGES = 256


def decode(q: Tensor, qpos: Tensor, page: Tensor, owner: Tensor, slot: Tensor, filled: Tensor, pages,
           opts: Options) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of queries ``q (n, h, d)`` at positions ``qpos (n,)``.

    Entries ``(N,)``: ``page`` id, ``owner`` (0 .. n - 1), ``slot`` (its place among the
    owner's pages: keys ``slot · P ..``), ``filled`` keys. A score_mod is not applied here
    (the front sends such calls one request at a time).
    """
    n, h, d = q.shape
    g, P = pages.kv_heads, pages.page_size
    x = h // g
    acc = torch.promote_types(q.dtype, torch.float32)
    m = torch.full((n + 1, g, x), float("-inf"), dtype=acc, device=q.device)  # row n: pages no entry names
    den = torch.zeros((n + 1, g, x), dtype=acc, device=q.device)
    num = torch.zeros((n + 1, g, x, pages.value_dim), dtype=acc, device=q.device)
    q_of = torch.cat([q, q.new_zeros(1, h, d)]).view(n + 1, g, x, d)
    qpos_of = torch.cat([qpos, qpos.new_zeros(1)])
    order = torch.argsort(page, stable=True)
    page, owner, slot, filled = page[order], owner[order], slot[order], filled[order]
    ids = page.tolist()
    start = 0
    while start < len(ids):
        stop = _tile_end(ids, start)
        K, V, tile_owner, tile_slot, tile_filled = _tile(pages, ids, start, stop, page, owner, slot, filled, n)
        _accumulate(q_of, qpos_of, K, V, tile_owner, tile_slot, tile_filled, opts, P, m, den, num)
        start = stop
    m, den, num = m[:n], den[:n], num[:n]
    seen = den > 0
    out = torch.where(seen[..., None], num / torch.where(seen, den, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, den, 1.0)), float("-inf"))
    return out.reshape(n, h, -1).to(q.dtype), lse.reshape(n, h)


def _tile_end(ids: list[int], start: int) -> int:
    """One past the last entry of the tile starting at ``start``: at most TILE_PAGES entries, spanning at most TILE_PAGES ids."""
    stop = min(len(ids), start + TILE_PAGES)
    while stop > start + 1 and ids[stop - 1] - ids[start] >= TILE_PAGES:
        stop -= 1
    return stop


def _tile(pages, ids, start, stop, page, owner, slot, filled, n):
    """The tile's keys and values, and per tile page its owner (``n`` for none), slot and filled length."""
    lo, hi = ids[start], ids[stop - 1] + 1
    count = stop - start
    unique = len(set(ids[start:stop])) == count
    if unique and 2 * count >= hi - lo:  # most of a range, once each: read the range where it lies
        K, V = pages.range(lo, hi)
        where = page[start:stop] - lo
        tile_owner = torch.full((hi - lo,), n, dtype=torch.long, device=page.device).index_copy_(0, where, owner[start:stop])
        tile_slot = torch.zeros(hi - lo, dtype=torch.long, device=page.device).index_copy_(0, where, slot[start:stop])
        tile_filled = torch.zeros(hi - lo, dtype=torch.long, device=page.device).index_copy_(0, where, filled[start:stop])
        return K, V, tile_owner, tile_slot, tile_filled
    K, V = pages.take(page[start:stop])
    return K, V, owner[start:stop], slot[start:stop], filled[start:stop]


def _accumulate(q_of, qpos_of, K, V, owner, slot, filled, opts: Options, P: int, m, den, num) -> None:
    """Fold one tile's pages into each owner's running ``(m, den, num)``."""
    C, g = K.shape[0], K.shape[2]
    acc = m.dtype
    qt = q_of.index_select(0, owner)  # (C, g, x, d)
    s = torch.stack([torch.bmm(qt[:, j], K[:, :, j].transpose(1, 2)) for j in range(g)], 1).to(acc)  # (C, g, x, P)
    offset = torch.arange(P, device=K.device)
    kpos = (slot[:, None] * P + offset)[:, None, None, :]  # (C, 1, 1, P)
    qpos = qpos_of.index_select(0, owner)[:, None, None, None]
    s = opts.logits(s, qpos, kpos)
    seen = (offset < filled[:, None])[:, None, None, :]
    by_position = opts.seen(qpos, kpos)
    if by_position is not None:
        seen = seen & by_position
    s = s.masked_fill(~seen, float("-inf"))
    page_max = s.amax(-1)  # (C, g, x)
    tile_max = torch.full_like(m, float("-inf")).scatter_reduce_(0, owner[:, None, None].expand_as(page_max), page_max, "amax")
    new_m = torch.maximum(m, tile_max)
    safe = torch.where(torch.isneginf(new_m), 0.0, new_m)
    rescale = torch.exp(m - safe)  # exp(-inf) = 0 for a request with nothing yet
    e = torch.exp(s - safe.index_select(0, owner)[..., None])  # masked keys: exp(-inf) = 0
    den.mul_(rescale).index_add_(0, owner, e.sum(-1))
    pv = torch.stack([torch.bmm(e[:, j].to(V.dtype), V[:, :, j]) for j in range(g)], 1).to(acc)  # (C, g, x, e)
    num.mul_(rescale[..., None]).index_add_(0, owner, pv)
    m.copy_(new_m)
