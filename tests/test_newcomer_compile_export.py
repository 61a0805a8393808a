"""A deployer's modes over qkv's public building blocks, each against the eager call.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=4, g=2, i=5, j=7, d=8, e=6. Modules
are ``(b, length, dim)`` with dim=16 and 4 heads.

The modes: ``torch.compile(fullgraph=True)``, ``torch.export`` (the exported program run on
other inputs), ``torch.jit.trace`` (the trace run on other inputs), ``torch.inference_mode``,
``torch.autocast("cpu", torch.bfloat16)``, ``meta`` tensors and ``torch.func`` (``vmap`` over
the batch, ``grad``, per-sample gradients). What other files check is not repeated here:
``tests/test_trace.py`` (each mask and bias compiled, exported and on meta; ``jit.trace`` of
biased and padded modules), ``tests/test_score_mods_trace.py`` (score_mods) and
``tests/test_sdpa_dialect_audit.py`` (the SDPA drop-in compiled).

Compiled calls go to a backend that counts dynamo's graphs and then runs AOT autograd's
tracing (``aot_eager``): a full graph is one graph, and the count shows the compiled code
ran. Inductor itself is exercised in ``tests/test_trace.py``.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.nn.attention.flex_attention import create_block_mask

import qkv

B, H, G, I, J, D, E = 2, 4, 2, 5, 7, 8, 6
DIM = 16
SINKS = torch.linspace(-1.0, 1.0, H)
SLOPE = torch.linspace(0.0, 1.0, H)
CU_Q, CU_K = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
IDS_Q, IDS_K = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 0, 0, 1, 1, 1, 1])  # documents of queries, keys


def inputs(seed=0, grad=False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, I, D), (B, G, J, D), (B, G, J, E))
    return [torch.randn(s, generator=gen).to(device).requires_grad_(grad) for s in shapes]


def packed(q, k, v):
    """Batch row 0 as flash-attn's packed tokens: ``(i, h, d)``, ``(j, g, d)``, ``(j, g, e)`` (two sequences)."""
    return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)


def counting(backend="aot_eager"):
    """A dynamo backend that records each graph it is given, then compiles it with ``backend``."""
    graphs = []
    compile_with = torch._dynamo.lookup_backend(backend)

    def count(gm, example_inputs):
        graphs.append(gm)
        return compile_with(gm, example_inputs)

    return count, graphs


def quiet_jit_trace(fn, example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks become constants of the trace
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated, and still used
        return torch.jit.trace(fn, example, check_trace=False)


def softcap_slope(score, b, h, q_idx, kv_idx):
    """A user's score_mod: ALiBi-like slopes read by head, then a cap."""
    return torch.tanh((score - SLOPE[h] * (q_idx - kv_idx)) / 5.0) * 5.0


#: qkv.attention's options and the SDPA and flex drop-ins, each a function of (q, k, v): one call on each path.
ATTENTION = {
    "none": lambda q, k, v: qkv.attention(q, k, v),
    "causal": lambda q, k, v: qkv.attention(q, k, v, causal=True),
    "bool": lambda q, k, v: qkv.attention(q, k, v, mask=torch.ones(I, J, dtype=torch.bool).tril(2)),
    "window": lambda q, k, v: qkv.attention(q, k, v, mask=qkv.masks.window(2, 1)),
    "documents": lambda q, k, v: qkv.attention(q, k, v, mask=qkv.masks.documents(IDS_Q, IDS_K)),
    "alibi": lambda q, k, v: qkv.attention(q, k, v, bias=qkv.ALiBi(H), causal=True),
    "softcap": lambda q, k, v: qkv.attention(q, k, v, score_mod=qkv.SoftCap(5.0), causal=True),
    "lambda": lambda q, k, v: qkv.attention(q, k, v, score_mod=softcap_slope),
    "sinks": lambda q, k, v: qkv.attention(q, k, v, sinks=SINKS, causal=True),
    "lse": lambda q, k, v: qkv.attention(q, k, v, return_lse=True),
    "sdpa drop-in": lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    "flex drop-in": lambda q, k, v: qkv.flex_attention(q, k, v, score_mod=qkv.SoftCap(3.0), return_lse=True,
                                                       enable_gqa=True),  # fmt: skip
}


def assert_same(got, want, **tol):
    got, want = (x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **(tol or dict(rtol=1e-5, atol=1e-5)))


# --------------------------------------------------------------------------- torch.jit.trace


#: Calls a trace must read afresh. Those on the chunked engines (sinks, the log-sum-exp) handed their autograd
#: function the call's request, a constant of the trace: the trace answered the example's inputs at every call.
JIT_CALLS = {
    "sinks": ATTENTION["sinks"],
    "lse": ATTENTION["lse"],
    "flex lse": lambda q, k, v: qkv.flex_attention(q, k, v, return_lse=True, enable_gqa=True),
    "varlen lse": lambda q, k, v: qkv.varlen_attention(*packed(q, k, v), CU_Q, CU_K, causal=True, return_lse=True),
    "sdpa bool mask": lambda q, k, v: qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(I, J, dtype=torch.bool).tril(2), enable_gqa=True
    ),
}


@pytest.mark.parametrize("name", list(JIT_CALLS))
def test_jit_trace_of_a_call_reads_each_calls_inputs(name):
    fn = JIT_CALLS[name]
    traced = quiet_jit_trace(fn, tuple(inputs(0)))
    other = inputs(1)
    with torch.no_grad():
        assert_same(traced(*other), fn(*other))


def test_jit_trace_of_a_module_with_learned_sinks_follows_its_parameters():
    """What a GPT-OSS-like layer holds: sinks as a parameter (a tensor input of the trace, not a constant)."""

    class Sinks(nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = nn.Parameter(torch.zeros(H))

        def forward(self, q, k, v):
            return qkv.attention(q, k, v, sinks=self.sinks, causal=True)

    module = Sinks()
    traced = quiet_jit_trace(module, tuple(inputs(0)))
    with torch.no_grad():
        module.sinks.copy_(SINKS)  # the trace shares the parameter
        other = inputs(1)
        assert_same(traced(*other), module(*other))


def test_jit_trace_of_a_score_mod_runs_declared_elementwise_and_names_the_rest():
    """README: jit.trace takes a score_mod declared elementwise (qkv.SoftCap, ``fn.broadcasts = True``); another
    raises naming score_mod and the declaration (jit cannot trace flex's torch.vmap evaluation)."""
    module = qkv.MultiHeadAttention(DIM, 4, score_mod=qkv.SoftCap(2.0)).eval()
    traced = quiet_jit_trace(module, (torch.randn(2, 6, DIM),))
    x = torch.randn(2, 6, DIM)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), module(x), rtol=1e-5, atol=1e-6)

    def undeclared(q, k, v):
        return qkv.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + (q_idx - kv_idx))

    with pytest.raises(RuntimeError, match=r"score_mod: could not be traced under torch.vmap.*fn.broadcasts = True"):
        quiet_jit_trace(undeclared, tuple(inputs(0)))

    def declared_mod(s, b, h, q_idx, kv_idx):
        return s - SLOPE[h] * (q_idx - kv_idx)

    declared_mod.broadcasts = True

    def declared(q, k, v):
        return qkv.attention(q, k, v, score_mod=declared_mod, causal=True)

    traced = quiet_jit_trace(declared, tuple(inputs(0)))
    with torch.no_grad():
        assert_same(traced(*inputs(1)), declared(*inputs(1)))


def test_jit_trace_of_flex_attention_with_a_block_mask():
    """A traced size is a 0-d tensor: it reached ``from_mask_mod(B=...)`` as one ("B: expected a positive int")."""
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, I, I, device="cpu")

    def fn(q, k, v):
        return qkv.flex_attention(q, k[:, :, :I], v[:, :, :I], block_mask=block_mask, enable_gqa=True)

    traced = quiet_jit_trace(fn, tuple(inputs(0)))
    with torch.no_grad():
        assert_same(traced(*inputs(1)), fn(*inputs(1)))


# --------------------------------------------------------------------------- torch.func


@pytest.mark.parametrize("name", list(ATTENTION))
def test_vmap_over_the_batch_equals_the_batched_call(name):
    """vmap hides the batch: values cannot be read (``.item()``), and the engines' autograd function has no
    ``setup_context``; the call takes public ops there, as under tracing."""
    fn = ATTENTION[name]
    q, k, v = inputs()
    got = torch.func.vmap(lambda q, k, v: _first(fn(q[None], k[None], v[None])))(q, k, v)
    assert_same(got, fn(q, k, v))


def _first(result):
    return tuple(x[0] for x in result) if isinstance(result, tuple) else result[0]


#: torch.func.grad's calls: on SDPA (causal, documents), on the engines (the rest before: "must override the
#: setup_context staticmethod"), and flash-attn's dialect.
GRAD_CALLS = {
    **{name: ATTENTION[name] for name in ("causal", "documents", "alibi", "lambda", "sinks", "lse", "flex drop-in")},
    "varlen": lambda q, k, v: qkv.varlen_attention(*packed(q, k, v), CU_Q, CU_K, causal=True, softcap=3.0),
}


@pytest.mark.parametrize("name", list(GRAD_CALLS))
def test_func_grad_equals_autograd(name):
    fn = GRAD_CALLS[name]
    q, k, v = inputs()

    def loss(q, k, v):
        result = fn(q, k, v)
        return sum(x.square().sum() for x in (result if isinstance(result, tuple) else (result,)))

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    assert_same(got, want)


def test_per_sample_gradients_of_a_module_with_alibi():
    """``vmap(grad(...))`` over ``functional_call``: the per-sample gradients of torch.func's tutorial."""
    torch.manual_seed(0)
    module = qkv.MultiHeadAttention(DIM, 4, kv_heads=2, positional=qkv.ALiBi(4))
    params = {name: p.detach() for name, p in module.named_parameters()}
    x = torch.randn(3, 6, DIM)

    def loss(params, x):
        return torch.func.functional_call(module, params, (x[None],), {"causal": True}).square().mean()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for n in range(x.shape[0]):
        module.zero_grad()
        loss(dict(module.named_parameters()), x[n]).backward()
        for name, p in module.named_parameters():
            torch.testing.assert_close(got[name][n], p.grad, rtol=1e-5, atol=1e-6, msg=f"{name}, sample {n}")


# --------------------------------------------------------------------------- torch.autocast


#: The options whose calls ran on qkv's engines, not SDPA: float32 under autocast where SDPA's call gives bfloat16.
AUTOCAST = ["none", "window", "documents", "alibi", "softcap", "lambda", "sinks"]


@pytest.mark.parametrize("name", AUTOCAST)
def test_autocast_gives_every_call_sdpas_dtype(name):
    fn = ATTENTION[name]
    q, k, v = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(q, k, v)
        plain = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert got.dtype == plain.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fn(q, k, v), rtol=0, atol=3e-2)  # bfloat16's rounding


def test_autocast_of_the_drop_ins_answers_in_flexs_and_sdpas_dtype():
    """torch's flex_attention answers bfloat16 under CPU autocast, with or without a score_mod; qkv's did only without."""
    q, k, v = inputs()
    qp, kp, vp = packed(q, k, v)
    bias = torch.linspace(-2.0, 0.0, J)
    calls = {
        "flex": lambda: qkv.flex_attention(q, k, v, score_mod=qkv.SoftCap(3.0), enable_gqa=True),
        "varlen": lambda: qkv.varlen_attention(qp, kp, vp, CU_Q, CU_K, causal=True, softcap=3.0),
        "sdpa": lambda: qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
    }
    for name, call in calls.items():
        want = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2, msg=name)


def test_autocast_of_a_module_with_alibi_trains_float32_parameters():
    torch.manual_seed(0)
    layer = qkv.TransformerEncoderLayer(DIM, 4, positional=qkv.ALiBi(4), norm_first=True)
    x = torch.randn(2, 6, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, causal=True)
    y.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    torch.testing.assert_close(y.float(), layer(x, causal=True), rtol=0, atol=5e-2)


# --------------------------------------------------------------------------- torch.inference_mode


def test_inference_mode_equals_no_grad_for_every_call_and_module():
    q, k, v = inputs()
    qp, kp, vp = packed(q, k, v)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, I, I, device="cpu")
    calls = {name: (lambda fn=fn: fn(q, k, v)) for name, fn in ATTENTION.items()}
    calls["varlen"] = lambda: qkv.varlen_attention(qp, kp, vp, CU_Q, CU_K, causal=True, return_lse=True)
    calls["flex"] = lambda: qkv.flex_attention(q, k[:, :, :I], v[:, :, :I], block_mask=block_mask, enable_gqa=True)
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(DIM, 4, kv_heads=2, positional=qkv.Rotary(4)).eval()
    x = torch.randn(2, 8, DIM)
    for max_len in (None, 16):  # a growing cache and a preallocated one
        calls[f"decoding, max_len={max_len}"] = lambda max_len=max_len: _decode(mha, x, qkv.KVCache(max_len))
    calls["encoder"] = lambda: qkv.Encoder(2, DIM, 4, positional=qkv.ALiBi(4)).eval()(x, mask=qkv.masks.lengths(
        torch.tensor([8, 3])))  # fmt: skip
    for name, call in calls.items():
        torch.manual_seed(1)
        with torch.no_grad():
            want = call()
        torch.manual_seed(1)
        with torch.inference_mode():
            got = call()
        assert_same(got, want, rtol=1e-6, atol=1e-6)


def _decode(mha, x, cache, prefill=4):
    """A prefill of ``prefill`` tokens, then one token a step: ``(b, length, dim)``."""
    outs = [mha(x[:, :prefill], causal=True, cache=cache)]
    outs += [mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(outs, dim=1)


# --------------------------------------------------------------------------- meta tensors


def test_modules_built_on_meta_count_parameters_and_infer_shapes():
    """``with torch.device("meta")``: no memory, the same parameter count, every shape (a decoding step included)."""
    makers = {
        "rotary, grouped": lambda: qkv.MultiHeadAttention(64, 8, kv_heads=2, positional=qkv.Rotary(8)),
        "modern": lambda: qkv.MultiHeadAttention(64, 8, positional=qkv.Rotary(8), qk_norm=qkv.QKNorm(8),
                                                 gate=qkv.OutputGate(64, 8, 8), score_mod=qkv.SoftCap(30.0)),  # fmt: skip
        "t5": lambda: qkv.MultiHeadAttention(64, 8, positional=qkv.RelativePositionBias(8, 32, 128)),
        "encoder": lambda: qkv.Encoder(2, 64, 8, positional=qkv.ALiBi(8)),
        "decoder": lambda: qkv.Decoder(2, 64, 8, kv_heads=4),
    }
    x, memory = torch.empty(2, 9, 64, device="meta"), torch.empty(2, 5, 64, device="meta")
    for name, make in makers.items():
        with torch.device("meta"):
            module = make()
        assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in make().parameters()), name
        if name == "decoder":
            y = module(x, memory, mask=qkv.masks.lengths(torch.tensor([9, 4], device="meta")))
        elif name == "encoder":
            y = module(x, mask=qkv.masks.lengths(torch.tensor([9, 4], device="meta")), causal=True)
        else:
            cache = qkv.KVCache()
            module(x, causal=True, cache=cache)
            y = module(x[:, :1], causal=True, cache=cache)
            assert cache.length == 10 and cache.keys.device.type == "meta", name
        length = 9 if name in ("encoder", "decoder") else 1  # the stacks take the whole sequence, the rest a step
        assert y.device.type == "meta" and y.shape == (2, length, 64), name


def test_the_drop_ins_on_meta_tensors():
    q, k, v = inputs(device="meta")
    qp, kp, vp = packed(q, k, v)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, I, J, device="cpu")
    assert qkv.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).shape == (B, H, I, E)
    out, lse = qkv.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    assert out.device.type == lse.device.type == "meta" and out.shape == (B, H, I, E) and lse.shape == (B, H, I)
    # offsets on the host, tokens on meta: flash-attn's dialect sizes its calls from cu_seqlens
    out, lse = qkv.varlen_attention(qp, kp, vp, CU_Q, CU_K, causal=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == (I, H, E) and lse.shape == (H, I)


# --------------------------------------------------------------------------- torch.compile


class Blocks(nn.Module):
    """The README's modules in one forward: rotary grouped heads, ALiBi over padding, cross-attention, the layers."""

    def __init__(self):
        super().__init__()
        self.rope = qkv.MultiHeadAttention(DIM, 4, kv_heads=2, positional=qkv.Rotary(4))
        self.alibi = qkv.MultiHeadAttention(DIM, 4, positional=qkv.ALiBi(4))
        self.modern = qkv.MultiHeadAttention(DIM, 4, positional=qkv.Rotary(4), qk_norm=qkv.QKNorm(4),
                                             gate=qkv.OutputGate(DIM, 4, 4), score_mod=qkv.SoftCap(3.0))  # fmt: skip
        self.encoder = qkv.TransformerEncoderLayer(DIM, 4, kv_heads=2, norm_first=True)
        self.decoder = qkv.TransformerDecoderLayer(DIM, 4)

    def forward(self, x, memory, lengths):
        y = self.rope(x, causal=True) + self.alibi(x, mask=qkv.masks.lengths(lengths))
        y = y + self.modern(x, causal=True) + self.rope(x, memory)  # cross-attention: value = key = memory
        y = self.encoder(y, mask=qkv.masks.lengths(lengths), causal=True)
        return self.decoder(y, memory)


def test_compile_fullgraph_of_the_modules_is_one_graph_with_eager_gradients():
    torch.manual_seed(0)
    module = Blocks()
    x, memory, lengths = torch.randn(2, 6, DIM), torch.randn(2, 4, DIM), torch.tensor([6, 3])
    want = module(x, memory, lengths)
    want_grads = torch.autograd.grad(want.square().sum(), list(module.parameters()))
    torch._dynamo.reset()
    backend, graphs = counting()
    got = torch.compile(module, fullgraph=True, backend=backend)(x, memory, lengths)
    assert len(graphs) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), list(module.parameters())), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def calls_in_one(q, k, v):
    """qkv.attention's options and the drop-ins (not compiled in tests/test_trace.py), in one function."""
    outs = [ATTENTION[name](q, k, v) for name in ("none", "bool", "documents", "sinks")]
    outs += list(ATTENTION["lse"](q, k, v))
    outs.append(qkv.attention(q, k, v, mask=qkv.masks.documents(IDS_Q, IDS_K) & qkv.masks.causal()))
    outs.append(qkv.scaled_dot_product_attention(q, k, v, attn_mask=torch.linspace(-1.0, 0.0, J), enable_gqa=True))
    outs += list(qkv.flex_attention(q, k, v, return_lse=True, enable_gqa=True))
    return outs


def test_compile_fullgraph_of_the_functions_is_one_graph_with_eager_gradients():
    q, k, v = inputs(grad=True)
    want = calls_in_one(q, k, v)
    cot = [torch.randn_like(x) for x in want]
    want_grads = torch.autograd.grad(want, (q, k, v), cot)
    torch._dynamo.reset()
    backend, graphs = counting()
    got = torch.compile(calls_in_one, fullgraph=True, backend=backend)(q, k, v)
    assert len(graphs) == 1
    assert_same(got, want)
    assert_same(torch.autograd.grad(got, (q, k, v), cot), want_grads)


@pytest.fixture(scope="module")
def compiled_decoding():
    """A rotary, grouped MultiHeadAttention with a KV cache, its step compiled: ``(eager, compiled, graphs)``."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(DIM, 4, kv_heads=2, positional=qkv.Rotary(4)).eval()
    x = torch.randn(1, 10, DIM)
    torch._dynamo.reset()
    backend, graphs = counting("eager")
    step = torch.compile(mha, backend=backend)
    with torch.no_grad():
        want = _decode(mha, x, qkv.KVCache())
        got = _decode(step, x, qkv.KVCache())
    return want, got, graphs


def test_a_compiled_decoding_step_with_a_kv_cache_equals_eager(compiled_decoding):
    want, got, graphs = compiled_decoding
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert graphs  # the compiled step ran


def test_a_compiled_decoding_step_does_not_recompile_for_each_token(compiled_decoding):
    _, _, graphs = compiled_decoding
    assert len(graphs) <= 3, f"{len(graphs)} graphs for a prefill and 6 steps"


def test_compile_with_a_dynamic_sequence_length_of_the_plain_calls():
    """A deployer marks the length dynamic: one graph for every length. Calls off the plain lane (ALiBi) did it."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(DIM, 4).eval()
    calls = {
        "attention": lambda x: qkv.attention(*(x.unflatten(-1, (4, 4)).transpose(1, 2),) * 3, causal=True),
        "sdpa drop-in": lambda x: qkv.scaled_dot_product_attention(*(x.unflatten(-1, (4, 4)).transpose(1, 2),) * 3),
        "module": lambda x: mha(x, causal=True),
    }
    for name, call in calls.items():
        torch._dynamo.reset()
        x = torch.randn(2, 6, DIM)
        torch._dynamo.mark_dynamic(x, 1)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(call, backend="eager")(x), call(x), rtol=1e-5, atol=1e-6, msg=name)


def test_flex_attention_with_a_block_mask_compiles_with_one_break_not_fullgraph():
    """README and qkv.flex: a block_mask does not trace (its lists are read on the host); fullgraph says so (it named
    ``object()`` before), and without fullgraph the call breaks the graph there and gives eager's answer."""
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, I, J, device="cpu")
    q, k, v = inputs()

    def fn(q, k, v):
        return qkv.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent"):
        torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count >= 1
    torch._dynamo.reset()
    assert_same(torch.compile(fn, backend="eager")(q, k, v), fn(q, k, v))


# --------------------------------------------------------------------------- torch.export


class Layer(nn.Module):
    """An exported encoder layer over right-padded rows: rotary grouped heads, lengths an input."""

    def __init__(self):
        super().__init__()
        self.layer = qkv.TransformerEncoderLayer(DIM, 4, kv_heads=2, positional=qkv.Rotary(4), norm_first=True)

    def forward(self, x, lengths):
        return self.layer(x, mask=qkv.masks.lengths(lengths), causal=True)


def test_export_with_a_dynamic_length_runs_other_lengths_and_paddings():
    torch.manual_seed(0)
    module = Layer().eval()
    program = torch.export.export(module, (torch.randn(2, 8, DIM), torch.tensor([8, 5])),
                                  dynamic_shapes={"x": {1: Dim("length", min=2, max=64)}, "lengths": None})  # fmt: skip
    for length, lengths in ((13, [3, 13]), (4, [4, 4])):
        x = torch.randn(2, length, DIM)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x, torch.tensor(lengths)), module(x, torch.tensor(lengths)),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip


class Calls(nn.Module):
    """Masks as inputs (documents' ids, SDPA's bool mask) and the drop-ins, as an exported program takes them."""

    def __init__(self):
        super().__init__()
        self.decoder = qkv.TransformerDecoderLayer(DIM, 4, kv_heads=2)
        self.sinks = nn.Parameter(SINKS.clone())

    def forward(self, q, k, v, ids, keep, x, memory):
        a = qkv.attention(q, k, v, mask=qkv.masks.documents(ids[:I], ids) & qkv.masks.causal(), sinks=self.sinks)
        b = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        c, lse = qkv.flex_attention(q, k, v, score_mod=qkv.SoftCap(3.0), return_lse=True, enable_gqa=True)
        return a, b, c, lse, self.decoder(x, memory)


def test_export_of_masks_given_as_inputs_and_the_drop_ins_runs_on_other_inputs():
    torch.manual_seed(0)
    module = Calls().eval()

    def example(seed, ids):
        gen = torch.Generator().manual_seed(seed)
        keep = torch.rand(B, 1, I, J, generator=gen) > 0.4
        return (*inputs(seed), torch.tensor(ids), keep, torch.randn(2, 6, DIM, generator=gen),
                torch.randn(2, 3, DIM, generator=gen))  # fmt: skip

    program = torch.export.export(module, example(0, [0, 0, 1, 1, 1, 1, 1]))
    other = example(1, [0, 1, 1, 1, 2, 2, 2])  # other documents, another keep mask
    with torch.no_grad():
        assert_same(program.module()(*other), module(*other))


# --------------------------------------------------------------------------- documented limits


def test_varlen_reads_its_offsets_on_the_host_so_fullgraph_and_export_refuse_them():
    """README: varlen_attention sizes one call per sequence from cu_seqlens, read on the host (flash-attn's
    kernels take them on the device); for a traced packed batch, a documents mask (exported above) traces."""

    class Varlen(nn.Module):
        def forward(self, q, k, v, cu_q, cu_k):
            return qkv.varlen_attention(q, k, v, cu_q, cu_k, causal=True)

    example = (*packed(*inputs()), CU_Q, CU_K)
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(Varlen(), example)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent"):
        torch.compile(Varlen(), fullgraph=True, backend="eager")(*example)
