"""Inputs whose last dim is not dense (a ``[..., ::2]`` slice, a transposed or an expanded last dim) give the
same attention as their contiguous copies, on every backend and engine.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=4, g=2, i=9, j=11, d=e=8.

PyTorch's fused CPU kernel (which several engines call directly, for its log-sum-exp) reads
q, k, v as if ``stride(-1) == 1``: before ``flash_cpu`` made such inputs dense, a sliced key
gave outputs 1.35 off, and a transposed query values of 1e38.
"""

import pytest
import torch

import qkv
from qkv import backends
from qkv.backends.tiling import flash_cpu

B, H, G, I, J, D = 2, 4, 2, 9, 11, 8


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``'s values in a layout whose last dim is not dense."""
    if how == "sliced":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "transposed":
        return x.mT.contiguous().mT
    if how == "expanded":  # one value per row, repeated along d: stride 0
        return x[..., :1].expand(x.shape)
    raise AssertionError(how)


OPTIONS = {
    "causal": dict(causal=True),
    "lse": dict(causal=True, return_lse=True),
    "sinks": dict(causal=True, sinks=torch.linspace(-1, 1, H, dtype=torch.float64)),
    "alibi": dict(causal=True, bias=qkv.ALiBi(H).double()),
    "window": dict(mask=qkv.masks.window(3)),
    "softcap": dict(causal=True, score_mod=qkv.SoftCap(5.0)),
}


@pytest.mark.parametrize("how", ["sliced", "transposed", "expanded"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", ["auto", *sorted(backends.REGISTRY)])
def test_a_last_dim_that_is_not_dense_gives_the_contiguous_answer(name, option, how):
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((B, H, I, D), (B, G, J, D), (B, G, J, D))]
    kw = OPTIONS[option]
    for at in range(3):  # one of q, k, v at a time in the odd layout
        made = [_layout(x, how) if n == at else x for n, x in enumerate(dense)]
        want_inputs = [x.contiguous().requires_grad_() for x in made]
        odd = [x.detach().requires_grad_() if n != at else x.detach().requires_grad_() for n, x in enumerate(made)]
        assert odd[at].stride(-1) != 1
        try:
            got = qkv.attention(*odd, backend=name, **kw)
        except ValueError as err:
            if "cannot run this call" in str(err):
                pytest.skip(str(err))
            raise
        want = qkv.attention(*want_inputs, backend="reference", **kw)
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        loss = lambda outs: sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() for o in outs)  # noqa: E731
        grads = torch.autograd.grad(loss(got), odd)
        want_grads = torch.autograd.grad(loss(want), want_inputs)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_the_kernel_is_given_dense_rows():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    out, lse = flash_cpu.forward(q, k, v, 0.0, False, scale=0.5)[:2]
    for odd in (_layout(k, "sliced"), _layout(k, "transposed")):
        torch.testing.assert_close(flash_cpu.forward(q, odd, v, 0.0, False, scale=0.5)[0], out)
    d_out = torch.randn(1, 2, 5, 4, generator=gen)
    grads = flash_cpu.backward(d_out, q, k, v, out, lse, 0.0, False, scale=0.5)
    odd = flash_cpu.backward(_layout(d_out, "sliced"), q, k, v, _layout(out, "sliced"), lse, 0.0, False, scale=0.5)
    for a, b in zip(odd, grads, strict=True):
        torch.testing.assert_close(a, b)
