"""The hybrid strategy (Ulysses inside groups, ring across) equals single-process attention."""

import pytest
from distributed_cases import case, check

TARGET = "distributed_cases:run_cases"


@pytest.mark.parametrize(("size", "arrangement"), [(4, "u2r2"), (4, "u2r2t"), (2, "u2r1"), (3, "u1r3")])
def test_hybrid_matches_single_process(dist_pool, size, arrangement):
    cases = [
        case(strategy="hybrid", hybrid=arrangement, mask="causal", bias="alibi", h=6, g=2),
        case(strategy="hybrid", hybrid=arrangement, layout="contiguous", mask="window", bias="t5", i=11, j=19),
        case(strategy="hybrid", hybrid=arrangement, mask="lengths", score="additive", bias="dense", dtype="float32"),
        case(strategy="hybrid", hybrid=arrangement, mask="causal", dropout=0.25, h=6, g=6),
        case(strategy="hybrid", hybrid=arrangement, mask="window", score_mod="learned", h=6, g=2, sinks=True),
    ]
    check(dist_pool.run(TARGET, size, cases), cases)


def test_hybrid_groups_from_local_world_size(dist_pool):
    cases = [case(strategy="hybrid", hybrid="local", mask="causal", bias="t5", h=6, g=2)]
    check(dist_pool.run(TARGET, 4, cases), cases)
