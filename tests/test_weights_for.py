"""Weights on demand: rebuilt from the log-sum-exp, for chosen heads and rows (``weights_for=``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.
"""

import pytest
import torch

import qkv
from qkv.backends.tiling import weights_from_lse as weights

B, H, G, D, E = 2, 6, 3, 11, 13


def inputs(i=9, j=12, grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, i, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, j, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, j, E, generator=gen, dtype=torch.float64)
    return [x.requires_grad_(grad) for x in (q, k, v)]


CASES = {
    "plain": {},
    "causal+alibi": {"causal": True, "bias": qkv.ALiBi(H).double()},
    "lengths": {"mask": qkv.masks.lengths(torch.tensor([12, 0]))},  # batch row 1: no keys
    "additive": {"score": qkv.scores.Additive(D, D, 4).double(), "causal": True},
    "dense bias": {"bias": torch.randn(H, 9, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))},
}


@pytest.mark.parametrize("case", list(CASES))
def test_rebuilt_weights_equal_the_reference(case):
    q, k, v = inputs()
    out, w = qkv.attention(q, k, v, return_weights=True, backend="chunked", **CASES[case])
    out_ref, w_ref = qkv.attention(q, k, v, return_weights=True, backend="reference", **CASES[case])
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w, w_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize(
    "spec, heads, rows",
    [
        ({"heads": [4, 1]}, [4, 1], list(range(9))),
        ({"rows": slice(6, None)}, list(range(H)), [6, 7, 8]),
        ({"heads": 2, "rows": [0, 1, 2, 7, -1]}, [2], [0, 1, 2, 7, 8]),
        ({"heads": torch.tensor([5]), "rows": range(3, 5)}, [5], [3, 4]),
    ],
)
def test_selected_heads_and_rows(backend, spec, heads, rows):
    q, k, v = inputs()
    kw = CASES["causal+alibi"]
    _, full = qkv.attention(q, k, v, return_weights=True, backend="reference", **kw)
    out, w = qkv.attention(q, k, v, return_weights=True, weights_for=spec, backend=backend, **kw)
    assert w.shape == (B, len(heads), len(rows), 12)
    torch.testing.assert_close(w, full[:, heads][:, :, rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, qkv.attention(q, k, v, backend="reference", **kw))


def test_only_the_selected_block_is_built(monkeypatch):
    """With two heads and one row of a long sequence, no logits beyond (b, 2, rows, j) exist."""
    seen = []

    class Spy:  # torch as the weights module sees it, its exp recorded: the engine's own exps (which path
        # runs ALiBi's far keys is a timed choice) are not weights
        def __getattr__(self, name):
            return getattr(torch, name)

        def exp(self, x, *args, **kwargs):
            seen.append(tuple(x.shape))
            return torch.exp(x, *args, **kwargs)

    q, k, v = inputs(i=300, j=300)
    with torch.no_grad():
        out, _ = qkv.attention(q, k, v, bias=qkv.ALiBi(H).double(), return_weights=False)
        monkeypatch.setattr(weights, "torch", Spy())
        _, w = qkv.attention(q, k, v, bias=qkv.ALiBi(H).double(), return_weights=True, weights_for={"heads": [0, 3], "rows": [299]})
    assert w.shape == (B, 2, 1, 300)
    assert seen == [(B, 2, 1, 300)]


def test_weights_are_differentiable():
    q, k, v = inputs(grad=True)
    kw = CASES["causal+alibi"]
    _, w = qkv.attention(q, k, v, return_weights=True, weights_for={"heads": [1]}, backend="chunked", **kw)
    _, w_ref = qkv.attention(q, k, v, return_weights=True, backend="reference", **kw)
    cot = torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(w, [q, k], cot)
    expected = torch.autograd.grad(w_ref[:, [1]], [q, k], cot)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"weights_for": {"heads": [0]}}, ValueError, "weights_for: selects which weights to return, so it needs return_weights=True, got False"),
        ({"return_weights": True, "weights_for": [0]}, TypeError, "weights_for: expected a dict with keys 'heads' and/or 'rows', got list"),
        ({"return_weights": True, "weights_for": {"cols": [0]}}, ValueError, r"weights_for: expected keys 'heads' and/or 'rows', got \['cols'\]"),
        ({"return_weights": True, "weights_for": {"heads": [6]}}, ValueError, r"weights_for: 'heads' expected indices in \[0, 6\), got \[6\]"),
        ({"return_weights": True, "weights_for": {"rows": []}}, ValueError, r"weights_for: 'rows' selects nothing"),
        ({"return_weights": True, "weights_for": {"rows": 1.5}}, TypeError, "weights_for: 'rows' expected an int, slice, range, list or integer tensor, got float"),
    ],
)
def test_bad_weights_for(kw, error, message):
    q, k, v = inputs()
    with pytest.raises(error, match=message):
        qkv.attention(q, k, v, **kw)



def test_weights_rebuilt_when_only_the_values_record_gradients():
    """The weights do not depend on v: a call whose v alone requires grad returns them (it raised in the rebuild)."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    v = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=True)
    for kw in (dict(backend="chunked"), dict(weights_for={"rows": [0]})):
        out, w = qkv.attention(q, k, v, return_weights=True, **kw)
        want = qkv.attention(q, k, v, return_weights=True, backend="reference")[1]
        torch.testing.assert_close(w, want if "weights_for" not in kw else want[:, :, :1], rtol=1e-5, atol=1e-6)
        torch.autograd.grad(out.sum(), v)


def test_bfloat16_weights_are_the_softmax_of_the_logits_the_lse_summed():
    """bf16 weights from the lse: logits in float32 as the lse's (rounded bf16 logits put rows 5% off 1)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 31, 4, generator=gen).mul(3).bfloat16() for _ in range(3))
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 2, -1)
    plain = torch.softmax((q @ k.transpose(-1, -2)) / 2, -1)
    for mask in (None, qkv.masks.causal()):
        _, w = qkv.attention(q, k, v, mask=mask, backend="chunked", return_weights=True)
        want = exact if mask is None else qkv.attention(q.double(), k.double(), v.double(), mask=mask, return_weights=True)[1]
        assert (w.double() - want).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-3
        assert (w.float().sum(-1) - 1).abs().max() < 0.01
