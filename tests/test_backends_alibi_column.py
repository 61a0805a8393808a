"""ALiBi as a key column (``qkv.backends.engines.alibi_column``) against the float64 reference.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13. Blocks of 8 rows,
so that small inputs have left parts, squares and right parts, and rows with no key.
"""

import pytest
import torch

import qkv
from qkv.backends.engines import alibi_column
from qkv.backends.tiling import flash_cpu

B, H, G, D, E = 2, 6, 3, 11, 13


@pytest.fixture
def column(monkeypatch):
    """Small blocks, and the column path chosen whatever the timing on this CPU says."""
    monkeypatch.setattr(alibi_column, "BLOCK_ROWS", 8)
    monkeypatch.setattr(alibi_column, "preferred", lambda dtype, grad: True)


def inputs(i, j, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    shapes = ((B, H, i, D), (B, G, j, D), (B, G, j, E))
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def run(q, k, v, backend, **kw):
    out = qkv.attention(q, k, v, backend=backend, **kw)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out, *torch.autograd.grad(out, (q, k, v), cot)]


@pytest.mark.parametrize("i, j", [(37, 37), (21, 45), (45, 21), (9, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_float64(column, i, j, causal):
    q, k, v = inputs(i, j)
    kw = dict(bias=qkv.ALiBi(H).double(), causal=causal)
    assert qkv.explain(q, k, v, **kw).splitlines()[0] == "backend: chunked (alibi_column)"
    for a, b in zip(run(q, k, v, "chunked", **kw), run(q, k, v, "reference", **kw)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rows_with_no_key_give_zeros(column):
    q, k, v = inputs(40, 12)  # causal: the first 28 queries see no key
    out, dq, dk, dv = run(q, k, v, "chunked", bias=qkv.ALiBi(H).double(), causal=True)
    assert torch.equal(out[..., :28, :], torch.zeros_like(out[..., :28, :]))
    assert torch.equal(dq[..., :28, :], torch.zeros_like(dq[..., :28, :]))
    want = run(q, k, v, "reference", bias=qkv.ALiBi(H).double(), causal=True)
    torch.testing.assert_close(dk, want[2], rtol=1e-10, atol=1e-10)


def test_flash_rule_float32(column):
    """Error vs float64 at most twice that of the materialised float32 computation, + 1e-5."""
    q, k, v = inputs(70, 90)
    exact = run(q, k, v, "reference", bias=qkv.ALiBi(H).double())
    low = [x.detach().float().requires_grad_() for x in (q, k, v)]
    plain = run(*low, "reference", bias=qkv.ALiBi(H))
    fast = run(*low, "chunked", bias=qkv.ALiBi(H))
    for a, p, x in zip(fast, plain, exact):
        assert (a.double() - x).abs().max() <= 2 * (p.double() - x).abs().max() + 1e-5


@pytest.mark.parametrize(
    "kw, dtype",
    [
        (dict(bias=qkv.ALiBi(H), mask=qkv.masks.window(3)), torch.float32),  # windows keep the masked path
        (dict(bias=qkv.RelativePositionBias(H, 8, 20)), torch.float32),  # learned, not linear
        (dict(bias=qkv.ALiBi(H)), torch.bfloat16),  # the column's integers would round
    ],
)
def test_other_calls_keep_the_masked_path(column, kw, dtype):
    q, k, v = (x.detach().to(dtype) for x in inputs(37, 37))
    kw = {name: (x.to(dtype) if isinstance(x, torch.nn.Module) else x) for name, x in kw.items()}
    text = qkv.explain(q, k, v, **kw).splitlines()
    # the masked path: the fused kernel where it passes its check for this dtype (it fails
    # for bfloat16 under an emulated ATEN_CPU_CAPABILITY), else the online tiles
    masked = "fused_blocks" if flash_cpu.works(dtype) else "online_softmax"
    assert text[0] == f"backend: chunked ({masked})"
    assert any(line.startswith("  not alibi_column (engine): ") for line in text)


def test_the_timing_probe_answers_once_per_mode(monkeypatch):
    monkeypatch.setattr(alibi_column, "BLOCK_ROWS", 8)  # both paths timed on 16 rows
    alibi_column.preferred.cache_clear()
    try:
        answers = {grad: alibi_column.preferred(torch.float32, grad) for grad in (False, True)}
        assert all(isinstance(a, bool) for a in answers.values())
        monkeypatch.setattr(alibi_column, "_column_faster", lambda *a: pytest.fail("probed twice"))
        assert alibi_column.preferred(torch.float32, True) is answers[True]
    finally:
        alibi_column.preferred.cache_clear()  # later calls time afresh, at the real block size
