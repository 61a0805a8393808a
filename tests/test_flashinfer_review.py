"""qkv.flashinfer's answers to what a review against FlashInfer's source found, each reproduced first."""

import math

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import paged_requests, request

ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
WORKSPACE = torch.empty(0, dtype=torch.uint8)


def test_a_wider_output_dtype_keeps_its_precision():
    # FlashInfer accumulates in float32 and writes o_data_type: a half q's output asked in float32 is not half-rounded
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 64).half(), torch.randn(50, 2, 64).half(), torch.randn(50, 2, 64).half()
    out = flashinfer.single_prefill_with_kv_cache(q, k, v, o_dtype=torch.float32)
    ref, _ = request(q, k, v)
    assert out.dtype == torch.float32 and not torch.equal(out, out.half().float())
    assert (out.double() - ref).abs().max() < 1e-5


def test_buffers_of_another_dtype_or_device_are_refused():
    q, k, v = torch.randn(1, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(ints([0, 1]), ints([0]), ints([5]), 4, 2, 8, 5, q_data_type=torch.float32)
    cache = (k[None], v[None])
    for out in (torch.empty(1, 4, 8, dtype=torch.int32), torch.empty(1, 4, 8, device="meta")):
        with pytest.raises(ValueError, match="out: expected a torch.float32 tensor"):
            wrapper.run(q, cache, out=out)
    with pytest.raises(ValueError, match="lse: expected a torch.float32 tensor"):
        wrapper.run(q, cache, lse=torch.empty(1, 4, dtype=torch.float16), return_lse=True)


def test_decode_plan_takes_flashinfers_deprecated_positional_arguments_and_names():
    h, g, d, P = 4, 2, 8, 4
    k, v = torch.randn(2, P, g, d), torch.randn(2, P, g, d)
    q = torch.randn(1, h, d)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    with pytest.warns(DeprecationWarning, match="positionally"):
        wrapper.plan(ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, "NONE", 2, None, torch.float32)
    windowed = wrapper.run(q, (k, v))
    ref, _ = request(q, k.reshape(-1, g, d)[:7], v.reshape(-1, g, d)[:7], window_left=2)
    torch.testing.assert_close(windowed.double(), ref[None][0], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="multiple values"):
        wrapper.plan(ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, "NONE", pos_encoding_mode="ALIBI")
    wrapper.begin_forward(ints([0, 2]), ints([0, 1]), ints([3]), h, g, d, P, pos_encoding_mode="ALIBI",
                          logits_soft_cap=9.0, q_data_type=torch.float32)  # fmt: skip
    # the deprecated call restates the values the plan's kernel takes (scale, cap), not what plan compiled into it
    out, lse = wrapper.forward_return_lse(q, (k, v), "ALIBI", sm_scale=0.2, logits_soft_cap=3.0)
    ref, ref_lse = request(q, k.reshape(-1, g, d)[:7], v.reshape(-1, g, d)[:7], mode="ALIBI", sm_scale=0.2, cap=3.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wrapper.run(q, (k, v)), out)  # and for later runs, as FlashInfer keeps them
    for change, match in (({"pos_encoding_mode": "NONE", "logits_soft_cap": 3.0}, "pos_encoding_mode"),
                          ({"pos_encoding_mode": "ALIBI"}, "logits_soft_cap"),  # (FlashInfer's kernel: caps at 0)
                          ({"pos_encoding_mode": "ALIBI", "logits_soft_cap": 3.0, "window_left": 2}, "window_left")):
        with pytest.raises(ValueError, match=match):
            wrapper.forward(q, (k, v), **change)
    assert wrapper.end_forward() is None


def test_numpy_sizes_pass_and_a_float_is_named():
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(ints([0, 1]), ints([0, 1]), ints([0]), ints([2]), np.int64(4), np.int32(2), np.int64(8), np.int64(4),
                 q_data_type="float32")  # fmt: skip
    assert wrapper.run(torch.randn(1, 4, 8), torch.randn(1, 2, 4, 2, 8)).shape == (1, 4, 8)
    with pytest.raises(TypeError, match="page_size: expected an int, got float"):
        wrapper.plan(ints([0, 1]), ints([0, 1]), ints([0]), ints([2]), 4, 2, 8, 4.0)


def test_a_packed_mask_of_another_byte_count_is_refused_and_a_plan_keeps_its_own_copy():
    h, g, d, P = 2, 2, 8, 8
    k, v = torch.randn(2, P, g, d, dtype=torch.float64), torch.randn(2, P, g, d, dtype=torch.float64)
    q = torch.randn(2, h, d, dtype=torch.float64)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    table = (ints([0, 1, 2]), ints([0, 1, 2]), ints([0, 1]), ints([4, 8]))
    whole = flashinfer.packbits(torch.ones(12, dtype=torch.bool), bitorder="little")  # one stream: 2 bytes, not 1 + 1
    with pytest.raises(ValueError, match="segment_packbits"):
        wrapper.plan(*table, h, g, d, P, packed_custom_mask=whole[:1], q_data_type=torch.float64)
    bits, _ = flashinfer.segment_packbits(torch.ones(12, dtype=torch.bool), torch.tensor([0, 4, 12]), bitorder="little")
    wrapper.plan(*table, h, g, d, P, packed_custom_mask=bits, q_data_type=torch.float64)
    before = wrapper.run(q, (k, v))
    bits.zero_()
    torch.testing.assert_close(wrapper.run(q, (k, v)), before, atol=0, rtol=0)


def test_float8_queries_are_refused_at_plan():
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    with pytest.raises(NotImplementedError, match="q_data_type"):
        wrapper.plan(ints([0, 1]), ints([0]), ints([2]), 4, 2, 8, 4, q_data_type=torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_caches_of_one_slot_pages_without_their_page_axis(layout):
    torch.manual_seed(1)
    g, d = 2, 8
    k, v = torch.randn(6, g, d, dtype=torch.float64), torch.randn(6, g, d, dtype=torch.float64)
    q = torch.randn(1, 4, d, dtype=torch.float64)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, layout)
    wrapper.plan(ints([0, 4]), ints([5, 0, 2, 3]), ints([1]), 4, g, d, 1, q_data_type=torch.float64)
    ref, _ = request(q, k[[5, 0, 2, 3]], v[[5, 0, 2, 3]])
    for cache in ((k, v), torch.stack([k, v], 1)):  # 3-d pools, or one 4-d tensor (g and d: HND's order is the same)
        torch.testing.assert_close(wrapper.run(q, cache), ref, atol=1e-12, rtol=0)


def test_tables_read_from_their_first_offset_and_an_empty_last_page():
    rng = np.random.default_rng(2)
    h, g, d, P = 4, 2, 8, 4
    (K, V), (kv_indptr, kv_indices, last), keys, lens = paged_requests(rng, requests=3, page_size=P, g=g, d=d, e=d)
    q = torch.randn(3, h, d, dtype=torch.float64)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    shifted_indices = torch.cat([ints([7, 7]), kv_indices])
    wrapper.plan(kv_indptr + 2, shifted_indices, last, h, g, d, P, q_data_type=torch.float64)
    out = wrapper.run(q, (K, V))
    for r, (k, v) in enumerate(keys):
        torch.testing.assert_close(out[r], request(q[r : r + 1], k, v)[0][0], atol=1e-12, rtol=0)
    # a last page of 0 entries: the request is its full pages before it (FlashInfer's (pages - 1) · P + last)
    extra = torch.cat([kv_indices[: kv_indptr[1]], ints([0]), kv_indices[kv_indptr[1] :]])
    indptr = torch.cat([kv_indptr[:1], kv_indptr[1:] + 1])
    lengths = last.clone()
    lengths[0] = 0
    wrapper.plan(indptr, extra, lengths, h, g, d, P, q_data_type=torch.float64)
    full = keys[0][0].shape[0] - last[0] + P  # request 0: its pages all full, the next one empty
    k0 = K[kv_indices[: kv_indptr[1]].long()].reshape(-1, g, d)[: -(-full // P) * P][:full]
    v0 = V[kv_indices[: kv_indptr[1]].long()].reshape(-1, g, d)[: -(-full // P) * P][:full]
    torch.testing.assert_close(wrapper.run(q, (K, V))[0], request(q[:1], k0, v0)[0][0], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="kv_last_page_len"):  # checked when planned, not at the first run
        wrapper.plan(kv_indptr, kv_indices, last + P, h, g, d, P, q_data_type=torch.float64)


def test_merge_states_of_one_state_passes_it_through():
    v, s = torch.randn(2, 1, 3, 4), torch.full((2, 1, 3), -math.inf)
    out, lse = flashinfer.merge_states(v, s)
    torch.testing.assert_close(out, v[:, 0], atol=0, rtol=0)
    assert torch.isneginf(lse).all()


def test_single_prefill_causal_with_fewer_keys_than_queries_is_flashinfers_error():
    with pytest.raises(ValueError, match="kv_len must be greater than or equal to qo_len"):
        flashinfer.single_prefill_with_kv_cache(torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), causal=True)


def test_an_empty_batch_with_rope():
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(ints([0]), ints([0]), ints([]), ints([]), 2, 2, 8, 4, pos_encoding_mode="ROPE_LLAMA", q_data_type="float32")
    assert wrapper.run(torch.randn(0, 2, 8), torch.randn(3, 2, 4, 2, 8)).shape == (0, 2, 8)


def test_ragged_plan_names_its_own_arguments_and_takes_o_scale():
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    with pytest.raises(ValueError, match="qo_indptr, kv_indptr"):
        wrapper.plan(ints([0, 1, 2]), ints([0, 3]), 2, 2, 8)
    wrapper.plan(ints([0, 1]), ints([0, 3]), 2, 2, 8, q_data_type="float32")
    q, k, v = torch.randn(1, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch.testing.assert_close(wrapper.run(q, k, v, o_scale=1.0), wrapper.run(q, k, v))


def test_the_decode_kernel_keeps_rotated_half_queries_and_keys_in_float32():
    # FlashInfer's CUDA-core decode rotates in float32 registers; its prefill kernel (use_tensor_cores) stores them
    torch.manual_seed(3)
    q, k, v = torch.randn(8, 64).half(), torch.randn(300, 2, 64).half(), torch.randn(300, 2, 64).half()
    ref, ref_lse = request(q[None], k, v, mode="ROPE_LLAMA")
    errors = {}
    for cores in (False, True):
        out, lse = flashinfer.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", use_tensor_cores=cores,
                                                          return_lse=True)  # fmt: skip
        errors[cores] = (lse.double() - ref_lse[0]).abs().max().item()
    assert errors[False] < 1e-5 < errors[True]


def test_key_count_tables_read_from_their_first_offset():
    # BatchAttention and MLA plans count keys: a table whose offsets start past 0 reads kv_indices from there on
    torch.manual_seed(4)
    P = 4
    K, V = torch.randn(8, P, 1, 8, dtype=torch.float64), torch.randn(8, P, 1, 8, dtype=torch.float64)
    q = torch.randn(1, 1, 8, dtype=torch.float64)
    wrapper = flashinfer.BatchAttention()
    wrapper.plan(ints([0, 1]), ints([1, 4]), ints([7, 2, 5, 6]), ints([5]), 1, 1, 8, 8, P, q_data_type=torch.float64,
                 kv_data_type=torch.float64)  # fmt: skip
    out, lse = wrapper.run(q, (K, V))
    ids = torch.tensor([2, 5])
    ref, ref_lse = request(q, K[ids].reshape(-1, 1, 8)[:5], V[ids].reshape(-1, 1, 8)[:5])
    torch.testing.assert_close((out, lse), (ref, ref_lse), atol=1e-12, rtol=0)
    mla = flashinfer.BatchMLAPagedAttentionWrapper()
    mla.plan(ints([0, 1]), ints([1, 4]), ints([7, 2, 5, 6]), ints([5]), 1, 8, 0, P, False, 8**-0.5, torch.float64,
             torch.float64)  # fmt: skip
    torch.testing.assert_close(mla.run(q, q[..., :0], K[:, :, 0], K[:, :, 0, :0]),
                               request(q, K[ids].reshape(-1, 1, 8)[:5], K[ids].reshape(-1, 1, 8)[:5])[0],
                               atol=1e-12, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match="kv_len_arr"):
        wrapper.plan(ints([0, 1]), ints([0, 1]), ints([0]), ints([9]), 1, 1, 8, 8, P)


def test_rope_takes_numpy_sizes_and_names_bad_positions():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    torch.testing.assert_close(flashinfer.apply_rope_pos_ids(q, k, torch.arange(4), rotary_dim=np.int64(4)),
                               flashinfer.apply_rope_pos_ids(q, k, torch.arange(4), rotary_dim=4))  # fmt: skip
    assert len(flashinfer.MultiLevelCascadeAttentionWrapper(np.int64(2))._levels) == 2
    cache = torch.randn(10, 8)
    with pytest.raises(ValueError, match="key: expected one row per query row"):
        flashinfer.apply_rope_with_cos_sin_cache(torch.arange(4), q.view(4, 16), k[:3].view(3, 8), 8, cache)
    with pytest.raises(ValueError, match="positions: expected 0 .. 9"):
        flashinfer.apply_rope_with_cos_sin_cache(torch.tensor([0, 1, 2, 10]), q.view(4, 16), k.view(4, 8), 8, cache)
    with pytest.raises(ValueError, match="positions: expected one position per row"):
        flashinfer.apply_rope_with_cos_sin_cache(torch.arange(3), q.view(4, 16), k.view(4, 8), 8, cache)
    for bad in (torch.arange(4).float(), torch.ones(4, dtype=torch.bool)):
        with pytest.raises(TypeError, match="pos_ids: expected an int32 or int64"):
            flashinfer.apply_rope_pos_ids(q, k, bad)
    with pytest.raises(TypeError, match="offsets"):
        flashinfer.apply_rope(q, k, torch.tensor([0, 4]), torch.tensor([1.5]))
    with pytest.raises(TypeError, match="indptr"):
        flashinfer.apply_rope(q, k, torch.tensor([0.0, 4.0]), torch.tensor([1]))


def test_llama31_frequencies_at_a_low_factor_of_zero_are_flashinfers_clamped_blend():
    q, k = torch.randn(3, 1, 16, dtype=torch.float64), torch.randn(3, 1, 16, dtype=torch.float64)
    out, _ = flashinfer.apply_llama31_rope_pos_ids(q, k, torch.arange(3) * 50, low_freq_factor=0, high_freq_factor=4,
                                                   old_context_len=64, rope_scale=8.0, rope_theta=1e4)  # fmt: skip
    theta = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    smooth = (64 * theta / (2 * math.pi) / 4).clamp(0, 1)
    freq = (1 - smooth) * theta / 8 + smooth * theta
    angle = (torch.arange(3) * 50).double()[:, None, None] * freq
    a, b = q[..., :8], q[..., 8:]
    want = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_profilers_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="use_profiler"):
        flashinfer.BatchMLAPagedAttentionWrapper().plan(ints([0, 1]), ints([0, 1]), ints([0]), ints([1]), 1, 8, 0, 4,
                                                        False, 0.3, torch.float32, torch.float32, use_profiler=True)  # fmt: skip
    with pytest.raises(NotImplementedError, match="use_profiler"):
        flashinfer.BatchAttention().plan(ints([0, 1]), ints([0, 1]), ints([0]), ints([1]), 1, 1, 8, 8, 4,
                                         use_profiler=True)  # fmt: skip
