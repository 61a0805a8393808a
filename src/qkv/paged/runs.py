"""Decoding steps over runs of consecutive pages: one fused kernel call per run, on views of the pool.

Shape legend: ``n`` requests in the step, ``h`` query heads, ``g`` KV heads, ``x = h / g``,
``d`` key size, ``e`` value size, ``P`` page size, ``L`` keys of a run.

``qkv.PagedKVCache`` hands a request the page after its last one while it can, so a request's
pages are a few runs of consecutive ids. In the tuple form (keys and values in pools of their
own) a run is one strided matrix ``(L, g, d)``, and PyTorch's fused CPU kernel
(``backends.tiling.flash_cpu``) reads it where it lies: the ``x`` query heads that share a KV
head become ``x`` query rows of that head, so grouped heads need no copy of the keys::

    out_run, lse_run = flash(q_r (1, g, x, d), K_run (1, g, L, d), V_run (1, g, L, e))

and a request's runs merge by their log-sum-exp (``qkv.merge``'s rule). One call per run
costs about what one call of ``F.scaled_dot_product_attention`` on a contiguous cache costs,
so a step of requests with few runs each runs at the speed of a loop over contiguous caches.
Used for plain decoding steps (no soft-cap, ALiBi, window or score_mod); int8 pages are
dequantised a run at a time. The block pass (``qkv.paged.decode``) takes the rest.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.tiling import flash_cpu
from ..backends.tiling.lse import merge_all
from .options import Options
from .pages import FloatPages


def usable(q: Tensor, pages, opts: Options) -> bool:
    """Whether the steps can run here: float pages, the fused kernel usable, nothing but the scale on the logits."""
    plain = opts.soft_cap <= 0 and opts.alibi_slopes is None and opts.score_mod is None and opts.window_left < 0
    return plain and flash_cpu.unusable(q) is None and pages.dtype == q.dtype


def runs_of(page: Tensor, owner: Tensor, slot: Tensor, n: int) -> list[list[tuple[int, int, int]]]:
    """Per request (``owner`` 0 .. n - 1), its ``(first page, pages, first slot)`` runs of consecutive ids.

    ``page``, ``owner``, ``slot`` ``(N,)`` list every request's pages in order, request after
    request; a run breaks where the owner changes or the next id is not one more.
    """
    starts = torch.ones_like(page, dtype=torch.bool)
    starts[1:] = (page[1:] != page[:-1] + 1) | (owner[1:] != owner[:-1])
    at = starts.nonzero().flatten()
    counts = torch.diff(at, append=torch.tensor([page.numel()], device=at.device))
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for p, c, s, o in zip(*(x.tolist() for x in (page[at], counts, slot[at], owner[at]))):
        runs[o].append((p, c, s))
    return runs


def decode_runs(q: Tensor, runs: list[list[tuple[int, int, int]]], kv_len: list[int], pages,
                opts: Options) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of one query per request against its runs of pages."""
    n, h, d = q.shape
    g, P = pages.kv_heads, pages.page_size
    x = h // g
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(n, h, pages.value_dim)
    lse = torch.empty(n, h, dtype=acc, device=q.device)
    if isinstance(pages, FloatPages):
        view_k, view_v = _viewer(pages.keys), _viewer(pages.values)
        read = lambda first, count, keys: (view_k(first, keys), view_v(first, keys))  # noqa: E731
    else:  # quantised pages: the run dequantised (one tile), then viewed
        read = lambda first, count, keys: tuple(  # noqa: E731
            t.reshape(count * P, g, -1)[:keys].permute(1, 0, 2)[None] for t in pages.range(first, first + count)
        )
    for r in range(n):
        q_r = q[r].view(1, g, x, d)
        parts = []
        for first, count, slot in runs[r]:
            keys = min(count * P, kv_len[r] - slot * P)
            k, v = read(first, count, keys)
            o, l = flash_cpu.forward(q_r, k, v, 0.0, False, scale=opts.scale)[:2]
            parts.append((o.reshape(h, -1), l.reshape(h)))
        if len(parts) == 1:
            out[r], lse[r] = parts[0]
        else:
            o, l = merge_all([p[0] for p in parts], [p[1].to(acc) for p in parts])
            out[r], lse[r] = o, l
    return out, lse


def _viewer(pool: Tensor):
    """``(first page, keys) -> (1, g, keys, d)``: a run of the pool ``(num_pages, P, g, d)`` as one strided view.

    The pool's pages must each be contiguous and one after the other (the tuple form); then a
    run's ``keys`` rows start at ``first · P`` and step by ``g · d``.
    """
    num_pages, P, g, d = pool.shape
    if not pool.is_contiguous():
        return lambda first, keys: pool[first : first + -(-keys // P)].reshape(-1, g, d)[:keys].permute(1, 0, 2)[None]
    base = pool.storage_offset()
    return lambda first, keys: pool.as_strided((1, g, keys, d), (0, d, g * d, 1), base + first * P * g * d)
