"""Decoding steps over runs of consecutive pages: one fused kernel call per run, on views of the pool.

Shape legend: ``n`` requests in the step, ``h`` query heads, ``g`` KV heads, ``x = h / g``,
``d`` key size, ``e`` value size, ``P`` page size, ``L`` keys of a run.

A page table whose requests are each one run of consecutive ids (a request ``qkv.PagedKVCache``
reserved, a contiguous cache's rows), or hold a few runs not starting on block boundaries (runs
that do start there, several to a request, go to the items of ``qkv.paged.decode``). One run a
request needs no merge and no mask of unfilled slots: on the AMD EPYC Zen 5, from cold caches, 32
reserved requests took 2.9 ms as runs against 3.1 ms as items in one tile of aligned blocks, and a
contiguous cache's rows (cut by their unused slots into some 20 tiles of items) 3.6 against 4.6 ms.
In the tuple form (keys and values in pools of their
own) a run is one strided matrix ``(L, g, d)``, and PyTorch's fused CPU kernel
(``backends.tiling.flash_cpu``) reads it where it lies: the ``x`` query heads that share a KV
head become ``x`` query rows of that head, so grouped heads need no copy of the keys::

    out_run, lse_run = flash(q_r (1, g, x, d), K_run (1, g, L, d), V_run (1, g, L, e))

and a request's runs merge by their log-sum-exp (``qkv.merge``'s rule). One call per run
costs about what one call of ``F.scaled_dot_product_attention`` on a contiguous cache costs,
so a step of requests with few runs each runs at the speed of a loop over contiguous caches.
Used for plain decoding steps (no soft-cap, ALiBi, window or score_mod); int8 pages are
dequantised into buffers the kernel reads from cache, runs that follow each other in the pool
together (``Int8Pages.runs``). The item pass (``qkv.paged.decode``) takes the rest. The host work of
a step is a few operations per request: the runs come from one comparison over the page
list, and the outputs are joined once at the end.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import torch
from torch import Tensor

from ..backends.tiling import flash_cpu
from ..backends.tiling.lse import merge_all
from .items import TILE_KEYS
from .options import Options
from .float8 import widen
from .pages import FloatPages, key_view
from .table import PageTable


def usable(q: Tensor, pages, opts: Options) -> bool:
    """Whether the steps can run here: float pages, the fused kernel usable, nothing but the scale on the logits."""
    plain = opts.soft_cap <= 0 and opts.alibi_slopes is None and opts.score_mod is None and opts.window_left < 0
    # half-precision runs would give outputs rounded apart before their merge (the items convert a tile to float32)
    full = pages.dtype not in (torch.float16, torch.bfloat16)
    same = pages.value_dim == pages.head_dim  # (the kernel takes one head size)
    return plain and full and same and flash_cpu.unusable(q) is None and pages.dtype == q.dtype


def runs_in(table: PageTable, steps: list[int], skip: list[int]) -> list[list[tuple[int, int, int]]]:
    """Per step, its ``(first page, pages, first slot)`` runs of consecutive ids, after its first ``skip`` pages.

    One comparison over the whole page list finds where ids stop being consecutive; each
    request's runs are then the breaks inside its own entries (a bisection), so the host
    work grows with requests and runs, not with pages.
    """
    indices, breaks = table.indices, table.breaks
    spans: list[tuple[int, int, int]] = []  # (entry, entries, slot) of every run, step after step
    shape: list[int] = []
    for r, k in zip(steps, skip):
        a, b = table.page_start[r] + k, table.page_start[r] + table.page_count[r]
        if a == b:
            shape.append(0)
            continue
        cuts = [a, *breaks[bisect_right(breaks, a) : bisect_left(breaks, b)], b]
        shape.append(len(cuts) - 1)
        spans.extend((u, w - u, k + u - a) for u, w in zip(cuts, cuts[1:]))
    firsts = indices[[u for u, _, _ in spans]].tolist() if spans else []
    runs, at = [], 0
    for count in shape:
        runs.append([(p, c, s) for p, (_, c, s) in zip(firsts[at : at + count], spans[at : at + count])])
        at += count
    return runs


def decode_runs(q: Tensor, runs: list[list[tuple[int, int, int]]], kv_len: list[int], pages,
                opts: Options) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of one query per request against its runs of pages."""
    n, h, d = q.shape
    g, P = pages.kv_heads, pages.page_size
    acc = torch.promote_types(q.dtype, torch.float32)
    if not pages.views:  # runs read as copies (dequantised, converted): a bounded piece at a time, merged by LSE
        most = max(1, getattr(pages, "run_group_keys", TILE_KEYS) // P)
        runs = [[(f + k, min(most, c - k), s + k) for f, c, s in rs for k in range(0, c, most)] for rs in runs]
    read = _reader(pages, [(first, count) for rs in runs for first, count, _ in rs])
    qs = q.contiguous().view(n, 1, g, h // g, d)  # the x query heads of a KV head are its x query rows
    forward, scale = flash_cpu.forward, opts.scale
    outs, lses = [], []
    at = 0  # the next run, counted over all requests
    for r in range(n):
        parts = []
        for first, count, slot in runs[r]:
            k, v = read(at, first, min(count * P, kv_len[r] - slot * P))
            parts.append(forward(qs[r], k, v, 0.0, False, scale=scale)[:2])
            at += 1
        if len(parts) == 1:
            o, l = parts[0]
        elif not parts:  # no key: out = 0, lse = -inf
            o, l = q.new_zeros(1, g, h // g, pages.value_dim), q.new_full((1, g, h // g), float("-inf"), dtype=acc)
        else:
            o, l = merge_all([p[0] for p in parts], [p[1].to(acc) for p in parts])
        outs.append(o)
        lses.append(l)
    return torch.cat(outs).view(n, h, -1), torch.cat(lses).view(n, h).to(acc)


def _reader(pages, ranges: list[tuple[int, int]]):
    """``(run, first page, keys) -> (K (1, g, keys, d), V (1, g, keys, e))``: a run where it lies, or dequantised."""
    if isinstance(pages, FloatPages):
        view_k, view_v = _viewer(pages.keys), _viewer(pages.values)
        if pages.converts:  # float8 pages: each run converted to q's dtype as it is read
            return lambda n, first, keys: (widen(view_k(first, keys), pages.dtype), widen(view_v(first, keys), pages.dtype))
        return lambda n, first, keys: (view_k(first, keys), view_v(first, keys))
    dequantised = pages.runs(ranges)  # qkv.paged.Int8Pages: each run into reused buffers

    def read(n: int, first: int, keys: int) -> tuple[Tensor, Tensor]:
        k, v = dequantised(n, keys)
        return k.unsqueeze(0), v.unsqueeze(0)

    return read


def _viewer(pool: Tensor):
    """``(first page, keys) -> (1, g, keys, d)``: a run of the pool ``(num_pages, P, g, d)`` as one strided view.

    Where the pool's pages are each contiguous and one after the other (the tuple form), a view
    (:func:`.pages.key_view`); else a copy of the run's pages.
    """
    num_pages, P, g, d = pool.shape
    if not pool.is_contiguous():
        return lambda first, keys: pool[first : first + -(-keys // P)].reshape(-1, g, d)[:keys].permute(1, 0, 2)[None]
    return lambda first, keys: key_view(pool, first, 1, keys, 0)
