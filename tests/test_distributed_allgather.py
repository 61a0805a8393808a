"""The all-gather strategy equals single-process attention (spawned gloo ranks, P = 1..4)."""

import pytest
from distributed_cases import case, check

TARGET = "distributed_cases:run_cases"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allgather_matches_single_process(dist_pool, size):
    cases = [
        case(strategy="allgather", mask="causal"),
        case(strategy="allgather", layout="contiguous", mask="window", bias="alibi"),
        case(strategy="allgather", i=9, j=17, mask="lengths", bias="t5", dtype="float32"),
        case(strategy="allgather", mask="dense", score="general", bias="dense"),
        case(strategy="allgather", mask="offsets", score="additive", i=5),
        case(strategy="allgather", mask="custom", layout="contiguous"),
    ]
    check(dist_pool.run(TARGET, size, cases), cases)
