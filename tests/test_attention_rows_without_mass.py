"""``qkv.attention`` on rows with no key left by a bias or a sink, dropout's log-sum-exp, and a bias of low rank.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``d`` query/key
size, ``e`` value size.

Each test pins one place where backends answered otherwise than the definition: a ``-inf`` bias
over a whole row (no mask) left the fused engine an ``lse`` of 0 and the reference a nan; a row
with no key under a sink of ``-inf`` gave nan; the lse's gradient under dropout was scaled by
``1 / (1 - p)``; a ``(j,)`` bias passed the checks and failed inside the engines.
"""

import pytest
import torch

import qkv

BACKENDS = ["auto", "chunked", "reference"]
INF = float("inf")


def _inputs(i=3, j=5, h=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, i, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, h, j, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(1, h, j, 3, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks", [None, 0.5], ids=["no sink", "sink"])
def test_a_row_a_minus_inf_bias_hides_entirely_sees_no_key(backend, sinks):
    q, k, v = _inputs()
    bias = torch.randn(1, 2, 3, 5, dtype=torch.float64)
    bias[:, :, 0] = -INF
    sink = None if sinks is None else torch.full((2,), sinks, dtype=torch.float64)
    out, lse = qkv.attention(q, k, v, bias=bias, sinks=sink, return_lse=True, backend=backend)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.equal(lse[:, :, 0], torch.full_like(lse[:, :, 0], -INF if sinks is None else sinks))
    want, want_lse = _rows(q[:, :, 1:], k, v, bias[:, :, 1:], sink)
    torch.testing.assert_close(out[:, :, 1:], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, :, 1:], want_lse, rtol=0, atol=1e-12)
    # split keys merged again: the whole call's answer (an lse of 0 weighed a row of no key as one of mass 1)
    parts = [qkv.attention(q, k[:, :, s], v[:, :, s], bias=bias[..., s], return_lse=True, backend=backend)
             for s in (slice(0, 2), slice(2, 5))]  # fmt: skip
    merged, merged_lse = qkv.merge([p[0] for p in parts], [p[1] for p in parts])
    whole, whole_lse = qkv.attention(q, k, v, bias=bias, return_lse=True, backend=backend)
    torch.testing.assert_close(merged, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=0, atol=1e-12)
    q.requires_grad_(True)
    out = qkv.attention(q, k, v, bias=bias, sinks=sink, backend=backend)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(grad).all() and torch.equal(grad[:, :, 0], torch.zeros_like(grad[:, :, 0]))


def _rows(q, k, v, bias, sinks):
    """The definition, row by row: softmax over the keys and the sink, the sink's weight dropped."""
    logits = q @ k.transpose(-1, -2) / 2 + bias
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)], -1)
    lse = torch.logsumexp(logits, -1)
    weights = torch.exp(logits - lse[..., None])[..., : k.shape[-2]]
    return weights @ v, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_no_key_under_a_sink_of_minus_inf_give_zeros(backend):
    q, k, v = _inputs(i=4, j=2)
    sinks = torch.tensor([-INF, 0.0], dtype=torch.float64, requires_grad=True)
    out, lse = qkv.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=backend)  # rows 0, 1: no key
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.equal(lse[:, 0, :2], torch.full((1, 2), -INF, dtype=torch.float64))
    assert torch.equal(lse[:, 1, :2], torch.zeros((1, 2), dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.sum() + lse[:, 1].sum(), sinks)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_dropout_the_lse_and_its_gradient_are_those_without(backend):
    """The lse is dropout's input: its gradient was the dropped weights', 1 / (1 - p) too large on the engines."""
    q, k, v = _inputs()
    q.requires_grad_(True)
    lse = qkv.attention(q, k, v, dropout=0.4, generator=torch.Generator().manual_seed(1), return_lse=True,
                        backend=backend)[1]  # fmt: skip
    plain = qkv.attention(q, k, v, return_lse=True, backend=backend)[1]
    torch.testing.assert_close(lse, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(lse.sum(), q)[0], torch.autograd.grad(plain.sum(), q)[0],
                               rtol=0, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "sdpa", "chunked", "reference"])
@pytest.mark.parametrize("shape", [(5,), ()], ids=["row", "scalar"])
def test_a_bias_of_rank_below_two_broadcasts_as_documented(backend, shape):
    q, k, v = _inputs(j=5)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = qkv.attention(q, k, v, bias=bias, backend=backend)
    want, want_lse = _rows(q, k, v, bias.expand(1, 2, 3, 5), None)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    if backend != "sdpa":  # (PyTorch's kernel gives no lse)
        torch.testing.assert_close(qkv.attention(q, k, v, bias=bias, backend=backend, return_lse=True)[1], want_lse,
                                   rtol=0, atol=1e-12)  # fmt: skip
    (grad,) = torch.autograd.grad(out.sum(), bias)
    assert grad.shape == bias.shape
