"""The soft cap's ``tanh(z / 2) = 2σ(z) - 1`` form, chosen for half-precision inputs only (``tile_math.forms``).

It cancels as ``z → 0`` (an absolute error up to ``c·2⁻²³``), which float32 inputs do not
tolerate and bfloat16 and float16 ones do: the attention written out in their dtype rounds
every logit and weight to 8 or 11 bits. Each check forces the choice both ways, whatever
this CPU times faster.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends.engines import mod_tiles
from qkv.backends.tiling import threads, tile_math

import reference as ref

B, H, I, D = 1, 2, 37, 16
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Several tiles per call, on 2 threads however small the call."""
    monkeypatch.setattr(mod_tiles, "TILE_ROWS", 8)
    monkeypatch.setattr(mod_tiles, "TILE_COLS", 8)
    monkeypatch.setattr(threads, "THREADS", 2)
    monkeypatch.setattr(threads, "MIN_WORK", 0)


def force(monkeypatch, sigmoid_faster: bool) -> None:
    monkeypatch.setattr(tile_math, "_sigmoid_tanh_faster", lambda library_tanh: sigmoid_faster)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("faster", [True, False])
def test_the_form_is_chosen_for_half_precision_inputs_only(monkeypatch, dtype, faster):
    force(monkeypatch, faster)
    got = tile_math.forms(torch.device("cpu"), dtype)
    assert got.half_tanh == (faster and dtype in HALF)
    assert got.stretch == (2.0 if got.half_tanh or not got.library_tanh else 1.0)
    assert not tile_math.forms(torch.device("meta"), dtype).half_tanh  # off the CPU: PyTorch's kernels


def test_the_sigmoid_form_must_win_by_the_margin_a_near_tie_keeps_the_full_precision_form(monkeypatch):
    timed = tile_math._sigmoid_tanh_faster.__wrapped__  # the cached function's body: timed afresh
    for times, want in [((1.0, 0.5), True), ((1.0, 0.95), False), ((1.0, 2.0), False)]:
        monkeypatch.setattr(tile_math, "best_times", lambda *calls, t=times: list(t))
        assert timed(False) is want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_capped_logits_in_the_sigmoid_form_are_within_its_cancellation_bound(dtype):
    """``c·(2σ(z) - 1) - base`` against float64's ``c·tanh(z/2) - base``: off by a few ulp of ``c``, never more."""
    z = torch.cat([torch.linspace(-60.0, 60.0, 4001, dtype=torch.float64), torch.tensor([0.0, 1e-6, -1e-6, 1e-30])])
    base = torch.tensor([[3.0], [-2.0]], dtype=torch.float64)
    cap = 50.0
    exact = cap * torch.tanh(z / 2) - base
    form = tile_math.Forms(False, False, half_tanh=True)
    got = tile_math.capped_(z.expand(2, -1).to(dtype).clone(), base.to(dtype), cap, torch.empty(2, z.numel(), dtype=dtype),
                            form, clamp=False)  # fmt: skip
    unit = torch.finfo(dtype).eps
    assert (got.double() - exact).abs().max() <= 8 * unit * (cap + base.abs().max())
    u = tile_math.tanh_(z.to(dtype).clone(), torch.empty(z.numel(), dtype=dtype), form)
    assert (u.double() - torch.tanh(z / 2)).abs().max() <= 8 * unit
    assert float(u.abs().max()) <= 1.0  # |2σ - 1| never passes 1: no capped logit leaves [-c, c]


def inputs(dtype, seed=0, spread=4.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, I, D, generator=gen, dtype=torch.float64) * spread).clamp(-4, 4).to(dtype).requires_grad_()
            for _ in range(3)]  # fmt: skip


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("faster", [True, False], ids=["sigmoid-form", "full-form"])
@pytest.mark.parametrize("cap", [2.0, 50.0])
def test_half_precision_soft_cap_follows_the_flash_rule_in_either_form(monkeypatch, dtype, faster, cap):
    """Output and gradients against float64 on the same half-precision inputs, within twice the attention written out
    in the inputs' dtype (plus one rounding of the largest value, as for the products' dtype)."""
    force(monkeypatch, faster)
    low = inputs(dtype)
    high = [x.detach().double().requires_grad_() for x in low]
    cot = torch.randn(B, H, I, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kw = dict(score_mod=qkv.SoftCap(cap), causal=True)

    def call(xs, backend):
        out = qkv.attention(*xs, backend=backend, **kw)
        return [out, *torch.autograd.grad((out.double() * cot).sum(), xs)]

    assert "mod_tiles" in qkv.explain(*low, **kw)
    got, plain, oracle = call(low, "chunked"), call(low, "reference"), call(high, "reference")
    assert all(x.dtype == dtype for x in got)
    for name, g, p_, o in zip(("out", "dq", "dk", "dv"), got, plain, oracle, strict=True):
        bound = 2 * (p_.double() - o).abs().max() + torch.finfo(dtype).eps * o.abs().max()
        assert (g.double() - o).abs().max() <= bound, name


@pytest.mark.parametrize("faster", [True, False], ids=["sigmoid-form", "full-form"])
def test_a_row_that_sees_one_key_gets_exactly_its_value_and_no_query_or_key_gradient(monkeypatch, faster):
    """``P = 1`` whatever the form, to float32's rounding of ``lse``: the forward's and the backward's tanh are the
    same function, so ``dS`` is float32 rounding (5e-7 here in either form), not the form's error (a tanh differing
    between the passes by the form's ``c·2⁻²³`` would leave 1e-4)."""
    force(monkeypatch, faster)
    q, k, v = inputs(torch.bfloat16, seed=1165)
    out = qkv.attention(q, k, v, mask=qkv.masks.window(0, 8), causal=True, backend="chunked", score_mod=qkv.SoftCap(20.0))
    assert torch.equal(out, v.detach())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16())
    assert float(dq.abs().max()) <= 2e-6 and float(dk.abs().max()) <= 2e-6 and bool(dv.any())


def test_float32_soft_cap_keeps_its_accuracy_when_the_sigmoid_form_is_faster(monkeypatch):
    """A float32 call is not given the cheaper form: its output stays within float32's few-ulp reach of float64."""
    force(monkeypatch, True)
    xs = inputs(torch.float32, spread=1.0)
    kw = dict(score_mod=qkv.SoftCap(50.0), causal=True)
    got = qkv.attention(*xs, backend="chunked", **kw)
    exact = qkv.attention(*(x.detach().double() for x in xs), backend="reference", **kw)
    assert (got.double() - exact).abs().max() <= 1e-6
    ref.assert_flash_rule(got, qkv.attention(*xs, backend="reference", **kw), exact, floor=0.0)
