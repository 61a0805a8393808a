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

from ..backends.tiling import tile_math
from .options import Options

#: Pages per tile: about 2 MiB of float32 keys and values per KV head at P = 16, d = 64.
TILE_PAGES = 256
#: The largest block of pages read as one item: ``qkv.PagedKVCache`` hands a request pages in
#: aligned blocks of this many, so a block holds one request's consecutive keys.
BLOCK_PAGES = 16


def decode(q: Tensor, qpos: Tensor, page: Tensor, owner: Tensor, slot: Tensor, filled: Tensor, pages,
           opts: Options) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of queries ``q (n, h, d)`` at positions ``qpos (n,)``.

    Entries ``(N,)``: ``page`` id, ``owner`` (0 .. n - 1), ``slot`` (its place among the
    owner's pages: keys ``slot · P ..``), ``filled`` keys. A score_mod is not applied here
    (the front sends such calls one request at a time).

    Where each aligned block of ``S`` pages holds one request's consecutive pages (what
    :class:`qkv.PagedKVCache` hands out), a block is one item of the batched products: ``S``
    times fewer, ``S`` times larger matrix products than one per page.
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
    S = _block_pages(page, owner, slot)
    block, owner, base, fill = _blocks(page, owner, slot, filled, S, P)
    ids = block.tolist()
    per_tile = max(1, TILE_PAGES // S)
    start = 0
    while start < len(ids):
        stop = _tile_end(ids, start, per_tile)
        K, V, tile_owner, tile_base, tile_fill = _tile(pages, ids, start, stop, block, owner, base, fill, n, S)
        _accumulate(q_of, qpos_of, K, V, tile_owner, tile_base, tile_fill, opts, P, m, den, num)
        start = stop
    m, den, num = m[:n], den[:n], num[:n]
    seen = den > 0
    out = torch.where(seen[..., None], num / torch.where(seen, den, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, den, 1.0)), float("-inf"))
    return out.reshape(n, h, -1).to(q.dtype), lse.reshape(n, h)


def _block_pages(page: Tensor, owner: Tensor, slot: Tensor) -> int:
    """The largest ``S`` (a power of two up to :data:`BLOCK_PAGES`) whose aligned blocks each hold one owner's
    consecutive pages, at least half full; 1 when none does (or a page is named twice)."""
    if page.numel() < 2 or bool((page[1:] == page[:-1]).any()):
        return 1
    S = BLOCK_PAGES
    while S > 1:
        same_block = (page[1:] // S) == (page[:-1] // S)
        start = slot - page % S  # the slot the block's first page would have
        consistent = (owner[1:] == owner[:-1]) & (start[1:] == start[:-1])
        blocks = int((page // S).unique_consecutive().numel())
        if bool((consistent | ~same_block).all()) and 2 * page.numel() >= blocks * S:
            return S
        S //= 2
    return 1


def _blocks(page: Tensor, owner: Tensor, slot: Tensor, filled: Tensor, S: int, P: int):
    """Per block of ``S`` pages (ids sorted): its id, owner, first key's position, and keys filled per page ``(nb, S)``."""
    if S == 1:  # one block per entry: a page two requests name (a shared page) is read for each
        return page, owner, slot * P, filled[:, None]
    block = page // S
    first = torch.ones_like(block, dtype=torch.bool)
    first[1:] = block[1:] != block[:-1]
    index = torch.cumsum(first.long(), 0) - 1
    fill = torch.zeros(int(first.sum()), S, dtype=torch.long, device=page.device)
    fill[index, page % S] = filled  # pages no entry names stay empty
    return block[first], owner[first], ((slot - page % S) * P)[first], fill


def _tile_end(ids: list[int], start: int, per_tile: int) -> int:
    """One past the last block of the tile starting at ``start``: at most ``per_tile`` blocks, spanning as many ids."""
    stop = min(len(ids), start + per_tile)
    while stop > start + 1 and ids[stop - 1] - ids[start] >= per_tile:
        stop -= 1
    return stop


def _tile(pages, ids, start, stop, block, owner, base, fill, n, S):
    """The tile's keys and values ``(C, S·P, g, d)``, and per tile block its owner (``n`` for none), base and fill."""
    lo, hi = ids[start], ids[stop - 1] + 1
    count = stop - start
    once = S > 1 or len(set(ids[start:stop])) == count  # a page named twice (shared) cannot be one view row
    if once and 2 * count >= hi - lo and hi * S <= pages.num_pages:  # most of a range of blocks: read it where it lies
        K, V = pages.range(lo * S, hi * S)
        where = block[start:stop] - lo
        tile_owner = torch.full((hi - lo,), n, dtype=torch.long, device=block.device).index_copy_(0, where, owner[start:stop])
        tile_base = torch.zeros(hi - lo, dtype=torch.long, device=block.device).index_copy_(0, where, base[start:stop])
        tile_fill = torch.zeros(hi - lo, S, dtype=torch.long, device=block.device).index_copy_(0, where, fill[start:stop])
    else:
        ids_in = (block[start:stop, None] * S + torch.arange(S, device=block.device)).clamp(max=pages.num_pages - 1)
        K, V = pages.take(ids_in.reshape(-1))  # pages past the pool's end are read twice and stay empty
        tile_owner, tile_base, tile_fill = owner[start:stop], base[start:stop], fill[start:stop]
    C = tile_owner.numel()
    return K.reshape(C, -1, *K.shape[2:]), V.reshape(C, -1, *V.shape[2:]), tile_owner, tile_base, tile_fill


def _accumulate(q_of, qpos_of, K, V, owner, base, fill, opts: Options, P: int, m, den, num) -> None:
    """Fold one tile's blocks ``K, V (C, S·P, g, d)`` into each owner's running ``(m, den, num)``."""
    C, L, g = K.shape[0], K.shape[1], K.shape[2]
    acc = m.dtype
    qt = q_of.index_select(0, owner)  # (C, g, x, d)
    s = torch.stack([torch.bmm(qt[:, j], K[:, :, j].transpose(1, 2)) for j in range(g)], 1).to(acc)  # (C, g, x, L)
    kpos = (base[:, None] + torch.arange(L, device=K.device))[:, None, None, :]  # (C, 1, 1, L)
    qpos = qpos_of.index_select(0, owner)[:, None, None, None]
    s = opts.logits(s, qpos, kpos)
    seen = (torch.arange(P, device=K.device) < fill[:, :, None]).reshape(C, 1, 1, L)
    by_position = opts.seen(qpos, kpos)
    if by_position is not None:
        seen = seen & by_position
    s = s.masked_fill(~seen, float("-inf"))
    page_max = s.amax(-1)  # (C, g, x)
    tile_max = torch.full_like(m, float("-inf")).scatter_reduce_(0, owner[:, None, None].expand_as(page_max), page_max, "amax")
    new_m = torch.maximum(m, tile_max)
    safe = torch.where(torch.isneginf(new_m), 0.0, new_m)
    rescale = torch.exp(m - safe)  # exp(-inf) = 0 for a request with nothing yet
    e = tile_math.exp_floored(s - safe.index_select(0, owner)[..., None])  # masked keys: exp(-inf) = 0; no subnormals
    den.mul_(rescale).index_add_(0, owner, e.sum(-1))
    pv = torch.stack([torch.bmm(e[:, j].to(V.dtype), V[:, :, j]) for j in range(g)], 1).to(acc)  # (C, g, x, e)
    num.mul_(rescale[..., None]).index_add_(0, owner, pv)
    m.copy_(new_m)
