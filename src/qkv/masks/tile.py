"""A tile: a rectangle of the ``(i, j)`` logits, the unit every mask is asked about, and its states.

Shape legend: ``i`` query length, ``j`` key length; a tile is the rectangle ``rows i0:i1`` x
``cols j0:j1`` of the ``(i, j)`` logits, ``it = i1 - i0`` and ``jt = j1 - j0`` its sides.

Queries and keys align bottom-right: query row ``r`` sits at key position ``r + j - i``, so
a tile's :attr:`Tile.diagonal` ``c - r - (j - i)`` is 0 on the causal diagonal whatever the
lengths (a decoding step's one query is the last key's position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

State = Literal["full", "empty", "partial"]


@dataclass(frozen=True)
class Tile:
    """A rectangle of the logits: rows ``i0:i1`` of ``i_len`` queries, cols ``j0:j1`` of ``j_len`` keys."""

    i0: int  # first query row of the tile
    i1: int  # one past the last query row
    j0: int  # first key column
    j1: int  # one past the last key column
    i_len: int  # total number of queries
    j_len: int  # total number of keys
    device: torch.device | str = "cpu"

    @classmethod
    def whole(cls, i_len: int, j_len: int, device: torch.device | str = "cpu") -> Tile:
        return cls(0, i_len, 0, j_len, i_len, j_len, device)

    @property
    def shift(self) -> int:
        """``j_len - i_len``: how far the bottom-right alignment moves the diagonal."""
        return self.j_len - self.i_len

    @property
    def rows(self) -> Tensor:
        return torch.arange(self.i0, self.i1, device=self.device)

    @property
    def cols(self) -> Tensor:
        return torch.arange(self.j0, self.j1, device=self.device)

    @property
    def diagonal(self) -> Tensor:
        """``(it, jt)`` long: ``col - row - (j_len - i_len)``; 0 on the causal diagonal, < 0 in the past."""
        return (self.cols - self.shift)[None, :] - self.rows[:, None]  # (one pass over the (it, jt) result)

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest value of :attr:`diagonal` in this tile (no tensor built)."""
        return self.j0 - (self.i1 - 1) - self.shift, (self.j1 - 1) - self.i0 - self.shift
