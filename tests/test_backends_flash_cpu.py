"""The fused CPU kernel's probe (``qkv.backends.tiling.flash_cpu``) and the public fallback it guards.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, i=5, j=7, d=11, e=13.
"""

import pytest
import torch

import qkv
from qkv.backends import engines
from qkv.backends.tiling import flash_cpu as kernels

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def inputs(i=I, j=J):
    gen = torch.Generator().manual_seed(0)
    shapes = ((B, H, i, D), (B, G, j, D), (B, G, j, E))
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def test_the_kernel_passes_its_check_here():
    for dtype in (torch.float32, torch.float64):
        assert kernels.works(dtype)
    assert kernels.unusable(torch.ones(1)) is None
    assert kernels.unusable(torch.ones(1, device="meta")) == "the fused CPU kernel needs CPU tensors, got meta"


@pytest.fixture
def broken_kernel(monkeypatch):
    """A torch whose private kernel is missing: every dtype fails the probe."""
    monkeypatch.setattr(kernels, "forward", None)
    monkeypatch.setattr(kernels, "_probed", {})
    yield


@pytest.mark.parametrize(
    "kw", [dict(bias=qkv.ALiBi(H).double()), dict(causal=True, return_weights=True, weights_for={"rows": [0, 3]})]
)
def test_without_the_kernel_chunked_runs_the_public_tiles(broken_kernel, kw):
    q, k, v = inputs()
    text = qkv.explain(q, k, v, **kw)
    assert "backend: chunked (online_softmax)" in text
    assert "this torch's fused CPU kernel is missing or failed its check for torch.float64" in text
    got = qkv.attention(q, k, v, **kw)
    want = qkv.attention(q, k, v, backend="reference", **kw)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_without_the_kernel_a_long_window_leaves_the_local_backend(broken_kernel):
    q, k, v = (x.detach().float() for x in inputs(i=600, j=600))
    text = qkv.explain(q, k, v, mask=qkv.masks.window(16))
    assert "not local: this torch's fused CPU kernel is missing or failed its check for torch.float32" in text
    req = qkv.checks.request(q, k, v, score="scaled_dot", mask=None, bias=qkv.ALiBi(H), causal=False, scale=None,
                             dropout=0.0, return_weights=False)  # fmt: skip
    assert engines.choose(req)[0].name == "online_softmax"


def test_a_kernel_that_gives_wrong_answers_fails_the_probe(monkeypatch):
    real = kernels.forward

    def off_by_one(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 1, lse

    monkeypatch.setattr(kernels, "forward", off_by_one)
    monkeypatch.setattr(kernels, "_probed", {})
    assert not kernels.works(torch.float32)
