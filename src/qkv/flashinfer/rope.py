"""FlashInfer's rotary embeddings (``flashinfer.rope``): queries and keys of a ragged batch rotated at their positions.

Shape legend: ``n`` rows of all requests, ``h`` query heads, ``g`` key heads, ``d`` head size,
``r`` rotated dims (``rotary_dim``, the first ``r`` of each head; default ``d``), ``B`` requests.

Row ``i`` of request ``b`` (rows ``indptr[b] : indptr[b + 1]``) stands at ``offsets[b] + i -
indptr[b]`` (``apply_rope``), or at ``pos_ids[i]`` (``apply_rope_pos_ids``). Its pair ``k`` of the
first ``r`` dims — ``(k, k + r/2)``, or ``(2k, 2k + 1)`` with ``interleave`` — turns by
``position · θ^(-2k/r) / rope_scale`` (``θ = rope_theta``); the ``llama31`` forms use Llama 3.1's
frequencies (``qkv.positional.rope_scaling``'s ``"llama3"``: unscaled above ``old_context_len /
high_freq_factor`` wavelengths, divided by ``rope_scale`` below ``old_context_len /
low_freq_factor``, blended between, as FlashInfer's kernel clamps it). The ``cos_sin_cache``
forms (vLLM's and SGLang's) read ``cos | sin`` rows ``(max_position, r)`` at ``positions``;
``is_neox`` pairs the halves, else neighbours. Computed in float32 (float64 for float64
inputs), rounded to the inputs' dtype; the ``_inplace`` forms write ``q`` and ``k`` back.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from ..positional.rope_scaling import DEFAULT, frequencies
from ..positional.rotary import rotate_pairs


def apply_rope(q: Tensor, k: Tensor, indptr: Tensor, offsets: Tensor, rotary_dim: int | None = None,
               interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(q_rope (n, h, d), k_rope (n, g, d))``: each request's rows rotated from its offset on."""
    theta = _theta(q, rotary_dim, rope_theta, rope_scale)
    return _rotate(q, k, _ragged_positions(indptr, offsets, q), rotary_dim, interleave, theta)


def apply_rope_inplace(q: Tensor, k: Tensor, indptr: Tensor, offsets: Tensor, rotary_dim: int | None = None,
                       interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4) -> None:  # fmt: skip
    """:func:`apply_rope` written into ``q`` and ``k``."""
    _write(q, k, apply_rope(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta))


def apply_rope_pos_ids(q: Tensor, k: Tensor, pos_ids: Tensor, rotary_dim: int | None = None, interleave: bool = False,
                       rope_scale: float = 1, rope_theta: float = 1e4) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(q_rope, k_rope)``: row ``i`` rotated at ``pos_ids[i]``."""
    return _rotate(q, k, _positions(pos_ids, q), rotary_dim, interleave, _theta(q, rotary_dim, rope_theta, rope_scale))


def apply_rope_pos_ids_inplace(q: Tensor, k: Tensor, pos_ids: Tensor, rotary_dim: int | None = None,
                               interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4) -> None:  # fmt: skip
    """:func:`apply_rope_pos_ids` written into ``q`` and ``k``."""
    _write(q, k, apply_rope_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta))


def apply_llama31_rope(q: Tensor, k: Tensor, indptr: Tensor, offsets: Tensor, rotary_dim: int | None = None,
                       interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5,
                       low_freq_factor: float = 1, high_freq_factor: float = 4,
                       old_context_len: int = 8192) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`apply_rope` with Llama 3.1's frequencies."""
    theta = _llama31(q, rotary_dim, rope_theta, rope_scale, low_freq_factor, high_freq_factor, old_context_len)
    return _rotate(q, k, _ragged_positions(indptr, offsets, q), rotary_dim, interleave, theta)


def apply_llama31_rope_inplace(q: Tensor, k: Tensor, indptr: Tensor, offsets: Tensor, rotary_dim: int | None = None,
                               interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5,
                               low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192) -> None:  # fmt: skip
    """:func:`apply_llama31_rope` written into ``q`` and ``k``."""
    _write(q, k, apply_llama31_rope(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
                                    low_freq_factor, high_freq_factor, old_context_len))  # fmt: skip


def apply_llama31_rope_pos_ids(q: Tensor, k: Tensor, pos_ids: Tensor, rotary_dim: int | None = None,
                               interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5,
                               low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`apply_rope_pos_ids` with Llama 3.1's frequencies."""
    theta = _llama31(q, rotary_dim, rope_theta, rope_scale, low_freq_factor, high_freq_factor, old_context_len)
    return _rotate(q, k, _positions(pos_ids, q), rotary_dim, interleave, theta)


def apply_llama31_rope_pos_ids_inplace(q: Tensor, k: Tensor, pos_ids: Tensor, rotary_dim: int | None = None,
                                       interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5,
                                       low_freq_factor: float = 1, high_freq_factor: float = 4,
                                       old_context_len: int = 8192) -> None:  # fmt: skip
    """:func:`apply_llama31_rope_pos_ids` written into ``q`` and ``k``."""
    _write(q, k, apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
                                            low_freq_factor, high_freq_factor, old_context_len))  # fmt: skip


def apply_rope_with_cos_sin_cache(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                                  is_neox: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(query_out, key_out)`` in the inputs' shapes: ``query (n, h · head_size)``, ``key (n, g · head_size)`` (or
    3-d) rotated by ``cos_sin_cache (max_position, r)`` (float32, ``cos | sin``) at ``positions (n,)``."""
    if not isinstance(cos_sin_cache, Tensor) or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2:
        raise ValueError("cos_sin_cache should be float32")
    r = cos_sin_cache.shape[1]
    if r % 2 or not 0 < r <= head_size:
        raise ValueError(f"cos_sin_cache: expected an even rotary_dim (its width) up to head_size = {head_size}, got {r}")
    heads = [_heads(name, x, head_size) for name, x in (("query", query), ("key", key))]
    if heads[1].shape[0] != heads[0].shape[0]:
        raise ValueError(f"key: expected one row per query row ({heads[0].shape[0]}), got {heads[1].shape[0]}")
    pos = _positions(positions, heads[0], "positions")
    if pos.numel() and not 0 <= int(pos.min()) <= int(pos.max()) < cos_sin_cache.shape[0]:
        raise ValueError(f"positions: expected 0 .. {cos_sin_cache.shape[0] - 1} (cos_sin_cache's rows), got "
                         f"{int(pos.min())} .. {int(pos.max())}")  # fmt: skip
    rows = cos_sin_cache.index_select(0, pos.to(cos_sin_cache.device))  # (n, r)
    cos, sin = rows[:, None, : r // 2], rows[:, None, r // 2 :]
    out = [_turn(x, cos, sin, not is_neox) for x in heads]
    return out[0].view_as(query), out[1].view_as(key)


def apply_rope_with_cos_sin_cache_inplace(positions: Tensor, query: Tensor, key: Tensor, head_size: int,
                                          cos_sin_cache: Tensor, is_neox: bool = True) -> None:  # fmt: skip
    """:func:`apply_rope_with_cos_sin_cache` written into ``query`` and ``key``."""
    _write(query, key, apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox))


def _theta(q: Tensor, rotary_dim, base: float, scale: float) -> Tensor:
    return llama_theta(_rotary_dim(q, rotary_dim), base, scale)


def _llama31(q: Tensor, rotary_dim, base, scale, low, high, old) -> Tensor:
    """Llama 3.1's frequencies (``rope_scaling``'s ``"llama3"``, in the clamped form FlashInfer's kernel uses)."""
    if not high > low >= 0:
        raise ValueError(f"low_freq_factor, high_freq_factor: expected 0 <= low < high, got {low} and {high}")
    settings = {"rope_type": "llama3", "factor": float(scale), "low_freq_factor": float(low),
                "high_freq_factor": float(high), "original_max_position_embeddings": old}  # fmt: skip
    return frequencies(_rotary_dim(q, rotary_dim), float(base), settings)[0]


def _rotary_dim(q: Tensor, rotary_dim) -> int:
    d = q.shape[-1] if isinstance(q, Tensor) and q.dim() == 3 else None
    if d is None:
        raise ValueError(f"q: expected (nnz, num_q_heads, head_dim), got {tuple(q.shape) if isinstance(q, Tensor) else q}")
    try:
        r = d if rotary_dim is None else operator.index(rotary_dim)  # (numpy's ints too)
    except TypeError:
        raise TypeError(f"rotary_dim: expected an int, got {type(rotary_dim).__name__}") from None
    if isinstance(rotary_dim, bool) or r % 2 or not 0 < r <= d:
        raise ValueError(f"rotary_dim: expected an even number up to head_dim = {d}, got {r}")
    return r


def _rotate(q: Tensor, k: Tensor, positions: Tensor, rotary_dim, interleave: bool, theta: Tensor) -> tuple[Tensor, Tensor]:
    if not isinstance(k, Tensor) or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        got = tuple(k.shape) if isinstance(k, Tensor) else type(k).__name__
        raise ValueError(f"k: expected ({q.shape[0]}, num_k_heads, {q.shape[-1]}) like q, got {got}")
    return rotate(q, positions, theta, interleave), rotate(k, positions, theta, interleave)


def llama_theta(rotary_dim: int, rope_theta: float, rope_scale: float) -> Tensor:
    """``(r/2,)`` float64: FlashInfer's RoPE frequencies ``θ^(-2i/r) / rope_scale``."""
    return frequencies(rotary_dim, float(rope_theta), DEFAULT)[0] / float(rope_scale)


def rotate(x: Tensor, positions: Tensor, theta: Tensor, interleave: bool) -> Tensor:
    """``x (n, heads, d)``, row ``i`` turned by ``positions[i] · θ`` (the first ``2 · len(θ)`` dims), in float32 at least,
    rounded back to its dtype."""
    angles = positions.to(torch.float64)[:, None, None] * theta.to(positions.device)  # (n, 1, r/2)
    return _turn(x, angles.cos(), angles.sin(), interleave)


def _turn(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """``x (n, heads, d)`` turned pair by pair in float32 (float64 for float64), rounded back to its dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return rotate_pairs(x.to(wide), cos.to(wide), sin.to(wide), interleaved=interleave).to(x.dtype)


def _ragged_positions(indptr: Tensor, offsets: Tensor, q: Tensor) -> Tensor:
    """Row ``i`` of request ``b`` at ``offsets[b] + i - indptr[b]``."""
    _indices("indptr", indptr)
    _indices("offsets", offsets)
    bounds = indptr.tolist()
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] != q.shape[0]:
        raise ValueError(f"indptr: expected offsets from 0 rising to nnz = {q.shape[0]}, got {bounds[:8]}")
    counts = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
    if not isinstance(offsets, Tensor) or offsets.shape != (len(counts),):
        raise ValueError(f"offsets: expected one per request ({len(counts)},), got {getattr(offsets, 'shape', offsets)}")
    first = offsets.to("cpu", torch.int64) - torch.tensor(bounds[:-1])
    return (torch.arange(q.shape[0]) + torch.repeat_interleave(first, counts)).to(q.device)


def _positions(pos_ids: Tensor, q: Tensor, name: str = "pos_ids") -> Tensor:
    _indices(name, pos_ids)
    if pos_ids.shape != (q.shape[0],):
        raise ValueError(f"{name}: expected one position per row ({q.shape[0]},), got {tuple(pos_ids.shape)}")
    return pos_ids.to(q.device, torch.int64)


def _indices(name: str, x) -> None:
    """FlashInfer's kernels take int32 or int64 index tensors only (a float or bool one is no position)."""
    if not isinstance(x, Tensor) or x.dtype not in (torch.int32, torch.int64):
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {got}")


def _heads(name: str, x: Tensor, head_size: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() not in (2, 3) or x.shape[-1] % head_size:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected (nnz, num_heads · {head_size}), got {got}")
    return x.reshape(x.shape[0], -1, head_size)


def _write(q: Tensor, k: Tensor, rotated: tuple[Tensor, Tensor]) -> None:
    q.copy_(rotated[0])
    k.copy_(rotated[1])

