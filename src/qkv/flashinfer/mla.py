"""FlashInfer's ``BatchMLAPagedAttentionWrapper``: multi-head latent attention over its two MLA page pools, plan then run.

Shape legend: ``T`` query rows of all requests, ``h`` heads, ``c`` latent size
(``head_dim_ckv``), ``r`` rotary size (``head_dim_kpe``, 0 for NoPE MLA), ``N`` pages, ``P`` page
size.

``plan`` takes the step's table (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr``:
request ``r``'s keys are the first ``kv_len_arr[r]`` slots of its pages), the sizes, ``causal``
and ``sm_scale`` (MLA's ``1/√(head size before absorption)``); ``run`` takes a layer's absorbed
queries ``q_nope (T, h, c)``, ``q_pe (T, h, r)`` and caches ``ckv_cache (N, P, c)``, ``kpe_cache
(N, P, r)`` and gives ``out (T, h, c)``, and with ``return_lse`` the base-2 ``lse (T, h)``
(``return_lse_base_on_e=True``: natural). It runs ``qkv.paged_latent_attention``. FlashInfer's
CUDA kernels take float16 and bfloat16 latents (float8 on Hopper); here float32 and float64 too,
and float8 latents are refused, as are the cutlass backend's ``kv_len``, ``page_table`` and
``o_scale`` and the float8 cache's scales.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..paged.latent import paged_latent_attention
from .plans import dtype_of, no_profiler, refuse
from .terms import into


class BatchMLAPagedAttentionWrapper:
    """MLA decoding and prefill over paged latents, FlashInfer's wrapper."""

    def __init__(self, float_workspace_buffer: Tensor | None = None, use_cuda_graph: bool = False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend: str = "auto"):  # fmt: skip
        if backend == "cutlass":
            raise NotImplementedError("backend: 'cutlass' (its kv_len and page_table form) is not supported; the "
                                      "default plan and run are")  # fmt: skip
        self._use_cuda_graph = bool(use_cuda_graph)
        self._table = None

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_len_arr: Tensor, num_heads: int,
             head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_data_type,
             kv_data_type, use_profiler: bool = False) -> None:  # fmt: skip
        """Plan the step: the table (copied), heads and sizes, ``causal``, ``sm_scale`` and the dtypes ``run`` takes."""
        no_profiler(use_profiler)
        if head_dim_kpe < 0:
            raise ValueError(f"head_dim_kpe must be >= 0, got {head_dim_kpe}.")
        tables = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        for name, x in zip(("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"), tables):
            if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
                got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
                raise TypeError(f"{name}: expected a 1-d integer tensor, got {got}")
        self._table = tuple(x.detach().clone() for x in tables)
        self._sizes = (num_heads, head_dim_ckv, head_dim_kpe, page_size)
        self._causal, self._sm_scale = causal, sm_scale
        self._dtypes = (dtype_of(q_data_type), dtype_of(kv_data_type))

    def run(self, q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, kpe_cache: Tensor, out: Tensor | None = None,
            lse: Tensor | None = None, return_lse: bool = False, profiler_buffer=None, kv_len=None, page_table=None,
            return_lse_base_on_e: bool = False, o_scale=None, ckv_scale=None, ckv_scale_arr=None,
            kpe_scale=None):  # fmt: skip
        """``out (T, h, c)``, or ``(out, lse (T, h))``: each request's absorbed queries over its latents."""
        refuse(profiler_buffer=profiler_buffer, kv_len=kv_len, page_table=page_table, o_scale=o_scale,
               ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale)  # fmt: skip
        if self._table is None:
            raise RuntimeError("run: call plan(...) first (FlashInfer's wrappers plan a step before running it)")
        q_dtype, kv_dtype = self._dtypes
        for name, x, want, what in (("q_nope", q_nope, q_dtype, "q_data_type"), ("q_pe", q_pe, q_dtype, "q_data_type"),
                                    ("ckv_cache", ckv_cache, kv_dtype, "kv_data_type"),
                                    ("kpe_cache", kpe_cache, kv_dtype, "kv_data_type")):  # fmt: skip
            if isinstance(x, Tensor) and x.dtype != want:
                raise ValueError(f"{name}.dtype={x.dtype} does not match the planned {what}={want}.")
        h, c, r, P = self._sizes
        if isinstance(q_nope, Tensor) and q_nope.dim() == 3 and q_nope.shape[1] != h:
            raise ValueError(f"q_nope: {q_nope.shape[1]} heads, the plan was made for num_heads = {h}")
        if isinstance(ckv_cache, Tensor) and isinstance(kpe_cache, Tensor) and (
                ckv_cache.dim() != 3 or kpe_cache.dim() != 3 or (ckv_cache.shape[1:], kpe_cache.shape[1:]) != ((P, c), (P, r))):  # fmt: skip
            raise ValueError(f"ckv_cache, kpe_cache: expected (num_pages, {P}, {c}) and (num_pages, {P}, {r}) as planned, "
                             f"got {tuple(ckv_cache.shape)} and {tuple(kpe_cache.shape)}")  # fmt: skip
        result, natural = paged_latent_attention(q_nope, q_pe, ckv_cache, kpe_cache, *self._table, sm_scale=self._sm_scale,
                                                 causal=self._causal, return_lse=True)  # fmt: skip
        result = into("out", out, result)
        if not return_lse:
            return result
        return result, into("lse", lse, natural if return_lse_base_on_e else natural / math.log(2.0))
