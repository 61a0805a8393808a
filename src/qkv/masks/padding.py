"""Masks of padding: per batch row, the keys that are real (right padding) or the first real key (left padding).

Shape legend: ``b`` batch, ``j`` key length; a tile is ``(b, 1, 1, jt)``.

The per-row tensors are read once, when the mask is made, so that ``state`` (called once
per tile) reads no tensor; where values cannot be read (tracing, meta tensors) every tile
is "partial": the same result, with no tile skipped.

Below them, padding found in any mask (:func:`padding_of`): a ``lengths`` or ``starts`` part
of a top-level ``&``, or a dense ``(b|1, 1, 1, j)`` bool mask keeping a prefix or a suffix of
each row's keys (SDPA's dialect passes padding so), which the segments backend runs row by
row; :func:`pull` takes such a part out of a conjunction (``documents_of`` uses it too).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .._trace import concrete, version
from .base import And, Dense, Mask, State, Tile


def _per_row(name: str, values: object, what: str) -> tuple[int, int]:
    """Check a ``(b,)`` integer tensor of non-negative key positions; return its (min, max) as ints.

    The two ints are kept by the mask so that ``state`` (called once per tile) reads no tensor.
    Where values cannot be read (traced by torch.compile or torch.export, meta tensors) it
    returns ``(0, -1)``, an empty range that makes ``state`` answer "partial" for every tile:
    the same result, with no tile skipped.
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
    low, high = torch.stack(torch.aminmax(values)).tolist()  # one host read (on a GPU each waits for the stream)
    if low < 0:
        raise ValueError(f"{name}: expected non-negative {what}, got {values.tolist()}")
    return low, high


def _is_current(values: Tensor, read_at: int | None) -> bool:
    """Whether ``values`` is unchanged since its version was ``read_at``: a user who changes a mask's tensor in place,
    against its docs, gets no answer built from the numbers read before (``key_bounds``, ``state``) where this is
    asked. A tensor made under ``torch.inference_mode`` keeps no version: taken as unchanged."""
    return read_at is None or version(values) == read_at


class Lengths(Mask):
    """Key padding on the right: in batch row ``n`` only the first ``key_lengths[n]`` keys are real.

    ``key_lengths`` has shape ``(b,)``; the tile is ``(b, 1, 1, jt)``. The tensor is read
    once, when the mask is made (do not change it in place afterwards).
    """

    def __init__(self, key_lengths: Tensor):
        self._shortest, self._longest = _per_row("key_lengths", key_lengths, "lengths")
        self.key_lengths = key_lengths
        self._read_at = version(key_lengths)

    def read_is_current(self) -> bool:
        """Whether the numbers read when the mask was made still describe ``key_lengths`` (see :func:`_is_current`)."""
        return _is_current(self.key_lengths, self._read_at)

    def tile(self, t: Tile) -> Tensor:
        lengths = self.key_lengths.to(t.device)
        return (t.cols[None, :] < lengths[:, None])[:, None, None, :]  # (b, 1, 1, jt)

    def same_for_every_row(self) -> bool:
        return True

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

    def check(self, i_len: int, j_len: int) -> None:
        if self._longest > j_len:  # (unread values: _longest is -1) a length past the keys is a misread count
            raise ValueError(f"mask: qkv.masks.lengths got a row of {self._longest} keys, but the call has j = {j_len} "
                             "keys (a length counts a row's real keys, at most j)")  # fmt: skip

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [("qkv.masks.lengths' key_lengths", self.key_lengths)]

    def describe(self) -> str:
        return f"qkv.masks.lengths got key_lengths of shape {tuple(self.key_lengths.shape)}, one per batch row"

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        return self if len(lead) <= 1 else Lengths(self.key_lengths.expand(*lead).reshape(-1))

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        return None if self._longest < self._shortest else (0, min(t.j_len, self._longest))

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        if self._shortest >= j_len:  # no padding: nothing to hide, no tensor built
            return None
        return self.tile(Tile.whole(i_len, j_len, self.key_lengths.device)).logical_not()

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
        self._read_at = version(key_starts)

    def read_is_current(self) -> bool:
        """Whether the numbers read when the mask was made still describe ``key_starts`` (see :func:`_is_current`)."""
        return _is_current(self.key_starts, self._read_at)

    def tile(self, t: Tile) -> Tensor:
        starts = self.key_starts.to(t.device)
        return (t.cols[None, :] >= starts[:, None])[:, None, None, :]  # (b, 1, 1, jt)

    def same_for_every_row(self) -> bool:
        return True

    def state(self, t: Tile) -> State:
        if self._last < self._first:  # values unread (tracing, meta): keep every tile
            return "partial"
        if t.j0 >= self._last:
            return "full"
        if t.j1 <= self._first:
            return "empty"
        return "partial"

    def check(self, i_len: int, j_len: int) -> None:
        if self._last > j_len:  # (a start of j: a row of padding only, which sees no key)
            raise ValueError(f"mask: qkv.masks.starts got a row starting at key {self._last}, but the call has j = "
                             f"{j_len} keys (a start is the first real key, at most j)")  # fmt: skip

    def batch_shape(self) -> tuple[int, ...]:
        return (self.key_starts.shape[0], 1)

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [("qkv.masks.starts' key_starts", self.key_starts)]

    def describe(self) -> str:
        return f"qkv.masks.starts got key_starts of shape {tuple(self.key_starts.shape)}, one per batch row"

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        return self if len(lead) <= 1 else Starts(self.key_starts.expand(*lead).reshape(-1))

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        return None if self._last < self._first else (min(t.j_len, self._first), t.j_len)

    def hidden_keys(self, i_len: int, j_len: int) -> Tensor | None:
        if self._first <= self._last and self._last <= 0:  # no padding: nothing to hide
            return None
        return self.tile(Tile.whole(i_len, j_len, self.key_starts.device)).logical_not()

    def __repr__(self) -> str:
        return f"starts({self.key_starts.tolist()})"


def starts(key_starts: Tensor) -> Starts:
    """Left-padding mask from the index of the first real key per batch row, ``(b,)``."""
    return Starts(key_starts)


# --------------------------------------------------------------- padding found in any mask


def pull(mask: Mask | None, found: Callable[[Mask], Mask | None]):
    """``(part, rest)``: the first operand of a top-level ``&`` (searched depth first) that ``found`` turns
    into a part, and the mask without it; ``(None, mask)`` when there is none."""
    if mask is None:
        return None, None
    part = found(mask)
    if part is not None:
        return part, None
    if isinstance(mask, And):
        part, rest = pull(mask.a, found)
        if part is not None:
            return part, (mask.b if rest is None else And(rest, mask.b))
        part, rest = pull(mask.b, found)
        if part is not None:
            return part, (mask.a if rest is None else And(mask.a, rest))
    return None, mask


def padding_of(mask: Mask | None) -> tuple[Lengths | Starts | None, Mask | None]:
    """``(padding, rest)`` of a mask ``lengths(n) & rest`` or ``starts(n) & rest`` (a top-level ``&``), else ``(None, mask)``.

    A dense key-padding mask ``(b|1, 1, 1, j)`` whose every row keeps a prefix (or every row a
    suffix) of the keys counts as ``lengths`` (``starts``): SDPA's dialect passes padding so.
    Its values are read: ask :func:`may_be_padded` first, which reads none.
    """

    def found(m: Mask) -> Lengths | Starts | None:
        if isinstance(m, (Lengths, Starts)):
            return m
        return _dense_padding(m.mask) if _key_padding_shaped(m) else None

    return pull(mask, found)


def may_be_padded(mask: Mask | None) -> bool:
    """Whether :func:`padding_of` could find padding in ``mask`` (its structure alone: no value read)."""
    if isinstance(mask, (Lengths, Starts)) or _key_padding_shaped(mask):
        return True
    return isinstance(mask, And) and (may_be_padded(mask.a) or may_be_padded(mask.b))


def _key_padding_shaped(mask: Mask | None) -> bool:
    """A dense bool CPU mask ``(b|1, 1, 1, j)``: one keep-row per batch row, which may be padding.

    Not ``(b|1, 1, 1, 1)``: that one value is broadcast over every key, not a row of one key.
    """
    keep = mask.mask if isinstance(mask, Dense) else None
    if keep is None or keep.dtype != torch.bool or keep.device.type != "cpu":
        return False
    return keep.dim() == 4 and keep.shape[1:3] == (1, 1) and keep.shape[-1] > 1


def _dense_padding(keep: Tensor) -> Lengths | Starts | None:
    """``keep (b|1, 1, 1, j)`` as right or left padding, where it is one (its values readable); else None."""
    if not concrete(keep):
        return None
    rows = keep.reshape(keep.shape[0], keep.shape[-1])
    counts = rows.sum(-1)
    cols = torch.arange(rows.shape[-1])
    if torch.equal(rows, cols[None, :] < counts[:, None]):
        return Lengths(counts)
    if torch.equal(rows, cols[None, :] >= (rows.shape[-1] - counts)[:, None]):
        return Starts(rows.shape[-1] - counts)
    return None


def padding_ends(pad: Lengths | Starts) -> Tensor:
    """Each row's ``(b,)`` key count (right padding) or first real key (left padding)."""
    return pad.key_lengths if isinstance(pad, Lengths) else pad.key_starts
