"""Markdown pieces shared by the suites: tables and a targets list with met / not met."""

from __future__ import annotations

import math


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A markdown table as a list of lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines


class Targets:
    """Targets of a suite, each with its measured figure and whether it was met."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, bool, str]] = []

    def add(self, what: str, figure: float, bound: float, *, higher: bool = False, unit: str = "") -> bool:
        """Record ``figure`` against ``bound`` (``figure <= bound``, or ``>=`` with ``higher``)."""
        met = (figure >= bound if higher else figure <= bound) if math.isfinite(figure) else False
        self.rows.append((what, figure, bound, met, unit))
        return met

    def lines(self) -> list[str]:
        rows = [[what, f"{figure:.3g}{unit}", "met" if met else "**not met**"] for what, figure, _, met, unit in self.rows]
        return table(["target", "measured", "status"], rows)
