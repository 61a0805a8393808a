"""``backend="auto"``: which backend runs a call, why the faster ones did not, and forcing one.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.
"""

from dataclasses import replace

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
    rows = kw.pop("weights_for", {}).get("rows")
    req = checks.request(q, k, v, **{**base, **kw})
    if rows is not None:
        req = replace(req, weights_for=(None, torch.tensor(rows)))
    return backends.choose(req)[0].name


def test_preference_order_is_fastest_first_with_reference_last():
    assert backends.PREFERENCE == ("segments", "local", "sdpa", "chunked", "reference")  # the CPU's
    assert backends.CUDA_PREFERENCE == ("sdpa", "flex", "segments", "local", "chunked", "reference")
    assert set(backends.CUDA_PREFERENCE) == set(backends.REGISTRY)
    assert set(backends.PREFERENCE) == set(backends.REGISTRY) - {"flex"}  # flex_attention has no CPU backward


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, "sdpa"),
        ({"causal": True}, "sdpa"),
        ({"bias": qkv.ALiBi(H)}, "chunked"),
        ({"bias": qkv.RelativePositionBias(H, 8, 20)}, "chunked"),
        ({"score": "dot", "return_weights": True}, "reference"),  # every weight, and few: materialised
        ({"score": "dot", "return_weights": True, "weights_for": {"rows": [1]}}, "chunked"),
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
    assert text.splitlines()[-1] == "  not alibi_column (engine): i = 5 is one block of 256 rows: nothing to take off the mask"
    text = qkv.explain(q, k, v, score=qkv.scores.Additive(D, D, 4).double(), weights_for={"rows": [0]}, return_weights=True)
    assert text.splitlines()[0] == "backend: chunked (online_softmax)"
    assert "not sdpa: the concat score is not a dot product" in text
    assert "  not fused_blocks (engine): the concat score is not a dot product" in text.splitlines()
    text = qkv.explain(q, k, v, return_weights=True)  # every weight of a small call: one softmax
    assert text.splitlines()[0] == "backend: reference"
    assert "chunked: every weight is returned and the logits fit in" in text
    assert qkv.explain(q, k, v) == (
        "backend: sdpa\n  not segments: the mask has no lazy documents (qkv.masks.documents) or padding (lengths, starts)\n"
        "  not local: the mask has no bounded sliding window"
    )


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
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \['chunked', 'flex', 'local', 'reference', 'sdpa', 'segments'\], got 'fast'"):
        qkv.attention(q, k, v, backend="fast")


def test_weights_with_auto_come_from_the_fast_path_and_match_reference():
    q, k, v = inputs()
    out, w = qkv.attention(q, k, v, causal=True, return_weights=True)
    out_ref, w_ref = qkv.attention(q, k, v, causal=True, return_weights=True, backend="reference")
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(w, w_ref)


def test_an_empty_call_goes_to_the_reference_even_when_a_backend_is_named():
    q, k, v = inputs(i=0)
    assert qkv.explain(q, k, v) == (
        "backend: reference\n  not segments: the mask has no lazy documents (qkv.masks.documents) or padding (lengths, starts)\n"
        "  not local: the mask has no bounded sliding window\n"
        "  not sdpa: an empty call (i = 0, j = 7) has nothing to compute\n"
        "  not chunked: an empty call (i = 0, j = 7) has nothing to compute"
    )
    assert qkv.explain(q, k, v, backend="sdpa") == "backend: reference\n  not sdpa: an empty call (i = 0, j = 7) has nothing to compute"


@pytest.mark.parametrize("layout", ["(i, d)", "(h, i, d)", "(x, b, h, i, d)"])
def test_every_layout_takes_the_path_and_result_of_its_b_h_i_d_equivalent(layout):
    """Inputs are reshaped once, when checked: no layout selects another backend or engine."""
    q, k, v = inputs(i=9, j=9)
    if layout == "(i, d)":  # one head of one batch row: (1, 1, i, d)
        q4, k4, v4 = q[:1, :1], k[:1, :1], v[:1, :1]
        cut = lambda x: x[0, 0]  # noqa: E731
    elif layout == "(h, i, d)":  # one batch row: (1, h, i, d)
        q4, k4, v4 = q[:1], k[:1], v[:1]
        cut = lambda x: x[0]  # noqa: E731
    else:  # x = 2 groups of b = 1: (2, h, i, d)
        q4, k4, v4 = q, k, v
        cut = lambda x: x.unflatten(0, (2, 1))  # noqa: E731
    heads = q4.shape[1]
    calls = [({}, {}), ({"causal": True}, {}), ({"bias": qkv.ALiBi(heads)}, {}), ({"score_mod": qkv.SoftCap(3.0)}, {}),
             ({"return_weights": True, "weights_for": {"rows": [2]}}, {})]  # fmt: skip
    if layout == "(x, b, h, i, d)":  # a lengths mask of the b = 1 rows, the same for both groups
        calls.append(({"mask": qkv.masks.lengths(torch.tensor([4]))}, {"mask": qkv.masks.lengths(torch.tensor([4, 4]))}))
    for kw, kw4 in calls:
        kw4 = kw4 or kw
        assert qkv.explain(cut(q4), cut(k4), cut(v4), **kw) == qkv.explain(q4, k4, v4, **kw4), kw
        got, want = qkv.attention(cut(q4), cut(k4), cut(v4), **kw), qkv.attention(q4, k4, v4, **kw4)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, cut(b), rtol=1e-12, atol=1e-12)
