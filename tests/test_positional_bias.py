"""Tests of the lazy positional biases (``qkv.positional.bias``): ALiBi and T5 buckets.

Shape legend: ``h`` heads, ``i`` query length, ``j`` key length; ``it``/``jt`` a tile's sides.
"""

import random

import pytest
import reference as ref
import torch

import qkv
from qkv.masks import Tile
from qkv.positional import ALiBi, RelativePositionBias, alibi_slopes, relative_buckets


def test_alibi_slopes_for_eight_heads_are_powers_of_one_half():
    # Press et al. 2022, section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0**-n for n in range(1, 9)], dtype=torch.float64))


def test_alibi_slopes_for_six_heads():
    # Not a power of two: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other slope of
    # the 8-head sequence (2^-1, 2^-3, ...), as many as are missing.
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert torch.equal(alibi_slopes(6), torch.tensor(expected, dtype=torch.float64))


def test_alibi_slopes_are_float64_and_equal_the_formula_for_twelve_heads():
    slopes = alibi_slopes(12)
    assert slopes.dtype == torch.float64
    assert max(abs(a - b) for a, b in zip(slopes.tolist(), ref.alibi_slopes(12))) < 1e-15


def test_float64_alibi_attention_with_twelve_heads_follows_the_formula():
    # float32-rounded slopes put this 3e-8 off: 2^-0.5 has no exact float32 value.
    from tests.reference import literal_attention

    h, i, j, d = 12, 3, 9, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=torch.float64) for n in (i, j, j))
    slopes = ref.alibi_slopes(h)
    bias = torch.tensor(
        [[[-slopes[n] * abs(c - r - (j - i)) for c in range(j)] for r in range(i)] for n in range(h)],
        dtype=torch.float64,
    )
    want, _ = literal_attention(q, k, v, scale=d**-0.5, bias=bias)
    for backend in ("reference", "chunked"):
        got = qkv.attention(q, k, v, bias=ALiBi(h), backend=backend)
        assert (got - want).abs().max().item() < 1e-13, backend
    assert (ALiBi(h).dense(i, j) - bias).abs().max().item() < 1e-14  # start ** k vs 2 ** (-8k/n): last-bit differences


def test_alibi_slopes_stay_float64_when_the_module_is_cast():
    # A bf16 model's ALiBi keeps the formula's slopes; backends cast tiles to their logits.
    module = qkv.MultiHeadAttention(24, 12, positional=ALiBi(12)).to(torch.bfloat16)
    assert module.positional.slopes.dtype == torch.float64
    assert torch.equal(module.positional.slopes, alibi_slopes(12))
    assert module.positional.half().slopes.dtype == torch.float64
    x = torch.randn(1, 5, 24, dtype=torch.bfloat16)
    assert module(x).dtype == torch.bfloat16


def test_alibi_bias_is_minus_slope_times_distance_bottom_right():
    i, j, h = 3, 5, 4
    bias = ALiBi(h).dense(i, j)
    slopes = alibi_slopes(h).tolist()
    expected = [[[-slopes[n] * abs(c - r - (j - i)) for c in range(j)] for r in range(i)] for n in range(h)]
    assert bias.shape == (h, i, j)
    assert torch.equal(bias, torch.tensor(expected, dtype=torch.float64))
    # The last query's own position (the bottom-right corner) has no penalty.
    assert torch.equal(bias[:, -1, -1], torch.zeros(h))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_equal_the_formula(bidirectional):
    rel = torch.tensor([-300, -128, -100, -33, -17, -9, -8, -7, -1, 0, 1, 5, 8, 12, 40, 127, 500])
    got = relative_buckets(rel, 32, 128, bidirectional).tolist()
    assert got == [ref.t5_bucket(int(r), 32, 128, bidirectional) for r in rel]


def test_t5_buckets_known_values():
    # Bidirectional, 32 buckets, max distance 128: 16 per direction, 8 exact.
    known = {0: 0, -3: 3, -7: 7, 3: 19, 7: 23, -8: 8, -128: 15, -1000: 15, 1000: 31}
    rel = torch.tensor(list(known))
    assert relative_buckets(rel, 32, 128, True).tolist() == list(known.values())
    # Causal: future keys share bucket 0.
    assert relative_buckets(torch.tensor([5, 0, -1]), 32, 128, False).tolist() == [0, 0, 1]


def test_relative_position_bias_reads_its_table():
    rpb = RelativePositionBias(heads=3, buckets=8, max_distance=20)
    i, j = 4, 6
    dense = rpb.dense(i, j)
    table = rpb.embedding.weight  # (buckets, h)
    for r in range(i):
        for c in range(j):
            bucket = ref.t5_bucket(c - r - (j - i), 8, 20, True)
            assert torch.equal(dense[:, r, c], table[bucket])


@pytest.mark.parametrize("make", [lambda: ALiBi(6), lambda: RelativePositionBias(4, 16, 40, bidirectional=False)])
def test_tile_equals_slice_of_dense(make):
    bias = make()
    rng = random.Random(1)
    for _ in range(30):
        i, j = rng.randint(1, 12), rng.randint(1, 12)
        i0, j0 = rng.randrange(i), rng.randrange(j)
        t = Tile(i0, rng.randint(i0 + 1, i), j0, rng.randint(j0 + 1, j), i, j)
        assert torch.equal(bias.tile(t), bias.dense(i, j)[:, t.i0 : t.i1, t.j0 : t.j1])


def test_lazy_bias_in_attention_equals_dense_bias():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    for bias in (ALiBi(4), RelativePositionBias(4)):
        dense = bias.dense(5, 7).double()
        expected = qkv.attention(q, k, v, bias=dense, causal=True)
        assert torch.allclose(qkv.attention(q, k, v, bias=bias, causal=True), expected)


def test_relative_position_bias_gets_gradients():
    rpb = RelativePositionBias(heads=2, buckets=8, max_distance=16)
    q, k, v = (torch.randn(1, 2, n, 4) for n in (3, 5, 5))
    qkv.attention(q, k, v, bias=rpb).sum().backward()
    assert rpb.embedding.weight.grad is not None and rpb.embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: alibi_slopes(0), r"heads: expected a positive int, got 0"),
        (lambda: RelativePositionBias(2, buckets=2), r"buckets: expected at least 4 buckets \(bidirectional\), got 2"),
        (lambda: RelativePositionBias(2, buckets=16, max_distance=4),
         r"max_distance: expected more than the 4 distances with a bucket each \(buckets=16\), got 4"),
    ],
)  # fmt: skip
def test_bias_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()
