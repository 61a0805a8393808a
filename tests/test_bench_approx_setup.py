"""Tests of the approx suite's configuration (``qkv.bench.approx_setup``).

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length, ``d`` head size.
"""

import pytest
import torch

from qkv.bench import approx_setup
from qkv.bench.approx_setup import (
    ApproxSetup,
    inputs,
    is_lsh,
    label,
    lsh_bucket_count,
    lsh_queries,
    mechanism,
    methods,
    size_label,
)


def test_repeats_for_large_sizes():
    setup = ApproxSetup()
    assert setup.repeats_for("exact", 4096) == setup.repeats
    assert setup.repeats_for("exact", 16384) == 3 and setup.repeats_for("exact", 32768) == 2
    assert setup.repeats_for("linear", 16384) == 7 and setup.repeats_for("linear", 32768) == 5


def test_every_method_runs_on_the_inputs_and_keeps_their_shape():
    setup = ApproxSetup(sizes=(128,), heads=2, dim_head=8, linformer_k=16, nb_features=16, landmarks=8, lsh_chunk=16)
    q, k, v = inputs(128, setup)
    assert q.shape == k.shape == v.shape == (1, 2, 128, 8)
    with torch.inference_mode():
        for m in methods(setup):
            query = lsh_queries(q, setup) if is_lsh(m) else q
            assert mechanism(m, 128, setup)(query, k, v).shape == (1, 2, 128, 8), m
    with pytest.raises(ValueError, match="method: expected one of"):
        mechanism("flash", 128, setup)


def test_reformer_rows_name_their_rounds_and_factorise_many_buckets():
    setup = ApproxSetup()
    assert methods(setup) == ("exact", "linformer", "reformer_lsh_1", "reformer_lsh_2", "reformer_lsh_4", "performer",
                              "linear", "nystrom")  # fmt: skip
    assert label("reformer_lsh_1") == "Reformer LSH, 1 round" and label("reformer_lsh_4") == "Reformer LSH, 4 rounds"
    assert mechanism("reformer_lsh_4", 1024, setup).n_hashes == 4
    # i / 64 buckets, one number up to 128, then two even factors near the square root
    assert [lsh_bucket_count(i, setup) for i in (1024, 4096, 8192, 16384, 32768)] == [16, 64, 128, (16, 16), (16, 32)]
    assert lsh_bucket_count(64 * 134, setup) == 134  # 134 = 2 · 67: no two even factors
    assert lsh_bucket_count(64 * 144, setup) == (12, 12)
    assert mechanism("reformer_lsh_2", 16384, setup).n_buckets == (16, 16)


def test_lsh_queries_have_the_fixed_norm_and_the_same_directions():
    setup = ApproxSetup(dim_head=16)
    q = torch.randn(1, 2, 5, 16)
    lq = lsh_queries(q, setup)
    torch.testing.assert_close(lq.norm(dim=-1), torch.full((1, 2, 5), setup.lsh_norm * 4.0))
    torch.testing.assert_close(torch.nn.functional.cosine_similarity(lq, q, dim=-1), torch.ones(1, 2, 5))


def test_size_labels_and_timing():
    assert [size_label(i) for i in (1024, 4096, 16384, 1000)] == ["1K", "4K", "16K", "1000"]
    seconds, out = approx_setup.timed(lambda: torch.ones(3))
    assert seconds >= 0 and torch.equal(out, torch.ones(3))


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="family: expected one of"):
        ApproxSetup(family="noise")
    with pytest.raises(ValueError, match="sizes: expected positive lengths"):
        ApproxSetup(sizes=())
    with pytest.raises(ValueError, match=r"lsh_rounds: expected distinct positive round counts, got \(2, 2\)"):
        ApproxSetup(lsh_rounds=(2, 2))
