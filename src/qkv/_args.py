"""Argument checks shared by every layer (imports nothing from qkv, so any file may use it)."""

from __future__ import annotations

import math
import numbers


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1, else ``ValueError`` naming the argument."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def finite_number(name: str, value: object, *, above: float | None = None) -> float:
    """``value`` as a float if it is a finite real number (numpy's too), greater than ``above`` where given, else
    ``TypeError``/``ValueError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite number, got {type(value).__name__}")
    if not math.isfinite(value) or (above is not None and not value > above):
        raise ValueError(f"{name}: expected a finite number{'' if above is None else f' > {above:g}'}, got {value!r}")
    return float(value)


def probability(name: str, value: object) -> float:
    """``value`` as a float if it lies in [0, 1), else ``TypeError``/``ValueError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1), got {value}")
    return float(value)


def int_at_least(low: int, what: str):
    """An argparse ``type``: the text as an int ``>= low``, else one line naming ``what`` was expected."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse

def meta_fix(device: object, owner: str = "") -> str:
    """How to bring parameters on meta to ``device``: ``.to()`` cannot copy out of meta (no values there)."""
    return f"make them with {owner}.to_empty(device='{device}') and load its weights"
