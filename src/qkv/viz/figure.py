"""The figure machinery of ``qkv.viz``: sizes, the Agg canvas, argument checks, one heatmap's drawing, saving.

Shape legend: ``i`` rows (queries), ``j`` columns (keys) of a drawn array.

A heatmap's cell is :data:`_CELL` inches while the figure fits; :func:`_fit` shrinks the
cells so that neither side passes :data:`MAX_INCHES`, and :func:`_draw` labels an axis one
cell at a time only up to :data:`MAX_LABELS` cells (the package docstring says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import install

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
