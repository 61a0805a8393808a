"""Conversion from Keras 3's attention layers to qkv's modules, with the same weights.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length (Keras'
``T``/``Tq``), ``j`` key length (``S``/``Tv``), ``d`` per-head query/key size (``key_dim``,
``head_dim``), ``e`` per-head value size (``value_dim``), ``dim`` the query's size.

==========================================  ==============================================
``keras.layers.``                           qkv (``from_keras`` builds it)
==========================================  ==============================================
``MultiHeadAttention(num_heads, key_dim,    ``MultiHeadAttention(dim, h, dim_head=d,
value_dim, use_bias, dropout, use_gate)``   dim_value_head=e, kdim, vdim, bias, dropout,
                                            gate=OutputGate(dim, h, e, bias))``
``GroupQueryAttention(head_dim,             the same with ``kv_heads=g``
num_query_heads, num_key_value_heads)``
``Attention()``                             ``Attention("dot")``
``Attention(use_scale=True)``               ``Attention(LearnedScaleDot())``: ``s·qᵀk``
``Attention(score_mode="concat")``          ``Attention(TanhSum(d, weight="scalar",
                                            scale=use_scale))``: ``w·Σ_c tanh(s·(q_c + k_c))``
``AdditiveAttention(use_scale)``            ``Attention(TanhSum(d, weight="vector" or
                                            None))``: ``Σ_c w_c tanh(q_c + k_c)``
==========================================  ==============================================

Keras' ``EinsumDense`` kernels are ``(dim, h, d)`` for W^Q (and W^K, W^V, the gate), with
biases ``(h, d)``, and ``(h, e, dim)`` for W^O: heads are contiguous blocks of ``d`` in both,
qkv's ``(h d)`` layout, so ``Linear.weight = kernel.reshape(dim, h·d).T``. A kernel with LoRA
enabled is copied merged. GQA's KV head ``u`` serves query heads ``u·h/g .. (u+1)·h/g - 1``
(``ops.repeat``), as qkv's query head ``n`` reads KV head ``n // (h/g)``. Checked against the
Keras layers (torch backend, float64, to 1e-12: outputs, weights, gradients of the inputs
and of every weight) in ``tests/test_keras_dialect_audit.py``, which pins each item below.

Where the two differ, and how to call qkv for the same result:

* argument order: Keras' layers take ``(query, value, key)`` (``Attention``: a list
  ``[query, value, key]``); qkv's ``(query, key, value)``, so ``layer(q, v)`` is ``ours(q, v)``
  and ``layer(q, v, k)`` is ``ours(q, k, v)``.
* masks are **True = may attend** on both sides. ``attention_mask (b, i, j)`` is
  ``mask=attention_mask[:, None]``; a value (or key) mask ``(b, j)``, given through Keras'
  masking, is ``mask=value_mask[:, None, None, :]`` (``Attention``: ``value_mask[:, None, :]``);
  the multi-head layers' query mask ``(b, i)`` adds ``& query_mask[:, None, :, None]``.
  ``Attention``'s ``query_mask`` zeroes output rows only: ``out * query_mask[..., None]``.
* ``use_causal_mask``: Keras' causal mask is aligned top-left (key ``≤`` query index) at any
  lengths, qkv's ``causal=True`` bottom-right; they agree when ``i == j``. Otherwise pass
  ``mask=torch.ones(i, j, dtype=torch.bool).tril()`` (``&`` the other masks).
* a query that sees no key: qkv gives zero weights, so the multi-head modules give the
  output bias. Keras' multi-head layers give that on their explicit path (dropout > 0 or
  ``return_attention_scores=True``); their fused path (``ops.dot_product_attention``, taken
  otherwise) fills masked logits with -2.4e38 and gives the values' mean over every key.
  ``Attention`` and ``AdditiveAttention`` subtract 1e9 from masked logits (65504 in float16),
  which leaves such a row about its unmasked attention, where qkv's ``Attention`` gives zeros.
* float64: Keras' type promotion on its torch (and JAX) backend gives float64 ``matmul`` and
  ``dot_product_attention`` float32 results, so a ``dtype="float64"`` ``Attention`` returns
  float32 and the multi-head layers' fused path rounds to float32 (~1e-7); qkv stays float64.
* dropout: both drop weights after the softmax (kept ones scaled by ``1/(1-p)``), from
  different random streams (Keras' seed generator, qkv's torch generator): in training the
  outputs agree in distribution only. The multi-head layers return the weights before
  dropout, as qkv does; Keras' ``Attention`` returns the dropped ones (rows no longer sum to
  1), where qkv's ``Attention`` returns them before dropout too. Keras picks training per call
  (default inference): the copy is returned in eval mode, ``ours.train()`` is ``training=True``.
* weights: ``return_attention_scores=True`` is ``return_weights=True``, the same
  ``(b, h, i, j)`` (``(b, i, j)`` for ``Attention``).
* the learned scalars of ``Attention(use_scale=True)`` and of its concat score stay scalars
  (``qkv.scores.LearnedScaleDot``, ``qkv.scores.TanhSum``), so their gradients are Keras'.
* ``trainable=False`` is carried (``requires_grad=False``); not carried: regularizers,
  constraints, initializers and ``seed`` (training-time settings), and the dtype policy's
  compute dtype (the copy holds the variables' dtype: ``torch.autocast``).
* refused, naming the argument: ``attention_axes`` other than the sequence axis of
  ``(b, i, dim)`` inputs, ``output_shape`` other than ``(dim,)``, ``sliding_window`` (a qkv
  module holds no mask: ``mask=qkv.masks.window(w - 1, w - 1)`` at each call, ``i == j``),
  quantized kernels, a subclass that overrides the layer's math, and a layer not built yet.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from .scores import Dot, LearnedScaleDot, TanhSum

#: The Keras classes converted, by name, and the qkv class each becomes.
_KINDS = {
    "MultiHeadAttention": "MultiHeadAttention",
    "GroupedQueryAttention": "MultiHeadAttention",
    "Attention": "Attention",
    "AdditiveAttention": "Attention",
}
#: Methods holding a layer's math: a subclass that overrides one computes something else.
_MATH = ("call", "_compute_attention", "_masked_softmax", "_calculate_scores", "_apply_scores",
         "_calculate_score_mask", "_compute_attention_mask", "_compute_causal_mask")  # fmt: skip


def from_keras(cls, layer) -> nn.Module:
    """Build ``cls`` (``qkv.MultiHeadAttention`` or ``qkv.Attention``, as their ``from_keras`` pass it) computing what
    the Keras attention ``layer`` computes, with its weights copied.

    Raises ``TypeError`` for a layer of another kind (or one ``cls`` does not take) and
    ``ValueError`` for what qkv cannot express (the module docstring lists both, and how to call
    qkv for the same result).
    """
    kind = _keras_kind(layer)
    target = _KINDS[kind]
    if target not in {c.__name__ for c in cls.__mro__}:  # by name: this module sits below qkv.attention
        raise TypeError(f"layer: {_public(kind)} converts to qkv.{target} (qkv.{target}.from_keras), "
                        f"not qkv.{cls.__name__}")  # fmt: skip
    if not layer.built:
        raise ValueError(f"layer: this {_public(kind)} is not built yet, so its weights do not exist; "
                         "call it once on inputs (or layer.build(...)) first")  # fmt: skip
    ours = _multi_head(cls, layer, kind) if target == "MultiHeadAttention" else _single(cls, layer, kind)
    ours.requires_grad_(bool(layer.trainable))  # a frozen layer's copy stays frozen
    return ours.eval()  # Keras' default call is inference; ours.train() is training=True


def _keras_kind(layer) -> str:
    """The Keras attention class ``layer`` is (or subclasses without changing its math)."""
    mro = type(layer).__mro__
    for n, base in enumerate(mro):
        if base.__module__.startswith("keras.") and base.__name__ in _KINDS:
            changed = [f"{c.__name__}.{name}" for c in mro[:n] for name in _MATH if name in vars(c)]
            if changed:
                raise TypeError(f"layer: {changed[0]} overrides {_public(base.__name__)}'s math, "
                                "which is what qkv copies")  # fmt: skip
            return base.__name__
    expected = f"layer: expected a Keras attention layer ({', '.join(map(_public, _KINDS))})"
    if isinstance(layer, type):  # the class itself: the parentheses forgotten
        name = _public(layer.__name__) if layer.__name__ in _KINDS else layer.__name__
        raise TypeError(f"{expected}, got the class {name}; "
                        "pass a built instance (make one and call it once on inputs)")  # fmt: skip
    inner = [f"model.get_layer({sub.name!r})" for sub in getattr(layer, "layers", None) or ()
             if any(base.__module__.startswith("keras.") and base.__name__ in _KINDS for base in type(sub).__mro__)]
    if inner:  # a keras.Model: its attention layers are what converts
        raise TypeError(f"{expected}, got a Keras model ({type(layer).__name__}); convert its attention layers "
                        f"one at a time: {', '.join(inner)}")  # fmt: skip
    raise TypeError(f"{expected}, got {type(layer).__name__}")


def _public(kind: str) -> str:
    """The name Keras exports a class under (``GroupedQueryAttention`` is ``keras.layers.GroupQueryAttention``)."""
    return "keras.layers." + ("GroupQueryAttention" if kind == "GroupedQueryAttention" else kind)


def _tensor(variable) -> Tensor:
    """A Keras variable's value as a torch tensor (the torch backend's is one already)."""
    value = getattr(variable, "value", variable)
    if isinstance(value, Tensor):
        return value.detach()
    return torch.as_tensor(np.asarray(value))  # another backend's array


def _dense(layer, name: str, kind: str) -> tuple[Tensor, Tensor | None]:
    """``(kernel, bias)`` of one of ``layer``'s ``EinsumDense`` projections."""
    dense = getattr(layer, f"_{name}_dense")
    if getattr(dense, "quantization_mode", None) is not None:
        raise ValueError(f"layer: {_public(kind)}'s {name} projection is quantized "
                         f"({dense.quantization_mode}); qkv copies float kernels")  # fmt: skip
    return _tensor(dense.kernel), None if dense.bias is None else _tensor(dense.bias)


def _multi_head(cls, layer, kind: str) -> nn.Module:
    """``keras.layers.MultiHeadAttention`` or ``GroupedQueryAttention`` as ``qkv.MultiHeadAttention``."""
    from .variants import OutputGate

    gqa = kind == "GroupedQueryAttention"
    if gqa:
        heads, kv_heads, d, e = layer.num_query_heads, layer.num_key_value_heads, layer.head_dim, layer.head_dim
        dropout, bias, window, gated = layer.dropout, layer.use_bias, layer.sliding_window, layer.use_gate
    else:
        heads, d, e = layer.num_heads, layer.key_dim, layer.value_dim
        kv_heads, dropout, bias = heads, layer.dropout, layer.use_bias
        window, gated = layer._sliding_window, layer._use_gate
    if window is not None:
        raise ValueError(f"sliding_window: a qkv module holds no mask (the layer has sliding_window={window}); "
                         f"build it without one and pass mask=qkv.masks.window({window - 1}, {window - 1}) "
                         "at each call (Keras' band, for equal query and key lengths)")  # fmt: skip
    kernels = {name: _dense(layer, name, kind) for name in ("query", "key", "value", "output")}
    dim, kdim, vdim = (kernels[name][0].shape[0] for name in ("query", "key", "value"))
    out_kernel = kernels["output"][0]
    if not gqa:
        rank = len(layer._query_dense.equation.split(",")[0])  # the query input's rank
        if rank != 3 or tuple(layer._attention_axes) != (1,):
            raise ValueError(f"attention_axes: qkv.MultiHeadAttention attends over the sequence axis of (b, i, dim) "
                             f"inputs (Keras' default, (1,)); the layer attends over axes "
                             f"{tuple(layer._attention_axes)} of rank-{rank} inputs")  # fmt: skip
        if tuple(out_kernel.shape[2:]) != (dim,):
            raise ValueError(f"output_shape: qkv.MultiHeadAttention projects back to the query's size ({dim},); "
                             f"the layer has output_shape={layer._output_shape}")  # fmt: skip
    gate = OutputGate(dim, heads, e, bias=bias) if gated else None
    ours = cls(dim, heads, kv_heads=kv_heads, dim_head=d, dim_value_head=e, kdim=kdim, vdim=vdim, bias=bias,
               dropout=dropout, gate=gate).to(dtype=out_kernel.dtype, device=out_kernel.device)  # fmt: skip
    slots = {"query": ours.q_proj, "key": ours.k_proj, "value": ours.v_proj}
    if gated:
        kernels["gate"] = _dense(layer, "gate", kind)
        slots["gate"] = ours.gate.proj
    with torch.no_grad():
        for name, proj in slots.items():  # kernel (dim, h, d) -> weight (h·d, dim); bias (h, d) -> (h·d,)
            kernel, b = kernels[name]
            proj.weight.copy_(kernel.reshape(kernel.shape[0], -1).T)
            if b is not None:
                proj.bias.copy_(b.reshape(-1))
        kernel, b = kernels["output"]  # (h, e, dim) -> (dim, h·e)
        ours.out_proj.weight.copy_(kernel.reshape(-1, dim).T)
        if b is not None:
            ours.out_proj.bias.copy_(b)
    return ours


def _single(cls, layer, kind: str) -> nn.Module:
    """``keras.layers.Attention`` or ``AdditiveAttention`` as ``qkv.Attention`` with the matching score."""
    scale = None if layer.scale is None else _tensor(layer.scale)
    if kind == "AdditiveAttention" or layer.score_mode == "concat":
        shapes = (layer.get_build_config() or {}).get("input_shape")
        size = shapes[0][-1] if shapes else None  # the query's channels, which the key's equal
        if not isinstance(size, int):
            raise ValueError(f"layer: {_public(kind)}'s build config names no query size (got {shapes}); "
                             "call the layer once on inputs first")  # fmt: skip
        if kind == "AdditiveAttention":  # Σ_c scale_c tanh(q_c + k_c), scale (d,) with use_scale
            score = TanhSum(size, weight=None if scale is None else "vector")
            params = {} if scale is None else {"weight": scale}
        else:  # w · Σ_c tanh(s (q_c + k_c)): w always, s with use_scale
            score = TanhSum(size, weight="scalar", scale=scale is not None)
            params = {"weight": _tensor(layer.concat_score_weight)}
            params.update({} if scale is None else {"scale": scale})
    else:
        score = Dot() if scale is None else LearnedScaleDot()
        params = {} if scale is None else {"scale": scale}
    ours = cls(score, dropout=layer.dropout)
    if params:
        like = next(iter(params.values()))
        ours = ours.to(dtype=like.dtype, device=like.device)
    with torch.no_grad():
        for name, value in params.items():
            getattr(score, name).copy_(value)
    return ours
