"""Tests of ``qkv.inspect.figures``: the head and layer PNGs, labelled for short texts, bounded for long ones."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

from qkv.inspect import figures  # noqa: E402
from qkv.inspect.capture import Capture, Text  # noqa: E402
from qkv.inspect.selection import Selection  # noqa: E402


def _capture(tokens: int, heads: tuple[int, ...], rows: tuple[int, ...], layers: int = 2, total_heads: int = 4) -> Capture:
    rng = np.random.default_rng(0)
    weights = rng.random((layers, len(heads), len(rows), tokens)).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    text = Text(ids=tuple(range(tokens)), labels=tuple(f"t{k}" for k in range(tokens)), special=())
    return Capture(text, Selection(heads, rows, total_heads, tokens, False), weights)


def test_short_text_labels_every_token_and_names_heads_as_in_the_model():
    capture = _capture(7, heads=(1, 3), rows=tuple(range(7)))
    figure = figures.head_figure(capture, layer=1, head=3)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"t{k}" for k in range(7)]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"t{k}" for k in range(7)]
    np.testing.assert_array_equal(ax.images[0].get_array(), capture.weights[1, 1])
    assert ax.get_title() == "layer 1, head 3"
    grid = figures.layer_figure(capture, layer=0)
    assert [ax.get_title() for ax in grid.axes[:2]] == ["head 1", "head 3"]


def test_chosen_rows_are_the_rows_drawn_and_the_title_says_so():
    capture = _capture(7, heads=(0,), rows=(2, 6))
    figure = figures.head_figure(capture, layer=0, head=0)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["t2", "t6"]
    assert ax.get_title() == "layer 0, head 0 (2 of 7 rows)"


def test_long_text_keeps_a_fixed_size(tmp_path):
    capture = _capture(3000, heads=(0, 2), rows=(0, 1500, 2999))
    paths = figures.write(capture, layer=1, head=2, out=tmp_path)
    assert [p.name for p in paths] == ["layer1_head2.png", "layer1_heads.png"]
    for path in paths:
        height, width = imread(path).shape[:2]
        assert width <= 1400 and height <= 1000, (path.name, width, height)
    ax = figures.head_figure(capture, layer=1, head=2).axes[0]
    assert ax.get_xlabel() == "key position"
    assert ax.images[0].get_array().shape == (3, 3000)  # every key drawn, none dropped


def test_write_short_text(tmp_path):
    capture = _capture(9, heads=(0, 1, 2, 3), rows=tuple(range(9)))
    paths = figures.write(capture, layer=0, head=1, out=tmp_path)
    assert all(p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
