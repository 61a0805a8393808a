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

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ._layout import merge_lead
from ._trace import concrete

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
        return self.cols[None, :] - self.rows[:, None] - self.shift

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest value of :attr:`diagonal` in this tile (no tensor built)."""
        return self.j0 - (self.i1 - 1) - self.shift, (self.j1 - 1) - self.i0 - self.shift


class Mask:
    """Base class of lazy masks. Subclasses implement :meth:`tile` and :meth:`state`."""

    def tile(self, t: Tile) -> Tensor:
        """Bool ``(..., it, jt)``, True = may attend, broadcastable to ``(b, h, it, jt)``."""
        raise NotImplementedError

    def state(self, t: Tile) -> State:
        """'empty' if nothing in the tile may attend, 'full' if everything may, else 'partial'."""
        return "partial"

    def dense(self, i_len: int, j_len: int, device: torch.device | str = "cpu") -> Tensor:
        """The whole mask as a bool tensor broadcastable to ``(b, h, i, j)``."""
        return self.tile(Tile.whole(i_len, j_len, device))

    def batch_shape(self) -> tuple[int, ...]:
        """Leading dims the mask carries besides ``(i, j)``; ``()`` for masks of positions only."""
        return ()

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        """The same mask for inputs whose leading dims ``lead`` are merged into one batch dim.

        ``qkv.attention`` runs ``(x, …, b, h, i, d)`` inputs as ``(x·…·b, h, i, d)``
        (``qkv._layout``); a mask that varies along those dims is merged the same way. A mask
        of positions only is itself.
        """
        return self if len(lead) <= 1 or len(self.batch_shape()) <= 1 else _MergedLead(self, lead)

    def __and__(self, other: Mask | Tensor) -> Mask:
        return And(self, as_mask(other))

    def __rand__(self, other: Tensor) -> Mask:
        return And(as_mask(other), self)

    def __or__(self, other: Mask | Tensor) -> Mask:
        return Or(self, as_mask(other))

    def __ror__(self, other: Tensor) -> Mask:
        return Or(as_mask(other), self)


class Offsets(Mask):
    """Keys whose offset ``c - r - (j - i)`` (:attr:`Tile.diagonal`) lies in ``lo..hi``; None = no bound.

    A :class:`Window` always contains the query's own position; an offset range need not,
    e.g. ``offsets(1, 2)``, "the next two tokens only", or ``offsets(None, -1)``, strictly
    the past. A query whose range holds no key gets zero output, like any fully masked row::

        offsets(1, 2), i = j = 4
            k0 k1 k2 k3
        q0   .  1  1  .
        q1   .  .  1  1
        q2   .  .  .  1
        q3   .  .  .  .
    """

    def __init__(self, lo: int | None, hi: int | None):
        for name, value in (("lo", lo), ("hi", hi)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"offsets: expected lo <= hi, got lo={lo}, hi={hi}")
        self.lo, self.hi = lo, hi

    def tile(self, t: Tile) -> Tensor:
        offset = t.diagonal
        allowed = torch.ones_like(offset, dtype=torch.bool)
        if self.lo is not None:
            allowed &= offset >= self.lo
        if self.hi is not None:
            allowed &= offset <= self.hi
        return allowed

    def state(self, t: Tile) -> State:
        first, last = t.offset_range()
        lo = -float("inf") if self.lo is None else self.lo
        hi = float("inf") if self.hi is None else self.hi
        if last < lo or first > hi:
            return "empty"
        return "full" if first >= lo and last <= hi else "partial"

    def __repr__(self) -> str:
        return f"offsets({self.lo}, {self.hi})"


def offsets(lo: int | None, hi: int | None) -> Offsets:
    """Each query sees the keys at offsets ``lo..hi`` from its bottom-right aligned position."""
    return Offsets(lo, hi)


class Window(Offsets):
    """Keys within ``left`` steps before and ``right`` steps after each query's (bottom-right aligned) position.

    ``causal()`` is ``Window(left=None, right=0)``; ``None`` means unbounded on that side.
    It is the offset range ``-left..right``, which always holds the query's own position;
    backends read ``left`` and ``right`` to run it block-locally.
    """

    def __init__(self, left: int | None = None, right: int | None = 0):
        for name, value in (("left", left), ("right", right)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: expected a non-negative int or None, got {value!r}")
        super().__init__(None if left is None else -left, right)
        self.left, self.right = left, right

    def __repr__(self) -> str:
        if self.left is None and self.right == 0:
            return "causal()"
        return f"window(left={self.left}, right={self.right})"


def causal() -> Window:
    """Causal mask aligned bottom-right: query ``r`` sees keys ``c <= r + (j - i)``."""
    return Window(left=None, right=0)


def window(left: int, right: int = 0) -> Window:
    """Sliding window: each query sees ``left`` keys before its position and ``right`` after."""
    if left is None:
        raise ValueError("left: expected a non-negative int, got None (use causal() for no left bound)")
    return Window(left=left, right=right)


def _per_row(name: str, values: object, what: str) -> tuple[int, int]:
    """Check a ``(b,)`` integer tensor of non-negative key positions; return its (min, max) as ints.

    The two ints are kept by the mask so that ``state`` (called once per tile) reads no tensor.
    Where values cannot be read (``qkv._trace``) it returns ``(0, -1)``, an empty range that
    makes ``state`` answer "partial" for every tile: the same result, with no tile skipped.
    """
    if not isinstance(values, Tensor) or values.dim() != 1:
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"{name}: expected a 1-d tensor of shape (b,), got {got}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {values.dtype}")
    if values.numel() == 0:
        raise ValueError(f"{name}: expected at least one batch row, got an empty tensor")
    if not concrete(values):  # tracing or meta: no value may be read; every tile is then "partial"
        return 0, -1
    low, high = torch.aminmax(values)
    low, high = int(low), int(high)
    if low < 0:
        raise ValueError(f"{name}: expected non-negative {what}, got {values.tolist()}")
    return low, high


class Lengths(Mask):
    """Key padding on the right: in batch row ``n`` only the first ``key_lengths[n]`` keys are real.

    ``key_lengths`` has shape ``(b,)``; the tile is ``(b, 1, 1, jt)``. The tensor is read
    once, when the mask is made (do not change it in place afterwards).
    """

    def __init__(self, key_lengths: Tensor):
        self._shortest, self._longest = _per_row("key_lengths", key_lengths, "lengths")
        self.key_lengths = key_lengths

    def tile(self, t: Tile) -> Tensor:
        lengths = self.key_lengths.to(t.device)
        return (t.cols[None, :] < lengths[:, None])[:, None, None, :]  # (b, 1, 1, jt)

    def state(self, t: Tile) -> State:
        if self._longest < self._shortest:  # values unread (tracing, meta): keep every tile
            return "partial"
        if t.j1 <= self._shortest:
            return "full"
        if t.j0 >= self._longest:
            return "empty"
        return "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return (self.key_lengths.shape[0], 1)

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        return self if len(lead) <= 1 else Lengths(self.key_lengths.expand(*lead).reshape(-1))

    def __repr__(self) -> str:
        return f"lengths({self.key_lengths.tolist()})"


def lengths(key_lengths: Tensor) -> Lengths:
    """Padding mask from the number of real keys per batch row, ``(b,)``."""
    return Lengths(key_lengths)


class Starts(Mask):
    """Key padding on the left: in batch row ``n`` the keys before ``key_starts[n]`` are padding.

    The mirror of :class:`Lengths`, for batches padded on the left (as decoders are for
    generation: every row's last token is at the end). ``starts(s) & lengths(l)`` keeps
    keys ``s[n] <= c < l[n]``. ``key_starts`` has shape ``(b,)``; the tile is
    ``(b, 1, 1, jt)``. With ``i`` queries on ``j`` keys and rows padded like the keys
    (``i == j``), the padded queries see no key and get zero output, like any fully masked
    row::

        starts([2]), j = 5      k0 k1 k2 k3 k4
                           q*    .  .  1  1  1
    """

    def __init__(self, key_starts: Tensor):
        self._first, self._last = _per_row("key_starts", key_starts, "starts")
        self.key_starts = key_starts

    def tile(self, t: Tile) -> Tensor:
        starts = self.key_starts.to(t.device)
        return (t.cols[None, :] >= starts[:, None])[:, None, None, :]  # (b, 1, 1, jt)

    def state(self, t: Tile) -> State:
        if self._last < self._first:  # values unread (tracing, meta): keep every tile
            return "partial"
        if t.j0 >= self._last:
            return "full"
        if t.j1 <= self._first:
            return "empty"
        return "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return (self.key_starts.shape[0], 1)

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        return self if len(lead) <= 1 else Starts(self.key_starts.expand(*lead).reshape(-1))

    def __repr__(self) -> str:
        return f"starts({self.key_starts.tolist()})"


def starts(key_starts: Tensor) -> Starts:
    """Left-padding mask from the index of the first real key per batch row, ``(b,)``."""
    return Starts(key_starts)


class Dense(Mask):
    """A bool tensor broadcastable to ``(..., i, j)``, sliced per tile."""

    def __init__(self, mask: Tensor):
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask: expected a bool tensor or a qkv.masks.Mask, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(
                f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}; "
                "pass a float tensor as bias= to add it to the logits"
            )
        if mask.dim() < 2:
            raise ValueError(f"mask: expected at least 2 dims (..., i, j), got shape {tuple(mask.shape)}")
        self.mask = mask

    def tile(self, t: Tile) -> Tensor:
        m = self.mask
        rows = slice(t.i0, t.i1) if m.shape[-2] != 1 else slice(None)
        cols = slice(t.j0, t.j1) if m.shape[-1] != 1 else slice(None)
        return m[..., rows, cols].to(t.device)

    def state(self, t: Tile) -> State:
        if not concrete(self.mask):  # tracing or meta: no value may be read, every tile is kept
            return "partial"
        part = self.tile(t)
        if bool(part.all()):
            return "full"
        if not bool(part.any()):
            return "empty"
        return "partial"

    def dense(self, i_len: int, j_len: int, device: torch.device | str = "cpu") -> Tensor:
        return self.mask.to(device)

    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.mask.shape[:-2])

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        merged = merge_lead(self.mask, lead)
        return self if merged is self.mask else Dense(merged)

    def __repr__(self) -> str:
        return f"Dense(shape={tuple(self.mask.shape)})"


class And(Mask):
    """May attend where both masks allow."""

    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def tile(self, t: Tile) -> Tensor:
        return self.a.tile(t) & self.b.tile(t)

    def state(self, t: Tile) -> State:
        sa = self.a.state(t)
        if sa == "empty":
            return "empty"
        sb = self.b.state(t)
        if sb == "empty":
            return "empty"
        return "full" if sa == sb == "full" else "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return _longer(self.a.batch_shape(), self.b.batch_shape())

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        a, b = self.a.merge_lead(lead), self.b.merge_lead(lead)
        return self if a is self.a and b is self.b else And(a, b)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class Or(Mask):
    """May attend where either mask allows."""

    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def tile(self, t: Tile) -> Tensor:
        return self.a.tile(t) | self.b.tile(t)

    def state(self, t: Tile) -> State:
        sa = self.a.state(t)
        if sa == "full":
            return "full"
        sb = self.b.state(t)
        if sb == "full":
            return "full"
        return "empty" if sa == sb == "empty" else "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return _longer(self.a.batch_shape(), self.b.batch_shape())

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        a, b = self.a.merge_lead(lead), self.b.merge_lead(lead)
        return self if a is self.a and b is self.b else Or(a, b)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _MergedLead(Mask):
    """Any mask whose tiles carry leading dims, with those dims merged into one (``Mask.merge_lead``)."""

    def __init__(self, mask: Mask, lead: tuple[int, ...]):
        self.mask, self.lead = mask, lead

    def tile(self, t: Tile) -> Tensor:
        return merge_lead(self.mask.tile(t), self.lead)

    def state(self, t: Tile) -> State:
        return self.mask.state(t)

    def batch_shape(self) -> tuple[int, ...]:
        *own, heads = self.mask.batch_shape()
        return (1 if all(n == 1 for n in own) else math.prod(self.lead), heads)

    def __repr__(self) -> str:
        return f"{self.mask!r}.merge_lead({self.lead})"


def _longer(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return a if len(a) >= len(b) else b


def as_mask(mask: Mask | Tensor | None) -> Mask | None:
    """Wrap a bool tensor as :class:`Dense`; pass masks and None through; reject anything else."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return Dense(mask)
    raise TypeError(f"mask: expected a bool tensor or a qkv.masks.Mask, got {type(mask).__name__}")
