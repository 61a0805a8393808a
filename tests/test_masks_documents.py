"""``qkv.masks.documents``: tiles, states, runs, checks, and the engines' skipping on a packed batch.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length; a tile is ``(b, 1, it, jt)``.
"""

import pytest
import torch

import qkv
from qkv.masks import Tile, documents

IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 6, 6, 6, 6, 7, 7, 7]])


def test_tile_is_the_equality_of_ids():
    mask = documents(IDS)
    t = Tile(1, 6, 2, 9, 9, 9)
    want = IDS[:, 1:6, None] == IDS[:, None, 2:9]
    assert torch.equal(mask.tile(t), want[:, None])
    cross = documents(IDS, IDS[:, :4])
    assert cross.tile(Tile.whole(9, 4)).shape == (2, 1, 9, 4)


def test_states_from_the_ends_of_sorted_ids():
    mask = documents(IDS)
    assert mask.state(Tile(0, 2, 0, 3, 9, 9)) == "partial"  # row 1: docs 5, 5 against 5, 5, 6
    assert mask.state(Tile(6, 9, 6, 9, 9, 9)) == "full"  # doc 2 and doc 7 in both rows
    assert mask.state(Tile(0, 2, 5, 9, 9, 9)) == "empty"  # docs 0 / 5 against 2 / 6, 7
    one = documents(IDS[:1])
    assert one.state(Tile(0, 3, 0, 3, 9, 9)) == "full"
    assert one.state(Tile(0, 3, 3, 9, 9, 9)) == "empty"


def test_unsorted_ids_are_exact_where_it_matters():
    ids = torch.tensor([[2, 2, 0, 0, 1, 1]])
    mask = documents(ids)
    assert mask.state(Tile(0, 2, 0, 2, 6, 6)) == "full"
    assert mask.state(Tile(0, 2, 2, 6, 6, 6)) == "empty"  # {2} against {0, 1}: disjoint ranges
    assert mask.state(Tile(1, 3, 4, 6, 6, 6)) == "partial"  # {0, 2} against {1}: the ranges overlap, so not provably empty
    assert mask.state(Tile(2, 4, 0, 2, 6, 6)) == "empty"  # {0} against {2}
    assert mask.runs() == [[(0, 2, 0, 2), (2, 4, 2, 4), (4, 6, 4, 6)]]
    assert documents(torch.tensor([0, 1, 0])).runs() is None  # document 0 comes back


def test_runs_leave_out_documents_missing_on_one_side():
    mask = documents(torch.tensor([[0, 0, 1, 1, 3]]), torch.tensor([[0, 1, 1, 2]]))
    assert mask.runs() == [[(0, 2, 0, 1), (2, 4, 1, 3)]]  # doc 3 has no key, doc 2 no query


def test_ids_are_checked_against_the_call():
    q = torch.randn(2, 3, 9, 4)
    with pytest.raises(ValueError, match=r"mask: documents' ids_q has 7 positions, the call has i = 9 queries"):
        qkv.attention(q, q, q, mask=documents(IDS[:, :7]))
    with pytest.raises(TypeError, match="ids_q: expected an integer tensor of document ids, got torch.float32"):
        documents(IDS.float())
    with pytest.raises(ValueError, match=r"ids_q: expected document ids of shape \(b, i\) or \(i,\), got \(1, 2, 9\)"):
        documents(IDS[None])


def test_unreadable_ids_keep_every_tile():
    mask = documents(IDS.to("meta"))
    assert mask.state(Tile(0, 2, 5, 9, 9, 9)) == "partial" and mask.runs() is None


def test_extra_leading_dims_are_merged_with_the_ids():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 2, 9, 5, generator=gen, dtype=torch.float64)  # (x, b, h, i, d)
    mask = documents(IDS) & qkv.masks.causal()
    got = qkv.attention(q, q, q, mask=mask)
    for x in range(3):
        torch.testing.assert_close(got[x], qkv.attention(q[x], q[x], q[x], mask=mask, backend="reference"))


def test_the_fused_engine_skips_tiles_no_document_shares(monkeypatch):
    """On the chunked backend a packed causal batch costs Σ lenᵢ² keys per row, not i²: count what the kernel sees."""
    from qkv.backends.engines import fused_blocks

    monkeypatch.setattr(fused_blocks, "BLOCK_BYTES", 1)  # blocks of 32 rows
    monkeypatch.setattr(fused_blocks, "KEY_STEP", 32)
    lengths = [64, 32, 96, 64]
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None]
    q = torch.randn(1, 2, 256, 8, dtype=torch.float64)
    seen = []
    real = fused_blocks._forward

    def spy(q_, k_, *args, **kwargs):
        seen.append(q_.shape[-2] * k_.shape[-2])
        return real(q_, k_, *args, **kwargs)

    monkeypatch.setattr(fused_blocks, "_forward", spy)
    mask = documents(ids) & qkv.masks.causal()
    got = qkv.attention(q, q, q, mask=mask, backend="chunked")
    torch.testing.assert_close(got, qkv.attention(q, q, q, mask=mask, backend="reference"))
    assert sum(seen) <= sum(n * n for n in lengths) and sum(seen) < 256 * 256 / 3
