"""Dropout masks drawn per tile from a seed, so the forward and the backward see the same mask.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``i`` query length, ``j``
key length; ``it``/``jt`` the sides of a tile (``qkv.masks.Tile``).

A tiled backend never holds the whole ``(..., h, i, j)`` dropout mask, and its backward
recomputes tiles long after the forward ran, so it cannot draw the mask from a stateful
generator tile by tile. Instead, whether weight ``(n, r, c)`` is kept is a pure function of
one 62-bit seed and the element's coordinates: a counter-based hash, in the spirit of the
Philox generator of Salmon et al. 2011 ("Parallel random numbers: as easy as 1, 2, 3"),
that any tile can evaluate independently. :func:`keep` is public so that tests (and users
who want to check a training run) can rebuild exactly the mask a call used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...masks import Tile

_LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Origin:
    """Where a block of a call sits in the whole call, so that its dropout mask is the whole's slice.

    A block holds query heads ``head .. head + h - 1`` of ``heads`` (None: the block's own
    ``h``, no head split), query rows from ``row`` and key columns from ``col``, all global
    indices. The whole call is ``Origin()``.
    """

    head: int = 0  # global index of the block's first query head
    heads: int | None = None  # query heads of the whole call (None: as many as the block has)
    row: int = 0  # global index of the block's first query row
    col: int = 0  # global index of the block's first key column


def draw_seed(generator: torch.Generator | None) -> int:
    """One seed per call, from ``generator`` (or the global generator), so seeded runs repeat."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device))


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 holding values < 2**32.

    Products wrap modulo 2**64 in int64 arithmetic and the mask keeps the low 32 bits, so
    the result equals the unsigned 32-bit computation. The constants are the "lowbias32"
    pair found by C. Wellons' hash search, whose output bits pass avalanche tests.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


def keep(seed: int, p: float, heads_shape: tuple[int, ...], tile: Tile, origin: Origin | None = None) -> Tensor:
    """Bool ``(*heads_shape, it, jt)``: True where the weight survives dropout with probability ``p``.

    ``heads_shape`` is the logits' shape without ``(i, j)``, e.g. ``(b, h)``; every
    ``(batch, head)`` slice gets its own stream. The same ``(seed, tile)`` always gives the
    same mask, and a tile of a larger tile is the corresponding slice of it. With an
    ``origin``, the tile's heads, rows and columns are read as global ones (a block of a
    larger call): the mask is then that call's mask at those coordinates.
    """
    device = tile.device
    origin = Origin() if origin is None else origin
    lead = heads_shape[:-1] if heads_shape else ()
    h = heads_shape[-1] if heads_shape else 1
    total = h if origin.heads is None else origin.heads
    batches = 1
    for n in lead:
        batches *= n
    lo, hi = seed & _LOW32, (seed >> 32) & _LOW32
    # stream = flat (batch, global head) index: the whole call's numbering
    batch = torch.arange(batches, device=device, dtype=torch.int64).view(*lead, 1, 1, 1)
    head = torch.arange(origin.head, origin.head + h, device=device, dtype=torch.int64).view(h, 1, 1)
    stream = (batch * total + head).view(*heads_shape, 1, 1)
    x = _mix(_mix(stream ^ lo) ^ hi)
    x = _mix(x ^ (tile.rows + origin.row).view(-1, 1))
    x = _mix(x ^ (tile.cols + origin.col).view(1, -1))
    # top 24 bits as a uniform number in [0, 1): exact in float32
    uniform = (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
    return uniform >= p
