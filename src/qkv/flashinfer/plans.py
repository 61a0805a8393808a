"""What FlashInfer's wrappers share: a plan kept between ``plan`` and ``run``, its checks, and the refusals.

Shape legend: ``T`` query rows, ``h`` query heads, ``g`` KV heads, ``d`` key size, ``e`` value
size, ``R`` requests, ``P`` page size.

A plan is the page table copied when it is made (FlashInfer keeps a reference to index tensors
already on its device, and copies them into its buffers under CUDA graphs; a copy here lets a
caller refill theirs for the next step either way), the heads, head sizes and dtypes ``run`` must
be given (FlashInfer raises when ``q`` or the cache has another dtype than ``plan`` named), and the
terms (:mod:`.terms`). The table is checked when planned, and laid out by
:class:`qkv.paged.PagedPlan` at the first run, once the cache's page count is known, and kept for
the plan's other runs. FlashInfer's kernels also read a ``kv_indptr`` that does not start at 0
(the pages from ``kv_indices[kv_indptr[0]]`` on) and a last page of 0 entries (a request of
``pages - 1`` full ones): the plan rewrites both into the table's form.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import Tensor

from ..paged.pages import as_pages
from ..paged.plan import PagedPlan
from ..paged.table import page_table
from .terms import Terms, check_layout, expand_pages, run, terms


def dtype_of(x) -> torch.dtype:
    """FlashInfer's ``canonicalize_torch_dtype``: a ``torch.dtype`` or its name (``"float16"``)."""
    if isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and isinstance(getattr(torch, x, None), torch.dtype):
        return getattr(torch, x)
    raise TypeError(f"dtype: expected a torch.dtype or its name, got {x!r}")


def no_profiler(use_profiler) -> None:
    """FlashInfer's intra-kernel profiler (``use_profiler=True``) has no counterpart here: refused by name."""
    if use_profiler:
        raise NotImplementedError("use_profiler: FlashInfer's intra-kernel profiler times CUDA kernels; it has no CPU "
                                  "counterpart (leave it False)")  # fmt: skip


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
        h, g, d, e, page_size = (_size(name, n) for name, n in zip(
            ("num_qo_heads", "num_kv_heads", "head_dim", "head_dim_vo", "page_size"), (*heads, *dims, page_size)))  # fmt: skip
        if h % g:
            raise ValueError(f"num_kv_heads: expected a divisor of num_qo_heads ({h}), got {g}")
        for name, dtype in (("q_data_type", dtypes[0]), ("kv_data_type", dtypes[1])):
            if dtype.itemsize == 1 and (name == "q_data_type" or not dtype.is_floating_point):
                raise NotImplementedError(f"{name}: {dtype} is not supported (FlashInfer's float8 queries and NVFP4 "
                                          "caches); a float8 kv_data_type under a wider q is")  # fmt: skip
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        if len(qo) != len(kv):
            raise ValueError(f"qo_indptr, kv_indptr: expected one entry per request and one more, both, got {len(qo)} "
                             f"and {len(kv)}")  # fmt: skip
        kv_indices, kv, last = _from_zero(kv_indices.detach(), kv, last_page_len.tolist(), page_size)
        if kv_lens is None:
            kv_lens = [(b - a - 1) * page_size + n if b > a else 0 for a, b, n in zip(kv, kv[1:], last)]
        lengths = [(b - a) * n for a, b, n in zip(qo, qo[1:], kv_lens)]
        self.terms = terms(mask_lengths=lengths, **term_kwargs)
        longs = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        self._table = (longs(qo), longs(kv), kv_indices.clone(), longs(last))
        page_table(qo[-1] if qo else 0, 1 << 62, page_size, *self._table, kv_indices.device)  # its checks, now
        self.heads, self.dims, self.page_size, self.dtypes = (h, g), (d, e), page_size, dtypes
        self._plans: dict[int, PagedPlan] = {}

    def restate(self, **term_kwargs) -> None:
        """The plan's terms changed as FlashInfer's deprecated ``forward`` changes them: ``causal``, the scale, RoPE's
        scale and base, and the values of a soft cap or window the plan has. What FlashInfer's ``plan`` compiled into
        its kernel (the position encoding, whether a cap or a window is used), ``forward`` cannot change there (its
        kernel ignores the new one, or caps at 0): such a call is refused here."""
        given, planned = terms(**term_kwargs), self.terms
        if given.pos_encoding_mode != planned.pos_encoding_mode:
            raise ValueError(f"pos_encoding_mode: the plan's kernel uses {planned.pos_encoding_mode!r}; forward cannot "
                             f"change it to {given.pos_encoding_mode!r} (plan again)")  # fmt: skip
        if (given.logits_soft_cap > 0) != (planned.logits_soft_cap > 0):
            raise ValueError(f"logits_soft_cap: the plan's kernel {'caps' if planned.logits_soft_cap > 0 else 'has no cap'}"
                             f"; forward cannot switch the cap on or off (plan again), got {given.logits_soft_cap}")  # fmt: skip
        if given.window_left >= 0 and planned.window_left < 0:
            raise ValueError(f"window_left: the plan's kernel has no window; forward cannot add one (plan again), got "
                             f"{given.window_left}")  # fmt: skip
        self.terms = replace(given, mask=planned.mask, mask_start=planned.mask_start, rope_rounds=planned.rope_rounds)

    def run(self, q: Tensor, kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, window_left=None, sinks=None, terms: Terms | None = None):  # fmt: skip
        """The planned attention of ``q (T, h, d)`` over ``kv_cache``; FlashInfer's checks of ``q`` and the cache first.
        ``terms``: this run's, where a wrapper takes one at run (``BatchAttention``'s soft cap)."""
        if self._table is None:
            raise RuntimeError("run: call plan(...) first (FlashInfer's wrappers plan a step before running it)")
        if window_left is not None and window_left != self.terms.window_left:
            raise ValueError(f"window_left: run takes None or the plan's window_left ({self.terms.window_left}), "
                             f"got {window_left!r}")  # fmt: skip
        pages = as_pages(expand_pages(kv_cache, self.kv_layout), self.kv_layout, getattr(q, "dtype", None))
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
        return run(plan, q, pages, "NHD", self.terms if terms is None else terms, q_scale=q_scale, k_scale=k_scale,
                   v_scale=v_scale, sinks=sinks, out=out, lse=lse, return_lse=return_lse, o_dtype=o_dtype)  # fmt: skip


def _size(name: str, n) -> int:
    """A head count or size: an int, or what ``operator.index`` reads as one (numpy's ints, a 0-d integer tensor)."""
    try:
        value = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(n).__name__}") from None
    if isinstance(n, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {n!r}")
    return value


def _from_zero(kv_indices: Tensor, kv: list[int], last: list[int], P: int) -> tuple[Tensor, list[int], list[int]]:
    """The table read from ``kv_indptr[0]`` on, and a last page of 0 entries dropped (the request's full pages kept)."""
    if kv and kv[0] != 0:
        kv_indices, kv = kv_indices[kv[0] :], [b - kv[0] for b in kv]
    if not any(n == 0 and b > a for a, b, n in zip(kv, kv[1:], last)):
        return kv_indices, kv, last
    keep, counts, fixed = [], [], []
    for a, b, n in zip(kv, kv[1:], last):
        pages = b - a - 1 if n == 0 and b > a else b - a
        keep += range(a, a + pages)
        counts.append(pages)
        fixed.append(P if n == 0 and b > a else n)
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    return kv_indices[torch.tensor(keep, dtype=torch.long, device=kv_indices.device)], indptr, fixed


class Wrapper:
    """What FlashInfer's batch wrappers share: a :class:`Planned`, the CUDA-graph flag, and the workspace calls, which
    change nothing on a CPU; ``jit_args`` (a custom kernel's) is refused."""

    def __init__(self, kv_layout: str, use_cuda_graph: bool, jit_args=None, jit_kwargs=None):
        refuse(jit_args=jit_args, jit_kwargs=jit_kwargs)
        self._planned = Planned(kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer, *args) -> None:
        """FlashInfer's workspace buffers: nothing to reset on a CPU."""

    def run_return_lse(self, *args, **kwargs):
        """``run(..., return_lse=True)``."""
        return self.run(*args, **kwargs, return_lse=True)

    def begin_forward(self, *args, **kwargs) -> None:
        """FlashInfer's older name of ``plan``."""
        return self.plan(*args, **kwargs)

    def end_forward(self) -> None:
        """FlashInfer's older API: nothing to release."""
