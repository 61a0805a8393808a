"""qkv.approx._common: the oneDNN batched product and the reusable buffers of the streamed methods.

Shape legend: ``n`` batch of products (flattened heads), ``o`` rows of ``w``, ``c`` the
contracted size, ``p`` columns of ``x``.
"""

import math

import pytest
import torch

from qkv.approx._common import Scratch, grouped_matmul, needs_grad, project_into
from dispatch_ops import Ops, onednn_available


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("n, o, c, p", [(1, 13, 300, 256), (1, 64, 2048, 272)])
def test_grouped_matmul_through_onednn_equals_bmm(n, o, c, p):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, c, o, generator=gen).transpose(1, 2)  # a transposed view, as the callers pass
    x = torch.rand(n, c, p, generator=gen)
    with Ops() as seen:
        got = grouped_matmul(w, x)
    assert any(name.startswith("mkldnn_convolution") for name in seen.names), seen.names
    assert got.shape == (n, o, p)
    want = torch.bmm(w.double(), x.double())
    # float32 rounding of a sum of c terms, against the float64 product
    assert (got - want).abs().max() < 1e-5 * c**0.5 * want.abs().max()


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_grouped_matmul_gradients_equal_those_of_bmm():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1, 7, 96, generator=gen, requires_grad=True)
    x = torch.rand(1, 96, 256, generator=gen, requires_grad=True)
    up = torch.randn(1, 7, 256, generator=gen)
    got = torch.autograd.grad((grouped_matmul(w, x) * up).sum(), (w, x))
    want = torch.autograd.grad((torch.bmm(w, x) * up).sum(), (w, x))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n, dtype, p", [(1, torch.float64, 256), (1, torch.float32, 8), (2, torch.float32, 256)])
def test_grouped_matmul_falls_back_to_bmm(n, dtype, p):
    # float64, and float32 with few columns or several products (oneDNN measured slower
    # there), are bmm exactly.
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, 3, 5000, generator=gen, dtype=dtype)
    x = torch.randn(n, 5000, p, generator=gen, dtype=dtype)
    with Ops() as seen:
        got = grouped_matmul(w, x)
    assert not any(name.startswith("mkldnn") for name in seen.names)
    assert torch.equal(got, torch.bmm(w, x))



def test_scratch_reuses_one_buffer_per_name_and_is_off_for_autograd():
    like = torch.zeros(1)
    scratch = Scratch(True)
    a = scratch.get("keys", (4, 8), like)
    assert a.shape == (4, 8) and a.is_contiguous()
    smaller = scratch.get("keys", (2, 3), like)  # the last block of a call is often smaller
    assert smaller.shape == (2, 3) and smaller.data_ptr() == a.data_ptr()
    other = scratch.get("queries", (4, 8), like)
    assert other.data_ptr() != a.data_ptr()
    larger = scratch.get("keys", (5, 8), like)
    assert larger.shape == (5, 8)
    assert scratch.get("keys", (5, 8), like.double()).dtype == torch.float64
    assert Scratch(False).get("keys", (4, 8), like) is None


def test_needs_grad_follows_requires_grad_and_grad_mode():
    x, y = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert not needs_grad(x) and needs_grad(x, y)
    with torch.no_grad():
        assert not needs_grad(x, y)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_project_into_writes_the_projection_into_the_buffer():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1024, 24, generator=gen)  # 2048 rows: qkv.projection's convolution route
    w = torch.randn(40, 24, generator=gen)
    out = torch.full((2, 1024, 40), float("nan"))  # stale contents must not leak into the result
    with Ops() as seen:
        got = project_into(x, w, out)
    want = x.double() @ w.double().T
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    if not any(name.startswith("_convolution_pointwise_") for name in seen.names):
        pytest.skip("this torch has no in-place oneDNN convolution; only the fallback was checked")
    assert got.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("rows, dtype, buffer", [(1024, torch.float32, False), (100, torch.float32, True), (1024, torch.float64, True)])
def test_project_into_falls_back_to_a_new_tensor(rows, dtype, buffer):
    # No buffer, too few rows for the convolution route, or float64: qkv.projection.linear.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 8, generator=gen, dtype=dtype)
    w = torch.randn(5, 8, generator=gen, dtype=dtype)
    out = torch.empty(rows, 5, dtype=dtype) if buffer else None
    got = project_into(x, w, out)
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_project_into_falls_back_when_the_internal_op_refuses_the_call(monkeypatch):
    import qkv.approx._common as common

    def changed_signature(*args):
        raise TypeError("_convolution_pointwise_() got an unexpected argument")

    monkeypatch.setattr(common, "_CONV_ADD", changed_signature)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 24, generator=gen)
    w = torch.randn(40, 24, generator=gen)
    got = project_into(x, w, torch.empty(2048, 40))
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=1e-5)
    assert common._CONV_ADD is False  # not tried again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_floor_logits_keeps_the_softmax_and_makes_no_subnormal(dtype):
    from qkv.approx._common import floor_logits, softmax_floor

    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 300
    floored = floor_logits(x.to(dtype))
    w = floored.softmax(-1)
    assert not bool(((w != 0) & (w.abs() < torch.finfo(dtype).tiny)).any())
    err = (w.double() - x.softmax(-1)).abs().max().item()
    assert err <= 2 * 256 * math.e * torch.finfo(dtype).tiny + (x.to(dtype).softmax(-1).double() - x.softmax(-1)).abs().max().item()
    assert torch.equal(floored >= floored.amax(-1, keepdim=True) - softmax_floor(dtype, 256), torch.ones_like(floored, dtype=torch.bool))
    y = x.to(dtype).clone()
    assert floor_logits(y, inplace=True) is y and torch.equal(y, floored)
