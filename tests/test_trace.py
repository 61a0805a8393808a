"""Calls that cannot read tensor values: ``meta`` tensors, ``torch.compile(fullgraph=True)``
and ``torch.export`` (``qkv._trace``), for every kind of mask and bias.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, i=5, j=7, d=11, e=13.

Compiled calls use the ``aot_eager`` backend (dynamo's full graph and AOT autograd, what
tracing needs of qkv, in about a second per case); one case also runs through inductor,
skipped where no C++ compiler exists.
"""

import os
import shutil
import warnings

import pytest
import torch

import qkv
from qkv import _trace

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13


def inputs(device="cpu", grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, I, D), (B, G, J, D), (B, G, J, E))
    return [torch.randn(s, generator=gen).to(device).requires_grad_(grad) for s in shapes]


def calls(device="cpu"):
    """Each kind of mask and bias, as keyword arguments of qkv.attention (built on ``device``)."""
    torch.manual_seed(1)
    lengths = torch.tensor([7, 3], device=device)
    return {
        "causal": dict(causal=True),
        "window": dict(mask=qkv.masks.window(2, 1)),
        "lengths": dict(mask=qkv.masks.lengths(lengths)),
        "lengths&causal": dict(mask=qkv.masks.lengths(lengths), causal=True),
        "dense": dict(mask=torch.ones(I, J, dtype=torch.bool, device=device).tril(1)),
        "alibi": dict(bias=qkv.ALiBi(H).to(device)),
        "alibi&causal": dict(bias=qkv.ALiBi(H).to(device), causal=True),
        "alibi&window": dict(bias=qkv.ALiBi(H).to(device), mask=qkv.masks.window(2)),
        "t5": dict(bias=qkv.RelativePositionBias(H, 8, 20).to(device)),
        "t5&causal": dict(bias=qkv.RelativePositionBias(H, 8, 20, bidirectional=False).to(device), causal=True),
    }


def test_concrete_only_for_real_tensors_outside_tracing():
    assert _trace.concrete(torch.ones(2))
    assert not _trace.concrete(torch.ones(2), torch.ones(2, device="meta"))
    assert not _trace.tracing()


@pytest.mark.parametrize("kind", list(calls()))
def test_meta_forward_runs_for_every_mask_and_bias(kind):
    q, k, v = inputs("meta")
    out = qkv.attention(q, k, v, **calls("meta")[kind])
    assert out.device.type == "meta" and out.shape == (B, H, I, E)


def test_meta_forward_of_weights_and_the_additive_score():
    q, k, v = inputs("meta")
    out, w = qkv.attention(q, k, v, causal=True, return_weights=True)
    assert w.device.type == "meta" and w.shape == (B, H, I, J)
    score = qkv.scores.Additive(D, D, 5).to("meta")
    assert qkv.attention(q, k, v, score=score, causal=True).shape == (B, H, I, E)


def test_explain_says_meta_calls_run_public_ops():
    q, k, v = inputs("meta")
    text = qkv.explain(q, k, v, bias=qkv.ALiBi(H).to("meta"))
    assert "backend: chunked (online_softmax)" in text
    assert "the fused CPU kernel needs CPU tensors, got meta" in text
    text = qkv.explain(q, k, v, mask=qkv.masks.window(2))
    assert "not local: the fused CPU kernel needs CPU tensors, got meta" in text


@pytest.mark.parametrize("kind", ["causal", "window", "lengths&causal", "alibi", "t5&causal"])
def test_compile_fullgraph_equals_eager_with_gradients(kind):
    q, k, v = inputs(grad=True)
    kw = calls()[kind]
    bias = kw.get("bias")
    params = [q, k, v] + ([] if bias is None else list(bias.parameters()))

    def f(q, k, v):
        return qkv.attention(q, k, v, **kw)

    cot = torch.randn(B, H, I, E, generator=torch.Generator().manual_seed(2))
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, params, cot)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, params, cot), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") is not None,
    reason="inductor's C++ targets the CPU itself, not ATEN_CPU_CAPABILITY: under an emulated capability "
    "its generated code fails to compile (a PyTorch limitation, not qkv's)",
)
def test_compile_with_inductor_equals_eager():
    q, k, v = inputs()
    bias = qkv.ALiBi(H)

    def f(q, k, v):
        return qkv.attention(q, k, v, bias=bias, mask=qkv.masks.lengths(torch.tensor([7, 3])), causal=True)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-6)


class _Padded(torch.nn.Module):
    """Self-attention with ALiBi over right-padded rows: what an exported encoder layer runs."""

    def __init__(self):
        super().__init__()
        self.mha = qkv.MultiHeadAttention(16, 4, positional=qkv.ALiBi(4))

    def forward(self, x, lengths):
        return self.mha(x, mask=qkv.masks.lengths(lengths))


def test_export_of_multi_head_attention_with_alibi_and_lengths():
    torch.manual_seed(3)
    module = _Padded().eval()
    x, lengths = torch.randn(2, 9, 16), torch.tensor([9, 4])
    program = torch.export.export(module, (x, lengths))
    # other values than the example's: the lengths are data in the graph, not constants
    x2, lengths2 = torch.randn(2, 9, 16), torch.tensor([2, 9])
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x2, lengths2), module(x2, lengths2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_jit_trace_of_multi_head_attention_equals_eager_on_a_fresh_input(kv_heads):
    """``enable_gqa`` reaches the kernel as a Python bool, not a traced size (``backends.sdpa``)."""
    torch.manual_seed(4)
    module = qkv.MultiHeadAttention(16, 4, kv_heads=kv_heads).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks become constants of the trace
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated, and still used
        traced = torch.jit.trace(module, (torch.randn(2, 5, 16),))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), module(x), rtol=1e-5, atol=1e-6)


class _Masked(torch.nn.Module):
    def __init__(self, mha: qkv.MultiHeadAttention, kind: str):
        super().__init__()
        self.mha, self.kind = mha, kind

    def forward(self, x, lengths):
        if self.kind == "lengths":
            return self.mha(x, mask=qkv.masks.lengths(lengths), causal=True)
        keep = torch.arange(x.shape[1])[None, :] < lengths[:, None]  # the key padding form the docstring gives
        return self.mha(x, mask=keep[:, None, None, :])


def _jit_trace(module, example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.trace(module, example, check_trace=False)


@pytest.mark.parametrize("positional", ["alibi", "relative"])
def test_jit_trace_of_a_biased_module_equals_eager(positional):
    """A lazy bias sent a traced call to the chunked engines' autograd function: ``unordered_map::at``."""
    torch.manual_seed(6)
    bias = qkv.ALiBi(4) if positional == "alibi" else qkv.RelativePositionBias(4, 8, 20)
    module = qkv.MultiHeadAttention(16, 4, positional=bias).eval()
    traced = _jit_trace(module, (torch.randn(2, 5, 16),))
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), module(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lengths", "key padding"])
def test_jit_trace_of_a_padded_call_reads_each_calls_lengths(kind):
    """Traced, a mask's values were read and frozen into the trace (or the tracer failed): now public ops."""
    torch.manual_seed(7)
    module = _Masked(qkv.MultiHeadAttention(16, 4).eval(), kind)
    traced = _jit_trace(module, (torch.randn(2, 6, 16), torch.tensor([6, 3])))
    x, other = torch.randn(2, 6, 16), torch.tensor([2, 6])
    with torch.no_grad():
        torch.testing.assert_close(traced(x, other), module(x, other), rtol=1e-5, atol=1e-6)


def test_jit_trace_as_a_processs_first_call_does_not_crash():
    """The one-time probes ran inside the trace on a process's first call (a segfault)."""
    code = (
        "import torch, warnings, qkv\n"
        "warnings.simplefilter('ignore')\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(s): super().__init__(); s.m = qkv.MultiHeadAttention(16, 4).eval()\n"
        "    def forward(s, x, n): return s.m(x, mask=qkv.masks.lengths(n), causal=True)\n"
        "m = M()\n"
        "t = torch.jit.trace(m, (torch.randn(2, 6, 16), torch.tensor([6, 3])), check_trace=False)\n"
        "x, n = torch.randn(2, 6, 16), torch.tensor([2, 6])\n"
        "print(float((t(x, n) - m(x, n)).abs().max()))\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5


@pytest.mark.parametrize("option", ["return_lse", "sinks"])
def test_compile_fullgraph_of_a_learned_bias_with_the_lse_or_sinks(option):
    """The engines' backward takes a learned bias's gradient with torch.autograd.grad, which dynamo does not trace."""
    q, k, v = inputs(grad=True)
    t5 = qkv.RelativePositionBias(H, 8, 20)
    kw = {"return_lse": True} if option == "return_lse" else {"sinks": torch.linspace(-1, 1, H)}

    def f(q, k, v):
        result = qkv.attention(q, k, v, bias=t5, **kw)
        return result[0] if isinstance(result, tuple) else result

    params = [q, k, v, *t5.parameters()]
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), params)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), params), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_of_a_mask_program_the_additive_score_and_selected_weights():
    q, k, v = inputs()
    score = qkv.scores.Additive(D, D, 5)
    program = qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 0)
    calls_ = {
        "mask_mod": lambda q, k, v: qkv.attention(q, k, v, mask=program),
        "additive": lambda q, k, v: qkv.attention(q, k, v, score=score, causal=True),
        "weights_for": lambda q, k, v: qkv.attention(q, k, v, return_weights=True, weights_for={"heads": [1]})[1],
    }
    for name, f in calls_.items():
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
        torch.testing.assert_close(got, f(q, k, v), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("positional", ["alibi", "relative", "rotary"])
def test_meta_forward_of_a_language_model_with_padding(positional):
    """Shape inference of a whole model: no check or mask reads a value."""
    lm = qkv.models.CausalLM(qkv.models.LMConfig(vocab=50, positional=positional)).to("meta")
    ids, lengths = torch.zeros(2, 7, dtype=torch.long, device="meta"), torch.tensor([7, 3], device="meta")
    assert lm(ids, lengths=lengths).shape == (2, 7, 50)


def test_a_version_is_none_where_a_tensor_keeps_none():
    x = torch.zeros(3)
    before = _trace.version(x)
    x.add_(1)
    assert _trace.version(x) == before + 1
    with torch.inference_mode():
        assert _trace.version(torch.zeros(3)) is None


def test_a_mask_program_reading_an_inference_tensor_has_no_fingerprint():
    from qkv.masks.reads import fingerprint

    ids = torch.tensor([0, 0, 1])
    assert fingerprint(lambda b, h, q, kv: ids[q] == ids[kv]) is not None
    with torch.inference_mode():
        frozen = torch.tensor([0, 0, 1])
    assert fingerprint(lambda b, h, q, kv: frozen[q] == frozen[kv]) is None  # its in-place changes cannot be seen
