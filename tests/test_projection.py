"""Tests of ``qkv.projection``: ``linear`` (F.linear, large float32 inputs through oneDNN) and ``Linear``.

Shape legend: ``b`` batch, ``i`` tokens per sequence, ``c`` input size, ``o`` output size.
The oracle is ``F.linear`` in float64 on the same values; float32 results must be as close to
it as ``F.linear``'s own float32 result is (the flash-attention rule: at most twice its
error, plus a small floor).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv import projection

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN: the route is never taken"
)


def _inputs(b, i, c, o, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, i, c, generator=g, dtype=dtype)
    w = torch.randn(o, c, generator=g, dtype=dtype) / c**0.5
    bias = torch.randn(o, generator=g, dtype=dtype)
    return x, w, bias


def _grads(fn, x, w, bias, dy):
    x, w, bias = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    y = fn(x, w, bias)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, bias.grad


def _close_as_linear(ours, plain, exact):
    """Error of ``ours`` against the float64 ``exact`` at most twice that of ``plain`` F.linear, plus 1e-5."""
    for name, a, p, e in zip(("y", "dx", "dW", "db"), ours, plain, exact):
        err_ours = (a.double() - e).abs().max().item()
        err_plain = (p.double() - e).abs().max().item()
        assert err_ours <= 2 * err_plain + 1e-5 * e.abs().max().item(), (name, err_ours, err_plain)


@needs_onednn
@pytest.mark.parametrize(("b", "i"), [(2, 512), (1, 1040), (3, 352)])
def test_convolution_route_matches_linear_forward_and_backward(b, i):
    # odd sizes so that a swapped axis fails; 3·352 = 1056 tokens = 16·66
    x, w, bias = _inputs(b, i, 37, 23)
    assert projection.uses_convolution(x, w)
    dy = torch.randn(b, i, 23, generator=torch.Generator().manual_seed(4))
    ours = _grads(projection.linear, x, w, bias, dy)
    plain = _grads(F.linear, x, w, bias, dy)
    exact = _grads(F.linear, x.double(), w.double(), bias.double(), dy.double())
    _close_as_linear(ours, plain, exact)


@needs_onednn
def test_convolution_route_without_bias_and_on_a_non_contiguous_input():
    _, w, _ = _inputs(1, 1, 37, 23)
    x = torch.randn(2, 37, 1024, generator=torch.Generator().manual_seed(6)).transpose(1, 2)  # (2, 1024, 37), strided
    assert projection.uses_convolution(x, w)
    exact = F.linear(x.double(), w.double())
    err = (projection.linear(x, w).double() - exact).abs().max().item()
    assert err <= 2 * (F.linear(x, w).double() - exact).abs().max().item() + 1e-5


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 256, 37), torch.float32),
        ((1, 1000, 37), torch.float32),
        ((2, 512, 37), torch.float64),
        ((37,), torch.float32),
    ],
    ids=["few tokens", "not a multiple of 16", "float64", "one vector"],
)
def test_other_inputs_run_f_linear_exactly(shape, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    w, bias = torch.randn(23, 37, generator=g, dtype=dtype), torch.randn(23, generator=g, dtype=dtype)
    assert not projection.uses_convolution(x, w)
    assert torch.equal(projection.linear(x, w, bias), F.linear(x, w, bias))


@needs_onednn
@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch's flags() context resets every flag
def test_route_follows_the_onednn_switch():
    x, w, _ = _inputs(2, 512, 37, 23)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not projection.uses_convolution(x, w)
        assert torch.equal(projection.linear(x, w), F.linear(x, w))
    assert projection.uses_convolution(x, w)


def test_linear_module_is_an_nn_linear_with_the_same_state_and_hooks():
    torch.manual_seed(0)
    plain = nn.Linear(37, 23)
    torch.manual_seed(0)
    ours = projection.Linear(37, 23)
    assert isinstance(ours, nn.Linear)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), plain.state_dict().values()))
    seen = []
    ours.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(2, 4, 37)
    assert torch.equal(ours(x), plain(x))
    assert seen == [torch.Size([2, 4, 23])]


@needs_onednn
def test_second_order_gradients_through_the_convolution_route():
    x, w, bias = _inputs(1, 1024, 5, 3)
    x.requires_grad_()

    def second(fn):
        (gx,) = torch.autograd.grad(fn(x, w, bias).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.sum(), x)[0]

    # gx = 2 (x Wᵀ + b) W, so Σ gx = 2 Σ_t,o y[t, o]·s[o] with s[o] = Σ_c W[o, c]: every token's
    # second gradient is 2 Wᵀ s
    assert projection.uses_convolution(x, w)
    closed_form = (2 * w.t() @ w.sum(dim=1)).expand(1, 1024, 5)
    torch.testing.assert_close(second(projection.linear), closed_form, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second(F.linear), closed_form, rtol=1e-5, atol=1e-5)
