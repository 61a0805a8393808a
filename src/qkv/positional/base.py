"""The two ways position enters attention, as base classes.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size; ``it``/``jt`` the sides of a tile (see ``qkv.masks.Tile``).

* :class:`Positional` — what ``MultiHeadAttention(positional=...)`` accepts. It may rotate
  the projected queries and keys (RoPE) and/or add a bias to the logits (ALiBi, T5 buckets).
* :class:`LazyBias` — a bias on the logits that is computed tile by tile from positions, so
  no ``(h, i, j)`` tensor exists outside the reference backend.

Absolute encodings (sinusoidal, learned) are added to token embeddings by the models; they
are not part of attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import Tile


class Positional(nn.Module):
    """Base class: identity rotation, no bias. Subclasses override what they change."""

    def rotate(
        self, q: Tensor, k: Tensor, start: int = 0, positions: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rotate ``q (b, h, i, d)`` and the new keys ``k (b, g, j, d)``, whose first position is ``start``.

        ``positions = (q_positions (i,), k_positions (j,))``, when given, are the rows' own
        positions instead (a shard of a longer sequence, ``qkv.distributed``).
        """
        return q, k

    def bias(self) -> LazyBias | None:
        """The lazy bias this encoding adds to the logits, or None."""
        return None


class LazyBias(Positional):
    """A bias on the logits computed per tile from relative positions.

    Relative position follows the bottom-right alignment of ``qkv.masks``: key ``c`` is
    ``tile.diagonal = c - r - (j - i)`` steps after query ``r`` (negative = in the past),
    which stays right when the keys include a KV cache.
    """

    #: number of heads the bias has (1 = shared by every head)
    heads: int = 1
    #: True when the bias depends on positions only through ``tile.diagonal`` (key minus
    #: query position), so a backend may compute one ``(h, i + j)`` profile and cut every
    #: tile from it as a strided view.
    shift_invariant: bool = False

    def tile(self, t: Tile) -> Tensor:
        """Float ``(h, it, jt)`` bias for one tile."""
        raise NotImplementedError

    def dense(self, i_len: int, j_len: int, device: torch.device | str = "cpu") -> Tensor:
        """The whole ``(h, i, j)`` bias (reference backend and tests only)."""
        return self.tile(Tile.whole(i_len, j_len, device))

    def bias(self) -> LazyBias:
        return self
