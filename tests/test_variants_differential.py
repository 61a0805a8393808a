"""Tests of differential attention (Ye et al. 2024): ``qkv.DifferentialAttention`` and its functional core.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` size of each query/key half, ``e`` per-head value size.

The oracle is the paper's formula materialised in float64: two softmax maps over
``Q1 K1ᵀ / √d`` and ``Q2 K2ᵀ / √d``, their difference with λ, times V, then the per-head
RMSNorm and the ``(1 − λ_init)`` scale.
"""

import math

import pytest
import torch
from einops import rearrange

import qkv
from qkv.variants import differential_attention, lambda_init

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, I, 2 * D, generator=g, dtype=dtype)
    k = torch.randn(B, G, J, 2 * D, generator=g, dtype=dtype)
    v = torch.randn(B, G, J, E, generator=g, dtype=dtype)
    return q, k, v


def _softmax_map(q, k, allowed, bias=None):
    """``softmax(q kᵀ / √d + bias)`` over the allowed keys, materialised; ``k`` repeated to the query heads."""
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1)


def _literal(q, k, v, lam, allowed, bias=None):
    d = q.shape[-1] // 2
    a1 = _softmax_map(q[..., :d], k[..., :d], allowed, bias)
    a2 = _softmax_map(q[..., d:], k[..., d:], allowed, bias)
    diff = a1 - lam * a2
    return diff @ v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3), diff


def _rmsnorm(x, gain, eps):
    return gain * x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
def test_functional_core_is_the_difference_of_two_softmax_maps(causal, backend):
    q, k, v = _inputs()
    allowed = qkv.masks.causal().dense(I, J) if causal else torch.ones(I, J, dtype=torch.bool)
    out, w = differential_attention(q, k, v, 0.37, causal=causal, return_weights=True, backend=backend)
    want, want_w = _literal(q, k, v, 0.37, allowed)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)


def test_lambda_init_schedule():
    assert lambda_init(1) == pytest.approx(0.2)
    assert lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert lambda_init(100) == pytest.approx(0.8, abs=1e-12)


def test_module_is_the_papers_head_with_lambda_norm_and_scale():
    torch.manual_seed(0)
    module = qkv.DifferentialAttention(2 * D, dim_value_head=E, layer=3).double()
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
    q, k, v = _inputs()
    lq1, lk1, lq2, lk2 = (p.tolist() for p in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2))
    lam = (math.exp(sum(a * b for a, b in zip(lq1, lk1))) - math.exp(sum(a * b for a, b in zip(lq2, lk2)))
           + 0.8 - 0.6 * math.exp(-0.3 * 2))  # fmt: skip
    assert module.lam().item() == pytest.approx(lam, abs=1e-14)
    allowed = qkv.masks.causal().dense(I, J)
    heads, diff = _literal(q, k, v, lam, allowed)
    want = (1 - module.lambda_init) * _rmsnorm(heads, module.norm.weight, 1e-5)
    out, w = module(q, k, v, causal=True, return_weights=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, diff, rtol=0, atol=1e-12)


def test_in_multi_head_attention_with_alibi_both_maps_get_the_bias():
    torch.manual_seed(0)
    h, d2, e = 3, 6, 5
    alibi = qkv.ALiBi(h)
    mha = qkv.MultiHeadAttention(12, h, dim_head=d2, dim_value_head=e, positional=alibi,
                                 attention=qkv.DifferentialAttention(d2, dim_value_head=e)).double()  # fmt: skip
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    q = rearrange(mha.q_proj(x), "b i (h d) -> b h i d", h=h)
    k = rearrange(mha.k_proj(x), "b j (h d) -> b h j d", h=h)
    v = rearrange(mha.v_proj(x), "b j (h e) -> b h j e", h=h)
    heads, _ = _literal(q, k, v, mha.attention.lam().item(), qkv.masks.causal().dense(7, 7), alibi.dense(7, 7))
    heads = (1 - mha.attention.lambda_init) * _rmsnorm(heads, mha.attention.norm.weight, 1e-5)
    want = mha.out_proj(rearrange(heads, "b h i e -> b i (h e)"))
    torch.testing.assert_close(mha(x, causal=True), want, rtol=0, atol=1e-12)


def test_gradients_reach_q_k_v_and_the_lambda_parameters():
    torch.manual_seed(0)
    module = qkv.DifferentialAttention(4, dim_value_head=3).double()
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *x: module(*x, causal=True), (q, k, v))
    params = (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2, module.norm.weight)
    assert torch.autograd.gradcheck(
        lambda *p: torch.func.functional_call(
            module, dict(zip(["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "norm.weight"], p)), (q, k, v)
        ),
        tuple(p.detach().requires_grad_() for p in params),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_follows_the_flash_rule(dtype):
    q, k, v = _inputs()
    want, _ = _literal(q, k, v, 0.5, qkv.masks.causal().dense(I, J))
    got = differential_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.5, causal=True)
    plain, _ = _literal(q.to(dtype), k.to(dtype), v.to(dtype), 0.5, qkv.masks.causal().dense(I, J))
    err, base = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * base + 1e-6


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: qkv.DifferentialAttention(5), "dim_head: expected an even size"),
        (lambda: qkv.DifferentialAttention(4, layer=0), "layer: expected a positive int, got 0"),
        (lambda: qkv.DifferentialAttention(4, eps=-1e-5), r"eps: expected a finite number > 0, got -1e-05"),  # (gave nan outputs)
        # pairs (c, c + d) across the halves: Q1·K1 depended on absolute positions (0.862 at (3, 1), -1.919 at (13, 11))
        (lambda: qkv.MultiHeadAttention(16, 2, attention=qkv.DifferentialAttention(8),
                                        positional=qkv.Rotary(8, interleaved=False)),
         r"positional: Rotary\(.*interleaved=False\) rotates pairs of channels across the parts of 4"),
        # an odd half: the interleaved pair (d - 1, d) crosses it (0.151 when the positions moved by 7)
        (lambda: qkv.MultiHeadAttention(12, 2, attention=qkv.DifferentialAttention(6), positional=qkv.Rotary(6)),
         r"positional: Rotary\(.*\) rotates pairs of channels across the parts of 3"),
        (lambda: qkv.DifferentialAttention(4)(torch.randn(1, 1, 2, 6), torch.randn(1, 1, 2, 6), torch.randn(1, 1, 2, 4)),
         r"q: DifferentialAttention\(dim_head=4\) expects head size 4"),
        (lambda: differential_attention(torch.randn(1, 1, 2, 5), torch.randn(1, 1, 2, 5), torch.randn(1, 1, 2, 4), 0.5),
         "q: expected an even last dim"),
    ],
)  # fmt: skip
def test_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("rotary", [dict(), dict(interleaved=False, rotary_dim=4)], ids=["interleaved", "half"])
def test_rotary_on_the_halves_keeps_relative_positions(rotary):
    """What MultiHeadAttention takes (pairs inside each half) gives the same weights for every shift of the positions."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 2, attention=qkv.DifferentialAttention(8), positional=qkv.Rotary(8, **rotary))
    mha = mha.double().eval()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    _, shifted = mha.attention(*_heads(mha, x, 7), causal=True, return_weights=True)
    _, plain = mha.attention(*_heads(mha, x, 0), causal=True, return_weights=True)
    torch.testing.assert_close(shifted, plain, rtol=0, atol=1e-12)


def _heads(mha, x, start):
    q = mha.q_proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
    k = mha.k_proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
    v = mha.v_proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
    q, k = mha.positional.rotate(q, k, start)
    return q, k, v

