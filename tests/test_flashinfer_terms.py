"""qkv.flashinfer's terms: FlashInfer's ALiBi slopes, the checks of a plan's terms, a RoPE call leaving the cache alone."""

import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import alibi_slopes


@pytest.mark.parametrize("heads", [1, 2, 3, 6, 8, 12, 16, 32, 40])
def test_alibi_slopes_are_flashinfers(heads):
    got = flashinfer.get_alibi_slopes(heads)
    assert got.dtype == torch.float32 and got.shape == (heads,)
    assert got.double().tolist() == alibi_slopes(heads).tolist()


def test_a_rope_call_rotates_a_copy_and_reads_the_same_twice():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    kept = k.clone()
    first = flashinfer.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", causal=True)
    torch.testing.assert_close(k, kept, atol=0, rtol=0)
    torch.testing.assert_close(flashinfer.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", causal=True),
                               first, atol=0, rtol=0)  # fmt: skip


@pytest.mark.parametrize("kwargs,match", [
    ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
    ({"logits_soft_cap": float("nan")}, "logits_soft_cap"),
    ({"sm_scale": "0.1"}, "sm_scale"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"window_left": 1.5}, "window_left"),
    ({"pos_encoding_mode": "rope_llama"}, "pos_encoding_mode"),
    ({"packed_custom_mask": torch.ones(1, dtype=torch.bool)}, "packed_custom_mask"),
    ({"packed_custom_mask": torch.ones(1, dtype=torch.uint8)}, "packed_custom_mask"),
])  # fmt: skip
def test_bad_terms_name_the_argument(kwargs, match):
    q, k, v = torch.randn(3, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    with pytest.raises((TypeError, ValueError), match=match):
        flashinfer.single_prefill_with_kv_cache(q, k, v, **kwargs)


def test_the_package_names_flashinfers_calls_under_its_module_paths():
    from qkv.flashinfer import cascade, decode, page, prefill, quantization

    assert decode.BatchDecodeWithPagedKVCacheWrapper is flashinfer.BatchDecodeWithPagedKVCacheWrapper
    assert prefill.BatchPrefillWithRaggedKVCacheWrapper is flashinfer.BatchPrefillWithRaggedKVCacheWrapper
    assert cascade.merge_states is flashinfer.merge_states and page.get_seq_lens is flashinfer.get_seq_lens
    assert quantization.segment_packbits is flashinfer.segment_packbits
    assert flashinfer.__version__ == "0.6.18" and set(flashinfer.__all__) <= set(dir(flashinfer))
