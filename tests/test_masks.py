"""Tests of ``qkv.masks``: tiles, the bottom-right convention, and tile states.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length; a tile is rows ``i0:i1`` x cols ``j0:j1``.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import band, bottom_right_causal

import qkv
from qkv import masks
from qkv.masks import Dense, Tile


def test_causal_matches_docstring_picture():
    # i=3 queries, j=5 keys: the picture in the module docstring.
    expected = torch.tensor(
        [[1, 1, 1, 0, 0],
         [1, 1, 1, 1, 0],
         [1, 1, 1, 1, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(masks.causal().dense(3, 5), expected)
    assert torch.equal(masks.causal().dense(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    # The last query sees every key (KV cache), whatever the lengths.
    assert bool(masks.causal().dense(2, 9)[-1].all())


@pytest.mark.parametrize(("i", "j"), [(5, 7), (7, 5), (4, 4), (1, 6)])
def test_causal_and_window_equal_literal_definition(i, j):
    assert torch.equal(masks.causal().dense(i, j), bottom_right_causal(i, j))
    assert torch.equal(masks.window(2).dense(i, j), band(i, j, 2, 0))
    assert torch.equal(masks.window(1, 3).dense(i, j), band(i, j, 1, 3))
    assert torch.equal(masks.Window(left=2, right=None).dense(i, j), band(i, j, 2, j + i))


def test_tile_diagonal_and_offset_range():
    t = Tile(1, 4, 2, 6, i_len=5, j_len=7)
    expected = torch.tensor([[c - r - 2 for c in range(2, 6)] for r in range(1, 4)])
    assert torch.equal(t.diagonal, expected)
    assert t.offset_range() == (int(expected.min()), int(expected.max()))
    assert torch.equal(t.rows, torch.arange(1, 4)) and torch.equal(t.cols, torch.arange(2, 6))


def test_lengths_tile_shape_and_values():
    m = masks.lengths(torch.tensor([3, 0, 7]))
    dense = m.dense(2, 7)
    assert dense.shape == (3, 1, 1, 7)
    assert torch.equal(dense[:, 0, 0], torch.arange(7)[None, :] < torch.tensor([3, 0, 7])[:, None])
    assert m.batch_shape() == (3, 1)


def test_starts_tile_shape_values_and_docstring_picture():
    m = masks.starts(torch.tensor([2, 0, 7]))
    dense = m.dense(3, 7)
    assert dense.shape == (3, 1, 1, 7)
    assert torch.equal(dense[:, 0, 0], torch.arange(7)[None, :] >= torch.tensor([2, 0, 7])[:, None])
    assert m.batch_shape() == (3, 1)
    assert repr(m) == "starts([2, 0, 7])"
    assert torch.equal(masks.starts(torch.tensor([2])).dense(1, 5)[0, 0, 0], torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool))


def test_starts_and_lengths_keep_a_span_of_keys_per_row():
    first, end = torch.tensor([1, 0, 3]), torch.tensor([4, 2, 7])
    span = (masks.starts(first) & masks.lengths(end)).dense(2, 7)[:, 0, 0]  # (b, j)
    cols = torch.arange(7)[None, :]
    assert torch.equal(span, (cols >= first[:, None]) & (cols < end[:, None]))


def test_starts_and_lengths_state_reads_no_tensor():
    """state() runs once per tile: it must use the ints kept at construction, not the tensor."""
    s, n = masks.starts(torch.tensor([2, 4])), masks.lengths(torch.tensor([3, 5]))
    s.key_starts, n.key_lengths = None, None  # any tensor read would now fail
    assert [s.state(Tile(0, 1, a, b, 1, 6)) for a, b in [(0, 2), (4, 6), (1, 5)]] == ["empty", "full", "partial"]
    assert [n.state(Tile(0, 1, a, b, 1, 6)) for a, b in [(0, 3), (5, 6), (2, 4)]] == ["full", "empty", "partial"]


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "local", "reference"])
def test_left_padding_with_causal_and_window_runs_on_every_backend(backend):
    """starts() & a causal window, the mask of a left-padded decoder batch, agrees with the dense mask."""
    import qkv

    gen = torch.Generator().manual_seed(0)
    b, h, g, i, d, e = 2, 6, 3, 300, 11, 13
    q, k, v = torch.randn(b, h, i, d, generator=gen), torch.randn(b, g, i, d, generator=gen), torch.randn(b, g, i, e, generator=gen)
    first = torch.tensor([0, 37])
    mask = masks.starts(first) & masks.window(20)
    dense = mask.dense(i, i)
    expected = qkv.attention(q.double(), k.double(), v.double(), mask=dense, backend="reference")
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    assert bool((out[1, :, :37] == 0).all())  # padded queries see no key


def test_dense_tile_slices_and_broadcast_dims():
    full = torch.rand(2, 1, 5, 7) > 0.5
    t = Tile(1, 4, 2, 6, 5, 7)
    assert torch.equal(Dense(full).tile(t), full[..., 1:4, 2:6])
    row = torch.rand(2, 1, 1, 7) > 0.5  # a per-key mask broadcasts over rows
    assert torch.equal(Dense(row).tile(t), row[..., :, 2:6])


def test_combinations_accept_tensors_on_either_side():
    dense = torch.rand(5, 7) > 0.3
    c = masks.causal().dense(5, 7)
    assert torch.equal((masks.causal() & dense).dense(5, 7), c & dense)
    assert torch.equal((dense & masks.causal()).dense(5, 7), c & dense)
    assert torch.equal((masks.causal() | dense).dense(5, 7), c | dense)
    assert torch.equal((dense | masks.causal()).dense(5, 7), c | dense)


def _random_mask(rng: random.Random, i: int, j: int, depth: int = 0) -> masks.Mask:
    kind = rng.choice(["causal", "window", "lengths", "starts", "dense"] + (["and", "or"] if depth < 2 else []))
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.Window(left=rng.choice([None, 0, 1, 3]), right=rng.choice([None, 0, 2]))
    if kind == "lengths":
        return masks.lengths(torch.tensor([rng.randint(0, j) for _ in range(2)]))
    if kind == "starts":
        return masks.starts(torch.tensor([rng.randint(0, j) for _ in range(2)]))
    if kind == "dense":
        gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
        # Sparse, dense or mixed, so that all three states occur.
        return Dense(torch.rand(2, 1, i, j, generator=gen) < rng.choice([0.05, 0.5, 0.95]))
    a, b = _random_mask(rng, i, j, depth + 1), _random_mask(rng, i, j, depth + 1)
    return a & b if kind == "and" else a | b


def _random_tile(rng: random.Random, i: int, j: int) -> Tile:
    i0 = rng.randrange(i)
    j0 = rng.randrange(j)
    return Tile(i0, rng.randint(i0 + 1, i), j0, rng.randint(j0 + 1, j), i, j)


def test_tile_states_agree_with_dense_tiles():
    """Property test: 'full' / 'empty' are never wrong; primitive masks are exact; a tile is a slice of dense."""
    rng = random.Random(0)
    seen = set()
    for _ in range(600):
        i, j = rng.randint(1, 9), rng.randint(1, 9)
        m, t = _random_mask(rng, i, j), _random_tile(rng, i, j)
        part = m.tile(t)
        whole = m.dense(i, j)
        whole = whole.expand(*whole.shape[:-2], i, j)  # size-1 row/col dims broadcast
        assert torch.equal(*torch.broadcast_tensors(part, whole[..., t.i0 : t.i1, t.j0 : t.j1])), (m, t)
        state = m.state(t)
        seen.add(state)
        if state == "full":
            assert bool(part.all()), (m, t)
        elif state == "empty":
            assert not bool(part.any()), (m, t)
        if isinstance(m, (masks.Window, masks.Lengths, masks.Starts, Dense)):
            # Primitive masks know their state exactly: 'partial' means mixed.
            exact = "full" if bool(part.all()) else "empty" if not bool(part.any()) else "partial"
            assert state == exact, (m, t)
    assert seen == {"full", "empty", "partial"}


def test_and_or_states_are_exact_when_the_parts_decide():
    t = Tile(0, 2, 5, 7, 7, 7)  # top-right corner: in the future of every query
    assert masks.causal().state(t) == "empty"
    assert (masks.causal() & masks.Window(None, None)).state(t) == "empty"
    assert (masks.causal() | masks.Window(None, None)).state(t) == "full"
    assert (masks.Window(None, None) & masks.Window(None, None)).state(t) == "full"


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: masks.window(-1), ValueError, r"left: expected a non-negative int or None, got -1"),
        (lambda: masks.Window(0, 1.5), ValueError, r"right: expected a non-negative int or None, got 1.5"),
        (lambda: masks.window(True), ValueError, r"left: expected a non-negative int or None, got True"),
        (lambda: masks.lengths(torch.tensor([[1, 2]])), ValueError, r"key_lengths: expected a 1-d tensor of shape \(b,\), got \(1, 2\)"),
        (lambda: masks.lengths([1, 2]), ValueError, r"key_lengths: expected a 1-d tensor of shape \(b,\), got list"),
        (lambda: masks.lengths(torch.tensor([1.0])), TypeError, r"key_lengths: expected an integer tensor, got torch.float32"),
        (lambda: masks.lengths(torch.tensor([2, -1])), ValueError, r"key_lengths: expected non-negative lengths, got \[2, -1\]"),
        (lambda: masks.lengths(torch.tensor([], dtype=torch.long)), ValueError, r"key_lengths: expected at least one batch row, got an empty tensor"),
        (lambda: masks.starts(torch.tensor([[0, 2]])), ValueError, r"key_starts: expected a 1-d tensor of shape \(b,\), got \(1, 2\)"),
        (lambda: masks.starts((0, 2)), ValueError, r"key_starts: expected a 1-d tensor of shape \(b,\), got tuple"),
        (lambda: masks.starts(torch.tensor([True])), TypeError, r"key_starts: expected an integer tensor, got torch.bool"),
        (lambda: masks.starts(torch.tensor([0, -3])), ValueError, r"key_starts: expected non-negative starts, got \[0, -3\]"),
        (lambda: Dense(torch.ones(5, 7)), TypeError, r"mask: expected dtype torch.bool \(True = may attend\), got torch.float32"),
        (lambda: Dense(torch.ones(7, dtype=torch.bool)), ValueError, r"mask: expected at least 2 dims \(..., i, j\), got shape \(7,\)"),
        (lambda: masks.as_mask([[True]]), TypeError, r"mask: expected a bool tensor or a qkv.masks.Mask, got list"),
    ],
)  # fmt: skip
def test_mask_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_offsets_match_the_docstring_picture_and_their_definition():
    picture = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(masks.offsets(1, 2).dense(4, 4), picture)
    # bottom-right aligned like every mask: with i < j the offsets move with the diagonal
    i, j = 3, 6
    rows, cols = torch.arange(i)[:, None], torch.arange(j)[None, :]
    expected = ((cols - rows - (j - i)) >= -1) & ((cols - rows - (j - i)) <= 0)
    assert torch.equal(masks.offsets(-1, 0).dense(i, j), expected)
    # a Window is the offset range that contains 0
    assert torch.equal(masks.offsets(-2, 1).dense(5, 7), masks.Window(left=2, right=1).dense(5, 7))
    assert torch.equal(masks.offsets(None, 0).dense(5, 7), masks.causal().dense(5, 7))


def test_an_offset_range_holding_the_diagonal_is_a_window_for_the_engines_fast_paths():
    # the engines read a Window's left and right (the kernel's own causal mask, tiles past it skipped): an equal
    # Offsets took the generic tile path, 15% slower for a causal call with its log-sum-exp on an AMD EPYC Zen 5
    assert type(masks.offsets(None, 0)) is masks.Window and repr(masks.offsets(None, 0)) == "causal()"
    window = masks.offsets(-3, 2)
    assert type(window) is masks.Window and (window.left, window.right) == (3, 2)
    assert type(masks.offsets(None, None)) is masks.Window
    assert type(masks.offsets(1, 2)) is masks.Offsets and type(masks.offsets(None, -1)) is masks.Offsets


def test_offsets_bounds_past_every_offset_are_unbounded_even_at_the_largest_int():
    """A bound beyond the call's offsets is none: ``sys.maxsize`` too, which int64 arithmetic on the tile would wrap."""
    import sys

    for lo, hi, same in [(-2, sys.maxsize, (-2, None)), (-sys.maxsize, 1, (None, 1)), (-sys.maxsize, sys.maxsize, (None, None)),
                         (-(10**12), 0, (None, 0))]:  # fmt: skip
        for i, j in [(3, 5), (5, 3), (4, 4)]:
            for t in (Tile.whole(i, j), Tile(1, i, 1, j, i, j)):
                assert torch.equal(masks.offsets(lo, hi).tile(t), masks.offsets(*same).tile(t)), (lo, hi, i, j)


def test_offsets_states_agree_with_their_tiles():
    for lo, hi in [(1, 2), (0, None), (None, -1), (-2, 3), (None, None)]:
        mask = masks.offsets(lo, hi)
        for i0, i1, j0, j1 in [(0, 3, 0, 3), (0, 2, 4, 8), (5, 8, 0, 3), (2, 4, 3, 5), (0, 8, 0, 8)]:
            t = Tile(i0, i1, j0, j1, 8, 8)
            tile = mask.tile(t)
            state = "full" if tile.all() else "empty" if not tile.any() else "partial"
            assert mask.state(t) == state, (lo, hi, i0, i1, j0, j1)


def test_offsets_rows_with_no_key_give_zeros_on_every_backend():
    import qkv

    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64) for _ in range(3))
    expected = qkv.attention(q, k, v, mask=masks.offsets(1, 2), backend="reference")
    assert torch.equal(expected[..., 3, :], torch.zeros(1, 2, 3, dtype=torch.float64))
    for backend in ("chunked",):
        torch.testing.assert_close(qkv.attention(q, k, v, mask=masks.offsets(1, 2), backend=backend), expected)


@pytest.mark.parametrize(
    "lo, hi, error, message",
    [(2, 1, ValueError, "offsets: expected lo <= hi, got lo=2, hi=1"), (0.5, 1, TypeError, "lo: expected an int or None, got float"),
     (0, True, TypeError, "hi: expected an int or None, got bool")],
)  # fmt: skip
def test_offsets_errors(lo, hi, error, message):
    with pytest.raises(error, match=message):
        masks.offsets(lo, hi)


@st.composite
def mask_trees(draw, i: int, j: int, depth: int = 2):
    """A random mask of every lazy kind (and dense ones), combined with & and |, for (2, 1, i, j) calls."""
    if depth == 0 or draw(st.booleans()):
        kind = draw(st.sampled_from(["causal", "window", "offsets", "lengths", "starts", "documents", "dense", "rows"]))
        if kind == "causal":
            return qkv.masks.causal()
        if kind == "window":
            return qkv.masks.window(draw(st.integers(0, 4)), draw(st.integers(0, 3)))
        if kind == "offsets":
            lo = draw(st.one_of(st.none(), st.integers(-6, 3)))
            hi = draw(st.one_of(st.none(), st.integers(-3, 6)))
            return qkv.masks.offsets(*sorted((lo, hi))) if lo is not None and hi is not None else qkv.masks.offsets(lo, hi)
        if kind in ("lengths", "starts"):
            n = torch.tensor([draw(st.integers(0, j)) for _ in range(2)])
            return qkv.masks.lengths(n) if kind == "lengths" else qkv.masks.starts(n)
        if kind == "documents":
            ids = lambda n: torch.tensor([sorted(draw(st.integers(0, 2)) for _ in range(n)) for _ in range(2)])  # noqa: E731
            return qkv.masks.documents(ids(i), ids(j))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        shape = (2, 1, i, j) if kind == "dense" else (2, 1, i, 1)  # per element, or per row alike for every key
        return qkv.masks.as_mask(torch.rand(shape, generator=gen) < draw(st.sampled_from([0.2, 0.7])))
    a, b = draw(mask_trees(i, j, depth - 1)), draw(mask_trees(i, j, depth - 1))
    return a & b if draw(st.booleans()) else a | b


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_engines_skip_on_is_what_the_mask_holds(data):
    """The promises the engines skip work on, against the whole mask: an "empty" tile holds nothing, a "full" one
    everything; no row of a tile sees a key outside its key_bounds; hidden_keys names only keys no row sees."""
    i, j = data.draw(st.integers(1, 10)), data.draw(st.integers(1, 10))
    mask = data.draw(mask_trees(i, j))
    whole = mask.tile(Tile.whole(i, j)).expand(2, 1, i, j)
    seen = whole.any(-2, keepdim=True)  # (2, 1, 1, j)
    hidden = mask.hidden_keys(i, j)
    if hidden is not None:
        assert not (hidden.expand(2, 1, 1, j) & seen).any(), mask
    for _ in range(4):
        i0 = data.draw(st.integers(0, i - 1))
        i1 = data.draw(st.integers(i0 + 1, i))
        j0 = data.draw(st.integers(0, j - 1))
        j1 = data.draw(st.integers(j0 + 1, j))
        t = Tile(i0, i1, j0, j1, i, j)
        part = whole[..., i0:i1, j0:j1]
        assert torch.equal(mask.tile(t).expand_as(part), part), mask
        state = mask.state(t)
        assert state != "empty" or not part.any(), (mask, t)
        assert state != "full" or part.all(), (mask, t)
        bounds = mask.key_bounds(t)
        if bounds is not None:
            outside = torch.ones(j, dtype=torch.bool)
            outside[max(bounds[0], 0) : max(bounds[1], 0)] = False
            assert not (whole[..., i0:i1, :] & outside).any(), (mask, t, bounds)
