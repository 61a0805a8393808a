"""Which weights ``qkv inspect`` asks for: every head and row, or only some.

Shape legend: ``l`` layers, ``h`` heads, ``i`` query rows, ``j`` keys.

All weights of a model are ``(l, h, i, j)``: for a sentence that is nothing, for a few
thousand tokens of a 30-layer model it is gigabytes. ``--heads`` and ``--rows`` choose a
subset; when neither is given and the whole would exceed :data:`PAGE_ELEMENTS`, rows are
chosen automatically (spread evenly over the text, the last one always included), as many
as fit in that budget, at most :data:`AUTO_ROWS`. Only the chosen weights are ever built (``qkv.attention``'s
``weights_for``), so the budget bounds the memory and the size of the page alike.

``--rows``/``--heads`` are parsed into :class:`Indices`, inclusive runs such as ``0-1000000000``
kept as two numbers, and checked against the text and the model (:func:`choose`) before they
are expanded: the number of tokens is known only after the model's tokenizer has run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

__all__ = ["AUTO_ROWS", "PAGE_ELEMENTS", "Indices", "Selection", "SelectionError", "choose", "format_indices",
           "parse_indices", "parse_ranges", "spread"]  # fmt: skip

#: Most weights (layers x heads x rows x keys) kept without an explicit --rows/--heads:
#: 4 Mi values are 8 MiB in the page (16-bit fixed point) and 16 MiB in memory (float32).
PAGE_ELEMENTS = 2**22

#: Most rows chosen automatically: more would make the head view a very long column.
AUTO_ROWS = 32


class SelectionError(ValueError):
    """A --rows/--heads/--layer/--head value that does not fit the model or the text."""


@dataclass(frozen=True)
class Selection:
    """The weights to build: ``heads`` and ``rows`` (sorted, distinct), of ``h`` and ``i``."""

    heads: tuple[int, ...]  # chosen query heads, in [0, h)
    rows: tuple[int, ...]  # chosen query rows (token positions), in [0, i)
    total_heads: int  # h: query heads per layer in the model
    total_rows: int  # i: tokens in the text
    automatic: bool  # rows were chosen by the size budget, not by the user

    @property
    def complete(self) -> bool:
        """Every head and every row: the full ``(l, h, i, j)``."""
        return len(self.heads) == self.total_heads and len(self.rows) == self.total_rows

    def weights_for(self) -> dict[str, list[int]] | None:
        """The ``weights_for`` argument of ``qkv.attention``: None when nothing is left out."""
        spec = {}
        if len(self.heads) < self.total_heads:
            spec["heads"] = list(self.heads)
        if len(self.rows) < self.total_rows:
            spec["rows"] = list(self.rows)
        return spec or None


class Indices(Sequence[int]):
    """Sorted distinct indices held as inclusive runs: ``0-1000000000`` is one pair, not a billion ints.

    A read-only sequence of its values (``len``, ``in``, indexing and iteration are computed
    from the runs), equal to the tuple of those values, so ``parse_ranges(o, "0-2") == (0, 1, 2)``.
    ``str`` gives the runs as ``--rows`` takes them (``"0-3,7"``).
    """

    __slots__ = ("runs",)

    def __init__(self, runs: Sequence[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for low, high in sorted(runs):  # overlapping or touching runs become one: "3-5,4-9" is 3-9
            if merged and low <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
            else:
                merged.append((low, high))
        self.runs: tuple[tuple[int, int], ...] = tuple(merged)

    def __len__(self) -> int:
        return sum(high - low + 1 for low, high in self.runs)

    def __contains__(self, value: object) -> bool:
        try:
            value = operator.index(value)  # ints and numpy's integers; not 2.0 or "2"
        except TypeError:
            return False
        return any(low <= value <= high for low, high in self.runs)

    def __iter__(self) -> Iterator[int]:
        for low, high in self.runs:
            yield from range(low, high + 1)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        position = index + len(self) if index < 0 else index
        for low, high in self.runs:
            if 0 <= position <= high - low:
                return low + position
            position -= high - low + 1
        raise IndexError(f"index {index} out of range for {len(self)} indices")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Indices):
            return self.runs == other.runs
        if isinstance(other, (tuple, list)):  # lengths first: a short tuple never expands a long run
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # equal to tuples of other hashes; unhashable, like a list

    def __str__(self) -> str:
        return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in self.runs)

    def __repr__(self) -> str:
        return f"Indices({str(self)!r})"


def parse_ranges(option: str, text: str) -> Indices:
    """``"0,3,5-8"`` -> :class:`Indices` of ``0, 3, 5, 6, 7, 8``, ranges kept as runs (not expanded)."""
    runs: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            start = int(low)
            stop = int(high) if dash else start
        except ValueError:
            raise SelectionError(
                f"{option}: expected integers and ranges such as 0,3,5-8, got {text!r}"
            ) from None
        if start < 0 or stop < start:
            raise SelectionError(f"{option}: expected ranges low-high with 0 <= low <= high, got {part!r}")
        runs.append((start, stop))
    return Indices(runs)


def parse_indices(option: str, text: str) -> tuple[int, ...]:
    """``"0,3,5-8"`` -> ``(0, 3, 5, 6, 7, 8)``: comma-separated integers and inclusive ranges.

    Expanded at once: for a value not yet checked against a size, use :func:`parse_ranges`.
    """
    return tuple(parse_ranges(option, text))


def _runs(values: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted distinct ``values`` as inclusive runs: ``(0, 1, 2, 7)`` -> ``[(0, 2), (7, 7)]``."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs


def _runs_of(values: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The runs of ``values``: read off :class:`Indices`, computed for any other sequence."""
    return values.runs if isinstance(values, Indices) else tuple(_runs(tuple(sorted(set(values)))))


def _check(option: str, chosen: Sequence[int], size: int, what: str) -> tuple[int, ...]:
    """``chosen`` as a tuple once every value is below ``size``; else SelectionError naming the runs outside.

    The check looks at the runs only, so ``--rows 0-1000000000`` is refused at once, never
    expanded. It names the ranges as the user wrote them: "--rows 0-1000" on nine tokens is
    "got 0-1000", not the first bad value 9, a number the user never typed.
    """
    outside = [(low, high) for low, high in _runs_of(chosen) if high >= size]
    if outside:
        given = ",".join(str(low) if low == high else f"{low}-{high}" for low, high in outside)
        raise SelectionError(f"{option}: expected values in 0..{size - 1} ({size} {what}), got {given}")
    return tuple(chosen)


def spread(count: int, size: int) -> tuple[int, ...]:
    """``count`` rows spread evenly over ``0..size-1``: the ends of ``count`` equal parts.

    The last row is always in; the first is not (unless every row is): in a decoder it can
    only see itself, in an encoder it is usually [CLS].
    """
    if count >= size:
        return tuple(range(size))
    return tuple(round((k + 1) * size / count) - 1 for k in range(count))


def choose(
    *,
    layers: int,
    heads: int,
    tokens: int,
    rows_option: Sequence[int] | None = None,
    heads_option: Sequence[int] | None = None,
    budget: int = PAGE_ELEMENTS,
) -> Selection:
    """The selection for a text of ``tokens`` tokens in a model of ``layers`` x ``heads``.

    The user's ``--rows``/``--heads`` (tuples, or :class:`Indices` from :func:`parse_ranges`)
    are checked against the sizes before they are expanded; without ``--rows``, rows are
    thinned to fit ``budget`` weights (``l * heads * rows * j``).
    """
    chosen_heads = tuple(range(heads)) if heads_option is None else _check("--heads", heads_option, heads,
                                                                             "heads per layer")  # fmt: skip
    automatic = False
    if rows_option is None:
        fit = max(1, budget // (layers * len(chosen_heads) * tokens))
        fit = fit if fit >= tokens else min(fit, AUTO_ROWS)
        rows = tuple(range(tokens)) if fit >= tokens else spread(fit, tokens)
        automatic = fit < tokens
    else:
        rows = _check("--rows", rows_option, tokens, "tokens in the text")
    return Selection(heads=chosen_heads, rows=rows, total_heads=heads, total_rows=tokens, automatic=automatic)


def format_indices(values: Sequence[int]) -> str:
    """The inverse of :func:`parse_indices`: ``(0, 1, 2, 5, 7, 8)`` -> ``"0-2, 5, 7-8"``.

    Sorted first; :class:`Indices` are read from their runs, never expanded.
    """
    return ", ".join(str(low) if low == high else f"{low}-{high}" for low, high in _runs_of(values))
