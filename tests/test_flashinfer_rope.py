"""qkv.flashinfer's rotary embeddings against FlashInfer's references (its tests' rope_reference.py, written out here)."""

import math

import pytest
import torch

import qkv.flashinfer as flashinfer


def _llama31_scaled(freqs, scale, low, high, old):
    """Meta's apply_scaling (FlashInfer's tests' reference), any factors."""
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / scale)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / scale + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _reference(x, positions, r, theta, scale, interleave, llama31=None):
    """``x (n, heads, d)`` rotated as complex pairs (interleaved) or halves, in float64."""
    freqs = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = _llama31_scaled(freqs, scale, *llama31) if llama31 else freqs / scale
    angle = positions.double()[:, None, None] * freqs
    rot, rest = x[..., :r].double(), x[..., r:].double()
    if interleave:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
        rot = torch.stack([z.real, z.imag], -1).flatten(-2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        rot = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
    return torch.cat([rot, rest], -1)


@pytest.mark.parametrize("interleave,rotary_dim,llama31", [(False, None, False), (True, None, False), (False, 32, True),
                                                           (True, 16, True)])  # fmt: skip
def test_ragged_and_position_forms_match_the_reference(interleave, rotary_dim, llama31):
    torch.manual_seed(0)
    indptr, offsets = torch.tensor([0, 3, 3, 10], dtype=torch.int32), torch.tensor([5, 0, 100], dtype=torch.int32)
    q, k = torch.randn(10, 4, 64, dtype=torch.float64), torch.randn(10, 2, 64, dtype=torch.float64)
    positions = torch.tensor([5, 6, 7, 100, 101, 102, 103, 104, 105, 106])
    r = rotary_dim or 64
    if llama31:
        kwargs = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=64)
        got = flashinfer.apply_llama31_rope(q, k, indptr, offsets, rotary_dim, interleave, **kwargs)
        by_ids = flashinfer.apply_llama31_rope_pos_ids(q, k, positions, rotary_dim, interleave, **kwargs)
        ref = [_reference(x, positions, r, 5e5, 8.0, interleave, (1.0, 4.0, 64)) for x in (q, k)]
    else:
        got = flashinfer.apply_rope(q, k, indptr, offsets, rotary_dim, interleave, rope_scale=2.0, rope_theta=500.0)
        by_ids = flashinfer.apply_rope_pos_ids(q, k, positions, rotary_dim, interleave, rope_scale=2.0, rope_theta=500.0)
        ref = [_reference(x, positions, r, 500.0, 2.0, interleave) for x in (q, k)]
    for out, want in zip(got + by_ids, ref + ref):
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_inplace_forms_write_their_inputs():
    torch.manual_seed(1)
    q, k = torch.randn(6, 2, 16), torch.randn(6, 1, 16)
    want = flashinfer.apply_rope_pos_ids(q, k, torch.arange(6))
    flashinfer.apply_rope_pos_ids_inplace(q, k, torch.arange(6))
    torch.testing.assert_close((q, k), want, atol=0, rtol=0)
    q2, k2 = torch.randn(6, 2, 16), torch.randn(6, 1, 16)
    want = flashinfer.apply_llama31_rope(q2, k2, torch.tensor([0, 6]), torch.tensor([3]))
    flashinfer.apply_llama31_rope_inplace(q2, k2, torch.tensor([0, 6]), torch.tensor([3]))
    torch.testing.assert_close((q2, k2), want, atol=0, rtol=0)


@pytest.mark.parametrize("is_neox", [True, False])
def test_cos_sin_cache_form_is_vllms(is_neox):
    torch.manual_seed(2)
    head, r, n = 32, 16, 7
    inv = 1.0 / 1e4 ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    angles = torch.arange(40, dtype=torch.float32)[:, None] * inv
    cache = torch.cat([angles.cos(), angles.sin()], -1)  # vLLM's cos_sin_cache
    positions = torch.tensor([0, 3, 39, 5, 5, 1, 20])
    query, key = torch.randn(n, 3 * head), torch.randn(n, head)
    q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions, query, key, head, cache, is_neox=is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    want = _reference(query.view(n, 3, head).double(), positions, r, 1e4, 1.0, not is_neox).view(n, -1)
    torch.testing.assert_close(q_out.double(), want, atol=2e-5, rtol=2e-5)
    flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head, cache, is_neox=is_neox)
    torch.testing.assert_close(query, q_out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="float32"):
        flashinfer.apply_rope_with_cos_sin_cache(positions, query, key, head, cache.double())


def test_half_inputs_are_rotated_in_float32_and_bad_inputs_named():
    q, k = torch.randn(4, 2, 32).half(), torch.randn(4, 2, 32).half()
    out, _ = flashinfer.apply_rope_pos_ids(q, k, torch.arange(4) * 1000)
    want = _reference(q, torch.arange(4) * 1000, 32, 1e4, 1.0, False)
    assert out.dtype == torch.float16 and (out.double() - want).abs().max() < 4e-3
    with pytest.raises(ValueError, match="rotary_dim"):
        flashinfer.apply_rope_pos_ids(q, k, torch.arange(4), rotary_dim=7)
    with pytest.raises(ValueError, match="pos_ids"):
        flashinfer.apply_rope_pos_ids(q, k, torch.arange(3))
    with pytest.raises(ValueError, match="indptr"):
        flashinfer.apply_rope(q, k, torch.tensor([0, 3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="low_freq_factor"):
        flashinfer.apply_llama31_rope_pos_ids(q, k, torch.arange(4), low_freq_factor=4, high_freq_factor=1)
