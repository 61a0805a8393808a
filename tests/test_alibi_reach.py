"""ALiBi's steep heads attend only the keys their weights can reach: the split equals the whole call to rounding.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key length, ``d`` size.
"""

import math

import pytest
import torch

import qkv
from qkv import checks
from qkv.backends import alibi_reach
from qkv.masks import lengths


def _inputs(h, g, i, j, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(2, h, i, 32, generator=gen, dtype=torch.float64)).to(dtype)
    k = torch.randn(2, g, j, 32, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(2, g, j, 32, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _steep(h):
    """ALiBi with slopes 8, 4, 2, ... (a model's own, as flash-attn's ``alibi_slopes`` takes them): at these short
    lengths its steep heads reach a few dozen keys, as the paper's slopes do over longer ones."""
    return qkv.ALiBi(h, slopes=8.0 * 0.5 ** torch.arange(h, dtype=torch.float64))


def _runs(q, k, v, backend="auto", **kw):
    """The runs ``qkv.attention(q, k, v, **kw)`` would split into, or None."""
    full = dict(score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False)
    return alibi_reach.runs(checks.request(q, k, v, **{**full, **kw}), backend)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h, g, i, j", [(8, 8, 1024, 1024), (8, 2, 512, 1536), (12, 4, 700, 700)])
def test_the_split_equals_the_whole_call_with_its_gradients(dtype, tol, causal, h, g, i, j):
    q, k, v = (x.requires_grad_() for x in _inputs(h, g, i, j, dtype))
    sinks = torch.linspace(-1, 1, h, dtype=dtype)
    kw = dict(bias=_steep(h), causal=causal, sinks=sinks, return_lse=True)
    assert _runs(q, k, v, **kw) is not None  # the steepest heads get windows
    out, lse = qkv.attention(q, k, v, **kw)
    (out.sum() + lse.sum()).backward()
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = qkv.attention(q2, k2, v2, backend="reference", **{**kw, "sinks": sinks.double()})
    (ref.sum() + ref_lse.sum()).backward()
    for got, want in ((out, ref), (lse, ref_lse), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_past_a_heads_reach_weigh_what_the_bound_says(dtype):
    """The weights the split leaves out, from the dense softmax: each below ``e^-T`` of its row's largest."""
    h, n = 8, 1024
    q, k, v = _inputs(h, h, n, n, dtype, seed=3)
    runs = _runs(q, k, v, bias=_steep(h))
    assert runs is not None
    w = qkv.attention_weights(q.double(), k.double(), bias=_steep(h), backend="reference")  # (b, h, i, j)
    offset = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs()
    bits = 53 if dtype == torch.float64 else 24
    T = math.log(n) + (bits + 2) * math.log(2)
    narrow = [r for r in runs if r.reach is not None]
    assert narrow
    for r in narrow:
        far = w[:, r.a : r.b][..., offset > r.reach]
        top = w[:, r.a : r.b].amax(-1, keepdim=True).expand_as(w[:, r.a : r.b])[..., offset > r.reach]
        assert bool((far <= math.exp(-T) * top).all())
        assert float(w[:, r.a : r.b][..., offset > r.reach].sum(-1).max() if far.numel() else 0) < 2.0 ** -(bits + 2)


def test_heads_are_cut_only_at_their_kv_groups_edges():
    got = alibi_reach._grouped([1, 1, 1, 1, None, None, None, None, None], 3)
    assert [tuple(r) for r in got] == [(0, 3, 0, 1, 1), (3, 4, 1, 2, 1), (4, 6, 1, 2, None), (6, 9, 2, 3, None)]
    for r in got:  # a call of its own: its query heads over whole KV heads, x' = (b - a) / (kb - ka) of them each
        x = (r.b - r.a) // (r.kb - r.ka)
        assert (r.b - r.a) % (r.kb - r.ka) == 0
        assert [(r.a + t) // 3 - r.ka for t in range(r.b - r.a)] == [t // x for t in range(r.b - r.a)]
    assert [tuple(r) for r in alibi_reach._grouped([5, 6, None, None], 1)] == [(0, 1, 0, 1, 5), (1, 2, 1, 2, 6),
                                                                               (2, 4, 2, 4, None)]  # fmt: skip


CALLS = {
    "a padding mask": dict(mask=lengths(torch.tensor([900, 1024]))),
    "dropout": dict(dropout=0.1),
    "weights": dict(return_weights=True),
    "a chosen backend": dict(backend="chunked"),
    "a score_mod": dict(score_mod=lambda s, b, h, q, kv: s),
    "a learned score": dict(score=qkv.scores.Bilinear(32)),
    "more queries than keys": dict(rows=1200),
    "a short call": dict(rows=128),
    "large norms (every head reaches every key)": dict(scale=1000.0),
    "no ALiBi": dict(bias=None),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_calls_outside_the_bound_are_left_whole(case):
    kw = dict(CALLS[case])
    q, k, v = _inputs(8, 8, kw.pop("rows", 1024), 1024, torch.float32, scale=kw.pop("scale", 1.0))
    kw.setdefault("bias", _steep(8))
    if kw["bias"] is None:
        kw.pop("bias")
    assert _runs(q, k, v, **kw) is None


def test_meta_tensors_are_left_whole_and_explain_names_the_split():
    q, k, v = _inputs(8, 8, 1024, 1024, torch.float32)
    assert _runs(q.to("meta"), k.to("meta"), v.to("meta"), bias=_steep(8)) is None
    said = qkv.explain(q, k, v, bias=_steep(8))
    assert said.startswith("split by ALiBi's reach") and "heads 0-0: offsets within" in said


def test_one_slope_for_every_head_is_split_as_every_head():
    """``ALiBi(1)`` broadcast over the query heads: each head gets that slope's window, none is dropped."""
    q, k, v = _inputs(4, 2, 512, 512, torch.float64)
    one = qkv.ALiBi(1, slopes=torch.tensor([8.0], dtype=torch.float64))
    runs = _runs(q, k, v, bias=one)
    assert runs is not None and runs[-1].b == 4
    got = qkv.attention(q, k, v, bias=one)
    torch.testing.assert_close(got, qkv.attention(q, k, v, bias=one, backend="reference"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["k", "v"])
def test_a_nan_far_from_a_steep_heads_queries_reaches_the_output_as_in_the_whole_call(where):
    """The whole call reads every key: a nan value or key at the far end gives nan (``0 · nan``); split, it would be
    outside the window, so a head whose inputs are not finite is left whole."""
    q, k, v = _inputs(8, 8, 1024, 1024, torch.float64)
    {"k": k, "v": v}[where][0, 0, -1, 0] = float("nan")
    got = qkv.attention(q, k, v, bias=_steep(8))
    want = qkv.attention(q, k, v, bias=_steep(8), backend="reference")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[0, 0, 0]).any())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-12, atol=1e-12)
