"""A block of local rows and keys, framed at its global positions: masks and biases translated.

Shape legend: ``b`` batch, ``h`` query heads, ``i``/``j`` the global query/key lengths
(``I``/``J`` below), ``it``/``jt`` the rows and keys of one block.

A block is global rows ``r0 .. r0 + it`` against global keys ``c0 .. c0 + jt`` of a call with
``I`` queries and ``J`` keys. Computed on its own, the block is an attention call with
``it`` queries and ``jt`` keys, whose masks and biases see local tile coordinates. Every
lazy mask and bias of qkv is a function of tile coordinates, bottom-right aligned
(``qkv.masks``), so the block's are the global ones translated:

* an offset range (``Offsets``, ``Window``, ``causal``): the block's local offset is
  ``c - r - (jt - it)`` and the global one ``(c0 + c) - (r0 + r) - (J - I)``; they differ by
  ``delta = (jt - it) + (c0 - r0) - (J - I)``, so the block's mask is ``offsets(lo - delta,
  hi - delta)``, still an ``Offsets`` (a ``Window`` when it holds offset 0), which keeps
  the engine's fused diagonal path;
* ``Lengths`` and ``Starts``: ``lengths - c0`` (clamped to ``0 .. jt``);
* ``Dense``: the slice ``[r0 : r0 + it, c0 : c0 + jt]``; ``Documents``: the slices of its ids;
* ``&`` / ``|``: both parts framed;
* any other mask: :class:`Translated`, which hands the mask global tiles;
* a shift-invariant lazy bias (ALiBi, T5 buckets): :class:`Shifted`, the same function of
  the offset moved by ``delta`` (it stays shift-invariant, so the fused path still applies,
  and it owns the wrapped module, so learned T5 buckets get their gradient);
* another lazy bias: :class:`Translated`; a dense bias: its slice.

* a ``score_mod`` (``fn(score, b, h, q_idx, kv_idx)``, raw indices): the same function with
  ``q_idx + r0``, ``kv_idx + c0`` and ``h + h0`` (:func:`frame_score_mod`), a
  ``functools.partial``, so the tensors it reads still get their gradients.

A block whose mask state is "empty" is not computed; one whose state is "full" drops the
mask. Ulysses also slices heads: :func:`frame_bias` and :func:`frame_mask` take ``heads=(h0, h1)``. A packed
batch's documents (the ``segments`` backend) are blocks of one batch row: :func:`frame_row`
keeps that row of a mask, :func:`row_slice` of a dense tensor, and :func:`frame_score_mod`
moves the batch index too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import Tensor

from ...masks import And, Dense, Documents, Lengths, Mask, Offsets, Or, Starts, Tile, Window, offsets
from ...positional import LazyBias
from ...score_mods import SoftCap


@dataclass(frozen=True)
class Block:
    """Global rows ``r0 .. r0 + it`` against global keys ``c0 .. c0 + jt`` of an ``(I, J)`` call."""

    r0: int
    it: int
    c0: int
    jt: int
    i_len: int  # I: queries of the whole call
    j_len: int  # J: keys of the whole call

    @property
    def delta(self) -> int:
        """Global offset minus the block's local offset, for every element of the block."""
        return (self.jt - self.it) + (self.c0 - self.r0) - (self.j_len - self.i_len)

    @property
    def whole(self) -> Tile:
        """The block as a tile of the global call (for ``state``)."""
        return Tile(self.r0, self.r0 + self.it, self.c0, self.c0 + self.jt, self.i_len, self.j_len)

    def to_global(self, t: Tile) -> Tile:
        """A tile of the block's own call -> the same elements as a tile of the global call."""
        return Tile(self.r0 + t.i0, self.r0 + t.i1, self.c0 + t.j0, self.c0 + t.j1, self.i_len, self.j_len, t.device)


def mask_state(mask: Mask | None, block: Block) -> str:
    """``"empty"``, ``"full"`` or ``"partial"``: what the global mask allows inside the block."""
    if block.it == 0 or block.jt == 0:
        return "empty"
    if mask is None:
        return "full"
    return mask.state(block.whole)


def frame_mask(mask: Mask | None, block: Block, heads: tuple[int, int] | None = None) -> Mask | None:
    """The block's own mask (None when it allows every key of the block); ``heads = (h0, h1)`` keeps only those
    query heads of a mask with a head dim (Ulysses: a rank holds some heads of every row)."""
    if mask is None or mask_state(mask, block) == "full":
        return None
    return _frame(mask, block, heads if heads is not None and _has_heads(mask) else None)


def _has_heads(mask: Mask) -> bool:
    shape = mask.batch_shape()
    return len(shape) >= 2 and shape[-1] != 1


def _frame(mask: Mask, block: Block, heads: tuple[int, int] | None = None) -> Mask:
    kind = type(mask)  # exact types: a subclass may redefine its tiles, so it is translated instead
    if kind in (Offsets, Window):  # causal included
        shift = block.delta
        lo = None if mask.lo is None else mask.lo - shift
        hi = None if mask.hi is None else mask.hi - shift
        return offsets(lo, hi)  # a Window where it holds offset 0: the window fast paths kept
    if kind is Lengths:
        return Lengths((mask.key_lengths - block.c0).clamp(min=0, max=block.jt))
    if kind is Starts:
        return Starts((mask.key_starts - block.c0).clamp(min=0, max=block.jt))
    if kind is Dense:
        return Dense(block_slice(mask.mask, block, heads))
    if kind is Documents:
        return Documents(mask.ids_q[:, block.r0 : block.r0 + block.it], mask.ids_k[:, block.c0 : block.c0 + block.jt])
    if kind is And:
        return And(_frame(mask.a, block, heads), _frame(mask.b, block, heads))
    if kind is Or:
        return Or(_frame(mask.a, block, heads), _frame(mask.b, block, heads))
    return Translated(mask, block, heads if heads is not None and _has_heads(mask) else None)


def block_slice(x: Tensor, block: Block, heads: tuple[int, int] | None = None) -> Tensor:
    """Rows, keys (and heads) of a tensor broadcastable to ``(..., h, I, J)``; size-1 dims kept."""
    if x.shape[-2] != 1:
        x = x[..., block.r0 : block.r0 + block.it, :]
    if x.shape[-1] != 1:
        x = x[..., block.c0 : block.c0 + block.jt]
    if heads is not None and x.dim() >= 3 and x.shape[-3] != 1:
        x = x[..., heads[0] : heads[1], :, :]
    return x


class Translated(Mask):
    """Any mask, read at the block's global positions (the generic, slower framing); with ``heads = (h0, h1)``,
    those query heads of its tiles (a mask whose head dim is the call's)."""

    def __init__(self, mask: Mask, block: Block, heads: tuple[int, int] | None = None):
        self.mask, self.block, self.heads = mask, block, heads

    def tile(self, t: Tile) -> Tensor:
        tile = self.mask.tile(self.block.to_global(t))
        if self.heads is not None and tile.dim() >= 3 and tile.shape[-3] != 1:
            tile = tile[..., self.heads[0] : self.heads[1], :, :]
        return tile

    def state(self, t: Tile) -> str:
        # over every head: "empty" or "full" there holds for these heads too, "partial" only asks for the tile
        return self.mask.state(self.block.to_global(t))

    def batch_shape(self) -> tuple[int, ...]:
        shape = self.mask.batch_shape()
        if self.heads is not None and len(shape) >= 2 and shape[-1] != 1:
            shape = (*shape[:-1], self.heads[1] - self.heads[0])
        return shape

    def __repr__(self) -> str:
        heads = "" if self.heads is None else f", heads={self.heads}"
        return f"Translated({self.mask!r}, r0={self.block.r0}, c0={self.block.c0}{heads})"


def frame_bias(
    bias: Tensor | LazyBias | None, block: Block, heads: tuple[int, int] | None = None
) -> Tensor | LazyBias | None:
    """The block's own bias: a slice of a dense one, a shifted or translated lazy one.

    ``heads = (h0, h1)`` keeps only query heads ``h0 .. h1`` (Ulysses); a bias with one head
    is shared by all and kept as it is.
    """
    if bias is None:
        return None
    if isinstance(bias, Tensor):
        return block_slice(bias, block, heads)
    if heads is not None and bias.heads == 1:
        heads = None
    if bias.shift_invariant:
        return Shifted(bias, block.delta, heads)
    return TranslatedBias(bias, block, heads)


class _Wrapped(LazyBias):
    """A lazy bias that owns ``inner`` (so its parameters are this module's) and may slice heads."""

    def __init__(self, inner: LazyBias, heads: tuple[int, int] | None):
        super().__init__()
        self.inner = inner
        self.head_range = heads
        self.heads = inner.heads if heads is None else heads[1] - heads[0]
        self.shift_invariant = inner.shift_invariant

    def _heads(self, x: Tensor) -> Tensor:
        return x if self.head_range is None else x[self.head_range[0] : self.head_range[1]]


class Shifted(_Wrapped):
    """A shift-invariant bias with every offset moved by ``delta``: ``tile(t) = inner(offset + delta)``.

    Shift-invariant biases read tiles only through ``Tile.diagonal``, so the tile handed on
    only needs that diagonal: raising ``i_len`` by ``delta`` lowers ``j_len - i_len`` and so
    raises every offset by ``delta``. This also holds for the one-row profile tiles the
    engine's fused path builds, whatever their sizes.
    """

    def __init__(self, inner: LazyBias, delta: int, heads: tuple[int, int] | None = None):
        super().__init__(inner, heads)
        self.delta = delta

    def tile(self, t: Tile) -> Tensor:
        moved = Tile(t.i0, t.i1, t.j0, t.j1, t.i_len + self.delta, t.j_len, t.device)
        return self._heads(self.inner.tile(moved))

    def extra_repr(self) -> str:
        return f"delta={self.delta}, heads={self.head_range}"


class TranslatedBias(_Wrapped):
    """Any lazy bias, read at the block's global positions."""

    def __init__(self, inner: LazyBias, block: Block, heads: tuple[int, int] | None = None):
        super().__init__(inner, heads)
        self.block = block
        self.shift_invariant = False  # tiles of other sizes than the block's are not meaningful

    def tile(self, t: Tile) -> Tensor:
        return self._heads(self.inner.tile(self.block.to_global(t)))


def heads_only(bias: Tensor | LazyBias | None, heads: tuple[int, int]) -> Tensor | LazyBias | None:
    """The bias of query heads ``h0 .. h1`` only (Ulysses, where rows and keys stay global)."""
    if bias is None:
        return None
    if isinstance(bias, Tensor):
        return bias[..., heads[0] : heads[1], :, :] if bias.dim() >= 3 and bias.shape[-3] != 1 else bias
    if bias.heads == 1:
        return bias
    return Shifted(bias, 0, heads) if bias.shift_invariant else HeadSlice(bias, heads)


class HeadSlice(_Wrapped):
    """Any lazy bias with only some heads (its tiles are otherwise unchanged)."""

    def tile(self, t: Tile) -> Tensor:
        return self._heads(self.inner.tile(t))


def frame_score_mod(fn, block: Block | None, heads: tuple[int, int] | None = None, row: int = 0):
    """``fn`` reading global indices: rows from ``block.r0``, keys from ``block.c0``, heads from ``heads[0]``, batch from ``row``.

    Soft-capping reads no index and is returned as it is (the engine recognises it).
    """
    if fn is None or isinstance(fn, SoftCap):
        return fn
    r0, c0 = (0, 0) if block is None else (block.r0, block.c0)
    h0 = 0 if heads is None else heads[0]
    if (r0, c0, h0, row) == (0, 0, 0, 0):
        return fn
    moved = functools.partial(_moved, fn, (row, h0, r0, c0))
    moved.__wrapped_mod__ = fn  # it only moves indices: evaluated the way fn is (qkv._mods)
    return moved


def _moved(fn, origin: tuple[int, int, int, int], score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    row, h0, r0, c0 = origin
    return fn(score, b + row, h + h0, q_idx + r0, kv_idx + c0)


def frame_row(mask: Mask | None, n: int, stop: int | None = None) -> Mask | None:
    """The mask of batch row ``n`` alone (rows ``n .. stop - 1`` with ``stop``), as a mask of a call of those rows."""
    stop = n + 1 if stop is None else stop
    kind = type(mask)
    if mask is None or kind in (Offsets, Window):
        return mask
    if kind is Lengths:
        return mask if mask.key_lengths.shape[0] == 1 else Lengths(mask.key_lengths[n:stop])
    if kind is Starts:
        return mask if mask.key_starts.shape[0] == 1 else Starts(mask.key_starts[n:stop])
    if kind is Dense:
        return Dense(row_slice(mask.mask, n, stop))
    if kind is Documents and stop == n + 1:
        return mask.row(n)
    if kind is And:
        return And(frame_row(mask.a, n, stop), frame_row(mask.b, n, stop))
    if kind is Or:
        return Or(frame_row(mask.a, n, stop), frame_row(mask.b, n, stop))
    return RowOf(mask, n, stop)


def row_slice(x: Tensor, n: int, stop: int | None = None) -> Tensor:
    """Batch row ``n`` (rows ``n .. stop - 1``) of a tensor broadcastable to ``(b, h, i, j)`` (kept as it is when
    it has no batch dim)."""
    return x[n : n + 1 if stop is None else stop] if x.dim() >= 4 and x.shape[0] > 1 else x


class RowOf(Mask):
    """Any mask, kept to batch row ``n`` (rows ``n .. stop - 1``: its tiles' batch dim sliced)."""

    def __init__(self, mask: Mask, n: int, stop: int | None = None):
        self.mask, self.n, self.stop = mask, n, n + 1 if stop is None else stop

    def tile(self, t: Tile) -> Tensor:
        return row_slice(self.mask.tile(t), self.n, self.stop)

    def state(self, t: Tile) -> str:
        return self.mask.state(t)  # of every row: "empty" and "full" hold for these rows too

    def __repr__(self) -> str:
        return f"RowOf({self.mask!r}, {self.n}, {self.stop})"


__all__ = ["Block", "frame_bias", "frame_mask", "frame_row", "frame_score_mod", "heads_only", "mask_state", "row_slice"]
