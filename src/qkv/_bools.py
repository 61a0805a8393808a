"""``any`` and ``all`` of a bool tensor along one dim, as the largest and smallest byte.

Imports nothing from qkv, so every layer may use it.

PyTorch's CPU ``Tensor.any(dim)`` on a bool tensor is a scalar loop: on the Intel Xeon a
``(2, 1, 1024, 1024)`` mask took 2.5 ms along its keys and 1.5 ms along its queries, while
``amax`` of the same bytes viewed as ``uint8`` (True is 1) took 0.10 and 0.04 ms. A dense
mask is reduced that way twice per call (its rows that see no key, its keys that no row
sees), which made a masked call 12% slower than ``F.scaled_dot_product_attention`` at
1024 × 1024. Where the byte view is not used, the native reductions run: an empty dim
(``any`` of nothing is False, ``all`` True; ``amax`` refuses it) and tensors without values
to read (tracing, meta), which keep the ops the tracers know.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._trace import concrete


def any_along(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """``x.any(dim, keepdim)`` of a bool tensor."""
    if not _bytes(x, dim):
        return x.any(dim=dim, keepdim=keepdim)
    return x.view(torch.uint8).amax(dim=dim, keepdim=keepdim).view(torch.bool)


def all_along(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """``x.all(dim, keepdim)`` of a bool tensor."""
    if not _bytes(x, dim):
        return x.all(dim=dim, keepdim=keepdim)
    return x.view(torch.uint8).amin(dim=dim, keepdim=keepdim).view(torch.bool)


def _bytes(x: Tensor, dim: int) -> bool:
    return x.dtype == torch.bool and x.device.type == "cpu" and x.dim() > 0 and x.shape[dim] > 0 and concrete(x)
