"""FlashInfer's prefill wrappers: many requests' query chunks over a paged cache, or over ragged keys and values.

Shape legend: ``T`` query rows of all requests, ``n`` key rows of all requests (ragged), ``h``
query heads, ``g`` KV heads, ``d`` key size, ``e`` value size, ``P`` page size.

Request ``r``'s queries are rows ``qo_indptr[r] : qo_indptr[r + 1]``, the last ``qo_len`` of its
``kv_len`` positions; ``causal`` aligns them to the bottom right (FlashInfer's default is False),
and a ``custom_mask`` (each request's ``(qo_len, kv_len)`` bools flattened, one after another) or
its ``packed_custom_mask`` (``segment_packbits(..., bitorder="little")``'s bytes: what ``plan``
packs a ``custom_mask`` into, exactly that many) replaces it. FlashInfer's docstring names
``packbits`` (one stream) for the packed form, and its kernel starts a given packed mask's request
at the byte its bit offset names, which agrees with either layout for one request only: the
segment layout is the one its own ``plan`` makes, and the one read here. The ragged wrapper's keys ``k (n, g, d)`` are read as
pages of one slot where they lie (request ``r``'s rows ``kv_indptr[r] : kv_indptr[r + 1]``), so
both wrappers are one plan over :func:`.terms.run`. The ragged wrapper's ``q_scale``, ``k_scale`` and
``v_scale`` are applied as the paged wrapper's (FlashInfer reads them there only for an NVFP4 cache). Arguments that only pick a CUDA kernel or
buffer are taken and change nothing; those that would change the result and qkv does not do
are refused by name (see :mod:`.decode`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .plans import Wrapper, dtype_of, refuse


class BatchPrefillWithPagedKVCacheWrapper(Wrapper):
    """Prefill and append chunks of a batch over a paged KV cache, FlashInfer's wrapper."""

    def __init__(self, float_workspace_buffer: Tensor | None = None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None):  # fmt: skip
        super().__init__(kv_layout, use_cuda_graph, jit_args, jit_kwargs)

    def plan(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor, paged_kv_last_page_len: Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: int | None = None,
             custom_mask=None, packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
             block_tables=None, max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv: bool = False) -> None:  # fmt: skip
        """Plan the step: the table, heads and sizes, the terms and the dtypes ``run`` will be given."""
        _refuse_items(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        refuse(seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables)
        self._planned.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                           heads=(num_qo_heads, num_kv_heads), dims=(head_dim_qk, head_dim_vo or head_dim_qk),
                           page_size=page_size, dtypes=_dtypes(q_data_type, kv_data_type, o_data_type),
                           custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                           pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                           rope_theta=rope_theta)  # fmt: skip

    def _forward(self, q: Tensor, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                 use_fp16_qk_reduction: bool = False, k_scale=None, v_scale=None, window_left: int = -1,
                 logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, *, return_lse: bool = False):  # fmt: skip
        """FlashInfer's deprecated call: these terms replace the plan's (for later runs too), then :meth:`run`."""
        self._planned.restate(causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                              logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                              rope_theta=rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward = functools.partialmethod(_forward, return_lse=False)
    forward_return_lse = functools.partialmethod(_forward, return_lse=True)

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None):  # fmt: skip
        """``out (T, h, e)``, or ``(out, lse (T, h))`` (base 2) with ``return_lse``; the cache as the decode wrapper's."""
        refuse(args=args or None, kv_cache_sf=kv_cache_sf, uses_spcompress=uses_spcompress or None,
               skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)  # fmt: skip
        return self._planned.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                 lse=lse, return_lse=return_lse, window_left=window_left, sinks=sinks)  # fmt: skip


class BatchPrefillWithRaggedKVCacheWrapper(Wrapper):
    """Prefill chunks of a batch over keys and values packed one request after another, FlashInfer's wrapper."""

    def __init__(self, float_workspace_buffer: Tensor | None = None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None):  # fmt: skip
        if kv_layout != "NHD":
            raise NotImplementedError(f"kv_layout: the ragged wrapper's keys are read as (rows, num_kv_heads, dim), "
                                      f"'NHD'; got {kv_layout!r}")  # fmt: skip
        super().__init__(kv_layout, use_cuda_graph, jit_args, jit_kwargs)

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0, max_item_len_ptr=None,
             fixed_split_size=None, disable_split_kv: bool = False, seq_lens=None, seq_lens_q=None,
             max_token_per_sequence=None, max_sequence_kv=None, v_indptr=None, o_indptr=None) -> None:  # fmt: skip
        """Plan the step: ``qo_indptr`` and ``kv_indptr`` (row offsets of each request's queries and keys), the rest as the
        paged wrapper's."""
        _refuse_items(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        refuse(seq_lens=seq_lens, seq_lens_q=seq_lens_q, v_indptr=v_indptr, o_indptr=o_indptr)
        if not isinstance(kv_indptr, Tensor) or kv_indptr.dim() != 1:
            raise TypeError(f"kv_indptr: expected a 1-d integer tensor, got {type(kv_indptr).__name__}")
        bounds = kv_indptr.tolist()
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        self._rows = bounds[-1] if bounds else 0
        # each key row a page of one slot, read where it lies (kv_indices: the rows themselves)
        self._planned.plan(qo_indptr, kv_indptr, torch.arange(self._rows, device=kv_indptr.device),
                           torch.ones(len(lens), dtype=torch.int64), kv_lens=lens,
                           heads=(num_qo_heads, num_kv_heads), dims=(head_dim_qk, head_dim_vo or head_dim_qk),
                           page_size=1, dtypes=_dtypes(q_data_type, kv_data_type, o_data_type),
                           custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                           pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                           rope_theta=rope_theta)  # fmt: skip

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, pos_encoding_mode: str = "NONE",
                 use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None, sm_scale=None,
                 rope_scale=None, rope_theta=None, *, return_lse: bool = False):  # fmt: skip
        """FlashInfer's deprecated call: these terms replace the plan's (for later runs too), then :meth:`run`."""
        self._planned.restate(causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                              logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                              rope_theta=rope_theta)  # fmt: skip
        return self.run(q, k, v, return_lse=return_lse)

    forward = functools.partialmethod(_forward, return_lse=False)
    forward_return_lse = functools.partialmethod(_forward, return_lse=True)

    def run(self, q: Tensor, k: Tensor, v: Tensor, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
            out=None, lse=None, return_lse: bool = False, enable_pdl=None, kv_cache_sf=None):  # fmt: skip
        """``out (T, h, e)``, or ``(out, lse (T, h))`` (base 2): ``q (T, h, d)`` over ``k (n, g, d)``, ``v (n, g, e)``.
        ``o_scale`` (a float8 output's scale, read by FlashInfer's cutlass backend only) changes nothing."""
        refuse(args=args or None, kv_cache_sf=kv_cache_sf)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] < self._rows:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected (kv_indptr[-1] = {self._rows} or more rows, num_kv_heads, dim), got {got}")
        return self._planned.run(q, (k[:, None], v[:, None]), q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                 out=out, lse=lse, return_lse=return_lse)  # fmt: skip


def _dtypes(q_data_type, kv_data_type, o_data_type) -> tuple:
    return (dtype_of(q_data_type), dtype_of(kv_data_type or q_data_type),
            None if o_data_type is None else dtype_of(o_data_type))  # fmt: skip


def _refuse_items(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr) -> None:
    """FlashInfer's multi-item scoring (items after a shared prefix, each seeing only itself) is not supported."""
    refuse(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
           token_pos_in_items_len=token_pos_in_items_len or None, max_item_len_ptr=max_item_len_ptr)  # fmt: skip
