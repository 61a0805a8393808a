"""Every error of ``qkv.checks`` (through ``qkv.attention``), matched on its message.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Base call: b=2, h=6, g=3, i=5, j=7, d=11, e=13.
"""

import pytest
import torch

import qkv
from qkv import masks

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def _qkv(**shapes):
    q = torch.randn(shapes.get("q", (B, H, I, D)))
    k = torch.randn(shapes.get("k", (B, G, J, D)))
    v = torch.randn(shapes.get("v", (B, G, J, E)))
    return q, k, v


def _call(q=None, k=None, v=None, **kwargs):
    q0, k0, v0 = _qkv()
    return qkv.attention(q0 if q is None else q, k0 if k is None else k, v0 if v is None else v, **kwargs)


CASES = [
    # tensors, dtypes, devices
    ("q-not-tensor", lambda: _call(q=[[1.0]]), TypeError, r"q: expected a torch.Tensor, got list"),
    ("q-int", lambda: _call(q=torch.ones(B, H, I, D, dtype=torch.long)), TypeError,
     r"q: expected a floating-point tensor, got torch.int64"),
    ("k-dtype", lambda: _call(k=torch.randn(B, G, J, D, dtype=torch.float64)), TypeError,
     r"k: expected dtype torch.float32 like q, got torch.float64"),
    ("v-dtype", lambda: _call(v=torch.randn(B, G, J, E, dtype=torch.bfloat16)), TypeError,
     r"v: expected dtype torch.float32 like q, got torch.bfloat16"),
    ("k-device", lambda: _call(k=torch.randn(B, G, J, D, device="meta")), ValueError,
     r"k: expected device cpu like q, got meta"),
    ("v-device", lambda: _call(v=torch.randn(B, G, J, E, device="meta")), ValueError,
     r"v: expected device cpu like q, got meta"),
    # ranks and sizes
    ("q-rank-1", lambda: _call(q=torch.randn(D), k=torch.randn(D), v=torch.randn(E)), ValueError,
     r"q: expected at least 2 dims \(..., i, d\), got shape \(11,\)"),
    ("k-rank", lambda: _call(k=torch.randn(G, J, D)), ValueError,
     r"k: expected 4 dims like q \(2, 6, 5, 11\), got shape \(3, 7, 11\)"),
    ("v-rank", lambda: _call(v=torch.randn(B, 1, G, J, E)), ValueError,
     r"v: expected 4 dims like q \(2, 6, 5, 11\), got shape \(2, 1, 3, 7, 13\)"),
    ("v-j", lambda: _call(v=torch.randn(B, G, J + 1, E)), ValueError,
     r"v: expected j=7 positions like k, got 8 \(shape \(2, 3, 8, 13\)\)"),
    ("v-g", lambda: _call(v=torch.randn(B, 2, J, E)), ValueError, r"v: expected g=3 heads like k, got 2"),
    ("h-mod-g", lambda: _call(k=torch.randn(B, 4, J, D), v=torch.randn(B, 4, J, E)), ValueError,
     r"k: query heads h=6 must be a multiple of KV heads g, got g=4"),
    ("g-0", lambda: _call(k=torch.randn(B, 0, J, D), v=torch.randn(B, 0, J, E)), ValueError,  # h = g = 0 is empty
     r"k: query heads h=6 must be a multiple of KV heads g, got g=0"),
    ("k-batch", lambda: _call(k=torch.randn(1, G, J, D), v=torch.randn(1, G, J, E)), ValueError,
     r"k: expected leading \(batch\) dims \(2,\) like q, got \(1,\)"),
    ("v-batch", lambda: _call(v=torch.randn(1, G, J, E)), ValueError,
     r"v: expected leading \(batch\) dims \(2,\) like q, got \(1,\)"),
    ("d", lambda: _call(k=torch.randn(B, G, J, D + 1)), ValueError,
     r"k: the scaled_dot score needs the same size for q and k, expected last dim 11, got 12"),
    # flags
    ("causal", lambda: _call(causal=1), TypeError, r"causal: expected a bool, got int"),
    ("return_weights", lambda: _call(return_weights="yes"), TypeError, r"return_weights: expected a bool, got str"),
    # masks
    ("mask-shape", lambda: _call(mask=torch.ones(5, 6, dtype=torch.bool)), ValueError,
     r"mask: expected shape broadcastable to \(b, h, i, j\) = \(2, 6, 5, 7\), got \(5, 6\)"),
    ("mask-grows", lambda: _call(mask=torch.ones(3, 1, 5, 7, dtype=torch.bool)), ValueError,
     r"mask: expected shape broadcastable to \(b, h, i, j\) = \(2, 6, 5, 7\), got \(3, 1, 5, 7\)"),
    ("mask-extra-dims", lambda: _call(mask=torch.ones(1, 2, 6, 5, 7, dtype=torch.bool)), ValueError,
     r"mask: expected shape broadcastable to \(b, h, i, j\) = \(2, 6, 5, 7\), got \(1, 2, 6, 5, 7\)"),
    ("mask-nested", lambda: _call(mask=masks.causal() & torch.ones(5, 6, dtype=torch.bool)), ValueError,
     r"mask: expected shape broadcastable to \(b, h, i, j\) = \(2, 6, 5, 7\), got \(5, 6\)"),
    ("mask-nested-lengths", lambda: _call(mask=masks.lengths(torch.tensor([1, 2])) & masks.lengths(torch.tensor([1, 2, 3]))),
     ValueError, r"mask: qkv.masks.lengths got key_lengths of shape \(3,\), one per batch row; the call needs b = 2 \(or 1\): a mask broadcasts to \(b, h, i, j\) = \(2, 6, 5, 7\)"),
    ("mask-lengths-batch", lambda: _call(mask=masks.lengths(torch.tensor([1, 2, 3]))), ValueError,
     r"mask: qkv.masks.lengths got key_lengths of shape \(3,\), one per batch row; the call needs b = 2 \(or 1\): a mask broadcasts to \(b, h, i, j\) = \(2, 6, 5, 7\)"),
    ("mask-float", lambda: _call(mask=torch.full((5, 7), 0.5)), TypeError,
     r"mask: expected dtype torch.bool \(True = may attend\), got torch.float32; pass a float tensor as bias="),
    ("mask-float-0-1", lambda: _call(mask=torch.ones(5, 7)), TypeError,
     r"mask: expected dtype torch.bool \(True = may attend\), got torch.float32; it holds only 0 and 1, so it looks "
     r"like a keep-mask of 0/1: pass mask=m.bool\(\) \(True = may attend\), or, if it is an additive bias "
     r"\(0 and -inf\), bias=$"),
    ("mask-int", lambda: _call(mask=torch.ones(5, 7, dtype=torch.int64)), TypeError,
     r"mask: expected dtype torch.bool \(True = may attend\), got torch.int64"),
    ("mask-type", lambda: _call(mask="causal"), TypeError, r"mask: expected a bool tensor or a qkv.masks.Mask, got str"),
    # biases
    ("bias-shape", lambda: _call(bias=torch.zeros(6, 7, 7)), ValueError,
     r"bias: expected shape broadcastable to \(2, 6, 5, 7\), got \(6, 7, 7\)"),
    ("bias-bool", lambda: _call(bias=torch.ones(5, 7, dtype=torch.bool)), TypeError,
     r"bias: expected a float tensor added to the logits, got a bool tensor \(pass it as mask=\)"),
    ("bias-int", lambda: _call(bias=torch.ones(5, 7, dtype=torch.int32)), TypeError,
     r"bias: expected a floating-point tensor, got torch.int32"),
    ("bias-type", lambda: _call(bias=0.5), TypeError,
     r"bias: expected a float tensor or a qkv.positional.LazyBias, got float"),
    ("bias-device", lambda: _call(bias=torch.zeros(5, 7, device="meta")), ValueError,
     r"bias: expected device cpu like q, got meta"),
    ("bias-heads", lambda: _call(bias=qkv.ALiBi(4)), ValueError, r"bias: expected a lazy bias with 1 or 6 heads, got 4"),
    # numbers
    ("scale-nan", lambda: _call(scale=float("nan")), ValueError, r"scale: expected a finite number, got nan"),
    ("scale-inf", lambda: _call(scale=float("inf")), ValueError, r"scale: expected a finite number, got inf"),
    ("scale-type", lambda: _call(scale="1"), TypeError, r"scale: expected a real number or None, got str"),
    ("scale-bool", lambda: _call(scale=True), TypeError, r"scale: expected a real number or None, got bool"),
    ("dropout-neg", lambda: _call(dropout=-0.1), ValueError, r"dropout: expected a probability in \[0, 1\), got -0.1"),
    ("dropout-one", lambda: _call(dropout=1.0), ValueError, r"dropout: expected a probability in \[0, 1\), got 1.0"),
    ("dropout-type", lambda: _call(dropout="0.1"), TypeError, r"dropout: expected a float in \[0, 1\), got str"),
    # score and backend
    ("score-name", lambda: _call(score="cosine"), ValueError, r"score: expected one of .* got 'cosine'"),
    ("score-learned-name", lambda: _call(score="concat"), ValueError, r"score: 'concat' has learned parameters"),
    ("backend-name", lambda: _call(backend="cuda"), ValueError, r"backend: expected 'auto' or one of \[.*'reference'.*\], got 'cuda'"),
    ("backend-unsupported", lambda: _call(score=qkv.scores.Additive(D, D, 4), backend="sdpa"), ValueError,
     r"backend: 'sdpa' cannot run this call: the concat score is not a dot product"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_valid_broadcasts_are_accepted():
    # Masks and biases that broadcast without growing the target are fine.
    out = _call(mask=torch.ones(B, 1, 1, J, dtype=torch.bool), bias=torch.zeros(H, I, J))
    assert out.shape == (B, H, I, E)
    assert _call(mask=masks.lengths(torch.tensor([3, 7])) & masks.causal()).shape == (B, H, I, E)
    # Inputs without batch or head dims.
    assert qkv.attention(torch.randn(I, D), torch.randn(J, D), torch.randn(J, E)).shape == (I, E)


def test_attention_weights_checks_too():
    with pytest.raises(ValueError, match=r"k: expected leading \(batch\) dims \(2,\) like q, got \(1,\)"):
        qkv.attention_weights(torch.randn(B, H, I, D), torch.randn(1, G, J, D))
