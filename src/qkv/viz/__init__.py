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

from .figure import MAX_INCHES, MAX_LABELS, MAX_PANELS, save
from .lines import curves, positional_encoding, rope_relative
from .maps import alignment, head_grid, heatmap, tile_states

__all__ = ["MAX_INCHES", "MAX_LABELS", "MAX_PANELS", "heatmap", "head_grid", "alignment", "positional_encoding",
           "rope_relative", "curves", "tile_states", "save"]  # fmt: skip
