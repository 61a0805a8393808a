"""FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``: one new token per request over a paged cache, plan then run.

Shape legend: ``B`` requests, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``P`` page size.

``plan`` takes the step's page table (``indptr``, ``indices``, ``last_page_len``) and the terms;
``run`` takes each layer's ``q (B, h, d)`` and cache and gives ``out (B, h, d)`` (and FlashInfer's
base-2 ``lse (B, h)``). The table is checked and laid out once per plan, at the first run
(:class:`qkv.paged.PagedPlan`): the later layers of a step pay only for their own keys. Request
``b``'s query stands after its ``kv_len`` keys (position ``kv_len - 1``). ``run(sinks=...)`` is applied as
FlashInfer documents it (one logit per head, in the logits' units, joining each row's softmax and its
``lse``); FlashInfer's default CUDA-core and fa2 kernels leave sinks out, its trtllm-gen and
cute-dsl backends apply them.

What selects a CUDA kernel or buffer (``float_workspace_buffer``, ``use_cuda_graph`` and its
buffers, ``use_tensor_cores``, ``backend``, ``non_blocking``, ``fixed_split_size``,
``disable_split_kv``, ``enable_pdl``) is taken and changes nothing here; what would change the
result and qkv does not do (a custom kernel's ``jit_args`` or extra run arguments, ``block_tables``,
``window_right != 0``, NVFP4 caches, skip-softmax sparsity) is refused by name.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .plans import Wrapper, dtype_of, refuse

#: ``plan``'s arguments after ``page_size`` that FlashInfer still takes by position (with a deprecation warning).
_LEGACY_POSITIONAL = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                      "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                      "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")  # fmt: skip


class BatchDecodeWithPagedKVCacheWrapper(Wrapper):
    """Decoding steps of a batch over a paged KV cache, FlashInfer's wrapper (``kv_layout`` ``"NHD"`` or ``"HND"``)."""

    def __init__(self, float_workspace_buffer: Tensor | None = None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None, jit_kwargs=None):  # fmt: skip
        super().__init__(kv_layout, use_cuda_graph, jit_args, jit_kwargs)
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *legacy, **kwargs) -> None:
        """Plan the step: the table, the heads, the terms and the dtypes ``run`` will be given (keywords as FlashInfer's;
        the ones after ``page_size`` also by position, deprecated there, with its warning)."""
        if legacy:
            if len(legacy) > len(_LEGACY_POSITIONAL):
                raise TypeError(f"BatchDecodeWithPagedKVCacheWrapper.plan() accepts at most {len(_LEGACY_POSITIONAL)} "
                                f"deprecated optional positional arguments after page_size; got {len(legacy)}")  # fmt: skip
            for name, value in zip(_LEGACY_POSITIONAL, legacy):
                if name in kwargs:
                    raise TypeError(f"BatchDecodeWithPagedKVCacheWrapper.plan() got multiple values for argument {name!r}")
                kwargs[name] = value
            warnings.warn("Passing optional arguments to BatchDecodeWithPagedKVCacheWrapper.plan() positionally is "
                          "deprecated; pass them as keyword arguments instead.", DeprecationWarning, stacklevel=2)  # fmt: skip
        self._plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)

    def _plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE", window_left: int = -1,
             window_right: int = 0, logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking: bool = True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv: bool = False, q_len_per_req: int = 1) -> None:  # fmt: skip
        """``data_type`` (deprecated in FlashInfer) fills ``q_data_type`` and ``kv_data_type`` where they are None, as
        FlashInfer's: ``q_data_type`` defaults to float16, so alone it sets the cache's dtype."""
        refuse(block_tables=block_tables, seq_lens=seq_lens)
        if window_right != 0:
            raise NotImplementedError(f"window_right: only 0 (keys up to the query) is supported, got {window_right!r}")
        if q_len_per_req != 1:
            raise NotImplementedError(f"q_len_per_req: one query per request here (BatchPrefillWithPagedKVCacheWrapper "
                                      f"takes any number), got {q_len_per_req!r}")  # fmt: skip
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        batch = _length("indptr", indptr) - 1
        self._planned.plan(torch.arange(batch + 1, dtype=torch.int32), indptr, indices, last_page_len,
                           heads=(num_qo_heads, num_kv_heads), dims=(head_dim, head_dim), page_size=page_size,
                           dtypes=(dtype_of(q_data_type), dtype_of(kv_data_type or q_data_type),
                                   None if o_data_type is None else dtype_of(o_data_type)),
                           causal=False, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                           rope_theta=rope_theta, rope_rounds=self._use_tensor_cores)  # fmt: skip

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):  # fmt: skip
        """``out (B, h, d)``, or ``(out, lse (B, h))`` with ``return_lse``: each request's query over its pages.

        ``paged_kv_cache``: ``(num_pages, 2, P, g, d)`` or ``(k_cache, v_cache)`` of ``(num_pages, P, g, d)``
        (``"HND"``: ``P`` and ``g`` swapped); ``sinks (h,)``: a logit per head joining each row's softmax;
        ``q_scale``, ``k_scale`` multiply ``sm_scale``, ``v_scale`` the output; ``out`` and ``lse``: tensors to
        write into. ``window_left`` must be None or the plan's.
        """
        refuse(args=args or None, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
               kv_cache_sf=kv_cache_sf)  # fmt: skip
        if q_len_per_req not in (None, 1):
            raise NotImplementedError(f"q_len_per_req: one query per request here, got {q_len_per_req!r}")
        return self._planned.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                 lse=lse, return_lse=return_lse, window_left=window_left, sinks=sinks)  # fmt: skip


    def _forward(self, q: Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None,
                 v_scale=None, window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                 rope_theta=None, *, return_lse: bool = False):  # fmt: skip
        """FlashInfer's deprecated call: these terms replace the plan's (for later runs too), then :meth:`run`."""
        self._planned.restate(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                              logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                              rope_theta=rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward = functools.partialmethod(_forward, return_lse=False)
    forward_return_lse = functools.partialmethod(_forward, return_lse=True)


def _length(name: str, x) -> int:
    if not isinstance(x, Tensor) or x.dim() != 1:
        raise TypeError(f"{name}: expected a 1-d integer tensor, got {type(x).__name__}")
    return x.shape[0]
