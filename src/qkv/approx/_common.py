"""Checks and helpers shared by the approximate mechanisms in :mod:`qkv.approx`.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``m`` random features / landmarks.

Masks follow the house convention, bool with True = may attend, broadcastable to
``(b, h, i, j)``. Most approximations can only honour a *key padding* mask, one that is the
same for every query of a row (it depends on ``b``, ``h`` and ``j`` only)::

    keys    0 1 2 3 4            keep = [1 1 1 0 0]   (keys 3 and 4 are padding)
    query 0 1 1 1 0 0
    query 1 1 1 1 0 0            every row is the same: a key padding mask
    query 2 1 1 1 0 0

:func:`key_padding` reduces such a mask to ``keep (b|1, h|1, j)`` and refuses the others
with a ``ValueError`` that names the method and what to use instead. Lazy masks (anything
with ``dense(i_len, j_len, device)``, e.g. ``qkv.masks.lengths``) are made dense first, so
this package does not import the mask module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..backends.request import repeat_kv as repeat_groups


class Dims(NamedTuple):
    """Sizes of one call, read once from ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``."""

    b: int
    h: int
    g: int
    i: int
    j: int
    d: int
    e: int


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> Dims:
    """Validate the mechanism inputs and return their sizes; errors name the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    for name, x, want in (("q", q, "(b, h, i, d)"), ("k", k, "(b, g, j, d)"), ("v", v, "(b, g, j, e)")):
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor {want}, got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {x.device}")
    b, h, i, d = q.shape
    _, g, j, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected (b, g, j, d) with b={b} and d={d} like q, got shape {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v: expected (b, g, j, e) with (b, g, j)={tuple(k.shape[:3])} like k, got shape {tuple(v.shape)}"
        )
    if g == 0 or h % g != 0:
        raise ValueError(f"k: query heads h={h} must be a multiple of KV heads g, got g={g}")
    return Dims(b, h, g, i, j, d, v.shape[3])


def check_flags(causal: object, return_weights: object) -> None:
    """The two keyword flags of the mechanism contract must be real bools."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights: expected a bool, got {type(return_weights).__name__}")


def repeat_kv(x: Tensor, h: int) -> Tensor:
    """``(b, g, n, c) -> (b, h, n, c)``: query head ``n`` reads KV head ``n // (h // g)``, the
    grouping of exact attention (``qkv.backends.repeat_kv``)."""
    return repeat_groups(x, h // x.shape[1])


def dense_mask(mask: object, dims: Dims, device: torch.device) -> Tensor | None:
    """The mask as a 4-d bool tensor broadcastable to ``(b, h, i, j)``, or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        if not callable(getattr(mask, "dense", None)):
            raise TypeError(
                "mask: expected a bool tensor (True = may attend) or a mask object with "
                f".dense(i_len, j_len, device), got {type(mask).__name__}"
            )
        mask = mask.dense(dims.i, dims.j, device)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}")
    target = (dims.b, dims.h, dims.i, dims.j)
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"mask: expected shape broadcastable to {target}, got {shape}")
    return mask.reshape((1,) * (4 - len(shape)) + shape).to(device)


def key_padding(mask: Tensor | None, dims: Dims, method: str, instead: str) -> Tensor | None:
    """Reduce a dense mask to ``keep (b|1, h|1, j)`` if it only depends on the keys, else refuse.

    ``method`` names the mechanism in the error and ``instead`` says what can run the mask.
    """
    if mask is None:
        return None
    if mask.shape[2] != 1 and not bool((mask == mask[:, :, :1]).all()):
        raise ValueError(
            f"mask: {method} only supports key padding masks (the same keys kept for every query, "
            f"shape (b, h, 1, j)), got a mask of shape {tuple(mask.shape)} that varies along the "
            f"query axis i; {instead}"
        )
    return mask[:, :, 0].expand(mask.shape[0], mask.shape[1], dims.j)


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """``num / den[..., None]`` with 0 where ``den == 0`` (a row that sees no key gives zeros).

    Used by the kernel methods whose features are non-negative, so ``den == 0`` implies
    ``num == 0``; the ``where`` keeps the gradient of such a row at zero, not NaN.
    """
    empty = den == 0
    return num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)


def masked_softmax(logits: Tensor, keep: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` with ``keep == False`` entries excluded; rows with nothing kept give zeros.

    Masked logits are filled with ``finfo.min`` (not ``-inf``, so no NaN appears), and the
    result is multiplied by ``keep`` so that an all-masked row is zero rather than uniform.
    """
    if keep is None:
        return logits.softmax(dim)
    filled = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return filled.softmax(dim) * keep


def make_generator(seed: object, generator: object) -> torch.Generator:
    """The random stream of a mechanism: its own ``generator``, a fresh one seeded with ``seed``,
    or (neither given) a fresh one seeded from torch's global RNG, so ``torch.manual_seed``
    makes the module reproducible too."""
    if seed is not None and generator is not None:
        raise ValueError("seed: give seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        return generator
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def check_interval(value: object) -> int | None:
    """``redraw_interval``: None (never redraw on its own) or a positive int of training steps."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"redraw_interval: expected a positive int or None, got {value!r}")
    return value


def check_scale(scale: object) -> float | None:
    """``scale``: None (use ``1/sqrt(d)``) or a finite positive number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    if not 0 < float(scale) < float("inf"):
        raise ValueError(f"scale: expected a finite positive number, got {scale}")
    return float(scale)


#: Elements (of the float32 ``(b h, rows, m)`` block) in one chunk of a method that streams
#: over the sequence (:func:`qkv.approx.linear.streamed_kernel_attention`, Linformer's
#: softmax). 2**19 float32 are 2 MiB, about a core's L2 cache: the block stays in cache
#: between the matmul that makes it and the one that reads it. Measured on the benchmark
#: machine (2 threads, quiet, b=1, h=8, m=256; Performer / Linformer / linear, ms):
#: 2**18: 50 / 34 / 8.1 at 4K, 172 / 146 / 31 at 16K; 2**19: 41 / 33 / 7.8 and 186 / 155 / 36;
#: 2**20: 48 / 36 / 8.4 and 191 / 187 / 43; 2**22: 70 / 45 / 8.3 and 212 / 174 / 54.
#: Smaller chunks mean more ops, each a parallel region that waits for a free core on a
#: busy machine, so the smallest size is not taken.
CHUNK_ELEMENTS = 1 << 19
