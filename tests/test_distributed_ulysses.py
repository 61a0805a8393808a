"""The Ulysses strategy equals single-process attention (spawned gloo ranks, P = 1..4)."""

import pytest
from distributed_cases import case, check

from qkv.distributed.ulysses import kv_heads

TARGET = "distributed_cases:run_cases"


def test_kv_heads_repeats_or_refuses():
    assert kv_heads(8, 2, 4) == 4  # each KV head sent twice
    assert kv_heads(6, 3, 3) == 3
    assert kv_heads(6, 3, 2) == 6
    with pytest.raises(ValueError, match=r"h=6 query heads over 4 ranks"):
        kv_heads(6, 3, 4)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_ulysses_matches_single_process(dist_pool, size):
    cases = [
        case(strategy="ulysses", mask="causal", bias="alibi"),
        case(strategy="ulysses", layout="contiguous", mask="window", bias="t5", dtype="float32"),
        case(strategy="ulysses", i=9, j=17, mask="lengths", bias="dense", score="general"),
        case(strategy="ulysses", mask="dense", score="additive", i=5),
    ]
    check(dist_pool.run(TARGET, size, cases), cases)


def test_ulysses_repeats_kv_heads(dist_pool):
    cases = [case(strategy="ulysses", h=8, g=2, mask="causal", bias="alibi")]
    check(dist_pool.run(TARGET, 4, cases), cases)
