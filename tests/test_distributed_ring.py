"""The ring strategy equals single-process attention (spawned gloo ranks, P = 1..4)."""

import pytest
from distributed_cases import case, check

TARGET = "distributed_cases:run_cases"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ring_matches_single_process(dist_pool, size):
    cases = [
        case(strategy="ring", mask="causal"),
        case(strategy="ring", layout="contiguous", mask="window", bias="alibi"),
        case(strategy="ring", i=9, j=17, mask="lengths", bias="t5", dtype="float32"),
        case(strategy="ring", mask="dense", score="general", bias="dense"),
        case(strategy="ring", mask="offsets", score="additive", i=5),
        case(strategy="ring", mask="custom", layout="contiguous", e=13),
    ]
    check(dist_pool.run(TARGET, size, cases), cases)


def test_dropout_is_the_whole_calls_mask(dist_pool):
    cases = [
        case(strategy=s, mask="causal", dropout=0.3, layout=lay)
        for s, lay in (("ring", "zigzag"), ("ulysses", "contiguous"), ("allgather", "zigzag"))
    ]
    check(dist_pool.run(TARGET, 3, cases), cases)
