"""FlashInfer's ``BatchAttention``: prefill chunks and decoding steps of a batch over a paged cache, one plan, one run.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads, ``d`` key
size, ``e`` value size, ``P`` page size.

FlashInfer's holistic wrapper: ``plan`` takes the table with each request's key count
(``kv_len_arr``; request ``r``'s keys are the first ``kv_len_arr[r]`` slots of its pages) instead
of the last page's fill, and ``run`` always returns ``(out, lse)``, the base-2 ``lse``. The soft
cap is ``run``'s (FlashInfer's ``plan`` only says whether one is used: a cap at run needs one at
plan); a plan made with a cap and run without one is refused here, where FlashInfer's kernel would
divide by it. ``out`` is ``(T, h, head_dim_vo)``, where FlashInfer allocates it like ``q`` (which holds it only when
the two sizes agree). Otherwise as :mod:`.prefill`'s wrappers, on the same plan (:mod:`.plans`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..paged.table import by_lengths
from .plans import Planned, dtype_of, no_profiler, refuse
from .terms import terms


class BatchAttention:
    """A mixed batch of prefill chunks and decoding steps, FlashInfer's holistic wrapper (``kv_layout`` ``"NHD"`` or
    ``"HND"``; ``device`` names where FlashInfer keeps its workspace, and changes nothing here)."""

    def __init__(self, kv_layout: str = "NHD", device: str = "cuda"):
        self._planned = Planned(kv_layout)
        self._cap = None

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_len_arr: Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool = False,
             sm_scale=None, logits_soft_cap=None, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
             use_profiler: bool = False) -> None:  # fmt: skip
        """Plan the step: the table with each request's key count, heads and sizes, ``causal``, scale, dtypes."""
        no_profiler(use_profiler)
        if head_dim_qk > 256 or head_dim_vo > 256:
            raise ValueError(f"BatchAttention (holistic persistent kernel) does not support head_dim > 256 (got "
                             f"head_dim_qk={head_dim_qk}, head_dim_vo={head_dim_vo}).")  # fmt: skip
        kv_indptr, kv_indices, last = by_lengths(kv_indptr, kv_indices, kv_len_arr, page_size, "kv_len_arr")
        self._cap = 0.0 if logits_soft_cap is None else logits_soft_cap
        self._planned.plan(qo_indptr, kv_indptr, kv_indices, last, heads=(num_qo_heads, num_kv_heads),
                           dims=(head_dim_qk, head_dim_vo), page_size=page_size,
                           dtypes=(dtype_of(q_data_type), dtype_of(kv_data_type), None), causal=causal,
                           sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)  # fmt: skip

    def run(self, q: Tensor, kv_cache, out: Tensor | None = None, lse: Tensor | None = None, k_scale=None, v_scale=None,
            logits_soft_cap: float = 0.0, profiler_buffer=None, kv_cache_sf=None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(out (T, h, e), lse (T, h))``, base 2: each request's queries over its pages; ``logits_soft_cap``: the cap."""
        refuse(profiler_buffer=profiler_buffer, kv_cache_sf=kv_cache_sf)
        if self._cap is None:
            raise RuntimeError("run: call plan(...) first (FlashInfer's wrappers plan a step before running it)")
        if logits_soft_cap > 0.0 and self._cap <= 0.0:
            raise ValueError("logits_soft_cap used in kernel run but not provided in plan(). This will cause template "
                             "deduction error.")  # fmt: skip
        if self._cap > 0.0 and not logits_soft_cap > 0.0:
            raise ValueError(f"logits_soft_cap: the plan was made with a soft cap ({self._cap}); pass run its cap too "
                             "(FlashInfer's kernel would divide by 0)")  # fmt: skip
        planned = self._planned.terms
        at_run = terms(causal=planned.causal, sm_scale=planned.sm_scale, logits_soft_cap=logits_soft_cap or None)
        return self._planned.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True,
                                 terms=at_run)  # fmt: skip
