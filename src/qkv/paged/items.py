"""A decoding step's pages as items, the batch entries of its products, and the tiles that read them.

Shape legend: ``n`` requests in the step, ``I`` items, ``C`` items in a tile, ``S`` pages in
an item, ``P`` page size, ``L = S·P`` keys of an item, ``g`` KV heads, ``d`` key size.

Each request's pages (after the leading ones a shared prompt's cascade took) are cut into
items of ``S`` consecutive entries of its page list, so an item holds up to ``L`` of the
request's consecutive keys from position ``base``, its first ``keys`` of them filled (every
page but a request's last is full). Items are read in tiles:

* **views** — where every item is ``S`` consecutive pages starting on a multiple of ``S``
  (what :class:`qkv.PagedKVCache` hands out) and no two share a block: a range of aligned
  blocks is one strided tensor ``(C, g, L, d)``; a block inside the range that no item names
  is computed against nothing (its owner is ``n``, a row that is dropped). A range ends at a
  gap of more than :data:`GAP_BLOCKS` unnamed blocks. Float pages' views are not limited in
  size; pages whose ``blocks`` copy or dequantise are read their ``tile_keys`` at a time;
* **copies** — otherwise (scattered pages, or one page named by two requests): a tile of
  items is one copy of their pages (``take``), an item's pages past its owner's last read as
  page 0 and never seen.

The host work is a few list operations per item: whether the items are aligned comes from
one comparison over the whole page list (where ids stop being consecutive).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from .table import PageTable, longs

#: Keys per item: measured on the Intel Xeon, PyTorch's fused kernel over 38K keys in items of
#: 256 ran 2.6x faster than in items of 16 (it pays per item), and items of 512 no faster.
ITEM_KEYS = 256
#: The largest block of pages read as one item: ``qkv.PagedKVCache`` hands a request pages in
#: aligned blocks of this many, so a block holds one request's consecutive keys.
BLOCK_PAGES = 16
#: Keys of a tile read as a copy or dequantised (views of float pages are not limited): about
#: 4 MiB of float32 keys and values at g = 2, d = 64, read back by the kernel while cached.
TILE_KEYS = 4096
#: The same off the CPU: each of a tile's operations is a kernel launch there (a 32-request step
#: over FlashInfer's one-tensor layout ran 10 tiles, 358 kernels: 10.6 ms on an H200 against
#: 3.1 for the same step in one tile), and memory is plentiful: 64 MiB of float32 keys and
#: values at g = 2, d = 64.
DEVICE_TILE_KEYS = 2**16
#: A view tile spans at most this many unnamed blocks between two named ones: reading one such
#: block (256 keys) costs about what one more call of the kernel costs.
GAP_BLOCKS = 1


@dataclass(frozen=True)
class Items:
    """The step's items, one entry per item in each list (host ints)."""

    S: int  # pages per item
    entry: list[int]  # its first page's place in the table's page list
    owner: list[int]  # its request's place in the step (0 .. n - 1)
    base: list[int]  # the position of its first key in the request
    keys: list[int]  # keys filled, from its first
    block: list[int] | None  # its aligned block's id (first page // S), or None: not read as views

    @property
    def aligned(self) -> bool:
        return self.block is not None


def item_pages(P: int) -> int:
    """Pages per item: a power of two, at most :data:`BLOCK_PAGES`, at most :data:`ITEM_KEYS` keys (one page if larger)."""
    S = 1
    while 2 * S <= BLOCK_PAGES and 2 * S * P <= ITEM_KEYS:
        S *= 2
    return S


def items(steps: list[int], skip: list[int], table: PageTable, num_pages: int) -> Items:
    """Each step's pages after its first ``skip`` (a shared prompt's), as items of :func:`item_pages` pages."""
    P = table.page_size
    S = item_pages(P)
    L = S * P
    entry, owner, base, keys, spans = [], [], [], [], []
    for n, (r, k) in enumerate(zip(steps, skip)):
        first, pages, kv_len = table.page_start[r] + k, table.page_count[r] - k, table.kv_len[r]
        if pages <= 0:
            continue
        count = -(-pages // S)
        spans.append((first, pages))
        entry.extend(range(first, first + pages, S))
        owner.extend([n] * count)
        base.extend(range(k * P, (k + pages) * P, L))
        keys.extend([L] * (count - 1))
        keys.append(kv_len - (k + (count - 1) * S) * P)  # the last item: up to the request's last key
    return Items(S, entry, owner, base, keys, _aligned(table, entry, spans, S, num_pages))


def _aligned(table: PageTable, entry: list[int], spans: list[tuple[int, int]], S: int, num_pages: int) -> list[int] | None:
    """Each item's block id when every item is consecutive pages from a multiple of ``S`` and no two share
    a block (and the last block lies inside the pool); else None. ``spans``: each request's ``(first entry, entries)``."""
    if not entry:
        return None
    heads = table.indices.index_select(0, longs(entry, table.indices.device)).tolist()
    if any(p % S for p in heads) or S * (max(heads) // S + 1) > num_pages:
        return None
    starts = [a for a, _ in spans]  # ascending: the table lists requests in order
    for b in table.breaks:  # ids b - 1 and b are not consecutive: allowed only where an item starts
        i = bisect_right(starts, b) - 1
        if i >= 0 and spans[i][0] < b < spans[i][0] + spans[i][1] and (b - spans[i][0]) % S:
            return None
    block = [p // S for p in heads]
    return block if len(set(block)) == len(block) else None


@dataclass(frozen=True)
class Layout:
    """The step's items in the order its tiles read them, filler blocks of view tiles included (owner ``n``).

    A tile is ``(a, b, source)``: slots ``a .. b - 1``, read by :meth:`read` from any layer's pages
    (a plan's layout serves every layer)."""

    item_keys: int  # L, keys of an item
    owner: torch.Tensor  # (M,) the slot's request, n for none
    base: torch.Tensor  # (M,) its first key's position
    keys: torch.Tensor  # (M,) keys filled, from its first (0 for a filler)
    tiles: list[tuple[int, int, tuple[int, int]]]  # slots a .. b - 1 and their pages: a range, or rows of ``ids``
    ids: torch.Tensor | None  # (M, S) page ids of copied items (unnamed: page 0), None for views
    row: torch.Tensor  # (M,) the query row the slot reads: its owner's (a filler's: row 0, its result dropped)
    shift: torch.Tensor  # (M,) the slot of its owner's last item (a filler's: slot 0), whose lse the merge subtracts
    final: torch.Tensor | None  # (n,) each request's last slot; None where a request has no item

    def read(self, tile: tuple[int, int, tuple[int, int]], pages) -> tuple[torch.Tensor, torch.Tensor]:
        """``K, V (b - a, g, L, d)`` of a tile: views of a range of aligned blocks, or a copy of its items' pages."""
        a, b, (p0, p1) = tile
        S = self.item_keys // pages.page_size
        if self.ids is None:
            return pages.blocks(p0, p1, S)
        K, V = pages.take(self.ids[a:b].reshape(-1))  # (C·S, P, g, d)
        return tuple(x.reshape(b - a, self.item_keys, *x.shape[2:]).transpose(1, 2) for x in (K, V))


def layout(plan: Items, table: PageTable, page_size: int, tile_keys: int | None, n: int, device) -> Layout:
    """Where each item is read: ranges of the pool where ``plan`` is aligned, at most ``tile_keys`` keys a
    range (None: unbounded, the pages' ``blocks`` are views), else copies of :func:`copy_tile_keys` keys a tile."""
    return _views(plan, page_size, tile_keys, n, device) if plan.aligned else _copies(plan, table, page_size, n, device)


def tile_keys(pages) -> int | None:
    """Keys a range of ``pages`` may span: None where its ``blocks`` are views, else its own ``tile_keys``
    (``Int8Pages``: measured on CPUs) or :data:`TILE_KEYS`; :data:`DEVICE_TILE_KEYS` off the CPU. Half-precision
    pages on a CPU are converted to float32 a tile at a time: :data:`TILE_KEYS`."""
    cpu = pages.device.type == "cpu"
    if cpu and pages.dtype in (torch.float16, torch.bfloat16):  # its items run in float32 (decode_fused): a tile at a time
        return TILE_KEYS
    if pages.views:
        return None
    return getattr(pages, "tile_keys", TILE_KEYS) if cpu else copy_tile_keys(pages.device)


def copy_tile_keys(device: torch.device) -> int:
    """Keys of a tile read as a copy of scattered pages: :data:`TILE_KEYS`, :data:`DEVICE_TILE_KEYS` off the CPU."""
    return TILE_KEYS if device.type == "cpu" else DEVICE_TILE_KEYS


def _views(plan: Items, P: int, keys: int | None, n: int, device) -> Layout:
    S = plan.S
    order = sorted(range(len(plan.block)), key=plan.block.__getitem__)
    block = [plan.block[i] for i in order]
    most = None if keys is None else max(1, keys // (S * P))  # blocks of a copied or dequantised tile
    owner, base, keys, tiles = [], [], [], []
    slot = [0] * len(order)  # each item's slot
    start = 0
    while start < len(block):  # a range of named blocks with small gaps, no longer than a dequantised tile may be
        stop = start + 1
        while stop < len(block) and block[stop] - block[stop - 1] <= GAP_BLOCKS + 1 and (
                most is None or block[stop] - block[start] < most):  # fmt: skip
            stop += 1
        lo, hi = block[start], block[stop - 1] + 1
        at = len(owner)
        owner += [n] * (hi - lo)
        base += [0] * (hi - lo)
        keys += [0] * (hi - lo)
        for i in order[start:stop]:
            slot[i] = at + plan.block[i] - lo
            owner[slot[i]], base[slot[i]], keys[slot[i]] = plan.owner[i], plan.base[i], plan.keys[i]
        tiles.append((at, len(owner), (lo * S, hi * S)))
        start = stop
    return _laid_out(plan, S * P, owner, base, keys, slot, n, device, tiles, None)


def _copies(plan: Items, table: PageTable, P: int, n: int, device) -> Layout:
    S = plan.S
    per_tile = max(1, copy_tile_keys(torch.device(device)) // (S * P))
    entry, keys = _longs(plan.entry, plan.keys, device=table.indices.device)
    at = entry[:, None] + torch.arange(S, device=entry.device)  # (I, S) places in the page list
    named = torch.arange(S, device=entry.device) * P < keys[:, None]  # the owner's pages, not the next request's
    ids = torch.where(named, table.indices[at.clamp(max=table.indices.numel() - 1)], 0)  # unnamed: page 0, never seen
    I = len(plan.entry)
    tiles = [(a, min(I, a + per_tile), (0, 0)) for a in range(0, I, per_tile)]
    return _laid_out(plan, S * P, plan.owner, plan.base, plan.keys, range(I), n, device, tiles, ids)


def _laid_out(plan: Items, L: int, owner: list[int], base: list[int], keys: list[int], slot, n: int, device,
              tiles: list, ids: torch.Tensor | None) -> Layout:  # fmt: skip
    """The :class:`Layout` of slots ``owner``, ``base``, ``keys`` (fillers' owner ``n``), item ``i`` at ``slot[i]``:
    with each slot's query row and the slot of its owner's last item, in one host-to-tensor conversion."""
    final = [-1] * n + [0]  # a filler's shift: slot 0 (its result is dropped)
    for i, o in enumerate(plan.owner):  # a request's items are listed in order: its last one is seen last
        final[o] = slot[i]
    shift = [final[o] for o in owner]
    row = [o if o < n else 0 for o in owner]
    M = len(owner)
    every = longs([*owner, *base, *keys, *row, *shift, *final[:n]], device)
    parts = [every[k * M : (k + 1) * M] for k in range(5)]
    return Layout(L, *parts[:3], tiles, ids, *parts[3:], every[5 * M :] if min(final) >= 0 else None)


def _longs(*lists: list[int], device) -> tuple[torch.Tensor, ...]:
    return tuple(longs(xs, device) for xs in lists)
