"""Line and table plots: a positional encoding's table, RoPE's relative property, curves along a sequence.

Shape legend: ``p`` positions and ``c`` feature dimensions of a positional table; ``m``
curves and ``r`` relative offsets of a RoPE plot; ``n`` points of a line plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .figure import _array, _figure


def positional_encoding(
    table: Any, *, title: str | None = None, ax: Any = None, colorbar_label: str = "value"
) -> Any:
    """A positional encoding ``table (p, c)``: positions down, feature dimensions across.

    Drawn on a diverging colour scale symmetric about zero, since sinusoidal features
    are signed.
    """
    array = _array("table", table, 2, "(positions, dims)")
    limit = float(np.abs(array).max()) or 1.0
    if ax is None:
        figure = _figure(7.0, 4.5)
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    image = ax.imshow(array, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto",
                      interpolation="nearest")
    figure.colorbar(image, ax=ax, label=colorbar_label)
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    if title:
        ax.set_title(title)
    return figure


def rope_relative(
    scores: Any,
    relative: Any,
    *,
    positions: Sequence[Any] | None = None,
    title: str | None = None,
    ax: Any = None,
) -> Any:
    """RoPE's defining property: ``q_m . k_n`` depends only on ``m - n``.

    ``scores (m, r)`` holds one curve per query position (row ``a`` is ``q_m . k_n`` over
    a range of ``n``) and ``relative`` the matching offsets ``m - n``, either ``(r,)``
    shared by all curves or ``(m, r)``. ``positions`` (``m`` of them) label the curves.
    With RoPE the curves lie on top of each other; the arrays are computed by the caller.
    """
    values = _array("scores", scores, 2, "(m, r)")
    offsets = np.asarray(relative.detach().cpu().numpy() if hasattr(relative, "detach") else relative,
                         dtype=float)
    if offsets.shape == values.shape[1:]:
        offsets = np.broadcast_to(offsets, values.shape)
    elif offsets.shape != values.shape:
        raise ValueError(
            f"relative: expected shape {values.shape[1:]} or {values.shape} to match scores, "
            f"got {offsets.shape}"
        )
    if positions is not None and len(positions) != len(values):
        raise ValueError(
            f"positions: expected {len(values)} labels (one per curve, m), got {len(positions)}"
        )
    if ax is None:
        figure = _figure(7.0, 4.0)
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    for index, (x, y) in enumerate(zip(offsets, values)):
        label = f"m = {positions[index]}" if positions is not None else f"curve {index}"
        # Thinner later lines keep earlier ones visible where the curves coincide.
        ax.plot(x, y, linewidth=2.5 - 1.5 * index / max(len(values) - 1, 1), label=label, alpha=0.85)
    ax.axvline(0.0, color="0.6", linewidth=0.8)
    ax.set_xlabel("m \u2212 n (query position minus key position)")
    ax.set_ylabel("q\u2098 \u00b7 k\u2099")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return figure


def curves(
    x: Any,
    ys: dict[str, Any],
    *,
    xlabel: str,
    ylabel: str,
    marks: dict[str, float] | None = None,
    log_y: bool = False,
    title: str | None = None,
    ax: Any = None,
) -> Any:
    """One line per entry of ``ys`` (label -> values over ``x``), e.g. a measure along a sequence.

    ``marks`` draws labelled vertical lines (label -> x), such as a training length.
    """
    xs = _array("x", x, 1, "(n,)")
    lines = {label: _array(f"ys[{label!r}]", y, 1, "(n,)") for label, y in ys.items()}
    for label, y in lines.items():
        if y.shape != xs.shape:
            raise ValueError(f"ys[{label!r}]: expected shape {xs.shape} like x, got {y.shape}")
    if ax is None:
        figure = _figure(7.0, 4.0)
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    for label, y in lines.items():
        ax.plot(xs, y, linewidth=1.8, label=label)
    for label, at in (marks or {}).items():
        ax.axvline(at, color="0.5", linewidth=0.9, linestyle="--")
        ax.annotate(label, (at, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="0.35")  # fmt: skip
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return figure
