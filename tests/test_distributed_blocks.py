"""Pieces and the in-place merge of the ring's blocks."""

import math

import pytest
import torch

from qkv.distributed import blocks
from qkv.distributed.blocks import Pieces, merge_into, piece_rows


def test_pieces_cut_every_slot_the_same_way():
    # two slots of 10 padded rows: the second holds 7 real rows
    pieces = Pieces.cut(((0, 10), (30, 7)), 10, 4)
    assert pieces.spans == ((0, 4, 0), (4, 4, 4), (8, 2, 8), (30, 4, 10), (34, 3, 14), (37, 0, 17))
    assert pieces.count == 6 and pieces.rows(4) == slice(14, 17)
    # a rank without rows has as many (empty) pieces as the others: rounds stay aligned
    assert Pieces.cut(((20, 0), (20, 0)), 10, 4).count == 6


def test_piece_rows_bound_the_bytes():
    assert piece_rows(4096) == blocks.PIECE_BYTES // 4096
    assert piece_rows(10**9) == blocks.MIN_ROWS


def _softmax_pieces(s, v, cuts):
    """(out, lse) of each block of keys, computed literally."""
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        block = s[:, a:b]
        lse = torch.logsumexp(block, -1)
        w = torch.exp(block - lse[:, None]).nan_to_num(0.0)
        parts.append((w @ v[a:b], lse))
    return parts


def test_merge_into_equals_the_whole_softmax_and_never_nans():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    s[0, :] = -math.inf  # a row that sees no key at all
    s[1, :4] = -math.inf  # a row that sees nothing in the first block
    v = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    out = torch.zeros(5, 3, dtype=torch.float64)
    lse = torch.full((5,), -math.inf, dtype=torch.float64)
    for o, m in _softmax_pieces(s, v, (0, 4, 6, 9)):
        merge_into(out, lse, o.clone(), m)
    want = torch.softmax(s[1:], -1) @ v
    assert torch.allclose(out[1:], want, atol=1e-14, rtol=0)
    assert torch.equal(out[0], torch.zeros(3, dtype=torch.float64)) and lse[0] == -math.inf
    assert not torch.isnan(out).any()
    assert torch.allclose(lse[1:], torch.logsumexp(s[1:], -1), atol=1e-14, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_into_keeps_the_accumulator_dtype(dtype):
    out, lse = torch.zeros(2, 3, dtype=dtype), torch.full((2,), -math.inf, dtype=dtype)
    merge_into(out, lse, torch.ones(2, 3, dtype=dtype), torch.zeros(2, dtype=dtype))
    assert out.dtype == dtype and torch.equal(out, torch.ones(2, 3, dtype=dtype)) and torch.equal(lse, torch.zeros(2, dtype=dtype))
