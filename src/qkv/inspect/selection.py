"""Which weights ``qkv inspect`` asks for: every head and row, or only some.

Shape legend: ``l`` layers, ``h`` heads, ``i`` query rows, ``j`` keys.

All weights of a model are ``(l, h, i, j)``: for a sentence that is nothing, for a few
thousand tokens of a 30-layer model it is gigabytes. ``--heads`` and ``--rows`` choose a
subset; when neither is given and the whole would exceed :data:`PAGE_ELEMENTS`, rows are
chosen automatically (spread evenly over the text, the last one always included), as many
as fit in that budget, at most :data:`AUTO_ROWS`. Only the chosen weights are ever built (``qkv.attention``'s
``weights_for``), so the budget bounds the memory and the size of the page alike.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO_ROWS", "PAGE_ELEMENTS", "Selection", "SelectionError", "choose", "format_indices", "parse_indices", "spread"]

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


def parse_indices(option: str, text: str) -> tuple[int, ...]:
    """``"0,3,5-8"`` -> ``(0, 3, 5, 6, 7, 8)``: comma-separated integers and inclusive ranges."""
    values: set[int] = set()
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
        values.update(range(start, stop + 1))
    return tuple(sorted(values))


def _runs(values: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted distinct ``values`` as inclusive runs: ``(0, 1, 2, 7)`` -> ``[(0, 2), (7, 7)]``."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs


def _check(option: str, chosen: tuple[int, ...], size: int, what: str) -> None:
    # Name the ranges as the user wrote them (parse_indices expanded them): "--rows 0-1000" on
    # nine tokens is "got 0-1000", not the first bad value 9, a number the user never typed.
    outside = [(low, high) for low, high in _runs(chosen) if high >= size]
    if outside:
        given = ",".join(str(low) if low == high else f"{low}-{high}" for low, high in outside)
        raise SelectionError(f"{option}: expected values in 0..{size - 1} ({size} {what}), got {given}")


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
    rows_option: tuple[int, ...] | None = None,
    heads_option: tuple[int, ...] | None = None,
    budget: int = PAGE_ELEMENTS,
) -> Selection:
    """The selection for a text of ``tokens`` tokens in a model of ``layers`` x ``heads``.

    The user's ``--rows``/``--heads`` are checked against the sizes; without ``--rows``,
    rows are thinned to fit ``budget`` weights (``l * heads * rows * j``).
    """
    chosen_heads = tuple(range(heads)) if heads_option is None else heads_option
    _check("--heads", chosen_heads, heads, "heads per layer")
    automatic = False
    if rows_option is None:
        fit = max(1, budget // (layers * len(chosen_heads) * tokens))
        fit = fit if fit >= tokens else min(fit, AUTO_ROWS)
        rows = tuple(range(tokens)) if fit >= tokens else spread(fit, tokens)
        automatic = fit < tokens
    else:
        rows = rows_option
        _check("--rows", rows, tokens, "tokens in the text")
    return Selection(heads=chosen_heads, rows=rows, total_heads=heads, total_rows=tokens, automatic=automatic)


def format_indices(values: tuple[int, ...]) -> str:
    """The inverse of :func:`parse_indices` for sorted values: ``(0, 1, 2, 5, 7, 8)`` -> ``"0-2, 5, 7-8"``."""
    parts, start = [], None
    for index, value in enumerate(values):
        if start is None:
            start = value
        if index + 1 == len(values) or values[index + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)
