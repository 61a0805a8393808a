"""``qkv.paged_attention``: many requests' prefill chunks and decoding steps, in one call, over a paged KV cache.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads (``h % g == 0``),
``d`` key size, ``e`` value size, ``R`` requests, ``P`` page size.

FlashInfer's page table (``qkv.paged.table``) names each request's queries and pages; the
call routes each request to the engine for its shape:

* **decoding steps** (one query) of every request together, one pass over their pages
  (``qkv.paged.decode``); requests that begin with the same pages (a shared prompt) attend
  to those pages **once**, all their queries together, and the two parts are merged by their
  log-sum-exp (FlashInfer's cascade; ``qkv.merge``'s rule);
* **prefill chunks** (several queries), and any call with a score_mod, one request at a
  time, a tile of its pages at a time, through ``qkv.attention`` (``qkv.paged.requests``).

Sinks (gpt-oss's learned per-head logit) join every row's softmax at the end:
``lse' = log(e^lse + e^sink)``, ``out' = out · e^(lse - lse')``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..backends.tiling.lse import merge_all
from ..functional import attention
from .decode import decode
from .items import items
from .options import Options, options
from .pages import FloatPages
from .requests import request, score_mod as positioned
from .runs import decode_runs, runs_in
from .runs import usable as runs_usable
from .table import PageTable, page_table


def paged_attention(
    q: Tensor,
    kv_cache,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    *,
    causal: bool = True,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sm_scale: float | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    alibi_slopes: Tensor | None = None,
    return_lse: bool = False,
):
    """``out (T, h, e)``, or ``(out, lse (T, h))`` with ``return_lse``: attention of each request over its pages.

    ``q (T, h, d)``: request ``r``'s queries are rows ``qo_indptr[r] : qo_indptr[r + 1]``,
    the last ``qo_len`` of its ``kv_len`` positions (bottom-right causal). ``kv_cache``:
    ``(num_pages, 2, P, g, d)`` (keys at ``[:, 0]``, values at ``[:, 1]``), a tuple
    ``(k_cache, v_cache)`` of ``(num_pages, P, g, d)`` (FlashInfer's two NHD forms), or an
    :class:`qkv.paged.Int8Pages`. Request ``r``'s pages are
    ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]`` in order, the last holding
    ``kv_last_page_len[r]`` keys. ``window_left``: keys at most that far before the query
    (-1: all); ``logits_soft_cap``: ``cap · tanh(s / cap)`` (0: none); ``sm_scale``: default
    ``1/√d``; ``sinks (h,)``; ``alibi_slopes (h,)``; ``score_mod(score, r, h, q_pos, kv_pos)``
    with positions in the request's sequence. ``lse`` is the natural log-sum-exp (FlashInfer's
    is base 2: divide by ``ln 2``); a row with no visible key gets ``out = 0``, ``lse = -inf``.
    """
    pages = kv_cache if hasattr(kv_cache, "take") and hasattr(kv_cache, "range") else FloatPages(kv_cache)
    _check_q(q, pages)
    table = page_table(q.shape[0], pages.num_pages, pages.page_size, qo_indptr, kv_indptr, kv_indices,
                       kv_last_page_len, pages.device)  # fmt: skip
    opts = options(q, causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                   alibi_slopes=alibi_slopes, score_mod=score_mod)  # fmt: skip
    sinks = _check_sinks(sinks, q.shape[1])
    out, lse = _run(q, table, pages, opts)
    if sinks is not None:
        sink = sinks.to(lse.dtype)[None, :]
        total = torch.logaddexp(lse, sink)
        out = (out.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(out.dtype)
        lse = total
    return (out, lse) if return_lse else out


def _run(q: Tensor, table: PageTable, pages, opts: Options) -> tuple[Tensor, Tensor]:
    T, h, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    steps = [r for r in range(table.requests) if table.qo_len[r] == 1] if opts.score_mod is None else []
    if steps and len(steps) == T:  # every row a decoding step, request after request: q as it is
        o, s = _steps(q, steps, table, pages, opts)
        return o.to(q.dtype), s.to(acc)
    out = q.new_zeros(T, h, pages.value_dim)
    lse = torch.full((T, h), float("-inf"), dtype=acc, device=q.device)
    if steps:
        rows = torch.tensor([table.qo_start[r] for r in steps], device=q.device)
        o, s = _steps(q.index_select(0, rows), steps, table, pages, opts)
        out.index_copy_(0, rows, o.to(out.dtype))
        lse.index_copy_(0, rows, s.to(acc))
    stepped = set(steps)
    for r in range(table.requests):
        if table.qo_len[r] == 0 or r in stepped:
            continue
        rows = slice(table.qo_start[r], table.qo_start[r] + table.qo_len[r])
        o, s = request(q[rows], table.kv_len[r], table.pages(r), pages, opts, r)
        out[rows] = o.to(out.dtype)
        lse[rows] = s.to(acc)
    return out, lse


def _steps(q: Tensor, steps: list[int], table: PageTable, pages, opts: Options) -> tuple[Tensor, Tensor]:
    """Decoding steps: shared leading pages once per group (a cascade), the rest in one pass."""
    qpos = torch.tensor([table.kv_len[r] - 1 for r in steps], device=q.device)
    shared = _shared_prefixes(steps, table) if opts.window_left < 0 else []
    skip = [0] * len(steps)  # leading pages attended with their group
    partials = []
    for members, count in shared:
        ids = table.pages(steps[members[0]])[:count]
        idx = torch.tensor(members, device=q.device)
        partials.append((idx, *_prefix(q.index_select(0, idx), qpos.index_select(0, idx), ids, pages, opts,
                                       torch.tensor([steps[n] for n in members], device=q.device))))  # fmt: skip
        for n in members:
            skip[n] = count
    plan = items(steps, skip, table, pages.num_pages)
    runs = runs_in(table, steps, skip) if not plan.aligned and runs_usable(q, pages, opts) else None
    if runs is not None and sum(len(x) for x in runs) <= 2 * len(steps):  # few runs, not aligned: one call per run, on views
        out, lse = decode_runs(q, runs, [table.kv_len[r] for r in steps], pages, opts)
    else:
        out, lse = decode(q, qpos, plan, table, pages, opts)
    for idx, o, s in partials:
        merged_out, merged_lse = merge_all([out.index_select(0, idx), o.to(out.dtype)], [lse.index_select(0, idx), s.to(lse.dtype)])
        out = out.index_copy(0, idx, merged_out)
        lse = lse.index_copy(0, idx, merged_lse)
    return out, lse


def _shared_prefixes(steps: list[int], table: PageTable) -> list[tuple[list[int], int]]:
    """Groups of decoding requests (their places in ``steps``) that begin with the same full pages, and how many."""
    first: dict[int, list[int]] = {}
    heads = table.indices[[table.page_start[r] for r in steps]].tolist() if steps else []
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
    """``(out (n, h, e), lse (n, h))`` of ``n`` queries, each after the whole prefix, against the prefix's pages once."""
    K, V = pages.take(ids)  # (c, P, g, d): every key of these full pages is seen by every query (causal holds)
    K = K.reshape(-1, *K.shape[2:]).permute(1, 0, 2)[None]  # (1, g, c·P, d)
    V = V.reshape(-1, *V.shape[2:]).permute(1, 0, 2)[None]
    out, lse = attention(q.permute(1, 0, 2)[None], K, V, scale=opts.scale, score_mod=positioned(opts, qpos, 0, requests),
                         return_lse=True)  # fmt: skip
    return out[0].permute(1, 0, 2), lse[0].permute(1, 0)


def _check_q(q: Tensor, pages) -> None:
    if not isinstance(q, Tensor) or q.dim() != 3:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q: expected (total_q, num_heads, head_dim), got {got}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q: expected a floating-point tensor, got {q.dtype}")
    if q.shape[2] != pages.head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's {pages.head_dim}")
    if q.shape[1] % pages.kv_heads:
        raise ValueError(f"q: {q.shape[1]} query heads are not a multiple of the cache's {pages.kv_heads} KV heads")
    if q.device != pages.device:
        raise ValueError(f"q is on {q.device} but the cache is on {pages.device}")


def _check_sinks(sinks, h: int) -> Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (h,):
        got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a tensor of shape ({h},), one logit per query head, got {got}")
    return sinks
