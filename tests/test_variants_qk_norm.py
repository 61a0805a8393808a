"""Tests of ``qkv.QKNorm`` (per-head RMSNorm of q and k) and the ``qk_norm=`` slot of ``MultiHeadAttention``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size.
"""

import math

import pytest
import torch
from einops import rearrange

import qkv
from qkv.cache import KVCache


def _rms_literal(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """``γ ⊙ x / sqrt(mean(x²) + ε)`` over the last dim, one vector at a time in Python floats."""
    rows = x.reshape(-1, x.shape[-1]).tolist()
    g = gain.tolist()
    out = []
    for row in rows:
        rms = math.sqrt(sum(a * a for a in row) / len(row) + eps)
        out.append([g[n] * a / rms for n, a in enumerate(row)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def test_qk_norm_is_rmsnorm_per_head_with_separate_gains():
    norm = qkv.QKNorm(11, eps=1e-6).double()
    with torch.no_grad():
        norm.q_norm.weight.uniform_(0.5, 1.5)
        norm.k_norm.weight.uniform_(0.5, 1.5)
    q, k = torch.randn(2, 6, 5, 11, dtype=torch.float64) * 3, torch.randn(2, 3, 7, 11, dtype=torch.float64)
    q2, k2 = norm(q, k)
    torch.testing.assert_close(q2, _rms_literal(q, norm.q_norm.weight, 1e-6), rtol=0, atol=1e-12)
    torch.testing.assert_close(k2, _rms_literal(k, norm.k_norm.weight, 1e-6), rtol=0, atol=1e-12)


def test_mha_applies_the_norm_per_head_before_rotary():
    torch.manual_seed(0)
    h, g, d = 6, 3, 4
    norm = qkv.QKNorm(d)
    mha = qkv.MultiHeadAttention(h * d, h, kv_heads=g, positional=qkv.Rotary(d), qk_norm=norm).double()
    x = torch.randn(2, 5, h * d, dtype=torch.float64)
    q = rearrange(mha.q_proj(x), "b i (h d) -> b h i d", h=h)
    k = rearrange(mha.k_proj(x), "b j (g d) -> b g j d", g=g)
    v = rearrange(mha.v_proj(x), "b j (g e) -> b g j e", g=g)
    q, k = mha.positional.rotate(_rms_literal(q, norm.q_norm.weight, 1e-6), _rms_literal(k, norm.k_norm.weight, 1e-6))
    out = qkv.attention(q, k, v, causal=True, backend="reference")
    want = mha.out_proj(rearrange(out, "b h i e -> b i (h e)"))
    torch.testing.assert_close(mha(x, causal=True), want, rtol=0, atol=1e-12)


def test_qk_norm_bounds_the_logits_whatever_the_projection_scale():
    # |q·k| <= |γ_q| |γ_k| d after the norm: scaling W^Q by 1000 leaves the output unchanged
    # (up to ε, taken tiny here)
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(24, 6, qk_norm=qkv.QKNorm(4, eps=1e-30)).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    before = mha(x)
    with torch.no_grad():
        mha.q_proj.weight.mul_(1000.0)
        mha.q_proj.bias.mul_(1000.0)
    torch.testing.assert_close(mha(x), before, rtol=0, atol=1e-9)


def test_qk_norm_gains_get_gradients_and_cached_decoding_matches():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(24, 6, kv_heads=3, positional=qkv.Rotary(4), qk_norm=qkv.QKNorm(4)).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mha(x, causal=True).square().sum().backward()
    for p in mha.qk_norm.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    cache = KVCache()
    steps = [mha(x[:, :3], causal=True, cache=cache)] + [mha(x[:, t : t + 1], cache=cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), mha(x, causal=True), rtol=0, atol=1e-10)


def test_default_module_state_dict_is_unchanged_and_the_norm_adds_two_gains():
    plain = qkv.MultiHeadAttention(24, 6)
    normed = qkv.MultiHeadAttention(24, 6, qk_norm=qkv.QKNorm(4))
    assert "qk_norm" not in dict(plain.named_children())
    extra = set(normed.state_dict()) - set(plain.state_dict())
    assert extra == {"qk_norm.q_norm.weight", "qk_norm.k_norm.weight"}


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: qkv.QKNorm(0), ValueError, "dim_head: expected a positive int, got 0"),
        (lambda: qkv.QKNorm(4, eps=0.0), ValueError, "eps: expected a positive float, got 0.0"),
        (lambda: qkv.MultiHeadAttention(24, 6, qk_norm=lambda q, k: (q, k)), TypeError,
         "qk_norm: expected an nn.Module or None, got function"),
        (lambda: qkv.QKNorm(5)(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5)), ValueError,
         r"q: QKNorm\(dim_head=5\) expects head size 5, got shape \(1, 2, 3, 4\)"),
    ],
)  # fmt: skip
def test_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()
