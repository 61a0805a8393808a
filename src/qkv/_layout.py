"""The one layout every engine sees, ``(b, h, i, d)``, and the way back to the caller's.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``d``
query/key size; ``lead`` the caller's dims before the head axis.

Imports nothing from qkv, so every layer may use it.

``qkv.attention`` takes ``(i, d)``, ``(h, i, d)``, ``(b, h, i, d)`` or ``(x, …, b, h, i, d)``
inputs, like ``F.scaled_dot_product_attention``. Each call is reshaped once, when it is
checked, to ``(b, h, i, d)`` (no head axis: ``h = 1``; no leading dims: ``b = 1``; several:
merged into one ``b``), and its outputs are reshaped back once, at the end
(:meth:`Layout.restore`). Every reshape here is a view of the caller's tensor when its
leading dims are contiguous with each other (the usual case), so no engine pays for the
caller's layout and no layout selects a slower engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Layout:
    """How a call's inputs were laid out before they became ``(b, h, i, d)``."""

    lead: tuple[int, ...]  # the caller's dims before (h, i, d); () for (h, i, d) and (i, d) inputs
    head_axis: bool = True  # False for (i, d) inputs: one head, and outputs without a head axis

    @classmethod
    def of(cls, q: Tensor) -> Layout:
        """The layout of query-like input ``q`` (``(..., i, d)``, at least 2 dims)."""
        if q.dim() == 2:
            return _NO_HEADS
        return cls(tuple(q.shape[:-3]))

    @property
    def canonical(self) -> bool:
        """True for ``(b, h, i, d)`` inputs: nothing to reshape."""
        return self.head_axis and len(self.lead) == 1

    def to_canonical(self, x: Tensor) -> Tensor:
        """``x (*lead, h, i, ·)`` (or ``(i, ·)`` without a head axis) as ``(b, h, i, ·)``."""
        if self.canonical:
            return x
        if not self.head_axis:
            return x[None, None]
        return x.reshape(math.prod(self.lead), *x.shape[-3:])

    def restore(self, x: Tensor) -> Tensor:
        """``x (b, h, ...)`` back to the caller's ``(*lead, h, ...)`` (``(...)`` without a head axis)."""
        if self.canonical:
            return x
        if not self.head_axis:
            return x[0, 0]
        return x.reshape(*self.lead, *x.shape[1:])


_NO_HEADS = Layout((), head_axis=False)


def merge_lead(x: Tensor, lead: tuple[int, ...]) -> Tensor:
    """A tensor broadcastable to ``(*lead, h, i, j)`` as one broadcastable to ``(prod(lead), h, i, j)``.

    Tensors of at most 3 dims carry no leading dim and broadcast unchanged; leading dims of
    size 1 merge into a view; others are expanded to ``lead`` and merged (a copy only when
    the tensor varies along some and broadcasts along others).
    """
    if x.dim() <= 3 or len(lead) == 1:
        return x
    own = x.shape[:-3]
    if all(n == 1 for n in own):
        return x.reshape(1, *x.shape[-3:])
    return x.expand(*lead, *x.shape[-3:]).reshape(math.prod(lead), *x.shape[-3:])
