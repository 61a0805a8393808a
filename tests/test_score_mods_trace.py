"""Score modifiers where values cannot be read: ``meta`` tensors, ``torch.compile(fullgraph=True)``
and ``torch.export`` (``qkv._trace``), through ``qkv.attention`` and ``qkv.flex_attention``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=4, g=2, i=5, j=7, d=8, e=6.

Traced calls with a ``score_mod`` run on the reference backend (public ops; the score_mod
engines are Python tile loops inside a custom autograd function, ``backends.chunked``),
eager ones on the tiled engines: the two must agree to float32 rounding. Compiled calls use
the ``aot_eager`` backend (dynamo's full graph and AOT autograd, about a second per case);
one runs through inductor, skipped where no C++ compiler exists.
"""

import os
import shutil

import pytest
import torch
from torch import nn

import qkv

B, H, G, I, J, D, E = 2, 4, 2, 5, 7, 8, 6


def inputs(device="cpu", grad=False, g=G, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, I, D), (B, g, J, D), (B, g, J, E))
    return [torch.randn(s, generator=gen).to(device).requires_grad_(grad) for s in shapes]


def table_mod(device="cpu", declared=False):
    """A look-up by relative position (``table[q_idx - kv_idx]``); ``declared``: ``broadcasts = True``."""
    table = torch.linspace(-1.0, 1.0, I + J, device=device)

    def fn(score, b, h, i, j):
        return score + table[i - j + J - 1]

    if declared:
        fn.broadcasts = True
    return fn


#: qkv's own (declared elementwise; a far cap and a tight one), a user's lambda of the
#: indices, a table look-up (vmap while tracing) and the same declared elementwise.
MODS = {
    "softcap": qkv.SoftCap(30.0),
    "softcap_tight": qkv.SoftCap(0.5),
    "lambda": lambda score, b, h, i, j: score + (i - j),
    "table": table_mod(),
    "table_declared": table_mod(declared=True),
}
#: What export cannot trace: vmap indexing a tensor with a batched 0-d index (qkv.score_mods).
NO_EXPORT = {"table"}


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("causal", [False, True])
def test_meta_forward_returns_a_meta_tensor_of_the_output_shape(name, causal):
    q, k, v = inputs("meta")
    # what the function reads lives where the call runs
    mod = table_mod("meta", declared=name.endswith("declared")) if name.startswith("table") else MODS[name]
    out = qkv.attention(q, k, v, score_mod=mod, causal=causal)
    assert out.device.type == "meta" and out.shape == (B, H, I, E)
    out = qkv.flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
    assert out.device.type == "meta" and out.shape == (B, H, I, E)


@pytest.mark.parametrize("name", list(MODS))
def test_compile_fullgraph_equals_eager_with_gradients(name):
    q, k, v = inputs(grad=True)
    mod = MODS[name]

    def f(q, k, v):
        return qkv.attention(q, k, v, score_mod=mod, causal=True)

    cot = torch.randn(B, H, I, E, generator=torch.Generator().manual_seed(2))
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), cot)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), cot), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softcap_tight", "lambda"])
def test_compile_fullgraph_of_flex_attention_equals_eager(name):
    q, k, v = inputs()
    mod = MODS[name]

    def f(q, k, v):
        return qkv.flex_attention(q, k, v, score_mod=mod, enable_gqa=True)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), rtol=1e-5, atol=1e-5)


def test_plain_compile_of_a_soft_cap_has_no_graph_break():
    q, k, v = inputs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda q, k, v: qkv.attention(q, k, v, score_mod=qkv.SoftCap(30.0)))(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons


class _Modded(nn.Module):
    """One attention call with a score_mod, as an exported model holds it."""

    def __init__(self, mod, flex=False):
        super().__init__()
        self.mod, self.flex = mod, flex

    def forward(self, q, k, v):
        if self.flex:
            return qkv.flex_attention(q, k, v, score_mod=self.mod, enable_gqa=True)
        return qkv.attention(q, k, v, score_mod=self.mod, causal=True)


@pytest.mark.parametrize("flex", [False, True], ids=["attention", "flex_attention"])
@pytest.mark.parametrize("name", sorted(set(MODS) - NO_EXPORT))
def test_export_runs_and_equals_eager_on_other_inputs(name, flex):
    module = _Modded(MODS[name], flex)
    program = torch.export.export(module, tuple(inputs()))
    q, k, v = inputs(seed=1)  # other values than the example's
    with torch.no_grad():
        torch.testing.assert_close(program.module()(q, k, v), module(q, k, v), rtol=1e-5, atol=1e-5)


def test_export_of_a_table_look_up_says_how_to_declare_it():
    with pytest.raises(RuntimeError, match=r"score_mod: could not be traced under torch.vmap.*fn.broadcasts = True"):
        torch.export.export(_Modded(MODS["table"]), tuple(inputs()))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") is not None,
    reason="inductor's C++ targets the CPU itself, not ATEN_CPU_CAPABILITY (a PyTorch limitation)",
)
def test_compile_with_inductor_equals_eager():
    q, k, v = inputs()
    mod = MODS["lambda"]

    def f(q, k, v):
        return qkv.attention(q, k, v, score_mod=mod, causal=True)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)
