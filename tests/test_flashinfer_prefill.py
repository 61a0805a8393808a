"""qkv.flashinfer's prefill wrappers (paged and ragged) against FlashInfer's formulas, request by request, in float64."""

import itertools

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import paged_requests, request

WORKSPACE = torch.empty(0, dtype=torch.uint8)


def _queries(rng, lens, h, d, causal):
    qo = [int(rng.integers(0, min(6, n) + 1)) if causal else int(rng.integers(0, 7)) for n in lens]
    qo[0] = max(qo[0], 1)
    return torch.randn(sum(qo), h, d, dtype=torch.float64), torch.tensor([0, *np.cumsum(qo)], dtype=torch.int32), qo


CASES = list(itertools.product((1, 3, 16), ("NONE", "ALIBI", "ROPE_LLAMA"), (False, True), (0.0, 4.0), (-1, 5)))


@pytest.mark.parametrize("page_size,mode,causal,cap,window", CASES)
def test_paged_prefill_matches_each_request_alone(page_size, mode, causal, cap, window):
    rng = np.random.default_rng(CASES.index((page_size, mode, causal, cap, window)))
    torch.manual_seed(int(rng.integers(1 << 30)))
    h, g, d = 6, 3, 8
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=5, page_size=page_size, g=g, d=d, e=d)
    q, qo_indptr, qo = _queries(rng, lens, h, d, causal)
    layout = "HND" if page_size == 3 else "NHD"
    cache = torch.stack([K, V], 1)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, layout)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, g, d, page_size, causal=causal, pos_encoding_mode=mode,
                 logits_soft_cap=cap or None, window_left=window, q_data_type=torch.float64, rope_theta=300.0)  # fmt: skip
    out, lse = wrapper.run(q, cache, return_lse=True)
    at = 0
    for (k, v), n in zip(keys, qo):
        ref, ref_lse = request(q[at : at + n], k, v, causal=causal, mode=mode, cap=cap, window_left=window,
                               rope_theta=300.0)  # fmt: skip
        torch.testing.assert_close(out[at : at + n], ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[at : at + n], ref_lse, atol=1e-12, rtol=0)
        at += n


def test_a_plan_runs_every_layer_and_keeps_the_table_it_was_given():
    rng = np.random.default_rng(5)
    h, g, d, P = 4, 2, 8, 4
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=4, page_size=P, g=g, d=d, e=d)
    q, qo_indptr, qo = _queries(rng, lens, h, d, True)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, g, d, P, causal=True, q_data_type="float64")
    first = wrapper.run(q, (K, V))
    kv_indices.copy_(kv_indices.flip(0))
    last.fill_(1)
    torch.testing.assert_close(wrapper.run(q, (K, V)), first, atol=0, rtol=0)
    layer2 = (torch.randn_like(K), torch.randn_like(V))
    other = wrapper.run_return_lse(q, layer2)[0]
    assert not torch.allclose(other, first)


def test_custom_masks_per_request_flat_and_packed():
    rng = np.random.default_rng(6)
    h, g, d, P = 4, 4, 8, 5
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=3, page_size=P, g=g, d=d, e=d)
    q, qo_indptr, qo = _queries(rng, lens, h, d, False)
    masks = [torch.rand(n, j) < 0.5 for n, j in zip(qo, lens)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, g, d, P, custom_mask=flat, causal=True, window_left=6,
                 q_data_type=torch.float64)  # fmt: skip
    out = wrapper.run(q, (K, V))
    bounds = torch.tensor([0, *np.cumsum([m.numel() for m in masks])])
    packed, _ = flashinfer.segment_packbits(flat, bounds, bitorder="little")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, g, d, P, packed_custom_mask=packed, q_data_type=torch.float64,
                 window_left=6)  # fmt: skip
    torch.testing.assert_close(wrapper.run(q, (K, V)), out, atol=0, rtol=0)
    at = 0
    for (k, v), n, m in zip(keys, qo, masks):
        ref, _ = request(q[at : at + n], k, v, mask=m, window_left=6)
        torch.testing.assert_close(out[at : at + n], ref, atol=1e-12, rtol=0)
        at += n


def test_sinks_scales_buffers_and_value_size():
    rng = np.random.default_rng(7)
    h, g, d, e, P = 4, 2, 8, 6, 4
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=3, page_size=P, g=g, d=d, e=e)
    q, qo_indptr, qo = _queries(rng, lens, h, d, True)
    sinks = torch.randn(h, dtype=torch.float64)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, g, d, P, head_dim_vo=e, causal=True, sm_scale=0.4,
                 q_data_type=torch.float64)  # fmt: skip
    out, lse = torch.empty(q.shape[0], h, e, dtype=torch.float64), torch.empty(q.shape[0], h, dtype=torch.float64)
    got = wrapper.run(q, (K, V), sinks=sinks, k_scale=2.0, q_scale=0.5, v_scale=3.0, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    at = 0
    for (k, v), n in zip(keys, qo):
        ref, ref_lse = request(q[at : at + n], k, v, causal=True, sm_scale=0.4, sinks=sinks)
        torch.testing.assert_close(out[at : at + n], 3.0 * ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[at : at + n], ref_lse, atol=1e-12, rtol=0)
        at += n


@pytest.mark.parametrize("mode,causal", [("NONE", True), ("NONE", False), ("ALIBI", True), ("ROPE_LLAMA", True)])
def test_ragged_prefill_matches_each_request_alone(mode, causal):
    rng = np.random.default_rng(8)
    torch.manual_seed(8)
    h, g, d = 4, 2, 8
    lens = [7, 1, 12, 3]
    k, v = torch.randn(sum(lens) + 2, g, d, dtype=torch.float64), torch.randn(sum(lens) + 2, g, d, dtype=torch.float64)
    q, qo_indptr, qo = _queries(rng, lens, h, d, causal)
    kv_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    wrapper.plan(qo_indptr, kv_indptr, h, g, d, causal=causal, pos_encoding_mode=mode, logits_soft_cap=3.0,
                 q_data_type=torch.float64)  # fmt: skip
    out, lse = wrapper.run_return_lse(q, k, v)
    at, kat = 0, 0
    for n, j in zip(qo, lens):
        ref, ref_lse = request(q[at : at + n], k[kat : kat + j], v[kat : kat + j], causal=causal, mode=mode, cap=3.0)
        torch.testing.assert_close(out[at : at + n], ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[at : at + n], ref_lse, atol=1e-12, rtol=0)
        at, kat = at + n, kat + j


def test_plan_and_run_checks():
    h, g, d, P = 4, 2, 8, 4
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    cache = torch.randn(3, 2, P, g, d)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(torch.randn(2, h, d), cache)
    wrapper.plan(ints([0, 2]), ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, causal=True)
    with pytest.raises(ValueError, match="q_data_type"):  # FlashInfer's default q_data_type is float16
        wrapper.run(torch.randn(2, h, d), cache)
    wrapper.plan(ints([0, 2]), ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, causal=True, q_data_type=torch.float32)
    assert wrapper.run(torch.randn(2, h, d), cache).shape == (2, h, d)
    with pytest.raises(ValueError, match="kv_data_type"):
        wrapper.run(torch.randn(2, h, d), cache.double())
    with pytest.raises(ValueError, match="num_kv_heads|KV heads"):
        wrapper.run(torch.randn(2, h, d), torch.randn(3, 2, P, 1, d))
    with pytest.raises(ValueError, match="window_left"):
        wrapper.run(torch.randn(2, h, d), cache, window_left=3)
    with pytest.raises(NotImplementedError, match="prefix_len_ptr"):
        wrapper.plan(ints([0, 2]), ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, prefix_len_ptr=ints([1]))
    with pytest.raises(NotImplementedError, match="jit_args"):
        flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, jit_args=[1])
    with pytest.raises(NotImplementedError, match="kv_layout"):
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, "HND")
