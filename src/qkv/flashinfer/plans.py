"""What FlashInfer's wrappers share: a plan kept between ``plan`` and ``run``, its checks, and the refusals.

Shape legend: ``T`` query rows, ``h`` query heads, ``g`` KV heads, ``d`` key size, ``e`` value
size, ``R`` requests, ``P`` page size.

A plan is the page table copied when it is made (FlashInfer copies it into its own buffers, so a
caller may refill theirs for the next step), the heads, head sizes and dtypes ``run`` must be
given (FlashInfer raises when ``q`` or the cache has another dtype than ``plan`` named), and the
terms (:mod:`.terms`). The table itself is checked and laid out by :class:`qkv.paged.PagedPlan`
at the first run, once the cache's page count is known, and kept for the plan's other runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..paged.pages import as_pages
from ..paged.plan import PagedPlan
from .terms import Terms, check_layout, run, terms


def dtype_of(x) -> torch.dtype:
    """FlashInfer's ``canonicalize_torch_dtype``: a ``torch.dtype`` or its name (``"float16"``)."""
    if isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and isinstance(getattr(torch, x, None), torch.dtype):
        return getattr(torch, x)
    raise TypeError(f"dtype: expected a torch.dtype or its name, got {x!r}")


def refuse(**given) -> None:
    """Raise on each FlashInfer argument given a value that would change the result and that qkv does not implement."""
    for name, x in given.items():
        if x is not None:
            raise NotImplementedError(f"{name}: not supported by qkv's FlashInfer dialect (a CUDA kernel's option "
                                      "that changes the result); leave it unset")  # fmt: skip


class Planned:
    """A wrapper's plan: the table as planned, heads, sizes, dtypes and terms; :meth:`run` per layer."""

    def __init__(self, kv_layout: str):
        check_layout(kv_layout)
        self.kv_layout = kv_layout
        self._table = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *, heads, dims, page_size, dtypes,
             kv_lens: list[int] | None = None, **term_kwargs) -> None:  # fmt: skip
        """Keep a copy of the table and check the terms; ``kv_lens``: each request's keys, where the table has no pages
        to count them (the ragged wrapper's), else read from it."""
        tables = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        for name, x in zip(("qo_indptr", "kv_indptr", "kv_indices", "last_page_len"), tables):
            if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
                got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
                raise TypeError(f"{name}: expected a 1-d integer tensor, got {got}")
        (h, g), (d, e) = heads, dims
        if not all(isinstance(n, int) and n > 0 for n in (h, g, d, e, page_size)) or h % g:
            raise ValueError(f"num_qo_heads, num_kv_heads, head_dim, page_size: expected positive ints with num_kv_heads "
                             f"dividing num_qo_heads, got {h}, {g}, {(d, e)}, {page_size}")  # fmt: skip
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        if len(qo) != len(kv) or len(last_page_len) != len(qo) - 1:
            raise ValueError(f"qo_indptr, kv_indptr, last_page_len: expected R + 1, R + 1 and R entries, got "
                             f"{len(qo)}, {len(kv)} and {len(last_page_len)}")  # fmt: skip
        if kv_lens is None:
            last = last_page_len.tolist()
            kv_lens = [(b - a - 1) * page_size + n if b > a else 0 for a, b, n in zip(kv, kv[1:], last)]
        lengths = [(b - a) * n for a, b, n in zip(qo, qo[1:], kv_lens)]
        self.terms = terms(mask_lengths=lengths, **term_kwargs)
        self._table = tuple(x.detach().to("cpu", torch.int64, copy=True) for x in tables[:2]) + (
            kv_indices.detach().clone(), last_page_len.detach().to("cpu", torch.int64, copy=True))
        self.heads, self.dims, self.page_size, self.dtypes = heads, dims, page_size, dtypes
        self._plans: dict[int, PagedPlan] = {}

    def run(self, q: Tensor, kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, window_left=None, sinks=None, terms: Terms | None = None):  # fmt: skip
        """The planned attention of ``q (T, h, d)`` over ``kv_cache``; FlashInfer's checks of ``q`` and the cache first.
        ``terms``: this run's, where a wrapper takes one at run (``BatchAttention``'s soft cap)."""
        if self._table is None:
            raise RuntimeError("run: call plan(...) first (FlashInfer's wrappers plan a step before running it)")
        if window_left is not None and window_left != self.terms.window_left:
            raise ValueError(f"window_left: run takes None or the plan's window_left ({self.terms.window_left}), "
                             f"got {window_left!r}")  # fmt: skip
        pages = as_pages(kv_cache, self.kv_layout, getattr(q, "dtype", None))
        q_dtype, kv_dtype, o_dtype = self.dtypes
        if not isinstance(q, Tensor) or q.dim() != 3 or tuple(q.shape[1:]) != (self.heads[0], self.dims[0]):
            got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
            raise ValueError(f"q: expected (total_q, {self.heads[0]}, {self.dims[0]}) as planned, got {got}")
        if q.dtype != q_dtype:
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {q_dtype} specified in plan function.")
        if pages.keys.dtype != kv_dtype:
            raise ValueError(f"The dtype of k {pages.keys.dtype} does not match the kv_data_type {kv_dtype} specified in "
                             "plan function.")  # fmt: skip
        shape = (pages.page_size, pages.kv_heads, pages.head_dim, pages.value_dim)
        if shape != (self.page_size, self.heads[1], *self.dims):
            raise ValueError(f"paged_kv_cache: pages of {shape[0]} slots, {shape[1]} KV heads, key size {shape[2]} and "
                             f"value size {shape[3]}; the plan was made for {self.page_size}, {self.heads[1]}, "
                             f"{self.dims[0]} and {self.dims[1]}")  # fmt: skip
        plan = self._plans.get(pages.num_pages)
        if plan is None:
            plan = self._plans[pages.num_pages] = PagedPlan.once(*self._table, num_pages=pages.num_pages,
                                                                 page_size=self.page_size, device=pages.device)  # fmt: skip
        return run(plan, q, pages, "NHD", self.terms if terms is None else terms, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                   out=out, lse=lse, return_lse=return_lse, o_dtype=o_dtype)  # fmt: skip
