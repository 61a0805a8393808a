"""qkv.flashinfer's BatchAttention (FlashInfer's holistic wrapper) against FlashInfer's formulas, request by request."""

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import paged_requests, request


@pytest.mark.parametrize("causal,cap,layout", [(True, 0.0, "NHD"), (False, 3.0, "NHD"), (True, 2.0, "HND")])
def test_a_mixed_batch_matches_each_request_alone(causal, cap, layout):
    rng = np.random.default_rng(int(causal) + int(cap))
    h, g, d, e, P = 6, 2, 8, 4, 4
    (K, V), (kv_indptr, kv_indices, _), keys, lens = paged_requests(rng, requests=6, page_size=P, g=g, d=d, e=e)
    qo = [1, 1, 3, 1, 5, 2] if causal else [2, 1, 7, 1, 3, 1]
    qo = [min(n, j) if causal else n for n, j in zip(qo, lens)]
    q = torch.randn(sum(qo), h, d, dtype=torch.float64)
    cache = (K, V) if layout == "NHD" else (K.transpose(1, 2).contiguous(), V.transpose(1, 2).contiguous())
    wrapper = flashinfer.BatchAttention(layout, device="cpu")
    wrapper.plan(torch.tensor([0, *np.cumsum(qo)], dtype=torch.int32), kv_indptr, kv_indices,
                 torch.tensor(lens, dtype=torch.int32), h, g, d, e, P, causal=causal, sm_scale=0.3,
                 logits_soft_cap=cap or None, q_data_type=torch.float64, kv_data_type=torch.float64)  # fmt: skip
    out, lse = wrapper.run(q, cache, logits_soft_cap=cap)
    at = 0
    for (k, v), n in zip(keys, qo):
        ref, ref_lse = request(q[at : at + n], k, v, causal=causal, cap=cap, sm_scale=0.3)
        torch.testing.assert_close(out[at : at + n], ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[at : at + n], ref_lse, atol=1e-12, rtol=0)
        at += n


def test_key_counts_leave_unfilled_pages_unread_and_caps_agree_between_plan_and_run():
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    k, v = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
    k[3], v[3] = float("nan"), float("nan")  # a page the request holds but has not begun
    wrapper = flashinfer.BatchAttention()
    wrapper.plan(ints([0, 1]), ints([0, 2]), ints([0, 3]), ints([2]), 2, 1, 8, 8, 2, q_data_type=torch.float32,
                 kv_data_type=torch.float32)  # fmt: skip
    out, lse = wrapper.run(torch.randn(1, 2, 8), (k, v))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="not provided in plan"):
        wrapper.run(torch.randn(1, 2, 8), (k, v), logits_soft_cap=5.0)
    wrapper.plan(ints([0, 1]), ints([0, 2]), ints([0, 3]), ints([2]), 2, 1, 8, 8, 2, logits_soft_cap=5.0,
                 q_data_type=torch.float32, kv_data_type=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="pass run its cap"):
        wrapper.run(torch.randn(1, 2, 8), (k, v))
    with pytest.raises(ValueError, match="head_dim > 256"):
        wrapper.plan(ints([0, 1]), ints([0, 2]), ints([0, 3]), ints([2]), 2, 1, 512, 8, 2)
    with pytest.raises(ValueError, match="kv_len"):
        wrapper.plan(ints([0, 1]), ints([0, 2]), ints([0, 3]), ints([5]), 2, 1, 8, 8, 2)
