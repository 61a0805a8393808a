"""Markdown pieces shared by the suites: tables and a targets list with met / not met."""

from __future__ import annotations

import math

import torch


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A markdown table as a list of lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines


class Targets:
    """Targets of a suite, each with its measured figure and whether it was met."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, bool, bool, str]] = []

    def add(self, what: str, figure: float, bound: float, *, higher: bool = False, unit: str = "") -> bool:
        """Record ``figure`` against ``bound`` (``figure <= bound``, or ``>=`` with ``higher``)."""
        met = (figure >= bound if higher else figure <= bound) if math.isfinite(figure) else False
        self.rows.append((what, figure, bound, met, higher, unit))
        return met

    def lines(self) -> list[str]:
        rows = [[what, f"{figure_text(figure, bound, met, higher)}{unit}", "met" if met else "**not met**"]
                for what, figure, bound, met, higher, unit in self.rows]  # fmt: skip
        return table(["target", "measured", "status"], rows)


def figure_text(figure: float, bound: float, met: bool, higher: bool = False) -> str:
    """``figure`` to three significant digits, or as many more as it takes for the text to fall on the side of
    ``bound`` that ``met`` says (1.004 against a bound of 1.0 reads 1.004, not 1, beside "not met")."""
    for digits in range(3, 10):
        text = f"{figure:.{digits}g}"
        shown = float(text)
        if not math.isfinite(figure) or (shown >= bound if higher else shown <= bound) == met:
            return text
    return repr(figure)


def ms(seconds: float) -> str:
    """Seconds as milliseconds, two decimals."""
    return f"{seconds * 1e3:.2f}"


def same_answer(got: torch.Tensor, want: torch.Tensor, what: str, against: str) -> None:
    """Raise unless ``got`` (``what``'s answer) is ``want`` (``against``'s) within 1e-4: a timing compares one answer."""
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{what} differs from {against} by {(got - want).abs().max():.2e}")
