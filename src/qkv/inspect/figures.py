"""The PNG heatmaps of ``qkv inspect``: the chosen head, and every chosen head of its layer.

Shape legend: ``h`` chosen heads, ``i`` chosen query rows, ``j`` keys.

Up to :data:`LABELLED` tokens a side, the pictures are ``qkv.viz``'s labelled heatmaps (one
cell per query and key, every token written). A long text has too many keys to label:
its pictures have a fixed size, the key axis counts token positions and each chosen row
is one strip, so a picture of 3000 keys stays a picture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import viz
from .capture import Capture

__all__ = ["LABELLED", "head_figure", "layer_figure", "write"]

#: The most queries or keys drawn as labelled cells; more are drawn as position axes. The
#: same limit as ``qkv.viz``'s heatmaps (``qkv plot``), which drop labels past it.
LABELLED = viz.MAX_LABELS


def _labelled(capture: Capture) -> bool:
    return len(capture.text.ids) <= LABELLED and len(capture.selection.rows) <= LABELLED


def _row_labels(capture: Capture) -> list[str]:
    return [capture.text.labels[r] for r in capture.selection.rows]


def _plain_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _strips(ax, weights: np.ndarray, row_labels: list[str] | None):
    """``weights (i, j)`` as strips over key positions; rows labelled when there are few."""
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xlabel("key position")
    if row_labels is not None and len(row_labels) <= LABELLED:
        ax.set_yticks(range(len(row_labels)))
        ax.set_yticklabels(row_labels, fontsize=7)
    ax.tick_params(length=2)
    return image


def _title(capture: Capture, layer: int, head: int | None) -> str:
    where = f"layer {layer}" + ("" if head is None else f", head {head}")
    rows = capture.selection.rows
    if len(rows) < len(capture.text.ids):
        where += f" ({len(rows)} of {len(capture.text.ids)} rows)"
    return where


def head_figure(capture: Capture, layer: int, head: int):
    """Heatmap of one head: rows are the chosen queries, columns every key."""
    column = capture.selection.heads.index(head)
    weights = capture.weights[layer, column]  # (i, j)
    title = _title(capture, layer, head)
    if _labelled(capture):
        return viz.heatmap(weights, list(capture.text.labels), _row_labels(capture), title=title)
    figure = _plain_figure(9.0, 1.6 + 0.16 * min(len(capture.selection.rows), LABELLED))
    ax = figure.add_subplot()
    image = _strips(ax, weights, _row_labels(capture))
    figure.colorbar(image, ax=ax, label="attention weight", shrink=0.9)
    ax.set_title(title)
    return figure


def layer_figure(capture: Capture, layer: int):
    """One panel per chosen head of ``layer``, on one 0..1 colour scale."""
    weights = capture.weights[layer]  # (h, i, j)
    heads = capture.selection.heads
    title = _title(capture, layer, None)
    if _labelled(capture):
        figure = viz.head_grid(weights, list(capture.text.labels), _row_labels(capture), title=title)
        for ax, head in zip(figure.axes, heads):  # panels come first, the colorbar last
            ax.set_title(f"head {head}", fontsize=9)
        return figure
    figure = _plain_figure(9.0, 0.8 + 0.9 * len(heads))
    axes = figure.subplots(len(heads), 1, squeeze=False)[:, 0]
    for ax, head, panel in zip(axes, heads, weights):
        image = _strips(ax, panel, None)
        ax.set_ylabel(f"head {head}", fontsize=8, rotation=0, ha="right", va="center")
        ax.set_yticks([])
        if ax is not axes[-1]:
            ax.set_xticks([])
            ax.set_xlabel("")
    figure.colorbar(image, ax=list(axes), label="attention weight", shrink=0.9)
    figure.suptitle(title)
    return figure


def write(capture: Capture, layer: int, head: int, out: Path) -> list[Path]:
    """Write the head's and the layer's PNGs into ``out``; return their paths."""
    paths = [
        viz.save(head_figure(capture, layer, head), out / f"layer{layer}_head{head}.png"),
        viz.save(layer_figure(capture, layer), out / f"layer{layer}_heads.png", dpi=100),
    ]
    return paths
