"""PyTorch's dialect: ``qkv.scaled_dot_product_attention``, a drop-in for ``F.scaled_dot_product_attention``.

Shape legend: ``N…`` leading (batch) dims, ``Hq`` query heads, ``H`` KV heads, ``L`` query
length, ``S`` key length, ``E`` query/key size, ``Ev`` value size.

Code moves over by changing an import: the same arguments, the same results, on qkv's
backends (a lazy causal mask, the fused kernels where they apply, a fused engine where
SDPA would build the mask). PyTorch's semantics are kept where they differ from
``qkv.attention``'s:

* ``is_causal`` is aligned **top-left** (query ``r`` sees keys ``c <= r``), as
  ``torch.ones(L, S).tril()``; qkv's own ``causal=True`` is bottom-right (a query at the end
  of a cache sees every key). Both agree when ``L == S``. With ``L < S`` no query sees the
  keys from ``L`` on: the call runs on the first ``L`` keys (their gradients are 0), the
  kernel's causal square.
* ``attn_mask`` is a bool mask (True = take part) or a float mask added to the scores;
  ``attn_mask`` with ``is_causal=True`` is an error, as in PyTorch.
* ``key`` and ``value`` broadcast along the leading dims of ``query``; grouped heads need
  ``enable_gqa=True``.
* A query whose keys are all masked gets zeros, as PyTorch's CPU kernels give.

Checked against ``F.scaled_dot_product_attention`` over masks, causal, scales, GQA,
broadcasting and dtypes in ``tests/test_torch_sdpa.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .functional import attention
from .masks import causal, offsets


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s call, on qkv: ``(N…, Hq, L, Ev)``."""
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise RuntimeError(
            f"The size of tensor a ({query.shape[-3]}) must match the size of tensor b ({key.shape[-3]}) at "
            f"non-singleton dimension {query.dim() - 3}; set enable_gqa=True for grouped-query attention"
        )
    lead = query.shape[:-3] if query.dim() >= 3 else ()
    if key.dim() == query.dim() and key.shape[:-3] != lead:  # PyTorch broadcasts K/V over the batch dims
        key = key.expand(*lead, *key.shape[-3:])
        value = value.expand(*lead, *value.shape[-3:])
    mask, bias = None, None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask: expected a bool or float tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        elif attn_mask.dtype.is_floating_point:
            bias = attn_mask
        else:
            raise TypeError(f"attn_mask: expected a bool or float tensor, got {attn_mask.dtype}")
    if is_causal:
        i, j = query.shape[-2], key.shape[-2]
        if 0 < i < j:  # top-left: no query sees the keys from i on; the kernel's causal square, those never read
            key, value, j = key[..., :i, :], value[..., :i, :], i
        mask = causal() if i == j else offsets(None, i - j)  # top-left: key c <= query r
    return attention(query, key, value, mask=mask, bias=bias, scale=scale, dropout=dropout_p)
