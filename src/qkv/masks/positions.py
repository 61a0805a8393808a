"""Masks of positions: which keys lie at which offsets from each (bottom-right aligned) query.

Shape legend: ``i`` query length, ``j`` key length; a tile is ``it x jt``.

``Offsets`` keeps keys whose offset ``c - r - (j - i)`` lies in a range; ``Window`` is the
range that holds the query's own position (``causal()``, sliding windows). Their tiles
depend on positions only, and whether a tile is empty, full or partial is arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Mask, State, Tile, keys_outside


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
        # c - r - shift in [lo, hi] as c >= r + shift + lo and c <= r + shift + hi: each bound one broadcast
        # comparison of a row and a column (bool out), never the (it, jt) int64 offsets (3-4x the time at i = 1000)
        # (bounds past every offset of the call are clamped to it: a sys.maxsize window would overflow int64)
        reach = t.i_len + t.j_len
        lo = None if self.lo is None else max(self.lo, -reach)
        hi = None if self.hi is None else min(self.hi, reach)
        rows, cols = (t.rows + t.shift)[:, None], t.cols[None, :]
        if lo is None and hi is None:
            return torch.ones(t.i1 - t.i0, t.j1 - t.j0, dtype=torch.bool, device=t.device)
        if lo is None:
            return cols <= rows + hi
        allowed = cols >= rows + lo
        return allowed if hi is None else allowed.logical_and_(cols <= rows + hi)

    def state(self, t: Tile) -> State:
        first, last = t.offset_range()
        lo = -float("inf") if self.lo is None else self.lo
        hi = float("inf") if self.hi is None else self.hi
        if last < lo or first > hi:
            return "empty"
        return "full" if first >= lo and last <= hi else "partial"

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        """Keys outside every row's range: rows ``0 .. i-1`` together see ``j - i + lo .. j - 1 + hi``.

        None where that covers every key (a square causal call, windows, a decoding step);
        PyTorch's top-left ``is_causal`` with fewer queries than keys, ``offsets(None, i - j)``,
        hides the keys from ``i`` on.
        """
        return keys_outside(self.lo, self.hi, i_len, j_len)

    def offset_bounds(self) -> tuple[int | None, int | None]:
        return self.lo, self.hi

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        # row r sees keys r + (j - i) + lo .. r + (j - i) + hi
        shift = t.j_len - t.i_len
        lo = 0 if self.lo is None else max(0, t.i0 + shift + self.lo)
        hi = t.j_len if self.hi is None else min(t.j_len, t.i1 - 1 + shift + self.hi + 1)
        return lo, max(lo, hi)

    def __repr__(self) -> str:
        return f"offsets({self.lo}, {self.hi})"


def offsets(lo: int | None, hi: int | None) -> Offsets:
    """Each query sees the keys at offsets ``lo..hi`` from its bottom-right aligned position.

    A range that holds the query's own position (``lo <= 0 <= hi``) is a :class:`Window`, the same
    keys, which the engines run block-locally (the kernel's own causal mask, tiles past the range
    skipped): ``offsets(None, 0)`` is ``causal()``.
    """
    mask = Offsets(lo, hi)  # (its checks and messages)
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        return Window(None if lo is None else -lo, hi)
    return mask


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


def window_mask(left: int | None, right: int | None, sq: int, sk: int) -> Window | None:
    """A sequence's ``Window(left, right)`` of ``sq`` queries over ``sk`` keys (bottom-right aligned), or None where it
    hides no key (a decoding step's causal mask): the call then runs the plain kernel."""
    hides = (left is not None and left < sk - 1) or (right is not None and right < sq - 1)
    return Window(left, right) if hides else None


def window(left: int | None, right: int | None = 0) -> Window:
    """Sliding window: each query sees ``left`` keys before its position and ``right`` after.

    ``None`` leaves that side unbounded, as in :class:`Window`: ``window(None)`` is
    ``causal()``, ``window(None, 2)`` every past key and the next two.
    """
    return Window(left=left, right=right)
