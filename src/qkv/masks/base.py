"""The mask contract (tiles, states), the combinations ``&`` and ``|``, and dense bool masks.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length; a tile
is the rectangle ``rows i0:i1`` x ``cols j0:j1`` of the ``(i, j)`` logits, ``it = i1 - i0``
and ``jt = j1 - j0`` its sides.

A mask produces any :class:`Tile` (``tile.py``) on demand (bool, True = may attend,
broadcastable to ``(b, h, it, jt)``) and says whether a tile is "empty" (skip it), "full"
(drop the mask) or "partial". The lazy masks of positions and of padding live beside this file.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._layout import merge_lead
from .._bools import any_along
from .._trace import concrete
from .tile import State, Tile


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

    def check(self, i_len: int, j_len: int) -> None:
        """Raise ``ValueError`` (naming ``mask``) if the mask was made for other query or key lengths."""

    def tensors(self) -> list[tuple[str, Tensor]]:
        """The tensors the tiles read, each with how the caller knows it (``"qkv.masks.lengths' key_lengths"``).

        ``qkv.checks`` names them when they cannot serve the call (a meta tensor has no values).
        """
        return []

    def describe(self) -> str:
        """What the caller passed, with the shape its batch dims came from, for messages.

        :meth:`batch_shape` is the mask's own view (``lengths`` of ``(b,)`` is ``(b, 1)``);
        a message quotes this instead, in the terms of the call that made the mask.
        """
        return f"{self!r} has batch dims {self.batch_shape()}"

    def reset(self) -> None:
        """Forget what was computed for an earlier call (a program's cached tile): a call starts afresh."""

    def offset_bounds(self) -> tuple[int | None, int | None] | None:
        """``(lo, hi)`` when the mask keeps exactly the keys at offsets ``lo .. hi`` (None: unbounded); else None."""
        return None

    def same_for_every_row(self) -> bool:
        """True when every query row keeps the same keys (key padding): its hidden keys are its masked keys."""
        return False

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        """``(j0, j1)``: keys outside it are masked for every row of ``t``'s rows (its columns ignored); None if unknown.

        Lets an engine skip, without asking any tile's state, the keys a block of rows
        cannot see (a packed batch's other documents, the future under a causal mask).
        """
        return None

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        """Bool ``(b|1, h|1, 1, j)``, True where a key is masked for every query row; None if unknown.

        What such a key holds (cache padding from ``torch.empty``: NaN, inf) must not reach
        an output, and ``0 · NaN`` in ``weights @ v`` would let it: ``qkv.backends.
        hidden_keys`` zeroes these keys when they hold a non-finite value. None is always
        safe (nothing is zeroed); masks of positions say None where some row sees every key
        (a square call), and name the keys beyond every row's range otherwise.
        """
        return None

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        """The same mask for inputs whose leading dims ``lead`` are merged into one batch dim.

        ``qkv.attention`` runs ``(x, …, b, h, i, d)`` inputs as ``(x·…·b, h, i, d)``;
        a mask that varies along those dims is merged the same way. A mask
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

    def __invert__(self) -> Mask:
        """No lazy complement (the algebra is ``&`` and ``|``): a ``TypeError`` that says how to write the mask meant.

        A range of offsets has its complement among the lazy masks, offsets again, which the
        message writes out; any other mask has it as a bool tensor. A ``~`` is often a habit
        from masks where True hides a key, which qkv's are not.
        """
        bounds = self.offset_bounds()
        if bounds is not None and bounds != (None, None):
            lo, hi = bounds
            parts = ([] if lo is None else [f"qkv.masks.offsets(None, {lo - 1})"]) + (
                [] if hi is None else [f"qkv.masks.offsets({hi + 1}, None)"]
            )
            hint = (
                f"the keys {self!r} hides are {' | '.join(parts)}, "
                f"and qkv masks are True = may attend (mask={self!r} needs no ~)"
            )
        else:
            hint = "pass its complement as a bool tensor, mask=~m.dense(i, j) (True = may attend)"
        raise TypeError(f"~{self!r}: lazy masks combine with & and | but have no complement; {hint}")


class Dense(Mask):
    """A bool tensor broadcastable to ``(..., i, j)``, sliced per tile.

    Its dims are read from the right, as broadcasting reads them: a 2-d mask is ``(i, j)``,
    never a ``(b, j)`` padding mask (which would be indistinguishable when ``b == i``); that
    one goes in as ``keep[:, None, None, :]`` or as :func:`~qkv.masks.lengths`.
    """

    def __init__(self, mask: Tensor):
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask: expected a bool tensor or a qkv.masks.Mask, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_floating_point and _zeros_and_ones(mask):
                # most often a tokenizer's attention_mask made float: as a bias, its 0/1 would shift
                # the logits by 1 and hide nothing, with no error
                hint = (
                    "it holds only 0 and 1, so it looks like a keep-mask of 0/1: pass mask=m.bool() (True = may attend), "
                    "or, if it is an additive bias (0 and -inf), bias="
                )
            elif mask.dtype.is_floating_point or mask.dtype.is_complex:
                hint = "pass a float tensor as bias= to add it to the logits"
            else:  # most often a tokenizer's 0/1 attention_mask
                hint = (
                    "a 0/1 integer mask becomes one with .bool(), and a tokenizer's (b, j) attention_mask "
                    "goes in as mask=attention_mask.bool()[:, None, None, :]"
                )
            raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}; {hint}")
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

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        m = self.mask
        m = m.reshape(*((1,) * (4 - m.dim())), *m.shape) if m.dim() < 4 else m
        # (b|1, h|1, i|1, j|1): any over the rows; leading dims beyond b were merged already
        return (~any_along(m, -2, keepdim=True)).expand(*m.shape[:-2], 1, j_len) if m.dim() == 4 else None

    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.mask.shape[:-2])

    def same_for_every_row(self) -> bool:
        return self.mask.dim() < 2 or self.mask.shape[-2] == 1

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [("a tensor", self.mask)]

    def describe(self) -> str:
        return f"got shape {tuple(self.mask.shape)}"

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        merged = merge_lead(self.mask, lead)
        return self if merged is self.mask else Dense(merged)

    def __repr__(self) -> str:
        return f"Dense(shape={tuple(self.mask.shape)})"


class _Pair(Mask):
    """Two masks combined (``&`` or ``|``): what does not depend on the operator."""

    op = ""

    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def batch_shape(self) -> tuple[int, ...]:
        return _longer(self.a.batch_shape(), self.b.batch_shape())

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        a, b = self.a.merge_lead(lead), self.b.merge_lead(lead)
        return self if a is self.a and b is self.b else type(self)(a, b)

    def check(self, i_len: int, j_len: int) -> None:
        self.a.check(i_len, j_len)
        self.b.check(i_len, j_len)

    def tensors(self) -> list[tuple[str, Tensor]]:
        return self.a.tensors() + self.b.tensors()

    def reset(self) -> None:
        self.a.reset()
        self.b.reset()

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        return _combine(self.a.key_bounds(t), self.b.key_bounds(t), self.op)

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        if self.op == "&":  # hidden by any part, and by the offset ranges together
            return _hidden_by_all(conjuncts(self), i_len, j_len)
        a, b = self.a.hidden_keys(i_len, j_len), self.b.hidden_keys(i_len, j_len)
        return None if a is None or b is None else a & b  # hidden by both

    def __repr__(self) -> str:
        return f"({self.a!r} {self.op} {self.b!r})"


def conjuncts(mask: Mask) -> list[Mask]:
    """The parts of ``a & b & ...`` (nested ``&`` flattened)."""
    return conjuncts(mask.a) + conjuncts(mask.b) if isinstance(mask, And) else [mask]


def _hidden_by_all(parts: list[Mask], i_len: int, j_len: int) -> Tensor | None:
    """Keys masked for every row by ``parts[0] & parts[1] & ...``: by one of them, or by their offset ranges together.

    Two ranges may each reach every key and still share none on any row (``window(0, 0) &
    offsets(None, -1)``: the diagonal and strictly the past), so ranges are intersected first.
    """
    bounds = [p.offset_bounds() for p in parts]
    ranges = [r for r in bounds if r is not None]
    found = None
    if len(ranges) > 1:
        los = [lo for lo, _ in ranges if lo is not None]
        his = [hi for _, hi in ranges if hi is not None]
        found = keys_outside(max(los) if los else None, min(his) if his else None, i_len, j_len)
        parts = [p for p, r in zip(parts, bounds) if r is None]
    for part in parts:
        hidden = part.hidden_keys(i_len, j_len)
        if hidden is not None:
            found = hidden if found is None else found | hidden
    return found


def keys_outside(lo: int | None, hi: int | None, i_len: int, j_len: int) -> Tensor | None:
    """Bool ``(1, 1, 1, j)``: keys no row's offsets ``lo .. hi`` reach; None where the rows together see every key.

    Rows ``0 .. i-1`` together see keys ``j - i + lo .. j - 1 + hi``; an empty range (``lo > hi``) none.
    """
    c = torch.arange(j_len)
    if lo is not None and hi is not None and lo > hi:
        return torch.ones(1, 1, 1, j_len, dtype=torch.bool)
    first = None if lo is None else j_len - i_len + lo
    last = None if hi is None else j_len - 1 + hi
    if (first is None or first <= 0) and (last is None or last >= j_len - 1):
        return None
    hidden = torch.zeros(j_len, dtype=torch.bool)
    if first is not None:
        hidden |= c < first
    if last is not None:
        hidden |= c > last
    return hidden.view(1, 1, 1, j_len)


class And(_Pair):
    """May attend where both masks allow."""

    op = "&"

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


class Or(_Pair):
    """May attend where either mask allows."""

    op = "|"

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


class _MergedLead(Mask):
    """Any mask whose tiles carry leading dims, with those dims merged into one (``Mask.merge_lead``)."""

    def __init__(self, mask: Mask, lead: tuple[int, ...]):
        self.mask, self.lead = mask, lead

    def tile(self, t: Tile) -> Tensor:
        return merge_lead(self.mask.tile(t), self.lead)

    def state(self, t: Tile) -> State:
        return self.mask.state(t)

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        hidden = self.mask.hidden_keys(i_len, j_len)
        return None if hidden is None else merge_lead(hidden, self.lead)

    def same_for_every_row(self) -> bool:
        return self.mask.same_for_every_row()

    def batch_shape(self) -> tuple[int, ...]:
        *own, heads = self.mask.batch_shape()
        return (1 if all(n == 1 for n in own) else math.prod(self.lead), heads)

    def __repr__(self) -> str:
        return f"{self.mask!r}.merge_lead({self.lead})"


def _combine(a: tuple[int, int] | None, b: tuple[int, int] | None, op: str) -> tuple[int, int] | None:
    """Key bounds of ``a & b`` (the intersection; either alone bounds it) or ``a | b`` (the union; both needed)."""
    if op == "&":
        if a is None or b is None:
            return a if b is None else b
        return max(a[0], b[0]), max(max(a[0], b[0]), min(a[1], b[1]))
    if a is None or b is None:
        return None
    return min(a[0], b[0]), max(a[1], b[1])


def _zeros_and_ones(mask: Tensor) -> bool:
    """Whether ``mask`` holds values, and only 0s and 1s (False where no value may be read: traced, meta)."""
    return mask.numel() > 0 and concrete(mask) and bool(((mask == 0) | (mask == 1)).all())


def _longer(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return a if len(a) >= len(b) else b


def as_mask(mask: Mask | Tensor | None) -> Mask | None:
    """Wrap a bool tensor as :class:`Dense`; pass masks and None through; reject anything else."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return Dense(mask)
    raise TypeError(f"mask: expected a bool tensor or a qkv.masks.Mask, got {type(mask).__name__}")
