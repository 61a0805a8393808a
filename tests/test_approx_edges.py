"""Every approximation at its edges: padded keys holding nan or inf, and calls with no batch row, query or key.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=4, g=2, i=j=8, d=e=4.

A padded slot (a cache from ``torch.empty``) may hold anything; its weight is 0, and ``0 ·
nan = nan``, so the methods zero what no query sees before their sums (four of the five
returned nan in every row before). An empty call gets exact attention's empty answer (the
block and landmark arithmetic divided by these sizes).
"""

import pytest
import torch

from qkv.approx import LinearAttention, Linformer, LSHAttention, NystromAttention, Performer

B, H, G, N, D = 2, 4, 2, 8, 4

MODULES = {
    "linformer": lambda: Linformer(N, 4, heads=H),
    "linear": lambda: LinearAttention(),
    "performer": lambda: Performer(D, seed=0),
    "nystrom": lambda: NystromAttention(4),
    "lsh": lambda: LSHAttention(D, n_buckets=2, chunk_size=4, seed=0).eval(),
}


def _inputs(b=B, i=N, j=N, g=G):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((b, H, i, D), (b, g, j, D), (b, g, j, D))]


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("g", [G, H], ids=["grouped", "per-head"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_what_padded_keys_and_values_hold_never_reaches_an_output(name, g, poison):
    module = MODULES[name]().double()
    q, k, v = _inputs(g=g)
    if name == "lsh":
        k = q[:, :g]  # shared QK: the keys are the queries
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[0, ..., 5:] = False  # row 0: its last three keys are padding
    keep[1, ..., 7:] = False
    want = module(q, k, v, mask=keep)
    padded = ~keep[:, :, 0, :, None]  # (b, 1, j, 1)
    bad_v = v.masked_fill(padded, poison)
    bad_k = k if name == "lsh" else k.masked_fill(padded, poison)
    got = module(q, bad_k, bad_v, mask=keep)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("b, i, j", [(0, N, N), (1, 0, 0), (1, N, 0), (1, 0, N)])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_an_empty_call_gets_exact_attentions_empty_answer(name, b, i, j):
    if name == "lsh" and i != j:
        pytest.skip("LSHAttention shares queries and keys: i == j")
    module = MODULES[name]().double()
    q, k, v = (x.requires_grad_() for x in _inputs(b, i, j))
    out, weights = module(q, k, v, return_weights=True)
    assert out.shape == (b, H, i, D) and weights.shape == (b, H, i, j)
    assert not out.any() and not weights.any()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(gr.shape == x.shape and not gr.any() for gr, x in zip(grads, (q, k, v)))
