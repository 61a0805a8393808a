"""Tests of the absolute encodings (``qkv.positional.absolute``): sinusoidal and learned.

Shape legend: ``b`` batch, ``i`` sequence length, ``dim`` model size.
"""

import math

import pytest
import torch

from qkv.positional import LearnedPositionalEmbedding, SinusoidalEncoding, sinusoidal


@pytest.mark.parametrize("dim", [8, 7])
def test_sinusoidal_equals_the_paper_formula_element_by_element(dim):
    # Vaswani et al. 2017, section 3.5: PE(pos, 2k) = sin(pos / 10000^(2k/dim)),
    # PE(pos, 2k+1) = cos(pos / 10000^(2k/dim)), written here with Python floats.
    length, start = 6, 3
    table = sinusoidal(length, dim, start=start, dtype=torch.float64)
    expected = []
    for pos in range(start, start + length):
        row = []
        for c in range(dim):
            pair = c - c % 2  # the 2k of this dimension
            angle = pos / 10000 ** (pair / dim)
            row.append(math.sin(angle) if c % 2 == 0 else math.cos(angle))
        expected.append(row)
    assert table.shape == (length, dim)
    torch.testing.assert_close(table, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_sinusoidal_position_zero_is_zeros_and_ones():
    table = sinusoidal(1, 6)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))


def test_sinusoidal_module_adds_the_table_with_offset():
    enc = SinusoidalEncoding(10)
    x = torch.randn(2, 5, 10, dtype=torch.float64)
    full = enc(x)
    torch.testing.assert_close(full - x, sinusoidal(5, 10, dtype=torch.float64).expand(2, 5, 10))
    # the last two tokens encoded on their own, starting at position 3, get the same values
    torch.testing.assert_close(enc(x[:, 3:], start=3), full[:, 3:], rtol=0, atol=1e-15)
    assert list(enc.parameters()) == []


def test_learned_embedding_adds_one_vector_per_position_and_offsets():
    enc = LearnedPositionalEmbedding(max_len=8, dim=4)
    x = torch.zeros(3, 5, 4)
    out = enc(x)
    assert out.shape == (3, 5, 4)
    torch.testing.assert_close(out[1], enc.embedding.weight[:5])
    torch.testing.assert_close(enc(x[:, :2], start=6), enc.embedding.weight[6:8].expand(3, 2, 4))
    out.sum().backward()
    assert enc.embedding.weight.grad[:5].abs().sum() > 0 and enc.embedding.weight.grad[5:].abs().sum() == 0


def test_learned_embedding_rejects_positions_past_max_len():
    enc = LearnedPositionalEmbedding(max_len=4, dim=2)
    with pytest.raises(ValueError, match=r"length: learned positions cover at most max_len=4 tokens, got positions 0..4"):
        enc(torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match=r"got positions 3..4 \(start=3, length=2\)"):
        enc(torch.zeros(1, 2, 2), start=3)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"x: expected shape \(b, i, 4\), got \(2, 3, 5\)"):
        SinusoidalEncoding(4)(torch.zeros(2, 3, 5))
    with pytest.raises(TypeError, match="x: expected a tensor"):
        SinusoidalEncoding(4)([1, 2])
    with pytest.raises(ValueError, match="start: expected a non-negative int"):
        SinusoidalEncoding(4)(torch.zeros(1, 2, 4), start=-1)
    with pytest.raises(ValueError, match="dim: expected a positive int, got 0"):
        SinusoidalEncoding(0)
    with pytest.raises(ValueError, match="base: expected a finite number > 1"):
        SinusoidalEncoding(4, base=1)
    with pytest.raises(ValueError, match="base: expected a finite number > 1"):
        SinusoidalEncoding(4, base=float("nan"))
    with pytest.raises(ValueError, match="max_len: expected a positive int"):
        LearnedPositionalEmbedding(0, 4)
