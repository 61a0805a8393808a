"""qkv.flashinfer's single-request calls against FlashInfer's formulas written out in float64 (tests/flashinfer_ref.py)."""

import itertools

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer
from flashinfer_ref import request

MODES = ("NONE", "ALIBI", "ROPE_LLAMA")


def _kv(j, g, d, e, layout, dtype=torch.float64):
    k, v = torch.randn(j, g, d, dtype=dtype), torch.randn(j, g, e, dtype=dtype)
    given = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    return (k, v), given


@pytest.mark.parametrize("mode,causal,cap,window,layout", [
    (mode, causal, cap, window, layout)
    for mode, causal, cap, window in itertools.product(MODES, (False, True), (0.0, 2.5), (-1, 3))
    for layout in (("NHD", "HND") if mode == "NONE" else ("NHD",))
])  # fmt: skip
def test_single_prefill_matches_the_formulas(mode, causal, cap, window, layout):
    torch.manual_seed(len(mode) + 7 * causal + int(cap) + window)
    n, j, h, g, d, e = 5, 11, 6, 2, 8, 4
    q = torch.randn(n, h, d, dtype=torch.float64)
    (k, v), given = _kv(j, g, d, e, layout)
    out, lse = flashinfer.single_prefill_with_kv_cache(q, *given, causal=causal, kv_layout=layout, pos_encoding_mode=mode,
                                                       logits_soft_cap=cap or None, window_left=window, return_lse=True,
                                                       rope_scale=2.0, rope_theta=500.0)  # fmt: skip
    ref, ref_lse = request(q, k, v, causal=causal, mode=mode, cap=cap, window_left=window, rope_scale=2.0, rope_theta=500.0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
    assert lse.dtype == torch.float64 and out.shape == (n, h, e)


def test_single_prefill_custom_mask_replaces_causal_and_its_packed_bits_read_the_same():
    torch.manual_seed(1)
    n, j, h, d = 4, 13, 4, 8
    q, k, v = torch.randn(n, h, d, dtype=torch.float64), torch.randn(j, 2, d, dtype=torch.float64), torch.randn(j, 2, d, dtype=torch.float64)
    mask = torch.rand(n, j) < 0.4
    mask[2] = False  # a row that sees nothing: zeros and -inf
    out, lse = flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, causal=True, return_lse=True)
    ref, ref_lse = request(q, k, v, mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
    packed = flashinfer.packbits(mask.reshape(-1), bitorder="little")
    again = flashinfer.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, custom_mask=~mask)
    torch.testing.assert_close(again, out, atol=0, rtol=0)  # the packed mask wins, as FlashInfer's


def test_single_decode_is_the_last_position_and_folds_the_scales():
    torch.manual_seed(2)
    h, g, j, d = 8, 2, 9, 16
    q = torch.randn(h, d, dtype=torch.float64)
    k, v = torch.randn(j, g, d, dtype=torch.float64), torch.randn(j, g, d, dtype=torch.float64)
    for mode in MODES:
        out, lse = flashinfer.single_decode_with_kv_cache(q, k, v, pos_encoding_mode=mode, window_left=4, q_scale=0.5,
                                                          k_scale=3.0, v_scale=2.0, sm_scale=0.2, return_lse=True)  # fmt: skip
        ref, ref_lse = request(q[None], k, v, mode=mode, window_left=4, sm_scale=0.2 * 0.5 * 3.0)
        torch.testing.assert_close(out, 2.0 * ref[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, ref_lse[0], atol=1e-12, rtol=0)
        assert out.shape == (h, d) and lse.shape == (h,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precisions_follow_the_float64_formula(dtype):
    torch.manual_seed(3)
    q = torch.randn(6, 4, 32).to(dtype)
    k, v = torch.randn(50, 4, 32).to(dtype), torch.randn(50, 4, 32).to(dtype)
    out, lse = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = request(q, k, v, causal=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    wider = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, o_dtype=torch.float32)
    assert wider.dtype == torch.float32


def test_return_lse_partial_and_numpy_scalars():
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out, lse = flashinfer.single_prefill_with_kv_cache_return_lse(q, k, v, sm_scale=np.float32(0.3))
    torch.testing.assert_close(out, flashinfer.single_prefill_with_kv_cache(q, k, v, sm_scale=0.3))
    assert lse.shape == (3, 2)


def test_refusals_and_bad_inputs_name_the_argument():
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    with pytest.raises(NotImplementedError, match="scale_q"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, torch.ones(2))
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match="kv_layout"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, kv_layout="NDH")
    with pytest.raises(ValueError, match="custom_mask"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one"):
        flashinfer.single_prefill_with_kv_cache(q, k[:0], v[:0])
    with pytest.raises(ValueError, match="q: expected"):
        flashinfer.single_decode_with_kv_cache(q, k, v)
    with pytest.raises(ValueError, match="window_left"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, window_left=-2)
