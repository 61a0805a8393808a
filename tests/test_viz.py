"""Tests for qkv.viz: figures, axes, labels, readability at 40 tokens, colour scale, saving."""

import numpy as np
import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

from qkv import viz  # noqa: E402


def _weights(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=generator).softmax(-1)


def _texts(labels):
    return [label.get_text() for label in labels]


def test_heatmap_returns_a_figure_with_labels_and_a_0_to_1_colorbar():
    figure = viz.heatmap(_weights(5, 7), list("abcdefg"), list("vwxyz"), title="one head")
    assert isinstance(figure, Figure)
    ax, colorbar = figure.axes  # the heatmap and its colorbar
    assert _texts(ax.get_xticklabels()) == list("abcdefg")
    assert _texts(ax.get_yticklabels()) == list("vwxyz")
    assert ax.get_title() == "one head"
    assert ax.images[0].get_clim() == (0.0, 1.0)
    assert colorbar.get_ylabel() == "attention weight"
    assert colorbar.get_ylim() == (0.0, 1.0)


def test_heatmap_without_labels_and_on_a_given_axes():
    figure = viz.heatmap(np.eye(3))
    assert len(figure.axes) == 2
    host = Figure()
    ax = host.add_subplot()
    assert viz.heatmap(np.eye(3), ax=ax, colorbar_label="p") is host
    assert host.axes[1].get_ylabel() == "p"


def test_forty_labels_are_all_drawn_readable_and_do_not_overlap():
    words = [f"word{k}" for k in range(40)]
    figure = viz.heatmap(_weights(40, 40, seed=1), words, words)
    small = viz.heatmap(_weights(5, 5), words[:5], words[:5])
    assert figure.get_size_inches()[0] > small.get_size_inches()[0]  # the figure grows
    ax = figure.axes[0]
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for labels, rotation in ((ax.get_xticklabels(), 90), (ax.get_yticklabels(), 0)):
        assert _texts(labels) == words  # none thinned out
        assert all(label.get_fontsize() >= 7 for label in labels)
        assert all(label.get_rotation() == rotation for label in labels)
        boxes = [label.get_window_extent(renderer) for label in labels]
        assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))


def test_single_character_labels_stay_upright():
    figure = viz.heatmap(_weights(3, 4), "abcd", "xyz")
    assert all(label.get_rotation() == 0 for label in figure.axes[0].get_xticklabels())


def test_head_grid_has_one_panel_per_head_and_one_colorbar():
    figure = viz.head_grid(_weights(6, 5, 7), list("abcdefg"), list("vwxyz"), title="six heads")
    panels, colorbar = figure.axes[:6], figure.axes[6]
    assert len(figure.axes) == 7
    assert [ax.get_title() for ax in panels] == [f"head {k}" for k in range(6)]
    assert colorbar.get_ylim() == (0.0, 1.0) and colorbar.get_ylabel() == "attention weight"
    # 4 per row: y labels on the first column, x labels on the lowest panel of each column.
    with_y = [k for k, ax in enumerate(panels) if _texts(ax.get_yticklabels())]
    with_x = [k for k, ax in enumerate(panels) if _texts(ax.get_xticklabels())]
    assert with_y == [0, 4] and with_x == [2, 3, 4, 5]
    assert len(viz.head_grid(_weights(4, 3, 3), cols=2).axes) == 5
    scores = viz.head_grid(torch.arange(12.0).reshape(2, 2, 3), vmin=None, vmax=None)
    assert [ax.images[0].get_clim() for ax in scores.axes[:2]] == [(0.0, 11.0)] * 2


def test_alignment_puts_input_across_and_output_down():
    source, target = "3 mars 2017", "2017-03-03"
    figure = viz.alignment(_weights(len(target), len(source)), source, target, title="dates")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "input" and ax.get_ylabel() == "output"
    assert _texts(ax.get_xticklabels()) == ["3", "\u2423", "m", "a", "r", "s", "\u2423", "2", "0", "1", "7"]
    assert _texts(ax.get_yticklabels()) == list(target)


def test_positional_encoding_uses_a_symmetric_scale():
    table = np.sin(np.arange(20)[:, None] / (10.0 ** np.arange(8)[None]))
    figure = viz.positional_encoding(table * 0.5)
    ax = figure.axes[0]
    low, high = ax.images[0].get_clim()
    assert low == -high == pytest.approx(-0.5, abs=0.01)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("dimension", "position")


def test_rope_relative_draws_one_curve_per_query_position():
    n = np.arange(30)
    positions = [5, 15, 25]
    scores = np.stack([np.cos(0.4 * (m - n)) for m in positions])
    figure = viz.rope_relative(scores, np.stack([m - n for m in positions]), positions=positions)
    ax = figure.axes[0]
    assert len(ax.get_lines()) == 4  # three curves and the m - n = 0 line
    assert _texts(ax.get_legend().get_texts()) == ["m = 5", "m = 15", "m = 25"]
    shared = viz.rope_relative(torch.tensor(scores), torch.arange(30))
    assert len(shared.axes[0].get_lines()) == 4


def test_curves_draw_one_line_per_series_and_the_marks():
    x = torch.arange(10.0)
    figure = viz.curves(x, {"a": x.square() + 1, "b": np.ones(10)}, xlabel="position", ylabel="perplexity",
                        marks={"training length": 4}, log_y=True, title="t")  # fmt: skip
    ax = figure.axes[0]
    assert len(ax.get_lines()) == 3  # two series and the mark
    assert _texts(ax.get_legend().get_texts()) == ["a", "b"]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "position"
    with pytest.raises(ValueError, match=r"ys\['b'\]: expected shape \(10,\) like x, got \(9,\)"):
        viz.curves(x, {"b": np.ones(9)}, xlabel="", ylabel="")


def test_save_writes_png_and_svg(tmp_path):
    figure = viz.heatmap(_weights(4, 4))
    png = viz.save(figure, tmp_path / "plots" / "weights.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = viz.save(figure, str(tmp_path / "weights.svg"))
    assert svg.stat().st_size > 0 and b"<svg" in svg.read_bytes()[:500]


def test_tensors_with_gradients_are_accepted():
    weights = _weights(3, 3).requires_grad_()
    assert isinstance(viz.heatmap(weights * 1.0), Figure)


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"weights: expected a 2-D \(i, j\) array, got shape \(2, 3, 4\)"):
        viz.heatmap(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"x_labels: expected 4 labels \(one per key, j\), got 3"):
        viz.heatmap(np.zeros((2, 4)), x_labels="abc")
    with pytest.raises(ValueError, match=r"y_labels: expected 2 labels \(one per query, i\), got 1"):
        viz.heatmap(np.zeros((2, 4)), y_labels=["a"])
    with pytest.raises(ValueError, match=r"weights: expected a 3-D \(h, i, j\) array, got shape \(2, 3\)"):
        viz.head_grid(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"cols: expected a positive integer, got 0"):
        viz.head_grid(np.zeros((2, 3, 3)), cols=0)
    with pytest.raises(ValueError, match=r"relative: expected shape \(5,\) or \(2, 5\) .* got \(4,\)"):
        viz.rope_relative(np.zeros((2, 5)), np.arange(4))
    with pytest.raises(ValueError, match=r"positions: expected 2 labels \(one per curve, m\), got 3"):
        viz.rope_relative(np.zeros((2, 5)), np.arange(5), positions=[1, 2, 3])
    with pytest.raises(ValueError, match=r"path: expected a .png, .svg or .pdf suffix, got '.jpg'"):
        viz.save(viz.heatmap(np.eye(2)), tmp_path / "x.jpg")


def test_no_pyplot_figures_are_left_open():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    viz.heatmap(np.eye(2))
    viz.head_grid(np.ones((2, 2, 2)) / 2)
    assert plt.get_fignums() == before


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'qkv.viz needs matplotlib: pip install "\.\[viz\]" in qkv\'s folder'):
        viz.heatmap(np.eye(2))


# ---- the size cap: a big array is still one readable picture, not a 20000-pixel one ----------------


def _png_size(path):
    """(height, width) in pixels of the PNG at ``path``, read back with matplotlib."""
    from matplotlib.image import imread

    return imread(path).shape[:2]


def test_a_512_by_512_heatmap_is_capped_quick_and_keeps_every_value(tmp_path):
    # Uncapped (0.26 inch a cell) this was a 20358 x 20208 PNG: 58 s and 16.7 GB.
    weights = torch.rand(512, 512, generator=torch.Generator().manual_seed(0))
    labels = [f"t{k}" for k in range(512)]
    figure = viz.heatmap(weights, labels, labels)
    assert max(figure.get_size_inches()) <= 20.0  # checked before drawing: the uncapped one is huge
    png = viz.save(figure, tmp_path / "big.png")
    assert max(_png_size(png)) <= 20 * 150
    ax = figure.axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), weights.numpy())  # every value is drawn
    # 512 labels a side cannot be read: none are written; the axes count positions instead.
    assert "t1" not in _texts(ax.get_xticklabels()) and "t1" not in _texts(ax.get_yticklabels())


def test_labels_are_drawn_up_to_the_limit_and_dropped_past_it():
    words = [f"w{k}" for k in range(viz.MAX_LABELS + 1)]
    at_limit = viz.heatmap(_weights(viz.MAX_LABELS, viz.MAX_LABELS), words[:-1], words[:-1])
    assert _texts(at_limit.axes[0].get_xticklabels()) == words[:-1]
    assert max(at_limit.get_size_inches()) <= viz.MAX_INCHES
    # Past the limit only the crowded axis loses its labels: 3 query labels still fit.
    past = viz.heatmap(_weights(3, viz.MAX_LABELS + 1), words, ["a", "b", "c"])
    assert "w1" not in _texts(past.axes[0].get_xticklabels())
    assert _texts(past.axes[0].get_yticklabels()) == ["a", "b", "c"]


@pytest.mark.parametrize("shape", [(2, 100000), (100000, 2), (2000, 2000)])
def test_extreme_shapes_get_a_capped_figure(shape):
    # (2, 100000) had a 26000-inch-wide figure (the process was killed); (2000, 2000) a MemoryError.
    figure = viz.heatmap(np.zeros(shape, dtype=np.float32))
    width, height = figure.get_size_inches()
    assert max(width, height) <= viz.MAX_INCHES
    # The short side keeps readable cells: two rows are not squeezed to a sliver.
    assert min(width, height) >= 1.5


def test_head_grid_is_capped_too(tmp_path):
    figure = viz.head_grid(_weights(6, 300, 300))
    assert max(figure.get_size_inches()) <= viz.MAX_INCHES
    assert max(_png_size(viz.save(figure, tmp_path / "heads.png"))) <= viz.MAX_INCHES * 150


def test_head_grid_holds_a_bounded_number_of_panels():
    # 64 heads: a square grid within the cap (four to a row, it would be 16 rows of panels).
    figure = viz.head_grid(np.random.default_rng(0).random((64, 8, 8)))
    assert len(figure.axes) == 64 + 1 and max(figure.get_size_inches()) <= viz.MAX_INCHES
    assert sum(1 for ax in figure.axes[:64] if ax.get_subplotspec().is_first_col()) == 8
    too_many = viz.MAX_PANELS + 1
    with pytest.raises(ValueError, match=rf"^weights: expected at most {viz.MAX_PANELS} heads .* got {too_many}; "):
        viz.head_grid(np.zeros((too_many, 2, 2)))
    with pytest.raises(ValueError, match=r"^cols: 1 to a row makes a grid of 20 x 1 panels for 20 heads; at most 16 "):
        viz.head_grid(np.zeros((20, 2, 2)), cols=1)


def test_tile_states_figure_is_capped_too():
    import qkv

    figure = viz.tile_states(qkv.masks.causal(), 16384, 16384, tile=64)  # 256 x 256 tiles: 31 inches uncapped
    assert max(figure.get_size_inches()) <= viz.MAX_INCHES
