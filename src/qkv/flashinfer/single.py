"""FlashInfer's single-request calls: ``single_decode_with_kv_cache`` and ``single_prefill_with_kv_cache``.

Shape legend: ``n`` queries, ``h`` query heads, ``g`` KV heads (``h % g == 0``), ``j`` keys,
``d`` key size, ``e`` value size.

One request's contiguous keys and values are one page of ``j`` slots, read where they lie (a
view), and the call is :func:`.terms.run` over that one-page table: the terms (causal from the
bottom right, window, soft cap, ALiBi, Llama's RoPE, a custom mask) and the base-2 ``lse`` are
the batch wrappers', written once. Forward only, as FlashInfer's kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..paged.plan import PagedPlan
from .terms import check_layout, run, terms


def single_decode_with_kv_cache(q: Tensor, k: Tensor, v: Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False,
                                q_scale=None, k_scale=None, v_scale=None, window_left: int = -1,
                                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
                                return_lse: bool = False):  # fmt: skip
    """``out (h, e)``, or ``(out, lse (h,))``: one query ``q (h, d)`` standing after its ``j`` keys.

    ``k (j, g, d)``, ``v (j, g, e)`` (``kv_layout="HND"``: ``(g, j, d)``). The query sits at position
    ``j - 1``; ``use_tensor_cores`` picks FlashInfer's prefill kernel, which rounds the rotated q and k of
    ``"ROPE_LLAMA"`` to their dtype (its decode kernel keeps them in float32), and changes nothing else.
    """
    if not isinstance(q, Tensor) or q.dim() != 2:
        raise ValueError(f"q: expected (num_qo_heads, head_dim), got {_shape(q)}")
    t = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
             sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, rope_rounds=use_tensor_cores)
    out = _request(q[None], k, v, kv_layout, t, scales=(q_scale, k_scale, v_scale), return_lse=return_lse)
    return (out[0][0], out[1][0]) if return_lse else out[0]


def single_prefill_with_kv_cache(q: Tensor, k: Tensor, v: Tensor, scale_q=None, scale_k=None, scale_v=None,
                                 o_dtype=None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1,
                                 logits_soft_cap=None, rope_scale=None, rope_theta=None, backend: str = "auto",
                                 return_lse: bool = False, kv_cache_sf=None, k_scale=None, v_scale=None):  # fmt: skip
    """``out (n, h, e)``, or ``(out, lse (n, h))``: queries ``q (n, h, d)``, the last ``n`` of ``j`` positions.

    ``k (j, g, d)``, ``v (j, g, e)`` (``kv_layout="HND"``: ``(g, j, d)``). ``causal``: the bottom-right
    alignment (query ``t`` sees keys up to ``j - n + t``), ignored under a mask; ``custom_mask``: ``(n, j)``
    bools (True: may attend), or ``packed_custom_mask``, its bits as ``packbits(mask.view(-1),
    bitorder="little")``. ``use_fp16_qk_reduction`` (a faster, less precise CUDA reduction) and
    ``backend`` change nothing here; ``scale_q``, ``scale_k``, ``scale_v`` (FlashInfer's float8 q's
    per-head scales) and ``kv_cache_sf`` (its NVFP4 cache) are refused by name.
    """
    for name, x in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v), ("kv_cache_sf", kv_cache_sf)):
        if x is not None:
            raise NotImplementedError(f"{name}: FlashInfer's float8 query and NVFP4 cache scales are not supported; "
                                      "k_scale and v_scale (a float8 cache's calibration) are")  # fmt: skip
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected (qo_len, num_qo_heads, head_dim), got {_shape(q)}")
    t = dict(causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
             sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, custom_mask=custom_mask,
             packed_custom_mask=packed_custom_mask)
    return _request(q, k, v, kv_layout, t, scales=(None, k_scale, v_scale), return_lse=return_lse, o_dtype=o_dtype)


def _request(q: Tensor, k: Tensor, v: Tensor, kv_layout: str, term_kwargs: dict, *, scales: tuple, return_lse: bool,
             o_dtype=None):  # fmt: skip
    """The one request ``q (n, h, d)`` over its keys as one page of ``j`` slots; ``scales``: ``(q, k, v)``'s."""
    check_layout(kv_layout)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"{name}: expected (kv_len, num_kv_heads, dim) ({kv_layout}), got {_shape(x)}")
    axis = 0 if kv_layout == "NHD" else 1
    n, j = q.shape[0], k.shape[axis]
    if j == 0 or v.shape[axis] != j:
        raise ValueError(f"k, v: expected the same number of keys, at least one, got {k.shape[axis]} and {v.shape[axis]}")
    t = terms(mask_lengths=[n * j], **term_kwargs)
    if t.causal and j < n and t.mask is None:
        raise ValueError(f"When mask_mode is set to MaskMode::kCausal, kv_len must be greater than or equal to qo_len, "
                         f"got kv_len {j} and qo_len {n}")  # fmt: skip
    ints = functools.partial(torch.tensor, dtype=torch.int32)
    plan = PagedPlan.once(ints([0, n]), ints([0, 1]), ints([0]), ints([j]), num_pages=1, page_size=j, total_q=n,
                          device=k.device)  # fmt: skip
    q_scale, k_scale, v_scale = scales
    return run(plan, q, (k[None], v[None]), kv_layout, t, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
               return_lse=return_lse, o_dtype=o_dtype)  # fmt: skip


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


def _shape(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
