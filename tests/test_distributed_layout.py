"""Layouts: which rows each rank holds, padding to slots and back (no processes needed)."""

import pytest
import torch

from qkv.distributed.layout import Layout, check_layout


def test_zigzag_pairs_an_early_and_a_late_chunk():
    lay = Layout("zigzag", 16, 4)
    assert lay.side == 2 and lay.owned(0) == (0, 7) and lay.owned(3) == (3, 4)
    assert lay.positions(1).tolist() == [2, 3, 12, 13]


def test_contiguous_slices_in_rank_order():
    lay = Layout("contiguous", 10, 3)
    assert [lay.positions(r).tolist() for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("length", "ranks"), [(17, 4), (2, 4), (0, 3), (13, 1), (7, 3)])
def test_every_row_belongs_to_one_rank(kind, length, ranks):
    lay = Layout(kind, length, ranks)
    held = torch.cat([lay.positions(r) for r in range(ranks)])
    assert sorted(held.tolist()) == list(range(length))
    assert sum(lay.rows(r) for r in range(ranks)) == length


def test_uneven_length_leaves_some_ranks_short_or_empty():
    lay = Layout("zigzag", 2, 4)  # chunks of 1 row: only chunks 0 and 1 are real
    assert [lay.rows(r) for r in range(4)] == [1, 1, 0, 0]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_pad_unpad_assemble_scatter_round_trip(kind):
    lay = Layout(kind, 11, 3)
    whole = torch.randn(2, 3, 11, 5)
    parts = [lay.take(whole, -2, r) for r in range(3)]
    padded = torch.stack([lay.pad(p, -2, r) for r, p in enumerate(parts)])
    assert padded.shape == (3, 2, 3, lay.slots * lay.side, 5)
    assert torch.equal(lay.assemble(padded, -2), whole)
    assert torch.equal(lay.scatter(whole, -2), padded)
    for r in range(3):
        assert torch.equal(lay.unpad(padded[r], -2, r), parts[r])


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match=r"layout: expected one of \('contiguous', 'zigzag'\), got 'striped'"):
        check_layout("striped")
