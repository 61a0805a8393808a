"""The cost model: closed-form cases, the least-squares fit, and the shape of its predictions."""

import pytest

from qkv.distributed import cost

COMPUTE = cost.Compute(c0=0.0, gamma=1e-10)


def test_line_fit_recovers_a_line():
    assert cost._line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0]) == pytest.approx((1.0, 2.0))


def test_one_rank_is_the_compute_alone():
    shape = cost.Shape(1024, 8, 8, 64, 64)
    work = COMPUTE.seconds(shape.causal_pairs, 8, 64, 64)
    link = cost.LINKS["IB-EDR"]
    assert cost.ring(shape, 1, link, COMPUTE) == pytest.approx(work)
    assert cost.ulysses(shape, 1, link, COMPUTE) == pytest.approx(work)


def test_ring_with_a_free_link_divides_the_work():
    free = cost.Link("free", 0.0, 0.0, "none")
    shape = cost.Shape(4096)
    one = cost.ring(shape, 1, free, COMPUTE)
    assert cost.ring(shape, 8, free, COMPUTE) == pytest.approx(one / 8)


def test_slow_links_cost_more_and_ulysses_needs_heads():
    shape = cost.Shape(16384)
    slow, fast = cost.LINKS["25GbE"], cost.LINKS["IB-NDR"]
    assert cost.ring(shape, 64, slow, COMPUTE) >= cost.ring(shape, 64, fast, COMPUTE)
    got = cost.predict(shape, 64, fast, COMPUTE)
    assert got["ulysses"] is None and got["hybrid"] is not None  # 64 ranks cannot split 8 heads
    assert cost.predict(shape, 4, fast, COMPUTE)["hybrid"] is None  # no ring across nodes of 8


def test_documented_links_say_where_their_figures_come_from():
    for link in cost.LINKS.values():
        assert "line rate" in link.source and "assumed" in link.source


def test_ranks_that_outnumber_the_cores_share_them():
    assert cost.cores_per_rank(2, 2) == 1.0 and cost.cores_per_rank(1, 2, threads=2) == 2.0
    assert cost.cores_per_rank(4, 2) == 0.5 and cost.cores_per_rank(4, 2, threads=2) == 0.5
    assert cost.cores_per_rank(3, 0.9) == pytest.approx(0.3)  # a busy machine: fewer cores free than it has
    free = cost.Link("free", 0.0, 0.0, "none")
    shape = cost.Shape(4096)
    on_two = cost.ring(shape, 4, free, COMPUTE, cores=cost.cores_per_rank(4, 2))
    on_four = cost.ring(shape, 4, free, COMPUTE, cores=cost.cores_per_rank(4, 4))
    assert on_two == pytest.approx(2 * on_four)


@pytest.mark.parametrize(("n", "p"), [(4096, 1), (4096, 4), (5000, 3), (16384, 2)])
def test_ring_pieces_are_the_blocks_the_ring_computes(n, p):
    import torch

    from qkv import checks
    from qkv.distributed.blocks import Pieces, Work, piece_rows
    from qkv.distributed.layout import Layout
    from qkv.distributed.ring import row_bytes

    shape = cost.Shape(n)
    whole = [torch.zeros(()).expand(1, 8, n, 64) for _ in range(3)]
    req = checks.request(*whole, score="scaled_dot", mask=None, bias=None, causal=True, scale=None, dropout=0.0,
                         return_weights=False)  # fmt: skip
    lay, work = Layout("zigzag", n, p), Work(req, n, n, 0, None, 8)
    rows = piece_rows(row_bytes(1, 8, 8, 64, 64, torch.float32))
    pieces = [Pieces.cut(lay.slot_spans(r), lay.side, rows) for r in range(p)]
    blocks = [sum(1 for s in range(p) for _ in work.blocks(pieces[r], pieces[s])) for r in range(p)]
    per_rank, calls = cost.ring_pieces(shape, p)
    assert per_rank == pieces[0].count
    assert calls == pytest.approx(sum(blocks) / p, rel=0.02)  # zigzag: about the same on every rank
