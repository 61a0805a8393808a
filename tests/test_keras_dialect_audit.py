"""An audit of ``qkv.interop_keras`` (``from_keras``) against Keras 3's attention layers (torch backend).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size, ``e`` per-head value size; b=2, h=6, g=3, i=5, j=7,
d=11, e=13, query size 10, key 9, value 8.

The oracle is the real Keras layer, called beside its qkv copy in every test, both in
float64 and equal to 1e-12. Keras' type promotion sends float64 ``matmul`` and
``dot_product_attention`` through float32 on its torch backend (``BIT64_TO_BIT32_DTYPE``,
JAX's default; its TensorFlow backend keeps float64); the ``float64`` fixture switches that
one entry off, so each layer runs its own code in float64, and
``test_keras_float64_layers_round_through_float32_by_default`` pins the default. Each
difference of ``qkv.interop_keras``'s docstring is pinned here by a test named after it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qkv
from qkv.scores import LearnedScaleDot, TanhSum

from keras_backend import KERAS_MASK_WARNING, keras, keras_dtypes

pytestmark = KERAS_MASK_WARNING

B, H, G, I, J, D, E, DIM, KDIM, VDIM = 2, 6, 3, 5, 7, 11, 13, 10, 9, 8
F64, TOL = torch.float64, {"rtol": 0.0, "atol": 1e-12}


@pytest.fixture
def float64(monkeypatch):
    monkeypatch.setitem(keras_dtypes.BIT64_TO_BIT32_DTYPE, "float64", "float64")


def randn(*shape, seed=1, grad=False):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_(grad)


def randomize(layer, seed=3):
    """Every Keras weight drawn afresh (biases start at zero, scales at one: make them count)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for variable in layer.weights:
            variable.value.copy_(0.4 * torch.randn(tuple(variable.shape), generator=gen, dtype=F64))
    return layer


def multi_head(kind, kdim=DIM, vdim=DIM, key=False, **kwargs):
    if kind == "mha":
        layer = keras.layers.MultiHeadAttention(H, D, value_dim=E, dtype="float64", **kwargs)
    else:
        layer = keras.layers.GroupQueryAttention(D, H, G, dtype="float64", **kwargs)
    layer.build((None, None, DIM), (None, None, vdim), (None, None, kdim) if key else None)
    return randomize(layer)


def inputs(case, grad=False):
    """``(q, k, v)`` in qkv's order: ``self`` (one tensor), ``cross`` (key = value) or ``key`` (three)."""
    q = randn(B, I, DIM, seed=1, grad=grad)
    if case == "self":
        return q, q, q
    v = randn(B, J, VDIM, seed=2, grad=grad)
    return q, (v if case == "cross" else randn(B, J, KDIM, seed=4, grad=grad)), v


def call_keras(layer, q, k, v, qpad=None, vpad=None, **kwargs):
    """``layer(query, value, key)``, padding given through Keras masking (``keras.layers.Masking``)."""
    masking = keras.layers.Masking(dtype="float64")
    qm = q if qpad is None else masking(q * qpad[..., None])
    vm = qm if v is q else (v if vpad is None else masking(v * vpad[..., None]))
    km = None if k is v else (k if vpad is None else masking(k * vpad[..., None]))
    return layer(qm, vm, km, **kwargs)


def pads(case):
    """Query and key padding ``(b, i)``, ``(b, j)``: batch row 1 sees no key (each side's answer is pinned)."""
    n = I if case == "self" else J
    vpad = torch.ones(B, n, dtype=torch.bool)
    vpad[0, -2:], vpad[1] = False, False
    qpad = vpad if case == "self" else torch.tensor([[True] * (I - 1) + [False], [True] * I])
    return qpad, vpad


def masks_for(case, masking):
    """Keras' call arguments and qkv's ``mask`` ``(b, 1, i, j)`` (None: no mask) for one masking."""
    i, j = I, (I if case == "self" else J)
    theirs, ours = {}, torch.ones(B, 1, i, j, dtype=torch.bool)
    if "causal" in masking:  # Keras' causal mask is top-left at any lengths: tril, not qkv's causal=True
        theirs["use_causal_mask"] = True
        ours = ours & torch.ones(i, j, dtype=torch.bool).tril()
    if "padding" in masking:
        qpad, vpad = pads(case)
        theirs.update(qpad=qpad, vpad=vpad)
        ours = ours & qpad[:, None, :, None] & vpad[:, None, None, :]
    if masking == "attention_mask":
        allowed = torch.rand(B, i, j, generator=torch.Generator().manual_seed(5)) < 0.6
        allowed[0, 1] = False  # a query that sees no key
        theirs["attention_mask"] = allowed
        ours = allowed[:, None]
    return theirs, (None if masking == "none" else ours)


def zeroed(x, pad):
    return x if pad is None else x * pad[..., None]


@pytest.mark.parametrize("masking", ["none", "causal", "padding", "attention_mask", "causal+padding"])
@pytest.mark.parametrize("case", ["self", "cross", "key"])
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_multi_head_matches(kind, case, masking, float64):
    """Outputs and weights of Keras' explicit path (``return_attention_scores``) everywhere; its fused path
    where a query sees a key (``test_query_that_sees_no_key_multi_head``)."""
    q, k, v = inputs(case)
    layer = multi_head(kind, k.shape[-1], v.shape[-1], key=case == "key")
    ours = qkv.MultiHeadAttention.from_keras(layer)
    theirs, mask = masks_for(case, masking)
    y_explicit, w_explicit = call_keras(layer, q, k, v, return_attention_scores=True, **theirs)
    y_fused = call_keras(layer, q, k, v, **theirs)
    qpad, vpad = theirs.get("qpad"), theirs.get("vpad")
    qz = zeroed(q, qpad)
    kz, vz = (qz, qz) if case == "self" else (zeroed(k, vpad), zeroed(v, vpad))
    y, w = ours(qz, kz, vz, mask=mask, return_weights=True)
    torch.testing.assert_close(y, y_explicit, **TOL)
    torch.testing.assert_close(w, w_explicit, **TOL)
    sees = torch.ones(B, I, dtype=torch.bool) if mask is None else mask.any(-1)[:, 0]
    torch.testing.assert_close(y[sees], y_fused[sees], **TOL)


def test_query_that_sees_no_key_multi_head(float64):
    """qkv: zero weights, so the output bias; Keras: that on its explicit path, the mean of the values
    projected on its fused path (masked logits filled with -2.4e38, then a plain softmax)."""
    q, k, v = inputs("key")
    layer = multi_head("mha", KDIM, VDIM, key=True)
    ours = qkv.MultiHeadAttention.from_keras(layer)
    allowed = torch.ones(B, I, J, dtype=torch.bool)
    allowed[0, 2] = False
    y = ours(q, k, v, mask=allowed[:, None])
    y_explicit, _ = layer(q, v, k, attention_mask=allowed, return_attention_scores=True)
    y_fused = layer(q, v, k, attention_mask=allowed)
    torch.testing.assert_close(y[0, 2], ours.out_proj.bias, **TOL)
    torch.testing.assert_close(y_explicit[0, 2], ours.out_proj.bias, **TOL)
    mean = ours.v_proj(v[0]).mean(0)  # (h·e,): the heads' values averaged over every key
    torch.testing.assert_close(y_fused[0, 2], ours.out_proj(mean), **TOL)
    assert (y_fused[0, 2] - y[0, 2]).abs().max() > 1e-3


OPTIONS = {"bias": {}, "no-bias": {"use_bias": False}, "gate": {"use_gate": True},
           "gate-no-bias": {"use_gate": True, "use_bias": False}}


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_multi_head_options_and_gradients(kind, options, float64):
    """``use_bias`` and ``use_gate``; gradients of the inputs and of every weight, on both Keras paths."""
    q, k, v = inputs("key", grad=True)
    layer = multi_head(kind, KDIM, VDIM, key=True, **options)
    ours = qkv.MultiHeadAttention.from_keras(layer)
    pairs = weight_pairs(layer, ours)
    assert len(pairs) == len(list(ours.parameters())) == len(layer.weights)
    allowed = torch.rand(B, I, J, generator=torch.Generator().manual_seed(6)) < 0.7
    allowed[1, 3] = False
    dy = randn(B, I, DIM, seed=7)
    # the explicit path with a mask and a query that sees nothing; the fused path without (its such rows differ)
    for keyword, mask in (({"return_attention_scores": True, "attention_mask": allowed}, allowed[:, None]), ({}, None)):
        y = layer(q, v, k, **keyword)
        y = y[0] if isinstance(y, tuple) else y
        theirs = torch.autograd.grad(y, (q, k, v, *(variable.value for variable, _, _ in pairs)), dy)
        mine = torch.autograd.grad(ours(q, k, v, mask=mask), (q, k, v, *(param for _, param, _ in pairs)), dy)
        for a, b in zip(mine[:3], theirs[:3]):
            torch.testing.assert_close(a, b, **TOL)
        for (_, _, layout), a, b in zip(pairs, mine[3:], theirs[3:]):
            torch.testing.assert_close(a, layout(b), **TOL)


def weight_pairs(layer, ours):
    """``(Keras variable, qkv parameter, Keras layout -> qkv layout)`` for every weight."""
    in_layout = lambda t: t.reshape(t.shape[0], -1).T  # noqa: E731 (dim, h, d) -> (h·d, dim)
    out_layout = lambda t: t.reshape(-1, t.shape[-1]).T  # noqa: E731 (h, e, dim) -> (dim, h·e)
    pairs = []
    for name, proj in (("query", ours.q_proj), ("key", ours.k_proj), ("value", ours.v_proj), ("output", ours.out_proj),
                       ("gate", ours.gate.proj if ours.gate is not None else None)):  # fmt: skip
        dense = getattr(layer, f"_{name}_dense", None)
        if proj is None or dense is None:
            continue
        pairs.append((dense._kernel, proj.weight, out_layout if name == "output" else in_layout))
        if dense.bias is not None:
            pairs.append((dense.bias, proj.bias, lambda t: t.reshape(-1)))
    return pairs


def test_dropout_what_compares(float64):
    """Different random streams (Keras' seed generator, qkv's torch generator): what compares is dropout
    off in inference, a rate of 0 in training, and the weights, which both return before dropout."""
    q, k, v = inputs("key")
    layer = multi_head("mha", KDIM, VDIM, key=True, dropout=0.5, seed=0)
    ours = qkv.MultiHeadAttention.from_keras(layer)
    assert not ours.training and ours.attention.dropout == 0.5
    torch.testing.assert_close(ours(q, k, v), layer(q, v, k), **TOL)  # inference: no dropout on either side
    y_theirs, w_theirs = layer(q, v, k, training=True, return_attention_scores=True)
    y, w = ours.train()(q, k, v, return_weights=True)
    torch.testing.assert_close(w, w_theirs, **TOL)
    assert (y - y_theirs).abs().max() > 1e-3  # each side dropped its own weights
    off = multi_head("gqa", KDIM, VDIM, key=True)
    torch.testing.assert_close(off(q, v, k, training=True), qkv.MultiHeadAttention.from_keras(off).train()(q, k, v),
                               **TOL)  # fmt: skip


LUONG = {
    "dot": ("Attention", {}),
    "dot-scale": ("Attention", {"use_scale": True}),
    "concat": ("Attention", {"score_mode": "concat"}),
    "concat-scale": ("Attention", {"score_mode": "concat", "use_scale": True}),
    "additive": ("AdditiveAttention", {}),
    "additive-unscaled": ("AdditiveAttention", {"use_scale": False}),
}


def luong(name, three=True, **kwargs):
    kind, options = LUONG[name]
    layer = getattr(keras.layers, kind)(**options, **kwargs, dtype="float64")
    layer.build([(None, None, D), (None, None, E if three else D)] + ([(None, None, D)] if three else []))
    return randomize(layer)


def luong_inputs(three, grad=False):
    """``(q, k, v)``: ``[query, value, key]`` for Keras, or ``[query, value]`` (key = value)."""
    q, v = randn(B, I, D, seed=1, grad=grad), randn(B, J, E if three else D, seed=2, grad=grad)
    return q, (randn(B, J, D, seed=4, grad=grad) if three else v), v


@pytest.mark.parametrize("masking", ["none", "causal", "value", "query", "causal+value"])
@pytest.mark.parametrize("three", [True, False], ids=["key", "value-as-key"])
@pytest.mark.parametrize("name", list(LUONG))
def test_luong_and_bahdanau_match(name, three, masking, float64):
    """Outputs and weights where a query sees a key (``test_query_that_sees_no_key_luong``)."""
    q, k, v = luong_inputs(three)
    layer = luong(name, three)
    ours = qkv.Attention.from_keras(layer)
    qpad, vpad = pads("cross")
    allowed, keyword = torch.ones(B, I, J, dtype=torch.bool), {}
    if "causal" in masking:
        allowed, keyword["use_causal_mask"] = allowed & torch.ones(I, J, dtype=torch.bool).tril(), True
    if "value" in masking:
        allowed = allowed & vpad[:, None, :]
    query_mask = qpad if masking == "query" else None
    y_theirs, w_theirs = layer([q, v, k] if three else [q, v], mask=[query_mask, vpad if "value" in masking else None],
                               return_attention_scores=True, **keyword)  # fmt: skip
    y, w = ours(q, k, v, mask=allowed, return_weights=True)
    y = y if query_mask is None else y * query_mask[..., None]  # Keras zeroes those output rows, not the weights
    sees = allowed.any(-1)
    torch.testing.assert_close(y[sees], y_theirs[sees], **TOL)
    torch.testing.assert_close(w[sees], w_theirs[sees], **TOL)
    if masking == "value":  # the value mask as it is, (b, 1, j)
        torch.testing.assert_close(ours(q, k, v, mask=vpad[:, None, :])[sees], y_theirs[sees], **TOL)


def test_query_that_sees_no_key_luong(float64):
    """Keras subtracts 1e9 from masked logits: a row that sees no key keeps about its unmasked attention
    (to ~1e-7 in float64); qkv's ``Attention`` gives zeros."""
    q, k, v = luong_inputs(True)
    layer = luong("dot", True)
    ours = qkv.Attention.from_keras(layer)
    _, vpad = pads("cross")  # batch row 1 sees no key
    y_theirs = layer([q, v, k], mask=[None, vpad])
    torch.testing.assert_close(y_theirs[1], ours(q, k, v)[1], rtol=0.0, atol=1e-5)
    assert ours(q, k, v, mask=vpad)[1].abs().max() == 0


@pytest.mark.parametrize("name", list(LUONG))
def test_luong_and_bahdanau_gradients(name, float64):
    """Gradients of q, k, v and of each learned scalar or vector, which stay scalars and vectors."""
    q, k, v = luong_inputs(True, grad=True)
    layer = luong(name)
    ours = qkv.Attention.from_keras(layer)
    _, vpad = pads("cross")
    vpad[1, 0] = True  # (rows that see no key differ: test_query_that_sees_no_key_luong)
    dy = randn(B, I, E, seed=7)
    keras_weights = [w.value for w in layer.weights]
    theirs = torch.autograd.grad(layer([q, v, k], mask=[None, vpad]), (q, k, v, *keras_weights), dy)
    by_path = {w.path.split("/")[-1]: g for w, g in zip(layer.weights, theirs[3:])}
    names = {"scale": "weight" if "additive" in name else "scale", "concat_score_weight": "weight"}
    params = [getattr(ours.score, names[p]) for p in by_path]
    mine = torch.autograd.grad(ours(q, k, v, mask=vpad), (q, k, v, *params), dy)
    for a, b in zip(mine, (*theirs[:3], *by_path.values())):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)
    assert len(list(ours.parameters())) == len(layer.weights)
    assert isinstance(ours.score, {"dot": qkv.scores.Dot, "dot-scale": LearnedScaleDot}.get(name, TanhSum))


def test_luong_dropout_weights_are_the_dropped_ones(float64):
    """Keras' ``Attention`` returns its weights after dropout in training (0 or ``w/(1-p)``); qkv's are before."""
    q, k, v = luong_inputs(True)
    layer = luong("dot", dropout=0.5, seed=0)
    ours = qkv.Attention.from_keras(layer)
    y_theirs, w_theirs = layer([q, v, k], training=True, return_attention_scores=True)
    _, w = ours.train()(q, k, v, return_weights=True)
    kept = w_theirs != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(w_theirs[kept] * 0.5, w[kept], **TOL)
    torch.testing.assert_close(y_theirs, w_theirs @ v, **TOL)
    _, w_inference = layer([q, v, k], return_attention_scores=True)
    torch.testing.assert_close(ours.eval()(q, k, v, return_weights=True)[1], w_inference, **TOL)


def test_causal_alignment(float64):
    """Keras' causal mask is top-left at any lengths; qkv's ``causal=True`` bottom-right (equal when i == j)."""
    q, k, v = luong_inputs(True)
    ours = qkv.Attention.from_keras(luong("dot"))
    layer = keras.layers.Attention(dtype="float64")
    theirs = layer([q, v, k], use_causal_mask=True)
    tril = torch.ones(I, J, dtype=torch.bool).tril()
    torch.testing.assert_close(ours(q, k, v, mask=tril), theirs, **TOL)
    assert (ours(q, k, v, causal=True) - theirs).abs().max() > 1e-2
    x = q[:, :, :D]
    torch.testing.assert_close(ours(x, causal=True), layer([x, x], use_causal_mask=True), **TOL)


def test_keras_float64_layers_round_through_float32_by_default():
    """Keras' promotion turns float64 matmuls and ``dot_product_attention`` to float32 on the torch backend."""
    q, k, v = luong_inputs(True)
    layer = luong("dot")
    assert layer([q, v, k]).dtype == torch.float32  # a float64 layer, float64 inputs
    q, k, v = inputs("key")
    mha = multi_head("mha", KDIM, VDIM, key=True)
    y = qkv.MultiHeadAttention.from_keras(mha)(q, k, v)
    torch.testing.assert_close(y, mha(q, v, k, return_attention_scores=True)[0], **TOL)  # einsums keep float64
    assert 1e-9 < (y - mha(q, v, k)).abs().max() < 1e-4  # the fused path rounds to float32


def test_lora_kernels_are_copied_merged_and_trainable_carried(float64):
    q, k, v = inputs("key")
    layer = multi_head("mha", KDIM, VDIM, key=True)
    layer.query_dense.enable_lora(2)
    randomize(layer, seed=8)
    torch.testing.assert_close(qkv.MultiHeadAttention.from_keras(layer)(q, k, v), layer(q, v, k), **TOL)
    layer.trainable = False  # and a frozen layer's copy is frozen
    assert not any(p.requires_grad for p in qkv.MultiHeadAttention.from_keras(layer).parameters())


def test_refused_with_the_argument_named():
    with pytest.raises(ValueError, match=r"attention_axes: .* axes \(1, 2\) of rank-4 inputs"):
        layer = keras.layers.MultiHeadAttention(2, 3, dtype="float64")
        layer.build((None, 4, 5, DIM), (None, 4, 5, DIM))
        qkv.MultiHeadAttention.from_keras(layer)
    with pytest.raises(ValueError, match=r"output_shape: .* \(10,\); the layer has output_shape=\(16,\)"):
        qkv.MultiHeadAttention.from_keras(multi_head("mha", output_shape=16))
    assert qkv.MultiHeadAttention.from_keras(multi_head("mha", output_shape=DIM)).dim == DIM
    with pytest.raises(ValueError, match=r"sliding_window: .* mask=qkv.masks.window\(2, 2\)"):
        qkv.MultiHeadAttention.from_keras(multi_head("gqa", sliding_window=3))
    with pytest.raises(ValueError, match=r"layer: this keras.layers.MultiHeadAttention is not built yet"):
        qkv.MultiHeadAttention.from_keras(keras.layers.MultiHeadAttention(2, 3))
    with pytest.raises(TypeError, match=r"keras.layers.GroupQueryAttention converts to qkv.MultiHeadAttention"):
        qkv.Attention.from_keras(multi_head("gqa"))
    quantized = multi_head("mha")
    quantized.query_dense.quantize("int8")
    with pytest.raises(ValueError, match=r"MultiHeadAttention's query projection is quantized \(int8\)"):
        qkv.MultiHeadAttention.from_keras(quantized)
    with pytest.raises(TypeError, match=r"layer: expected a Keras attention layer .*, got Linear"):
        qkv.MultiHeadAttention.from_keras(torch.nn.Linear(2, 2))

    class Custom(keras.layers.MultiHeadAttention):
        def _compute_attention(self, *args, **kwargs):
            return super()._compute_attention(*args, **kwargs)

    layer = Custom(2, 3)
    layer.build((None, None, DIM), (None, None, DIM))
    with pytest.raises(TypeError, match=r"Custom._compute_attention overrides keras.layers.MultiHeadAttention's"):
        qkv.MultiHeadAttention.from_keras(layer)


def test_import_qkv_does_not_import_keras():
    code = "import sys, qkv; qkv.MultiHeadAttention.from_keras; assert 'keras' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_self_attention_call_of_a_cross_attention_copy_names_key():
    """A cross-attention copy called with the query alone: PyTorch's "mat1 and mat2 shapes" named no argument."""
    layer = multi_head("mha", KDIM, VDIM, key=True)
    with pytest.raises(ValueError, match=r"key: expected shape \(b, length, 9\) \(batch first\), got \(2, 5, 10\)"):
        qkv.MultiHeadAttention.from_keras(layer)(randn(B, I, DIM))
    with pytest.raises(ValueError, match=r"value: expected shape \(b, length, 8\) \(batch first\), got \(2, 7, 9\)"):
        qkv.MultiHeadAttention.from_keras(layer)(randn(B, I, DIM), randn(B, J, KDIM))  # the value defaults to the key
