"""Where each request of a paged call runs: decoding steps together, prefill chunks one request at a time.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads, ``d`` key
size, ``e`` value size, ``P`` page size.

* **decoding steps** (one query) of every request together, one pass over their pages
  (``qkv.paged.decode``); requests that begin with the same pages (a shared prompt) attend
  to those pages **once**, all their queries together, and the two parts are merged by their
  log-sum-exp (FlashInfer's cascade; ``qkv.merge``'s rule);
* **prefill chunks** (several queries), and any call with a score_mod, one request at a
  time, a tile of its pages at a time, through ``qkv.attention`` (``qkv.paged.requests``).

What depends only on the page table (which rows are steps, the shared prefixes, the items
and where they are read) is kept in the plan's ``memo`` and computed once for all the layers
that run the same plan.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.tiling.lse import merge_all
from ..functional import attention
from .decode import decode
from .items import items
from .options import Options
from .requests import TILE_KEYS, packed, request, score_mod as positioned, tile
from .runs import decode_runs, runs_in
from .runs import usable as runs_usable
from .table import PageTable, longs


def run(q: Tensor, table: PageTable, memo: dict, pages, opts: Options,
        want_lse: bool = True) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(out (T, h, e), lse (T, h))`` of every request of ``table``; ``memo`` keeps what the table alone decides.
    Without ``want_lse`` (a call that returns none and merges none) prefill chunks run in one call that need not compute
    it, and the ``lse`` returned may be None."""
    T, h, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    # a step is one query over at least one key (without causal a request may have none: its row stays 0, -inf)
    steps = _memo(memo, ("steps", opts.score_mod is None), lambda: [r for r in range(table.requests)
                  if table.qo_len[r] == 1 and table.kv_len[r] > 0] if opts.score_mod is None else [])  # fmt: skip
    if steps and len(steps) == T:  # every row a decoding step, request after request: q as it is
        o, s = _steps(q, steps, table, memo, pages, opts)
        return o.to(q.dtype), s.to(acc)
    stepped = set(steps)
    chunks = [r for r in range(table.requests) if table.qo_len[r] and r not in stepped]
    together = packed(q, table, chunks, pages, opts, want_lse) if chunks else None
    if together is not None:  # every prefill chunk in one segmented call (its other rows 0 and -inf)
        out, lse = together[0], (None if together[1] is None else together[1].to(acc))
        chunks = []
    else:  # every row is written below (qo_indptr covers them all, each request's rows by its own call): no fill
        out = q.new_empty(T, h, pages.value_dim)
        lse = torch.empty((T, h), dtype=acc, device=q.device)
    if steps:
        rows = torch.tensor([table.qo_start[r] for r in steps], device=q.device)
        o, s = _steps(q.index_select(0, rows), steps, table, memo, pages, opts)
        out.index_copy_(0, rows, o.to(out.dtype))
        if lse is not None:
            lse.index_copy_(0, rows, s.to(acc))
    for r in chunks:
        rows = slice(table.qo_start[r], table.qo_start[r] + table.qo_len[r])
        o, s = request(q[rows], table.kv_len[r], table.pages(r), pages, opts, r, table.first_of_range(r))
        out[rows] = o.to(out.dtype)
        lse[rows] = s.to(acc)
    return out, lse


def _memo(memo: dict, key, make):
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _steps(q: Tensor, steps: list[int], table: PageTable, memo: dict, pages, opts: Options) -> tuple[Tensor, Tensor]:
    """Decoding steps: shared leading pages once per group (a cascade), the rest in one pass."""
    def qpos() -> Tensor:  # only the options that read positions, and the written-out products, ask
        return _memo(memo, ("qpos", str(q.device)), lambda: longs([table.kv_len[r] - 1 for r in steps], q.device))

    cascade = opts.window_left < 0
    whole = _memo(memo, ("items", pages.num_pages), lambda: items(steps, [0] * len(steps), table, pages.num_pages))
    # aligned items name distinct blocks, so no two requests begin with the same page: nothing to share
    shared = _memo(memo, ("shared", cascade), lambda: _shared_prefixes(steps, table) if cascade and not whole.aligned else [])
    skip = [0] * len(steps)  # leading pages attended with their group
    partials = []
    for members, count in shared:
        ids = table.pages(steps[members[0]])[:count]
        idx = torch.tensor(members, device=q.device)
        partials.append((idx, *_prefix(q.index_select(0, idx), qpos().index_select(0, idx), ids, pages, opts,
                                       torch.tensor([steps[n] for n in members], device=q.device))))  # fmt: skip
        for n in members:
            skip[n] = count
    plan = whole if not shared else _memo(memo, ("items", cascade, pages.num_pages), lambda: items(steps, skip, table, pages.num_pages))
    runs = _memo(memo, ("runs", cascade), lambda: runs_in(table, steps, skip)) if runs_usable(q, pages, opts) else None
    # one kernel call per run, on views, where requests hold few runs: one each (a reserved request, a contiguous
    # cache's rows), or up to two each where the pages are not aligned blocks (the items would be copies). Items,
    # one call per tile, then merge a request's items and mask their unfilled slots: on the AMD EPYC Zen 5, from
    # cold caches, 32 requests of one run each took 2.9 ms as runs against 3.1 ms as items in one tile of aligned
    # blocks, and 3.6 against 4.6 ms where gaps between a contiguous cache's rows cut the items into 20 tiles
    if runs is not None and sum(len(x) for x in runs) <= (len(steps) if plan.aligned else 2 * len(steps)):
        out, lse = decode_runs(q, runs, [table.kv_len[r] for r in steps], pages, opts)
    else:
        out, lse = decode(q, qpos, plan, table, pages, opts, _memo(memo, ("decode", cascade, bool(shared)), dict))
    for idx, o, s in partials:
        merged_out, merged_lse = merge_all([out.index_select(0, idx), o.to(out.dtype)], [lse.index_select(0, idx), s.to(lse.dtype)])
        out = out.index_copy(0, idx, merged_out)
        lse = lse.index_copy(0, idx, merged_lse)
    return out, lse


def _shared_prefixes(steps: list[int], table: PageTable) -> list[tuple[list[int], int]]:
    """Groups of decoding requests (their places in ``steps``) that begin with the same full pages, and how many."""
    first: dict[int, list[int]] = {}
    heads = table.indices.index_select(0, longs([table.page_start[r] for r in steps], table.indices.device)).tolist()
    for n, r in enumerate(steps):
        if table.page_count[r] >= 2:
            first.setdefault(heads[n], []).append(n)
    lists = {n: table.pages(steps[n]).tolist() for members in first.values() if len(members) > 1 for n in members}
    groups = []
    for members in first.values():
        if len(members) < 2:
            continue
        count = min(table.page_count[steps[n]] - 1 for n in members)  # a request's last page is its own
        head = lists[members[0]]
        for n in members[1:]:
            same = 0
            while same < count and lists[n][same] == head[same]:
                same += 1
            count = same
        if count >= 1:
            groups.append((members, count))
    return groups


def _prefix(q: Tensor, qpos: Tensor, ids: Tensor, pages, opts: Options, requests: Tensor) -> tuple[Tensor, Tensor]:
    """``(out (n, h, e), lse (n, h))`` of ``n`` queries, each after the whole prefix, against the prefix's pages once:
    a tile of :data:`.requests.TILE_KEYS` keys at a time (views where the pages are consecutive ids and the pages
    allow them, else a copy or dequantisation of the tile's pages, never the whole prefix), merged by LSE."""
    acc = torch.promote_types(q.dtype, torch.float32)  # merged with the rest: in float32, rounded once after it
    P, count = pages.page_size, ids.numel()
    per_tile = max(1, TILE_KEYS // P)
    first = int(ids[0]) if count and bool((ids[1:] - ids[:-1] == 1).all()) else None  # consecutive: ranges
    q_t = q.to(acc).permute(1, 0, 2)[None]  # (1, h, n, d)
    outs, lses = [], []
    for start in range(0, count, per_tile):  # every key of these full pages is seen by every query (causal holds)
        n = min(per_tile, count - start)
        K, V = tile(pages, ids, first, start, n, n * P, acc)  # (1, g, n·P, d): full pages
        out, lse = attention(q_t, K, V, scale=opts.scale, score_mod=positioned(opts, qpos, start * P, requests),
                             return_lse=True)  # fmt: skip
        outs.append(out[0].permute(1, 0, 2))  # (n, h, e)
        lses.append(lse[0].permute(1, 0))
    return merge_all(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
