"""Masks: which keys each query may attend to.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length;
a tile is the rectangle ``rows i0:i1`` x ``cols j0:j1`` of the ``(i, j)`` logits,
``it = i1 - i0`` and ``jt = j1 - j0`` its sides.

One convention everywhere: a mask is **bool, True = may attend**. Masks are lazy: a mask
object produces any tile on demand and can say that a tile is entirely masked ("empty"),
so that a backend skips it, or entirely visible ("full"), so that a backend drops the mask.
Dense bool tensors are wrapped in :class:`Dense`.

Causal masks are aligned to the **bottom-right** corner, so that the last query sees every
key (the right thing when the keys include a KV cache of earlier tokens)::

    i=3 queries, j=5 keys          i == j: the usual lower triangle
        k0 k1 k2 k3 k4                 k0 k1 k2
    q0   1  1  1  .  .             q0   1  .  .
    q1   1  1  1  1  .             q1   1  1  .
    q2   1  1  1  1  1             q2   1  1  1

Query ``r`` may see key ``c`` iff ``c - r - (j - i) <= 0``; that offset is
:attr:`Tile.diagonal`. A query row whose keys are all masked gives zero output (see
``qkv.attention``).
"""

from .base import And, Dense, Mask, Or, State, Tile, as_mask
from .documents import Documents, documents
from .padding import Lengths, Starts, lengths, starts
from .positions import Offsets, Window, causal, offsets, window
from .programs import FlexBlocks, MaskMod, from_mask_mod

__all__ = [
    "And", "Dense", "Documents", "FlexBlocks", "Lengths", "Mask", "MaskMod", "Offsets", "Or", "Starts", "State", "Tile", "Window", "as_mask", "causal",
    "documents", "from_mask_mod", "lengths", "offsets", "starts", "window",
]  # fmt: skip
