"""``qkv.paged_attention``: many requests' prefill chunks and decoding steps, in one call, over a paged KV cache.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads (``h % g == 0``),
``d`` key size, ``e`` value size, ``R`` requests, ``P`` page size.

FlashInfer's page table (``qkv.paged.table``) names each request's queries and pages; a call
is a :class:`qkv.paged.PagedPlan` of that table run once, which routes each request to the
engine for its shape (``qkv.paged.route``): decoding steps of every request together,
prefill chunks one request at a time.

Sinks (gpt-oss's learned per-head logit) join every row's softmax at the end:
``lse' = log(e^lse + e^sink)``, ``out' = out · e^(lse - lse')``.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from .pages import as_pages
from .plan import check_q
from .recent import plan_for


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
    kv_layout: str = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
):
    """``out (T, h, e)``, or ``(out, lse (T, h))`` with ``return_lse``: attention of each request over its pages.

    ``q (T, h, d)``: request ``r``'s queries are rows ``qo_indptr[r] : qo_indptr[r + 1]``,
    the last ``qo_len`` of its ``kv_len`` positions (bottom-right causal; a request may have more
    queries than keys, even none: with ``causal`` those before its first key see nothing, without
    it every query sees every key, as in FlashInfer). ``causal`` defaults to True, where
    FlashInfer's prefill plan defaults to False. ``kv_cache``:
    ``(num_pages, 2, P, g, d)`` (keys at ``[:, 0]``, values at ``[:, 1]``), a tuple
    ``(k_cache, v_cache)`` of ``(num_pages, P, g, d)`` and ``(num_pages, P, g, e)`` (FlashInfer's two NHD
    forms; values of another size, as its ``head_dim_vo``, run off the fused kernel), or an
    :class:`qkv.paged.Int8Pages`; ``kv_layout="HND"``: pages ``(g, P, d)`` in either form
    (FlashInfer's wrapper argument: shapes alone cannot tell the two apart). Request ``r``'s
    pages are ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]`` in order, the last holding
    ``kv_last_page_len[r]`` keys (entries past ``kv_indptr[-1]`` are not read). ``window_left``: keys at most that far before the query
    (-1: all); ``logits_soft_cap``: ``cap · tanh(s / cap)`` (0: none); ``sm_scale``: default
    ``1/√d``; ``sinks (h,)``: one logit per head, unscaled; ``alibi_slopes (h,)``;
    ``score_mod(score, r, h, q_pos, kv_pos)`` with positions in the request's sequence. ``lse``
    is the natural log-sum-exp (FlashInfer's is base 2: divide by ``ln 2``); a row with no
    visible key gets ``out = 0``, ``lse = -inf``.

    Float8 pages (``torch.float8_e4m3fn`` / ``float8_e5m2``, FlashInfer's fp8 KV cache) are read
    under a wider ``q`` (float16, bfloat16, float32 or float64), converted to ``q``'s dtype a tile at
    a time; ``k_scale`` and ``v_scale`` are FlashInfer's calibration scales (numbers or one-element
    tensors): the logits are
    ``sm_scale · k_scale · q·k`` (and the ``lse`` theirs), the output is multiplied by ``v_scale``.

    One call is a :class:`qkv.paged.PagedPlan` of the table run once; the plans of the last few
    tables a thread gave are kept and reused while the four index tensors hold the same values
    (compared entry by entry: a model's layers calling this with their step's table plan once,
    ``qkv.paged.recent``). A caller may also make the plan itself and run it per layer.

    Forward only, as FlashInfer's paged kernels: with gradients enabled and an input that
    requires them the call runs and its outputs join autograd's graph, but a backward through
    them raises (serving runs under ``torch.no_grad()``; training attends over contiguous keys).
    """
    pages = as_pages(kv_cache, kv_layout, getattr(q, "dtype", None))
    check_q(q, pages)
    plan = plan_for(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=pages.num_pages,
                    page_size=pages.page_size, device=pages.device, total_q=q.shape[0])  # fmt: skip
    return plan.run(q, pages, causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                    sinks=sinks, score_mod=score_mod, alibi_slopes=alibi_slopes, return_lse=return_lse,
                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip
