"""FlashInfer's cascade merges: attention states over disjoint key sets merged into the state over their union.

Shape legend: ``n`` rows, ``k`` states per row, ``h`` heads, ``d`` value size.

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

import torch
from torch import Tensor

from ..backends.tiling.lse import merge_all

_LN2 = math.log(2.0)


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
