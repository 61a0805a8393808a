"""``qkv.paged.PagedPlan``: a page table checked and laid out once, run for every layer of a step.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads, ``d`` key
size, ``e`` value size, ``P`` page size.

FlashInfer splits a batch's attention into ``plan`` (the page table, on the host, once per
step) and ``run`` (per layer, on that layer's cache). A model's layers share one step's
table, so what it alone decides (the checks, which rows are decoding steps, shared prefixes,
the items and where they are read, the masks of unfilled slots) is worked out at the first
run and kept: the later layers pay only for their own keys and values.
``qkv.paged_attention`` is one plan run once; ``qkv.PagedKVCache``'s steps keep theirs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from ..backends.tiling.sinks import with_sinks
from .options import calibration, options
from .pages import as_pages
from .route import run as route
from .table import page_table


class PagedPlan:
    """FlashInfer's page table for one step: ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``
    over a pool of ``num_pages`` pages of ``page_size`` (see :func:`qkv.paged_attention`).

    The plan is the table as it is when the plan is made: the offsets and lengths are read then,
    and ``kv_indices`` is copied where it would otherwise be the caller's own buffer (an int64
    tensor on the cache's device), so a buffer the caller refills for the next step does not
    change this step's plan (every run reads the pages the plan named; a new table needs a new
    plan, as FlashInfer's ``plan``).
    """

    def __init__(self, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_last_page_len: Tensor, *,
                 num_pages: int, page_size: int, device="cpu", total_q: int | None = None):  # fmt: skip
        self._setup(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, device, total_q)
        indices = self.table.indices
        if isinstance(kv_indices, Tensor) and indices.numel() and (
                indices.untyped_storage().data_ptr() == kv_indices.untyped_storage().data_ptr()):  # fmt: skip
            self.table = replace(self.table, indices=indices.clone())

    @classmethod
    def once(cls, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_last_page_len: Tensor, *,
             num_pages: int, page_size: int, device="cpu", total_q: int | None = None) -> PagedPlan:  # fmt: skip
        """A plan over the index tensors as they are, not copied: for a caller that runs it before they can change
        (:func:`qkv.paged_attention`) or owns them (``qkv.PagedKVCache``'s steps)."""
        plan = cls.__new__(cls)
        plan._setup(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, device, total_q)
        return plan

    @classmethod
    def over_copy(cls, plan: PagedPlan) -> PagedPlan:
        """``plan``'s requests over a copy of the pages its table names, entry ``n`` of the table at page ``n``
        (``pages.take(plan.table.indices)``): the table already checked, only its page ids renumbered."""
        table = plan.table
        copy = cls.__new__(cls)
        copy.table = replace(table, indices=torch.arange(table.indices.numel(), device=table.indices.device))
        copy.total_q, copy.num_pages, copy.page_size = plan.total_q, table.indices.numel(), plan.page_size
        copy.memo = {}
        return copy

    def _setup(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int, device,
               total_q: int | None) -> None:  # fmt: skip
        if total_q is None:
            last = qo_indptr[-1:].tolist() if isinstance(qo_indptr, Tensor) else []
            total_q = int(last[0]) if last else 0
        self.table = page_table(total_q, num_pages, page_size, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                torch.device(device))  # fmt: skip
        self.total_q, self.num_pages, self.page_size = total_q, num_pages, page_size
        self.memo: dict = {}  # what the table alone decides, filled by the first run that needs it

    def run(self, q: Tensor, kv_cache, *, causal: bool = True, window_left: int = -1, logits_soft_cap: float = 0.0,
            sm_scale: float | None = None, sinks: Tensor | None = None, score_mod: Callable | None = None,
            alibi_slopes: Tensor | None = None, return_lse: bool = False, kv_layout: str = "NHD",
            k_scale: float | None = None, v_scale: float | None = None):  # fmt: skip
        """``out (T, h, e)``, or ``(out, lse (T, h))``: the attention of each request over its pages in ``kv_cache``
        (the arguments of :func:`qkv.paged_attention`)."""
        pages = as_pages(kv_cache, kv_layout, getattr(q, "dtype", None))
        check_q(q, pages)
        if q.shape[0] != self.total_q:
            raise ValueError(f"q: {q.shape[0]} query rows but the plan's qo_indptr ends at {self.total_q}")
        if (pages.num_pages, pages.page_size) != (self.num_pages, self.page_size):
            raise ValueError(f"kv_cache: {pages.num_pages} pages of {pages.page_size} but the plan was made for "
                             f"{self.num_pages} pages of {self.page_size}")  # fmt: skip
        if pages.device != self.table.indices.device:
            raise ValueError(f"kv_cache is on {pages.device} but the plan was made for {self.table.indices.device}")
        opts = options(q, causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                       alibi_slopes=alibi_slopes, score_mod=score_mod, k_scale=k_scale)  # fmt: skip
        sinks = _check_sinks(sinks, q.shape[1])
        v_scale = calibration("v_scale", v_scale)

        def forward() -> tuple[Tensor, Tensor]:
            out, lse = route(q, self.table, self.memo, pages, opts, want_lse=return_lse or sinks is not None)
            if sinks is not None:  # (rows are (T, h): the merge's (h, T) view)
                merged, total = with_sinks(out.to(lse.dtype).transpose(0, 1), lse.T, sinks)
                out, lse = merged.transpose(0, 1).to(out.dtype), total.T
            if v_scale is not None:  # FlashInfer scales the output after its kernel; the lse is not scaled
                out = (out.to(torch.promote_types(out.dtype, torch.float32)) * v_scale).to(out.dtype)
            return out, lse

        tracked = _tracked(q, pages, sinks, alibi_slopes)
        out, lse = _ForwardOnly.apply(forward, *tracked) if tracked else forward()
        return (out, lse) if return_lse else out


def _tracked(q: Tensor, pages, *more) -> list[Tensor]:
    """The call's tensors that autograd records (grad enabled, ``requires_grad``): none in serving, under no_grad."""
    if not torch.is_grad_enabled():
        return []
    tensors = [q, *(x for x in vars(pages).values() if isinstance(x, Tensor)), *more]
    return [x for x in tensors if isinstance(x, Tensor) and x.requires_grad]


class _ForwardOnly(torch.autograd.Function):
    """The paged call's outputs in autograd's graph, with a backward that refuses.

    Paged attention has no backward, as FlashInfer's paged kernels have none: the decoding
    pass merges items by a log-sum-exp that PyTorch's fused kernel does not differentiate, so
    the gradients autograd would find are wrong. A forward with gradients enabled (a model
    evaluated without ``no_grad``) still runs; a backward through it raises instead of giving
    wrong numbers.
    """

    @staticmethod
    def forward(ctx, run, *tracked):  # autograd runs it without recording: the pass is not kept
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("paged attention (paged_attention, paged_latent_attention, PagedKVCache) has no backward, "
                           "as FlashInfer's paged kernels have none: run it under "
                           "torch.no_grad(), as serving does; to train, attend over contiguous keys with "
                           "qkv.attention or qkv.varlen_attention")  # fmt: skip


def check_q(q: Tensor, pages) -> None:
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
    if q.dtype != pages.dtype:
        raise TypeError(f"q: dtype {q.dtype} but kv_cache computes in {pages.dtype}; give q the cache's dtype")


def _check_sinks(sinks, h: int) -> Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (h,):
        got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a tensor of shape ({h},), one logit per query head, got {got}")
    return sinks
