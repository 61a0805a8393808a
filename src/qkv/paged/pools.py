"""A ``qkv.PagedKVCache``'s pools, one per layer, made from its arguments; a float8 cache's calibration scales.

Shape legend: ``N`` pages, ``P`` page size, ``g`` KV heads, ``d`` head size, ``L`` layers.

Float8 pages hold ``k / k_scale`` and ``v / v_scale`` (vLLM's and FlashInfer's per-tensor
calibration): ``float8_e4m3fn`` has 3 mantissa bits and a range of ±448, so keys with larger
entries saturate and small ones fall into subnormals unless a scale (``max |k| / 448``,
measured on calibration data) brings them into range. The attention undoes the scales
(``sm_scale · k_scale``, ``out · v_scale``: :func:`qkv.paged_attention`'s ``k_scale``,
``v_scale``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._args import positive_int
from .options import calibration
from .pages import empty


def make(num_pages: int, page_size: int, kv_heads: int, head_dim: int, layers: int, value_dim: int | None,
         dtype: torch.dtype, device, quantized: bool, latent_dim: int | None) -> list:  # fmt: skip
    """Every layer's pool: float pages (keys and values in pools of their own), ``Int8Pages`` or ``LatentPages``."""
    positive_int("kv_heads", kv_heads)
    positive_int("head_dim", head_dim)
    if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:  # pages computed in it, not stored as it
        raise TypeError(f"dtype: expected a floating-point dtype (for int8 pages: quantized=True with the dtype "
                        f"they are read as), got {dtype}")  # fmt: skip
    if float8(dtype) and (quantized or latent_dim is not None):
        raise TypeError(f"dtype: {dtype} pages are FlashInfer's float8 cache of keys and values (read under a wider "
                        "q); quantized= (int8) and latent_dim= (MLA) pools take float16, bfloat16, float32 or "
                        "float64")  # fmt: skip
    if value_dim not in (None, head_dim):
        positive_int("value_dim", value_dim)
        if quantized or latent_dim is not None:
            raise ValueError(f"value_dim: int8 (quantized=True) and MLA (latent_dim=) pages hold values of the keys' size "
                             f"({head_dim}), got {value_dim}")  # fmt: skip
    if latent_dim is not None:  # MLA: one latent [c^KV; k^R] per token, its first latent_dim the value
        positive_int("latent_dim", latent_dim)
        if kv_heads != 1 or latent_dim > head_dim or quantized:
            raise ValueError(
                f"latent_dim: MLA pages hold one latent of head_dim = latent_dim + rope_dim per token (kv_heads=1, "
                f"not quantized), got kv_heads={kv_heads}, head_dim={head_dim}, latent_dim={latent_dim}, quantized={quantized}"
            )
        from .latent import empty as empty_latent

        return [empty_latent(num_pages, page_size, latent_dim, head_dim - latent_dim, dtype, device) for _ in range(layers)]
    if quantized:
        from .quant import Int8Pages

        return [Int8Pages(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    return [empty(num_pages, page_size, kv_heads, head_dim, dtype, device, value_dim) for _ in range(layers)]


def float8(dtype) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1


def scales(k_scale, v_scale, layers: int, dtype) -> list[tuple[float, float]] | None:
    """Each layer's ``(k_scale, v_scale)`` (1 where one is not given), or None without either.

    Each is a positive number for every layer, or ``layers`` of them (a sequence or a 1-d tensor)."""
    if k_scale is None and v_scale is None:
        return None
    if not float8(dtype):
        raise ValueError(f"k_scale, v_scale: calibration scales of a float8 cache (dtype=torch.float8_e4m3fn or "
                         f"float8_e5m2), got dtype={dtype}")  # fmt: skip
    ks, vs = _per_layer("k_scale", k_scale, layers), _per_layer("v_scale", v_scale, layers)
    return list(zip(ks, vs))


def _per_layer(name: str, x, layers: int) -> list[float]:
    """``x`` for each layer: one scale for all, or one per layer (a sequence or a 1-d tensor), each read as
    :func:`~.options.calibration` reads a call's, and positive (a token is stored divided by it)."""
    if x is None:
        return [1.0] * layers
    if isinstance(x, Tensor) and x.dim() > 1:
        raise TypeError(f"{name}: expected a number, or one per layer, got a tensor of shape {tuple(x.shape)}")
    many = isinstance(x, (list, tuple)) or (isinstance(x, Tensor) and x.dim() == 1)
    values = list(x) if many else [x] * layers
    if len(values) != layers:
        raise ValueError(f"{name}: expected a number, or one per layer ({layers}), got {len(values)}")
    values = [calibration(name, v) for v in values]
    if not all(v > 0 for v in values):
        raise ValueError(f"{name}: expected positive numbers (stored = value / scale), got {values}")
    return values
