"""Tests of the reference backend against the literal element-by-element oracle (``tests/reference.py``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, i=5, j=7, d=11, e=13.
"""

import math

import pytest
import reference as ref
import torch

import qkv
from qkv import checks, scores
from qkv.backends import reference

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def _inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in ((B, H, I, D), (B, G, J, D), (B, G, J, E))]


def _score_and_oracle(name):
    """A score object (float64) and the literal per-element formula with the same parameters."""
    if name == "dot":
        return scores.Dot(), ref.dot, 1.0
    if name == "scaled_dot":
        return scores.ScaledDot(), ref.dot, 1 / math.sqrt(D)
    if name == "bilinear":
        s = scores.Bilinear(D).double()
        return s, ref.bilinear(s.weight.detach()), 1.0
    if name == "additive":
        s = scores.Additive(D, D, hidden=5, bias=True).double()
        p = s.query_proj
        return s, ref.additive(p.weight.detach(), s.key_proj.weight.detach(), s.v.detach(), p.bias.detach()), 1.0
    s = scores.Location(D, max_len=9).double()
    return s, ref.location(s.proj.weight.detach(), s.proj.bias.detach()), 1.0


@pytest.mark.parametrize("mask", ["none", "dense&lengths", "window|dense"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["dot", "scaled_dot", "bilinear", "additive", "location"])
def test_reference_equals_literal_oracle(name, causal, mask):
    q, k, v = _inputs()
    score, fn, scale = _score_and_oracle(name)
    lazy, allowed = ref.mask_case(mask, B, I, J, causal=causal)
    out, w = qkv.attention(q, k, v, score=score, mask=lazy, causal=causal, return_weights=True, backend="reference")
    exp_out, exp_w = ref.literal_attention(q, k, v, score=fn, scale=scale, mask=allowed)
    torch.testing.assert_close(w, exp_w, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, exp_out, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kind", ["dense", "alibi", "t5"])
def test_reference_with_bias_equals_literal_oracle(kind):
    q, k, v = _inputs(seed=2)
    if kind == "dense":
        bias = torch.randn(B, 1, I, J, dtype=torch.float64)
        dense = bias
    else:
        bias = qkv.ALiBi(H) if kind == "alibi" else qkv.RelativePositionBias(H, buckets=8, max_distance=16)
        dense = bias.dense(I, J).double()
    out = qkv.attention(q, k, v, bias=bias, scale=0.3, backend="reference")
    exp_out, _ = ref.literal_attention(q, k, v, scale=0.3, bias=dense.detach())
    torch.testing.assert_close(out, exp_out, atol=1e-12, rtol=1e-10)


def test_extra_leading_dims_and_no_head_dim():
    q, k, v = _inputs()
    many = qkv.attention(q.reshape(1, B, H, I, D), k[None], v[None], backend="reference")
    torch.testing.assert_close(many[0], qkv.attention(q, k, v, backend="reference"))
    flat = qkv.attention(q[0, 0], k[0, 0], v[0, 0], backend="reference")  # (i, d) inputs
    torch.testing.assert_close(flat, ref.literal_attention(q[:1, :1], k[:1, :1], v[:1, :1], scale=D**-0.5)[0][0, 0])


@pytest.mark.parametrize("kind", ["alibi", "t5"])
def test_no_head_dim_with_a_lazy_bias_keeps_the_shape(kind):
    # (i, d) inputs and a one-head lazy bias: the (1, i, j) bias grew the output to (1, i, e)
    # (found by tests/test_properties.py)
    q, k, v = (x[0, 0] for x in _inputs())
    bias = qkv.ALiBi(1) if kind == "alibi" else qkv.RelativePositionBias(1, buckets=8, max_distance=16).double()
    out, w = qkv.attention(q, k, v, bias=bias, return_weights=True, backend="reference")
    assert out.shape == (I, v.shape[-1]) and w.shape == (I, J)
    exp_out, exp_w = ref.literal_attention(q[None, None], k[None, None], v[None, None], scale=D**-0.5,
                                           bias=bias.dense(I, J).double().detach())  # fmt: skip
    torch.testing.assert_close(out, exp_out[0, 0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w, exp_w[0, 0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(qkv.attention(q, k, v, bias=bias, backend="chunked"), out, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_weights_are_the_float32_weights_rounded(dtype):
    q, k, _ = _inputs(dtype)
    req = lambda x, y: checks.request(  # noqa: E731
        x, y, y[..., :0], score="scaled_dot", mask=qkv.masks.causal(), bias=qkv.ALiBi(H), causal=False,
        scale=None, dropout=0.0, return_weights=True,
    )  # fmt: skip
    w_half = reference.weights(req(q, k))
    assert w_half.dtype == torch.float32  # the softmax itself runs in float32
    w32 = reference.weights(req(q.float(), k.float()))
    assert torch.equal(w_half.to(dtype), w32.to(dtype))
    _, w_public = qkv.attention(q, k, k, causal=True, bias=qkv.ALiBi(H), return_weights=True, backend="reference")
    assert w_public.dtype == dtype and torch.equal(w_public, w32.to(dtype))


def test_half_precision_additive_score_runs():
    q, k, v = _inputs(torch.bfloat16)
    s = scores.Additive(D, D, hidden=5).to(torch.bfloat16)
    out, w = qkv.attention(q, k, v, score=s, return_weights=True)
    assert out.dtype == w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float().sum(-1), torch.ones(B, H, I), atol=2e-2, rtol=0)


def test_dropout_weights_zero_and_rescale():
    w = torch.full((4, 1000), 0.25, dtype=torch.float64)
    dropped = reference.dropout_weights(w, 0.2, torch.Generator().manual_seed(0))
    kept = dropped != 0
    assert torch.allclose(dropped[kept], torch.tensor(0.25 / 0.8, dtype=torch.float64))
    assert abs(kept.double().mean().item() - 0.8) < 0.03
    assert reference.dropout_weights(w, 0.0, None) is w


def test_return_weights_are_before_dropout():
    q, k, v = _inputs()
    gen = torch.Generator().manual_seed(5)
    out, w = qkv.attention(q, k, v, dropout=0.3, return_weights=True, generator=gen, backend="reference")
    torch.testing.assert_close(w, qkv.attention_weights(q, k))
    keep_draw = torch.rand(w.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32) >= 0.3
    torch.testing.assert_close(out, (w * keep_draw / 0.7) @ v.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("d, j", [(4, 16), (16, 4)])
def test_the_scale_on_the_query_or_on_the_logits_gives_the_literal_weights(d, j):
    """Where ``d <= j`` the scale multiplies the queries (i·d products), else the logits: both the equations' weights."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, d, generator=gen, dtype=torch.float64) for n in (5, j, j))
    keep = torch.rand(2, 1, 5, j, generator=gen) > 0.3
    keep[0, 0, 2] = False  # a row with no key: zeros
    out, w = qkv.attention(q, k, v, mask=keep, scale=0.37, return_weights=True, backend="reference")
    s = (q @ k.transpose(-1, -2) * 0.37).masked_fill(~keep, float("-inf"))
    want_w = torch.softmax(s, -1).nan_to_num(0.0)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want_w @ v, rtol=1e-12, atol=1e-12)


def test_the_log_sum_exp_is_computed_only_when_asked(monkeypatch):
    q, k, v = _inputs()
    calls = []
    real = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qkv.attention(q, k, v, return_weights=True, backend="reference")
    assert not calls
    out, lse = qkv.attention(q, k, v, return_lse=True, backend="reference")
    assert calls
    s = q @ k.repeat_interleave(H // G, 1).transpose(-1, -2) / math.sqrt(D)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
