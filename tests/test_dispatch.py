"""``backend="auto"``: which backend runs a call, why the faster ones did not, and forcing one.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.
"""

import pytest
import torch

import qkv
from qkv import backends, checks

B, H, G, D, E = 2, 6, 3, 11, 13


def inputs(i=5, j=7, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, i, D, generator=gen, dtype=dtype),
        torch.randn(B, G, j, D, generator=gen, dtype=dtype),
        torch.randn(B, G, j, E, generator=gen, dtype=dtype),
    )


def chosen(q, k, v, **kw):
    base = dict(score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False)
    return backends.choose(checks.request(q, k, v, **{**base, **kw}))[0].name


def test_preference_order_is_fastest_first_with_reference_last():
    assert backends.PREFERENCE == ("local", "sdpa", "chunked", "reference")
    assert set(backends.PREFERENCE) == set(backends.REGISTRY)


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, "sdpa"),
        ({"causal": True}, "sdpa"),
        ({"bias": qkv.ALiBi(H)}, "chunked"),
        ({"bias": qkv.RelativePositionBias(H, 8, 20)}, "chunked"),
        ({"score": "dot", "return_weights": True}, "chunked"),
        ({"dropout": 0.1, "generator": torch.Generator()}, "chunked"),
        ({"mask": qkv.masks.window(2)}, "sdpa"),  # short: the window covers most keys
    ],
)
def test_auto_choice(kw, expected):
    assert chosen(*inputs(), **kw) == expected


def test_non_dot_scores_go_to_chunked():
    q, k, v = inputs()
    assert chosen(q, k, v, score=qkv.scores.Additive(D, D, 4).double()) == "chunked"
    assert chosen(q, k, v, score=qkv.scores.Location(D, 9).double()) == "chunked"


def test_long_sliding_window_goes_to_local():
    q, k, v = inputs(i=600, j=600, dtype=torch.float32)
    assert chosen(q, k, v, mask=qkv.masks.window(16)) == "local"
    assert chosen(q, k, v, mask=qkv.masks.window(16) & qkv.masks.lengths(torch.tensor([600, 300]))) == "local"


def test_explain_names_the_backend_and_each_reason():
    q, k, v = inputs()
    text = qkv.explain(q, k, v, bias=qkv.ALiBi(H))
    assert text.splitlines()[0] == "backend: chunked (fused_blocks)"
    assert "not local: the mask has no bounded sliding window" in text
    assert "not sdpa: a lazy bias would be materialised as an (h, i, j) tensor" in text
    text = qkv.explain(q, k, v, score=qkv.scores.Additive(D, D, 4).double(), return_weights=True)
    assert text.splitlines()[0] == "backend: chunked (online_softmax)"
    assert "not sdpa: the concat score is not a dot product" in text
    assert qkv.explain(q, k, v) == "backend: sdpa\n  not local: the mask has no bounded sliding window"


def test_explain_accepts_weights_for_and_a_forced_backend():
    q, k, v = inputs()
    assert qkv.explain(q, k, v, return_weights=True, weights_for={"heads": [1]}).startswith("backend: chunked")
    assert qkv.explain(q, k, v, backend="reference") == "backend: reference"


def test_every_backend_can_be_forced_and_they_agree():
    q, k, v = inputs(i=40, j=40)
    mask = qkv.masks.window(3)
    expected = qkv.attention(q, k, v, mask=mask, backend="reference")
    for name in ("sdpa", "chunked"):
        torch.testing.assert_close(qkv.attention(q, k, v, mask=mask, backend=name), expected)


def test_forcing_a_backend_that_cannot_run_the_call():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="backend: 'sdpa' cannot run this call: the fused kernel does not return weights"):
        qkv.attention(q, k, v, backend="sdpa", return_weights=True)
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \['chunked', 'local', 'reference', 'sdpa'\], got 'fast'"):
        qkv.attention(q, k, v, backend="fast")


def test_weights_with_auto_come_from_the_fast_path_and_match_reference():
    q, k, v = inputs()
    out, w = qkv.attention(q, k, v, causal=True, return_weights=True)
    out_ref, w_ref = qkv.attention(q, k, v, causal=True, return_weights=True, backend="reference")
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(w, w_ref)
