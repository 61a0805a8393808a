"""qkv.flashinfer's BatchDecodeWithPagedKVCacheWrapper against FlashInfer's formulas, request by request."""

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import paged_requests, request

WORKSPACE = torch.empty(128 * 1024 * 1024 // 1024, dtype=torch.uint8)


@pytest.mark.parametrize("page_size,mode,cap,window,form", [
    (1, "NONE", 0.0, -1, "5d"), (16, "NONE", 0.0, -1, "tuple"), (3, "ALIBI", 0.0, 2, "tuple"),
    (3, "ALIBI", 5.0, -1, "5d"), (16, "ROPE_LLAMA", 0.0, 7, "tuple"), (4, "ROPE_LLAMA", 2.0, -1, "hnd"),
])  # fmt: skip
def test_decode_matches_each_request_alone(page_size, mode, cap, window, form):
    rng = np.random.default_rng(page_size * 10 + len(mode))
    torch.manual_seed(page_size)
    h, g, d = 8, 2, 16
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=6, page_size=page_size, g=g, d=d,
                                                                       e=d, max_kv=70)  # fmt: skip
    cache = {"5d": torch.stack([K, V], 1), "tuple": (K, V), "hnd": (K.transpose(1, 2).contiguous(), V.transpose(1, 2).contiguous())}[form]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND" if form == "hnd" else "NHD")
    wrapper.plan(kv_indptr, kv_indices, last, h, g, d, page_size, pos_encoding_mode=mode, logits_soft_cap=cap or None,
                 window_left=window, q_data_type=torch.float64, rope_scale=4.0)  # fmt: skip
    q = torch.randn(len(lens), h, d, dtype=torch.float64)
    out, lse = wrapper.run(q, cache, return_lse=True)
    for r, (k, v) in enumerate(keys):
        ref, ref_lse = request(q[r : r + 1], k, v, mode=mode, cap=cap, window_left=window, rope_scale=4.0)
        torch.testing.assert_close(out[r], ref[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[r], ref_lse[0], atol=1e-12, rtol=0)
    assert K.shape[0] > sum(-(-n // page_size) for n in lens)  # spare pages, never read


def test_float32_step_with_sinks_and_a_float8_cache():
    rng = np.random.default_rng(1)
    h, g, d, P = 8, 2, 32, 16
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=5, page_size=P, g=g, d=d, e=d,
                                                                       dtype=torch.float32, max_kv=90)  # fmt: skip
    q = torch.randn(5, h, d)
    sinks = torch.randn(h)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(kv_indptr, kv_indices, last, h, g, d, P, q_data_type="float32")
    out = wrapper.run(q, (K, V), sinks=sinks)
    for r, (k, v) in enumerate(keys):
        ref, _ = request(q[r : r + 1], k, v, sinks=sinks)
        torch.testing.assert_close(out[r].double(), ref[0], atol=2e-6, rtol=2e-6)
    K8, V8 = K.to(torch.float8_e4m3fn), V.to(torch.float8_e4m3fn)
    wrapper.plan(kv_indptr, kv_indices, last, h, g, d, P, q_data_type=torch.float32, kv_data_type=torch.float8_e4m3fn)
    out8 = wrapper.run(q, (K8, V8), k_scale=0.5, v_scale=2.0)
    for r in range(5):
        ids = kv_indices[kv_indptr[r] : kv_indptr[r + 1]].long()
        k = K8[ids].float().reshape(-1, g, d)[: lens[r]]
        v = V8[ids].float().reshape(-1, g, d)[: lens[r]]
        ref, _ = request(q[r : r + 1], k, v, sm_scale=0.5 * d**-0.5)
        torch.testing.assert_close(out8[r].double(), 2.0 * ref[0], atol=2e-5, rtol=2e-5)


def test_deprecated_data_type_and_the_q_dtype_check():
    h, g, d, P = 4, 4, 8, 2
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    cache = torch.randn(3, 2, P, g, d)
    # FlashInfer's data_type fills the dtypes left None: q_data_type defaults to float16, so alone it sets the cache's
    wrapper.plan(ints([0, 1, 3]), ints([0, 1, 2]), ints([2, 1]), h, g, d, P, data_type=torch.float32)
    with pytest.raises(ValueError, match="q_data_type torch.float16"):
        wrapper.run(torch.randn(2, h, d), cache)
    wrapper.plan(ints([0, 1, 3]), ints([0, 1, 2]), ints([2, 1]), h, g, d, P, data_type=torch.float32, q_data_type=None)
    assert wrapper.run(torch.randn(2, h, d), cache).shape == (2, h, d)
    with pytest.raises(ValueError, match="q_data_type"):
        wrapper.run(torch.randn(2, h, d, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="q: expected"):
        wrapper.run(torch.randn(3, h + 1, d), cache)
    with pytest.raises(NotImplementedError, match="window_right"):
        wrapper.plan(ints([0, 1]), ints([0]), ints([1]), h, g, d, P, window_right=-1)
    with pytest.raises(NotImplementedError, match="block_tables"):
        wrapper.plan(ints([0, 1]), ints([0]), ints([1]), h, g, d, P, block_tables=ints([[0]]))
    with pytest.raises(NotImplementedError, match="args"):
        wrapper.run(torch.randn(2, h, d), cache, torch.zeros(1))
    assert not wrapper.use_tensor_cores and not wrapper.is_cuda_graph_enabled
