"""Heatmaps of attention: one matrix, a grid of heads, an alignment, and a mask's tiles.

Shape legend: ``h`` heads, ``i`` query length (rows), ``j`` key length (columns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .figure import _CELL, _GRID_SIDE, _MARGIN, MAX_INCHES, MAX_PANELS, _array, _draw, _figure, _fit, _labels


def heatmap(
    weights: Any,
    x_labels: Sequence[Any] | str | None = None,
    y_labels: Sequence[Any] | str | None = None,
    *,
    title: str | None = None,
    ax: Any = None,
    colorbar_label: str = "attention weight",
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
    cmap: str = "viridis",
) -> Any:
    """Heatmap of one attention matrix ``weights (i, j)``: rows are queries, columns keys.

    ``x_labels`` (``j`` of them) name the keys and ``y_labels`` (``i``) the queries; a
    string is taken as one label per character. The colour scale is fixed to
    ``vmin..vmax`` (0..1 for weights; pass None for the data's range). With ``ax`` the
    plot goes onto an existing axes and its figure is returned.

    Size cap: a cell is 0.26 inch while the figure fits, and neither side of the figure
    exceeds :data:`MAX_INCHES` (20 inches, 3000 pixels at :func:`save`'s 150 dpi): more
    rows or columns get smaller cells. An axis of more than :data:`MAX_LABELS` (80) cells
    is drawn without its labels, with position ticks. Every value is drawn all the same
    (one ``imshow`` of the whole array); past about 2500 a side, several share a pixel.
    """
    array = _array("weights", weights, 2, "(i, j)")
    rows, cols = array.shape
    xs = _labels("x_labels", x_labels, cols, "key, j")
    ys = _labels("y_labels", y_labels, rows, "query, i")
    if ax is None:
        figure = _figure(*_fit(_MARGIN + 1.0, _CELL * max(cols, 8), _MARGIN, _CELL * max(rows, 6)))
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    image = _draw(ax, array, xs, ys, vmin, vmax, cmap)
    figure.colorbar(image, ax=ax, label=colorbar_label, shrink=0.9)
    if title:
        ax.set_title(title)
    return figure


def head_grid(
    weights: Any,
    x_labels: Sequence[Any] | str | None = None,
    y_labels: Sequence[Any] | str | None = None,
    *,
    cols: int | None = None,
    title: str | None = None,
    colorbar_label: str = "attention weight",
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
) -> Any:
    """One heatmap per head of ``weights (h, i, j)``, sharing one colorbar (0..1 by default).

    Panels are laid out ``cols`` to a row (default: up to 4, or a square grid past 16 heads);
    at most :data:`MAX_PANELS` (256) heads, and 16 panels a row or column. The figure has ``h`` panel
    axes plus one colorbar axes. Tick labels are drawn on the outer edge of the grid only.
    All panels share the scale ``vmin..vmax``; None uses the data's range over all heads.
    The figure is capped as :func:`heatmap`'s is: at most :data:`MAX_INCHES` a side, and no
    labels along an axis of more than :data:`MAX_LABELS` cells.
    """
    array = _array("weights", weights, 3, "(h, i, j)")
    heads, rows, columns = array.shape
    xs = _labels("x_labels", x_labels, columns, "key, j")
    ys = _labels("y_labels", y_labels, rows, "query, i")
    if heads > MAX_PANELS:
        raise ValueError(f"weights: expected at most {MAX_PANELS} heads (one panel each, in at most {MAX_INCHES:g} "
                         f"inches), got {heads}; draw some of them, e.g. weights[:{MAX_PANELS}]")  # fmt: skip
    if cols is None:
        # Four to a row reads well for a few heads; many would make a column taller than MAX_INCHES.
        cols = min(heads, 4) if heads <= 16 else math.ceil(math.sqrt(heads))
    elif isinstance(cols, bool) or not isinstance(cols, int) or cols < 1:
        raise ValueError(f"cols: expected a positive integer, got {cols!r}")
    grid_rows = -(-heads // cols)
    if max(cols, grid_rows) > _GRID_SIDE:
        raise ValueError(f"cols: {cols} to a row makes a grid of {grid_rows} x {cols} panels for {heads} heads; "
                         f"at most {_GRID_SIDE} a side fit in {MAX_INCHES:g} inches")  # fmt: skip
    cell = _CELL * (0.6 if heads > 1 else 1.0)  # panels side by side may be a bit denser
    # The fixed parts (an inch a panel for its ticks and title, less in a grid of more than 8 a
    # side, so they never take more than 8 inches; the colorbar; the suptitle) stay, and the
    # cells shrink when the whole would pass MAX_INCHES.
    margin = min(1.0, 8.0 / max(cols, grid_rows))
    figure = _figure(*_fit(cols * margin + 1.5, cols * cell * max(columns, 6), grid_rows * margin + 0.6,
                           grid_rows * cell * max(rows, 6)))  # fmt: skip
    low = float(array.min()) if vmin is None else vmin
    high = float(array.max()) if vmax is None else vmax
    axes = figure.subplots(grid_rows, cols, squeeze=False).flat
    panels = []
    for index, ax in enumerate(axes):
        if index >= heads:
            ax.remove()  # an incomplete last row keeps no empty frames
            continue
        # One scale for all panels (the data's range if vmin/vmax are None), so colours
        # compare across heads and the single colorbar is true for every panel.
        image = _draw(ax, array[index], xs, ys, low, high, "viridis")
        # Tick labels only on the outer edge (lowest panel of each column, first column):
        # repeated inside the grid they would collide with the neighbouring panels.
        if xs is None or index + cols < heads:
            ax.set_xticks([])
        if ys is None or index % cols:
            ax.set_yticks([])
        ax.set_title(f"head {index}", fontsize=9)
        panels.append(ax)
    figure.colorbar(image, ax=panels, label=colorbar_label, shrink=0.9)
    if title:
        figure.suptitle(title)
    return figure


def alignment(
    weights: Any,
    source_tokens: Sequence[Any] | str,
    target_tokens: Sequence[Any] | str,
    *,
    title: str | None = None,
    ax: Any = None,
) -> Any:
    """The classic alignment picture: ``weights (i, j)`` of output over input tokens.

    Rows are the ``i`` output (target) tokens, columns the ``j`` input (source) tokens;
    strings are split into characters, so a character-level model's weights can be
    passed with the raw strings.
    """
    figure = heatmap(weights, list(source_tokens), list(target_tokens), title=title, ax=ax)
    ax = figure.axes[0] if ax is None else ax
    ax.set_xlabel("input")
    ax.set_ylabel("output")
    # Input along the top reads like the sentence being translated, as in the paper.
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    return figure


def tile_states(mask: Any, i: int, j: int, *, tile: int = 64, title: str | None = None, ax: Any = None) -> Any:
    """The tiles of a ``qkv.masks`` mask as the engines see them: skipped, computed whole, or masked.

    Each ``tile × tile`` square of the ``(i, j)`` logits is coloured by ``mask.state``:
    "empty" (never computed), "full" (computed without a mask) or "partial" (computed with
    the mask). A packed batch's documents show as squares on the diagonal. The figure is at
    most :data:`MAX_INCHES` a side (many tiles share a pixel there).
    """
    from ..masks import Tile

    rows, cols = -(-i // tile), -(-j // tile)
    code = {"empty": 0.0, "full": 1.0, "partial": 0.5}
    grid = np.zeros((rows, cols))
    for a in range(rows):
        for b in range(cols):
            t = Tile(a * tile, min(i, (a + 1) * tile), b * tile, min(j, (b + 1) * tile), i, j)
            grid[a, b] = code[mask.state(t)]
    if ax is None:
        figure = _figure(min(MAX_INCHES, _MARGIN + 1.5 + 0.12 * max(cols, 24)), min(MAX_INCHES, _MARGIN + 0.12 * max(rows, 24)))
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#f4f4f4", "#e0a030", "#2b5d8a"])
    image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto",
                      extent=(0, j, i, 0))  # fmt: skip
    bar = figure.colorbar(image, ax=ax, ticks=[1 / 6, 0.5, 5 / 6], shrink=0.8)
    bar.ax.set_yticklabels(["skipped", "masked", "unmasked"])
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    return figure
