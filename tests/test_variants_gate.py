"""Tests of ``qkv.OutputGate`` (Qiu et al. 2025's sigmoid gate on each head) and the ``gate=`` slot.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``e`` per-head value size,
``dim`` model size.
"""

import math

import pytest
import torch
from einops import rearrange

import qkv


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("headwise", [False, True])
def test_gate_is_sigmoid_of_x_w_times_the_head_output(headwise):
    torch.manual_seed(0)
    dim, h, e = 10, 3, 4
    gate = qkv.OutputGate(dim, h, e, headwise=headwise).double()
    y, x = torch.randn(2, h, 5, e, dtype=torch.float64), torch.randn(2, 5, dim, dtype=torch.float64)
    got = gate(y, x)
    w = gate.proj.weight.tolist()  # (h·e or h, dim)
    for b in range(2):
        for n in range(h):
            for t in range(5):
                for c in range(e):
                    row = n if headwise else n * e + c
                    pre = sum(w[row][a] * x[b, t, a].item() for a in range(dim))
                    assert got[b, n, t, c].item() == pytest.approx(y[b, n, t, c].item() * _sigmoid(pre), abs=1e-12)


def test_mha_gates_the_heads_before_the_output_projection():
    torch.manual_seed(0)
    dim, h, e = 12, 3, 5
    gate = qkv.OutputGate(dim, h, e)
    mha = qkv.MultiHeadAttention(dim, h, dim_value_head=e, gate=gate).double()
    x = torch.randn(2, 6, dim, dtype=torch.float64)
    plain = qkv.MultiHeadAttention(dim, h, dim_value_head=e).double()
    plain.load_state_dict({k: v for k, v in mha.state_dict().items() if not k.startswith("gate.")})
    _, weights = plain(x, causal=True, return_weights=True)
    v = rearrange(plain.v_proj(x), "b j (h e) -> b h j e", h=h)
    heads = (weights @ v) * rearrange(torch.sigmoid(gate.proj(x)), "b i (h e) -> b h i e", h=h)
    want = mha.out_proj(rearrange(heads, "b h i e -> b i (h e)"))
    torch.testing.assert_close(mha(x, causal=True), want, rtol=0, atol=1e-12)
    mha(x).sum().backward()
    assert mha.gate.proj.weight.grad.abs().sum() > 0


def test_gate_uses_the_query_input_in_cross_attention():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(8, 2, kdim=6, vdim=6, gate=qkv.OutputGate(8, 2, 4, headwise=True)).double()
    x, memory = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    assert mha(x, memory).shape == (2, 3, 8)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: qkv.OutputGate(8, 0, 4), "heads: expected a positive int, got 0"),
        (lambda: qkv.OutputGate(8, 2, 4)(torch.randn(1, 3, 5, 4), torch.randn(1, 5, 8)),
         r"y: OutputGate expects \(b, 2, i, 4\), got \(1, 3, 5, 4\)"),
        (lambda: qkv.OutputGate(8, 2, 4)(torch.randn(1, 2, 5, 4), torch.randn(1, 4, 8)),
         r"x: expected the layer input \(b=1, i=5, 8\), got \(1, 4, 8\)"),
    ],
)  # fmt: skip
def test_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()
