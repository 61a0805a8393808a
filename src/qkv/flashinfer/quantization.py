"""FlashInfer's bit packing (``flashinfer.quantization.packbits``, ``segment_packbits``): masks as bits.

Shape legend: ``n`` booleans, ``R`` segments.

FlashInfer's prefill reads a custom mask as bits, eight entries a byte. ``packbits`` is
``numpy.packbits`` on a 1-d tensor: bit ``7 - i`` of byte ``n // 8`` holds entry ``8n + i``
(``bitorder="big"``, the default) or bit ``i`` (``"little"``, what FlashInfer's kernels read and
what its ``plan`` packs a ``custom_mask`` into); a last partial byte is padded with zeros.
``segment_packbits`` packs each segment ``x[indptr[r] : indptr[r + 1]]`` from a whole byte, so
segment ``r`` owns bytes ``new_indptr[r] : new_indptr[r + 1]`` (``ceil(len / 8)`` of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

_BIG = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def packbits(x: Tensor, bitorder: str = "big") -> Tensor:
    """``x (n,)`` booleans (or 0/1 numbers) packed into ``((n + 7) // 8,)`` uint8, as ``numpy.packbits``."""
    x = _flat_bits("x", x)
    return _pack(x, _weights(bitorder, x.device))


def segment_packbits(x: Tensor, indptr: Tensor, bitorder: str = "big") -> tuple[Tensor, Tensor]:
    """Each segment ``x[indptr[r] : indptr[r + 1]]`` packed from a whole byte: ``(y, new_indptr)``, int32 offsets.

    ``new_indptr[r + 1] - new_indptr[r] == (indptr[r + 1] - indptr[r] + 7) // 8``.
    """
    x = _flat_bits("x", x)
    weights = _weights(bitorder, x.device)
    bounds = _offsets(indptr, x.numel())
    packed = [_pack(x[a:b], weights) for a, b in zip(bounds, bounds[1:])]
    sizes = torch.tensor([0] + [p.numel() for p in packed], dtype=torch.int64)
    new_indptr = sizes.cumsum(0).to(device=indptr.device, dtype=torch.int32)
    y = torch.cat(packed) if packed else x.new_zeros(0, dtype=torch.uint8)
    return y, new_indptr


def _pack(x: Tensor, weights: Tensor) -> Tensor:
    n = x.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=x.device)
    padded[:n] = x
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _weights(bitorder: str, device) -> Tensor:
    if bitorder not in ("big", "little"):
        raise ValueError(f"bitorder: expected 'big' or 'little', got {bitorder!r}")
    return (_BIG if bitorder == "big" else _BIG.flip(0)).to(device)


def _flat_bits(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d tensor (flatten it first), got shape {tuple(x.shape)}")
    if x.dtype.is_complex:
        raise TypeError(f"{name}: expected booleans or 0/1 numbers, got {x.dtype}")
    return x != 0


def _offsets(indptr: Tensor, n: int) -> list[int]:
    if not isinstance(indptr, Tensor) or indptr.dim() != 1 or indptr.dtype.is_floating_point or indptr.dtype == torch.bool:
        got = f"{indptr.dtype} of shape {tuple(indptr.shape)}" if isinstance(indptr, Tensor) else type(indptr).__name__
        raise TypeError(f"indptr: expected a 1-d integer tensor of segment offsets, got {got}")
    bounds = indptr.tolist()
    if not bounds or bounds[0] < 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] > n:
        raise ValueError(f"indptr: expected non-decreasing offsets within 0 .. len(x) = {n}, got {bounds[:8]}")
    return bounds
