"""Plots of attention weights, alignments and positional encodings.

Shape legend: ``h`` heads, ``i`` query length (rows), ``j`` key length (columns);
``p`` positions and ``c`` feature dimensions of a positional table; ``m`` curves and
``r`` relative offsets of a RoPE plot; ``n`` points of a line plot.

Every function returns a ``matplotlib.figure.Figure``, which a notebook displays when it is
the value of a cell; :func:`save` writes it to PNG, SVG or PDF. Figures are built
without pyplot on the non-interactive Agg canvas: nothing opens a window, nothing needs
a display, and figures are not kept alive by pyplot's global registry (so plotting in a
loop does not leak memory or trigger "More than 20 figures" warnings).

Readability at 40 tokens is a tested property: cells get a fixed physical size, the font
shrinks with the number of labels down to a floor, every label is drawn (none thinned
out), and multi-character column labels are rotated so they never overlap. Large arrays
stay one picture of a bounded size: a heatmap's figure is at most :data:`MAX_INCHES` a side
(3000 pixels at :func:`save`'s 150 dpi), its cells shrink to fit, and an axis with more than
:data:`MAX_LABELS` rows or columns gets position ticks instead of one label per cell (the
rule ``qkv inspect`` follows for its PNGs); every value is still drawn, by one ``imshow``.
Attention weights are drawn on a fixed 0..1 colour scale stated on a colorbar, so two plots can be
compared by colour. The look follows the alignment figures of Bahdanau et al. 2015.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from ._extras import install

__all__ = ["MAX_INCHES", "MAX_LABELS", "MAX_PANELS", "heatmap", "head_grid", "alignment", "positional_encoding",
           "rope_relative", "curves", "save"]  # fmt: skip

_CELL = 0.26  # inches per row/column of a heatmap: about 19 pt, room for a 9 pt label
_MARGIN = 1.6  # inches around the cells for tick labels, title and colorbar

#: The longest side of a heatmap's figure, in inches: 3000 pixels at 150 dpi. Uncapped, the
#: 0.26-inch cells made a (512, 512) array a 20358 x 20208 PNG (58 s, 16.7 GB of memory).
MAX_INCHES = 20.0

#: The most rows or columns labelled one by one (``qkv.inspect.figures.LABELLED`` too): at
#: :data:`MAX_INCHES` that leaves a cell of 0.2 inch, room for the 7 pt floor of the font.
#: Past it, an axis gets matplotlib's position ticks; the labels would be an unreadable smear.
MAX_LABELS = 80

_SHORT_SIDE = 6.0  # inches: the least a capped figure's other side keeps of its full length

#: The most panels (heads) of :func:`head_grid`: a 16 x 16 grid, past the 128 heads a layer of
#: the largest models has, leaves each panel about 0.6 inch of cells within MAX_INCHES.
MAX_PANELS = 256
_GRID_SIDE = 16  # most panels in a row or column, whatever ``cols``


def _mpl() -> Any:
    """Import matplotlib on first use, so ``import qkv`` works without it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"qkv.viz needs matplotlib: {install('viz')}"
        ) from error
    return Figure, FigureCanvasAgg


def _figure(width: float, height: float) -> Any:
    Figure, FigureCanvasAgg = _mpl()
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)  # attaches itself as figure.canvas: Agg, never a GUI backend
    return figure


def _array(name: str, value: Any, dims: int, shape_name: str) -> np.ndarray:
    """``value`` (tensor, array or nested list) as a float numpy array with ``dims`` axes."""
    if hasattr(value, "detach"):  # a torch tensor, possibly on GPU or requiring grad
        value = value.detach().float().cpu().numpy()
    array = np.asarray(value, dtype=float)
    if array.ndim != dims:
        raise ValueError(f"{name}: expected a {dims}-D {shape_name} array, got shape {array.shape}")
    return array


def _labels(name: str, labels: Sequence[Any] | str | None, count: int, axis: str) -> list[str] | None:
    if labels is None:
        return None
    # Spaces are invisible as tick labels; show them as the open-box symbol.
    labels = ["\u2423" if str(label) == " " else str(label) for label in labels]
    if len(labels) != count:
        raise ValueError(f"{name}: expected {count} labels (one per {axis}), got {len(labels)}")
    return labels


def _fit(fixed_width: float, cells_width: float, fixed_height: float, cells_height: float) -> tuple[float, float]:
    """Figure size in inches for cells of ``cells_*`` inches plus ``fixed_*`` inches of margins.

    When a side would pass :data:`MAX_INCHES`, the cells shrink, on both sides by one factor
    so their shape (and a head grid's panels) stays as drawn; but a side is not shrunk below
    :data:`_SHORT_SIDE` (or its full length, if shorter), or a (2, 100000) array would leave
    its two rows as a sliver. Either way neither side exceeds :data:`MAX_INCHES`.
    """
    scale = max(0.0, min(1.0, (MAX_INCHES - fixed_width) / cells_width, (MAX_INCHES - fixed_height) / cells_height))
    sides = []
    for fixed, cells in ((fixed_width, cells_width), (fixed_height, cells_height)):
        sides.append(min(MAX_INCHES, max(fixed + cells * scale, min(fixed + cells, _SHORT_SIDE))))
    return sides[0], sides[1]


def _font_size(count: int) -> float:
    """Tick font size for ``count`` labels: 10 pt for a few, 7 pt floor for many."""
    return float(np.clip(11.0 - count / 12.0, 7.0, 10.0))


def _draw(ax: Any, array: np.ndarray, x_labels: list[str] | None, y_labels: list[str] | None,
          vmin: float | None, vmax: float | None, cmap: str) -> Any:
    """Draw one heatmap on ``ax`` and label every row and column (up to MAX_LABELS); return the image."""
    image = ax.imshow(array, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    rows, cols = array.shape
    if x_labels is not None and cols <= MAX_LABELS:
        ax.set_xticks(range(cols))
        # Rotated only when needed: single characters read best upright, words do not fit.
        rotation = 90 if max((len(s) for s in x_labels), default=0) > 1 else 0
        ax.set_xticklabels(x_labels, rotation=rotation, fontsize=_font_size(cols))
    if y_labels is not None and rows <= MAX_LABELS:
        ax.set_yticks(range(rows))
        ax.set_yticklabels(y_labels, fontsize=_font_size(rows))
    ax.tick_params(length=0)
    return image


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


def tile_states(mask: Any, i: int, j: int, *, tile: int = 64, title: str | None = None, ax: Any = None) -> Any:
    """The tiles of a ``qkv.masks`` mask as the engines see them: skipped, computed whole, or masked.

    Each ``tile × tile`` square of the ``(i, j)`` logits is coloured by ``mask.state``:
    "empty" (never computed), "full" (computed without a mask) or "partial" (computed with
    the mask). A packed batch's documents show as squares on the diagonal. The figure is at
    most :data:`MAX_INCHES` a side (many tiles share a pixel there).
    """
    from .masks import Tile

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


def save(figure: Any, path: str | Path, *, dpi: int = 150) -> Path:
    """Write ``figure`` to ``path`` (format from the suffix: .png, .svg or .pdf); return it.

    Parent directories are created. At the default 150 dpi a heatmap is at most
    ``MAX_INCHES * 150`` = 3000 pixels a side.
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"path: expected a .png, .svg or .pdf suffix, got {path.suffix!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
