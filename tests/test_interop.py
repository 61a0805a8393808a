"""Tests of ``qkv.interop`` / ``MultiHeadAttention.from_torch`` against ``torch.nn.MultiheadAttention``.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``dim`` model
size; PyTorch's bool masks are True = blocked, qkv's True = may attend.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qkv

B, I, J, DIM, HEADS = 2, 5, 7, 12, 3


def _pair(*, kdim=None, vdim=None, bias=True, batch_first=True):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(DIM, HEADS, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).double()
    if bias:  # PyTorch zero-initialises the biases; make them count
        with torch.no_grad():
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    return theirs, qkv.MultiHeadAttention.from_torch(theirs)


def _inputs(kdim=DIM, vdim=DIM, self_attention=False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, I, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    if self_attention:
        return x, x, x
    key = torch.randn(B, J, kdim, generator=gen, dtype=torch.float64, requires_grad=True)
    value = torch.randn(B, J, vdim, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, key, value


def _their_grads(theirs):
    """Gradients of PyTorch's weights, under qkv's names."""
    if theirs._qkv_same_embed_dim:
        wq, wk, wv = theirs.in_proj_weight.grad.chunk(3)
    else:
        wq, wk, wv = theirs.q_proj_weight.grad, theirs.k_proj_weight.grad, theirs.v_proj_weight.grad
    grads = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "out_proj.weight": theirs.out_proj.weight.grad}
    if theirs.in_proj_bias is not None:
        bq, bk, bv = theirs.in_proj_bias.grad.chunk(3)
        grads.update({"q_proj.bias": bq, "k_proj.bias": bk, "v_proj.bias": bv, "out_proj.bias": theirs.out_proj.bias.grad})
    return grads


def _compare(theirs, ours, inputs, *, torch_kwargs, qkv_kwargs, batch_first=True):
    """Outputs, head-averaged weights and all gradients of the two modules on the same inputs."""
    their_inputs = inputs if batch_first else tuple(x.transpose(0, 1) for x in inputs)
    y_t, w_t = theirs(*their_inputs, need_weights=True, average_attn_weights=True, **torch_kwargs)
    if not batch_first:
        y_t = y_t.transpose(0, 1)
    y_q, w_q = ours(*inputs, return_weights=True, **qkv_kwargs)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q.mean(1), w_t)
    torch.testing.assert_close(ours(*inputs, **qkv_kwargs), y_t)  # without weights a fused backend may run
    dy = torch.randn(y_q.shape, generator=torch.Generator().manual_seed(2), dtype=y_q.dtype)
    leaves = tuple({id(x): x for x in inputs}.values())  # self-attention passes one tensor three times
    g_t = torch.autograd.grad(y_t, leaves, dy, retain_graph=True)
    g_q = torch.autograd.grad(y_q, leaves, dy, retain_graph=True)
    for a, b in zip(g_q, g_t, strict=True):
        torch.testing.assert_close(a, b)
    (y_t * dy).sum().backward()
    (y_q * dy).sum().backward()
    their_grads = _their_grads(theirs)
    assert set(their_grads) == {name for name, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, their_grads[name], msg=name)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", ["packed", "separate"])
def test_cross_attention_matches(layout, bias):
    kdim, vdim = (DIM, DIM) if layout == "packed" else (8, 10)  # kdim/vdim != dim forces separate weights
    theirs, ours = _pair(kdim=kdim, vdim=vdim, bias=bias)
    assert theirs._qkv_same_embed_dim == (layout == "packed")
    _compare(theirs, ours, _inputs(kdim, vdim), torch_kwargs={}, qkv_kwargs={})


def test_masks_translate_to_the_opposite_convention():
    theirs, ours = _pair()
    gen = torch.Generator().manual_seed(3)
    blocked = torch.rand(I, J, generator=gen) > 0.7
    blocked[:, 0] = False  # every query keeps a key (PyTorch gives NaN otherwise)
    padding = torch.tensor([[False] * J, [False] * 4 + [True] * 3])  # True = padding key
    _compare(
        theirs, ours, _inputs(),
        torch_kwargs=dict(attn_mask=blocked, key_padding_mask=padding),
        qkv_kwargs=dict(mask=~blocked & ~padding[:, None, None, :]),
    )  # fmt: skip


def test_causal_self_attention_matches():
    theirs, ours = _pair()
    future = torch.ones(I, I, dtype=torch.bool).triu(1)  # True = blocked
    _compare(theirs, ours, _inputs(self_attention=True), torch_kwargs=dict(attn_mask=future, is_causal=True),
             qkv_kwargs=dict(causal=True))  # fmt: skip


def test_fully_padded_query_is_nan_in_pytorch_and_zero_in_qkv():
    theirs, ours = _pair()
    x, key, value = (t.detach() for t in _inputs())
    blocked = torch.zeros(I, J, dtype=torch.bool)
    blocked[2] = True  # query 2 may see no key
    y_t, _ = theirs(x, key, value, attn_mask=blocked)
    y_q, w_q = ours(x, key, value, mask=~blocked, return_weights=True)
    assert bool(y_t[:, 2].isnan().all())  # the documented difference
    assert torch.equal(w_q[:, :, 2], torch.zeros(B, HEADS, J))
    # qkv's row is the output projection of a zero context: just the output bias.
    torch.testing.assert_close(y_q[:, 2], ours.out_proj.bias.expand(B, DIM))
    torch.testing.assert_close(y_q[:, [0, 1, 3, 4]], y_t[:, [0, 1, 3, 4]])
    # PyTorch's need_weights=False call gives the output bias there too
    torch.testing.assert_close(theirs(x, key, value, attn_mask=blocked, need_weights=False)[0], y_q)


def test_top_left_is_causal_with_fewer_queries_is_a_mask_here():
    """PyTorch's is_causal is top-left, qkv's causal=True bottom-right: with i != j, PyTorch's is mask=~attn_mask."""
    theirs, ours = _pair()
    x, key, value = (t.detach() for t in _inputs())
    future = torch.ones(I, J, dtype=torch.bool).triu(1)
    y_t, _ = theirs(x, key, value, attn_mask=future, is_causal=True)
    torch.testing.assert_close(ours(x, key, value, mask=~future), y_t)
    assert not torch.allclose(ours(x, key, value, causal=True), y_t)


@pytest.mark.parametrize("name, hint", [("attn_mask", "~attn_mask"), ("key_padding_mask", "~key_padding_mask"),
                                        ("need_weights", "return_weights="), ("average_attn_weights", "mean"),
                                        ("is_causal", "causal=")])  # fmt: skip
def test_the_modules_answer_pytorchs_keywords_with_qkvs(name, hint):
    _, ours = _pair()
    x = _inputs(self_attention=True)[0].detach()
    with pytest.raises(TypeError, match=f"MultiHeadAttention: {name}= is nn.MultiheadAttention's keyword; .*{hint}"):
        ours(x, **{name: None})
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ours(x, colour=1)
    with pytest.raises(TypeError, match=r"a float mask .* qkv.attention\(q, k, v, bias=...\)"):
        ours(x, mask=torch.zeros(I, I, dtype=torch.float64))


def test_sequence_first_module_keeps_its_layout():
    """A batch_first=False module (PyTorch's default) becomes a qkv module taking (i, b, dim), not a batch-first one."""
    theirs, ours = _pair(batch_first=False)
    assert not ours.batch_first and "batch_first=False" in repr(ours)
    x = torch.randn(I, B, DIM, dtype=torch.float64, requires_grad=True)  # (i, b, dim)
    y_t, w_t = theirs(x, x, x, need_weights=True, average_attn_weights=True)
    y_q, w_q = ours(x, return_weights=True)
    assert y_q.shape == (I, B, DIM)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q.mean(1), w_t)  # weights stay (b, h, i, j)
    dy = torch.randn(y_t.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(y_q, x, dy)[0], torch.autograd.grad(y_t, x, dy)[0])
    kv = torch.randn(J, B, DIM, dtype=torch.float64)  # cross-attention, keys longer than queries
    torch.testing.assert_close(ours(x, kv, kv), theirs(x, kv, kv, need_weights=False)[0])
    with pytest.raises(ValueError, match=r"query: expected shape \(length, b, \d+\) \(batch_first=False\)"):
        ours(x[0, 0])  # 1-d: neither batched nor unbatched


def test_conversion_keeps_sizes_mode_and_dropout():
    theirs = nn.MultiheadAttention(DIM, HEADS, dropout=0.25, kdim=8, vdim=10, batch_first=True)
    theirs.eval()
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    assert not ours.training and ours.attention.dropout == 0.25
    assert (ours.heads, ours.dim_head, ours.k_proj.in_features, ours.v_proj.in_features) == (HEADS, 4, 8, 10)
    assert ours.q_proj.weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("module", "error", "message"),
    [
        (nn.Linear(3, 3), TypeError, r"module: expected torch.nn.MultiheadAttention, got Linear"),
        (nn.MultiheadAttention(DIM, HEADS, add_bias_kv=True), ValueError, r"module: add_bias_kv and add_zero_attn"),
        (nn.MultiheadAttention(DIM, HEADS, add_zero_attn=True), ValueError, r"module: add_bias_kv and add_zero_attn"),
    ],
)
def test_from_torch_errors(module, error, message):
    with pytest.raises(error, match=message):
        qkv.MultiHeadAttention.from_torch(module)


@st.composite
def mha_calls(draw):
    """Random ``nn.MultiheadAttention`` calls: sizes, self or cross attention, bias, layout, and masks of every form."""
    heads = draw(st.integers(1, 3))
    dim = heads * draw(st.integers(1, 4))
    cross = draw(st.booleans())
    kdim, vdim = (draw(st.integers(1, 6)), draw(st.integers(1, 6))) if cross and draw(st.booleans()) else (None, None)
    b, i = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    j = draw(st.integers(1, 6)) if cross else i
    attn = draw(st.sampled_from([None, "bool 2d", "bool 3d", "float 2d", "float 3d", "causal"]))
    if attn == "causal" and cross:
        attn = None
    return dict(heads=heads, dim=dim, cross=cross, kdim=kdim, vdim=vdim, b=b, i=i, j=j, attn=attn,
                padding=draw(st.booleans()), bias=draw(st.booleans()), batch_first=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))  # fmt: skip


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=mha_calls())
def test_random_modules_and_masks_equal_pytorchs(c):
    """Outputs, head-averaged weights and the inputs' gradients, with PyTorch's masks turned into qkv's convention
    (True = may attend; a float mask is a bias); every query keeps a key (PyTorch gives NaN rows otherwise)."""
    gen = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])
    theirs = nn.MultiheadAttention(c["dim"], c["heads"], bias=c["bias"], kdim=c["kdim"], vdim=c["vdim"],
                                   batch_first=c["batch_first"]).double()  # fmt: skip
    if c["bias"]:
        with torch.no_grad():
            theirs.in_proj_bias.normal_(generator=gen)
            theirs.out_proj.bias.normal_(generator=gen)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    b, i, j, dim = c["b"], c["i"], c["j"], c["dim"]
    x = torch.randn(b, i, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    if c["cross"]:
        key = torch.randn(b, j, c["kdim"] or dim, generator=gen, dtype=torch.float64, requires_grad=True)
        value = torch.randn(b, j, c["vdim"] or dim, generator=gen, dtype=torch.float64, requires_grad=True)
    else:
        key = value = x
    blocked = torch.rand(b, c["heads"], i, j, generator=gen) < 0.4  # PyTorch's convention: True = blocked
    blocked[..., 0] = False  # every query keeps key 0
    torch_kw, qkv_kw = {}, {}
    keep = torch.ones(b, 1, i, j, dtype=torch.bool)
    if c["attn"] in ("bool 2d", "bool 3d"):
        torch_kw["attn_mask"] = blocked[0, 0] if c["attn"] == "bool 2d" else blocked.flatten(0, 1)
        keep = keep & ~(blocked[:1, :1] if c["attn"] == "bool 2d" else blocked)
    elif c["attn"] in ("float 2d", "float 3d"):
        bias = torch.randn(b, c["heads"], i, j, generator=gen, dtype=torch.float64)
        torch_kw["attn_mask"] = bias[0, 0] if c["attn"] == "float 2d" else bias.flatten(0, 1)
        qkv_kw["mask"] = None
        qkv_bias = bias[:1, :1] if c["attn"] == "float 2d" else bias
    elif c["attn"] == "causal":
        torch_kw.update(attn_mask=torch.ones(i, i, dtype=torch.bool).triu(1), is_causal=True)
        qkv_kw["causal"] = True
    if c["padding"]:
        pad = torch.rand(b, j, generator=gen) < 0.4
        pad[:, 0] = False
        torch_kw["key_padding_mask"] = pad
        keep = keep & ~pad[:, None, None, :]
    if c["attn"] in ("bool 2d", "bool 3d") or c["padding"]:
        qkv_kw["mask"] = keep
    if c["attn"] in ("float 2d", "float 3d"):  # qkv's module takes no bias: compare through a mechanism that adds it
        ours.attention = qkv.Attention("scaled_dot")
        ours.attention.forward = _with_bias(ours.attention.forward, qkv_bias)
    inputs = (x, key, value)
    their_inputs = inputs if c["batch_first"] else tuple(t.transpose(0, 1) for t in inputs)
    y_t, w_t = theirs(*their_inputs, need_weights=True, average_attn_weights=True, **torch_kw)
    y_q, w_q = ours(*their_inputs, return_weights=True, **qkv_kw)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q.mean(1), w_t)
    cot = torch.randn(y_t.shape, generator=gen, dtype=torch.float64)
    leaves = tuple({id(t): t for t in inputs}.values())  # self-attention passes one tensor three times
    for a, w in zip(torch.autograd.grad(ours(*their_inputs, **qkv_kw), leaves, cot), torch.autograd.grad(y_t, leaves, cot)):
        torch.testing.assert_close(a, w)


def _with_bias(forward, bias):
    def call(q, k, v, **kwargs):
        return forward(q, k, v, **{**kwargs, "bias": bias})

    return call



@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_inputs_as_pytorch_takes_them(batch_first):
    theirs, ours = _pair(batch_first=batch_first)
    x, key, value = (t.detach()[0] for t in _inputs())  # (i, dim), (j, dim)
    y_t, w_t = theirs(x, key, value, average_attn_weights=False)
    y_q, w_q = ours(x, key, value, return_weights=True)
    assert y_q.shape == y_t.shape == (I, DIM) and w_q.shape == w_t.shape == (HEADS, I, J)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q, w_t)
    torch.testing.assert_close(ours(x), theirs(x, x, x)[0])  # self-attention


def test_a_frozen_module_gives_a_frozen_copy_parameter_by_parameter():
    theirs = nn.MultiheadAttention(DIM, 3, kdim=8, vdim=5, batch_first=True)
    theirs.in_proj_bias.requires_grad_(False)
    theirs.q_proj_weight.requires_grad_(False)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    learned = {name for name, p in ours.named_parameters() if p.requires_grad}
    assert learned == {"k_proj.weight", "v_proj.weight", "out_proj.weight", "out_proj.bias"}
    theirs = nn.MultiheadAttention(DIM, 3).requires_grad_(False)
    assert not any(p.requires_grad for p in qkv.MultiHeadAttention.from_torch(theirs).parameters())


def test_a_subclass_with_its_own_forward_and_a_dropout_of_one_are_refused_by_name():
    """``torch.ao.nn.quantizable.MultiheadAttention`` is an ``nn.MultiheadAttention`` whose forward reads
    ``linear_Q/K/V``: the copy of ``in_proj_weight`` silently gave other outputs (0.57 apart)."""
    quantizable = pytest.importorskip("torch.ao.nn.quantizable")
    with pytest.raises(TypeError, match=r"module: .*MultiheadAttention computes its own forward"):
        qkv.MultiHeadAttention.from_torch(quantizable.MultiheadAttention(DIM, 3))
    with pytest.raises(ValueError, match=r"module: dropout=1.0 drops every weight"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(DIM, 3, dropout=1.0))


def test_a_sequence_first_module_names_shapes_as_they_were_given():
    """The checks ran after the inputs were transposed: ``(5, 2, 13)`` was reported as ``(2, 5, 13)`` "batch first"."""
    ours = qkv.MultiHeadAttention(DIM, 3, batch_first=False)
    with pytest.raises(ValueError, match=rf"query: expected shape \(length, b, {DIM}\) \(batch_first=False\), got \(5, 2, 13\)"):
        ours(torch.randn(5, 2, 13))
    with pytest.raises(ValueError, match=r"key: expected batch 2 like query, got 3 \(key \(7, 3, 12\)\)"):
        ours(torch.randn(5, 2, DIM), torch.randn(7, 3, DIM))
    with pytest.raises(ValueError, match=r"value: .* \(j, b = \(7, 2\)\), got query \(5, 2, 12\), key \(7, 2, 12\), value \(6, 2, 12\)"):
        ours(torch.randn(5, 2, DIM), torch.randn(7, 2, DIM), torch.randn(6, 2, DIM))


@pytest.mark.parametrize("kv_heads, kdim, vdim, bias, batch_first", [
    (8, None, None, True, True), (2, None, None, True, True), (1, 48, 40, False, False), (4, None, 24, True, False),
])  # fmt: skip
def test_to_torch_gives_pytorchs_module_with_the_same_outputs_and_gradients(kv_heads, kdim, vdim, bias, batch_first):
    """Grouped K/V heads become PyTorch's heads with each K/V head's weights repeated: the same function."""
    torch.manual_seed(0)
    ours = qkv.MultiHeadAttention(64, 8, kv_heads=kv_heads, kdim=kdim, vdim=vdim, bias=bias, batch_first=batch_first)
    ours = ours.double()
    theirs = ours.to_torch()
    assert isinstance(theirs, nn.MultiheadAttention) and theirs.batch_first == batch_first
    assert theirs.in_proj_weight is None if (kdim or vdim) else theirs.in_proj_weight.dtype == torch.float64
    b, i, j = 3, 5, 7
    x = torch.randn(b, i, 64, dtype=torch.float64)
    mem_k, mem_v = torch.randn(b, j, kdim or 64, dtype=torch.float64), torch.randn(b, j, vdim or 64, dtype=torch.float64)
    if not batch_first:
        x, mem_k, mem_v = (t.transpose(0, 1) for t in (x, mem_k, mem_v))
    causal = torch.ones(i, j, dtype=torch.bool).tril(j - i)
    want = ours(x, mem_k, mem_v, mask=causal)
    got, _ = theirs(x, mem_k, mem_v, attn_mask=~causal, need_weights=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    cot = torch.randn_like(want)
    want.backward(cot)
    got, _ = theirs(x, mem_k, mem_v, attn_mask=~causal, need_weights=False)
    got.backward(cot)
    torch.testing.assert_close(theirs.out_proj.weight.grad, ours.out_proj.weight.grad, rtol=0, atol=1e-11)
    back = qkv.MultiHeadAttention.from_torch(theirs)  # and back: PyTorch's heads, the same function
    torch.testing.assert_close(back(x, mem_k, mem_v, mask=causal), want, rtol=0, atol=1e-12)


def test_to_torch_keeps_mode_dropout_and_frozen_parameters():
    ours = qkv.MultiHeadAttention(32, 4, dropout=0.25).eval()
    ours.k_proj.weight.requires_grad_(False)
    ours.out_proj.bias.requires_grad_(False)
    theirs = ours.to_torch()
    assert not theirs.training and theirs.dropout == 0.25
    assert theirs.in_proj_weight.requires_grad  # (q and v still learn: the packed tensor learns)
    assert not theirs.out_proj.bias.requires_grad and theirs.out_proj.weight.requires_grad


@pytest.mark.parametrize("make, match", [
    (lambda: qkv.MultiHeadAttention(64, 8, positional=qkv.Rotary(8)), "this module has positional"),
    (lambda: qkv.MultiHeadAttention(64, 8, score_mod=qkv.SoftCap(30.0)), "this module has score_mod"),
    (lambda: qkv.MultiHeadAttention(64, 8, qk_norm=qkv.QKNorm(8)), "this module has qk_norm"),
    (lambda: qkv.MultiHeadAttention(64, 8, score="dot"), "score=Dot"),
    (lambda: qkv.MultiHeadAttention(64, 8, attention=qkv.approx.Performer(8, seed=0)), "attention=Performer"),
    (lambda: qkv.MultiHeadAttention(64, 8, dim_head=16), r"dim / heads = 8 wide"),
    (lambda: qkv.MultiHeadAttention(64, 8, dim_value_head=4), r"dim / heads = 8 wide"),
])  # fmt: skip
def test_to_torch_refuses_what_pytorchs_module_cannot_hold_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make().to_torch()


def test_to_torch_refuses_a_subclass_with_its_own_forward_and_wrapped_projections():
    class Halved(qkv.MultiHeadAttention):
        def forward(self, *args, **kwargs):
            return 0.5 * super().forward(*args, **kwargs)

    with pytest.raises(ValueError, match="Halved computes its own forward"):
        Halved(32, 4).to_torch()

    class Wrapped(nn.Linear):  # a LoRA-style projection: its own forward over a weight it exposes
        def forward(self, x):
            return super().forward(x) + 1.0

    mha = qkv.MultiHeadAttention(32, 4)
    mha.q_proj = Wrapped(32, 32)
    with pytest.raises(ValueError, match="q_proj is a Wrapped that computes its own projection"):
        mha.to_torch()
    mha = qkv.MultiHeadAttention(32, 4)
    torch.nn.utils.parametrizations.weight_norm(mha.k_proj)
    with pytest.raises(ValueError, match="k_proj is a"):
        mha.to_torch()
