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
