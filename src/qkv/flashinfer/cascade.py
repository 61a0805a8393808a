"""FlashInfer's cascade merges: attention states over disjoint key sets merged into the state over their union.

Shape legend: ``n`` rows, ``k`` states per row, ``h`` heads, ``d`` value size.

``MultiLevelCascadeAttentionWrapper`` is FlashInfer's cascade of page tables, each level's wrapper
run and its state merged into the last level's, in place: a prefix shared by many requests sits
in one upper level's pages once, attended by all their queries as one request.

A state is an output ``v`` and its base-2 log-sum-exp ``s`` (FlashInfer's ``lse``); merging is
``s = log2 Σ 2^(s_k)``, ``v = Σ 2^(s_k - s) v_k``, exact (Milakov & Gimelshein 2018's rule, as
``qkv.merge``, which these call on ``s · ln 2``). The weights are computed in float32 (float64
for float64 states), the output rounded once to ``v``'s dtype; a state with ``s = -inf`` weighs 0,
and a row whose states are all ``-inf`` (or ``merge_states`` of no states) gives ``v = 0``,
``s = -inf``, as FlashInfer's kernels (``attention/cascade.cuh``); ``merge_states`` of one state
passes it through as it is. FlashInfer's ``s`` is float32 whatever its input; here float64 states
keep float64.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

from ..backends.tiling.lse import merge_all
from .prefill import BatchPrefillWithPagedKVCacheWrapper

_LN2 = math.log(2.0)


class MultiLevelCascadeAttentionWrapper:
    """FlashInfer's multi-level cascade over one paged cache: ``num_levels`` tables planned together, run per layer."""

    def __init__(self, num_levels: int, float_workspace_buffer: Tensor | None = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None):  # fmt: skip
        try:
            levels = operator.index(num_levels)  # (numpy's ints too, as FlashInfer's range() takes them)
        except TypeError:
            raise TypeError(f"num_levels: expected an int, got {type(num_levels).__name__}") from None
        if isinstance(num_levels, bool) or levels < 1:
            raise ValueError(f"num_levels: expected a positive int, got {levels}")
        self._levels = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph)
                        for _ in range(levels)]  # fmt: skip
        self._use_cuda_graph = bool(use_cuda_graph)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers, *args) -> None:
        """FlashInfer's workspace buffers: nothing to reset on a CPU."""

    def plan(self, qo_indptr_arr: list[Tensor], paged_kv_indptr_arr: list[Tensor], paged_kv_indices_arr: list[Tensor],
             paged_kv_last_page_len: list[Tensor], num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None) -> None:  # fmt: skip
        """Plan every level: level ``i``'s table from the ``i``-th tensor of each list; ``causal`` for the last level only."""
        arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        if any(not isinstance(a, (list, tuple)) or len(a) != len(self._levels) for a in arrays):
            raise ValueError(f"qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len: "
                             f"expected one tensor per level ({len(self._levels)}) in each")  # fmt: skip
        for i, (level, *table) in enumerate(zip(self._levels, *arrays)):
            level.plan(*table, num_qo_heads, num_kv_heads, head_dim, page_size,
                       causal=causal if i == len(self._levels) - 1 else False, pos_encoding_mode=pos_encoding_mode,
                       sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                       rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                       kv_data_type=kv_data_type)  # fmt: skip

    begin_forward = plan

    def run(self, q: Tensor, paged_kv_cache) -> Tensor:
        """``out (T, h, d)``: the last level's attention merged with every upper level's, by their ``lse``."""
        out, lse = self._levels[-1].run(q, paged_kv_cache, return_lse=True)
        for level in self._levels[:-1]:
            merge_state_in_place(out, lse, *level.run(q, paged_kv_cache, return_lse=True))
        return out

    forward = run

    def end_forward(self) -> None:
        """FlashInfer's older API: nothing to release."""


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(v (n, h, d), s (n, h))``: the states ``(v_a, s_a)`` and ``(v_b, s_b)`` of two key sets merged."""
    _check("v_a", v_a, "s_a", s_a)
    _check("v_b", v_b, "s_b", s_b, like=v_a)
    return _merge([v_a, v_b], [s_a, s_b], v_a.dtype)


def merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor, mask: Tensor | None = None) -> None:
    """``(v, s)`` becomes its merge with ``(v_other, s_other)``, in place; ``mask (n,)``: only the rows it marks."""
    _check("v", v, "s", s)
    _check("v_other", v_other, "s_other", s_other, like=v)
    merged, total = _merge([v, v_other], [s, s_other], v.dtype)
    if mask is not None:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != (v.shape[0],):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask: expected ({v.shape[0]},), one flag per row, got {got}")
        keep = mask.to(device=v.device, dtype=torch.bool)
        merged = torch.where(keep.view(-1, *[1] * (v.dim() - 1)), merged, v)
        total = torch.where(keep.view(-1, *[1] * (s.dim() - 1)), total.to(s.dtype), s)
    v.copy_(merged)
    s.copy_(total)


def merge_states(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """``(v (n, h, d), s (n, h))``: the ``k`` states of each row, ``v (n, k, h, d)``, ``s (n, k, h)``, merged."""
    if not isinstance(v, Tensor) or not isinstance(s, Tensor) or v.dim() != 4 or tuple(s.shape) != tuple(v.shape[:3]):
        got = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in (v, s)]
        raise ValueError(f"v, s: expected (seq_len, num_states, num_heads, head_dim) and (seq_len, num_states, num_heads), "
                         f"got {got[0]} and {got[1]}")  # fmt: skip
    if v.shape[1] == 0:
        return v.new_zeros(v.shape[0], v.shape[2], v.shape[3]), s.new_full((s.shape[0], s.shape[2]), float("-inf"),
                                                                           dtype=_lse_dtype(s))  # fmt: skip
    if v.shape[1] == 1:  # one state is the merge: passed through as it is, a row without keys too (cascade.cuh)
        return v[:, 0].clone(), s[:, 0].to(_lse_dtype(s))
    return _merge(list(v.unbind(1)), list(s.unbind(1)), v.dtype)


def _merge(vs: list[Tensor], ss: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    lse_dtype = _lse_dtype(ss[0])
    out, lse = merge_all(vs, [x.to(lse_dtype) * _LN2 for x in ss])
    return out.to(dtype), lse / _LN2


def _lse_dtype(s: Tensor) -> torch.dtype:
    return torch.promote_types(s.dtype, torch.float32)


def _check(v_name: str, v, s_name: str, s, like: Tensor | None = None) -> None:
    if not isinstance(v, Tensor) or not isinstance(s, Tensor):
        raise TypeError(f"{v_name}, {s_name}: expected tensors, got {type(v).__name__} and {type(s).__name__}")
    if v.dim() < 2 or tuple(s.shape) != tuple(v.shape[:-1]) or (like is not None and v.shape != like.shape):
        want = f"{tuple(like.shape)} and {tuple(like.shape[:-1])}" if like is not None else "(seq_len, num_heads, head_dim) and (seq_len, num_heads)"
        raise ValueError(f"{v_name}, {s_name}: expected {want}, got {tuple(v.shape)} and {tuple(s.shape)}")
