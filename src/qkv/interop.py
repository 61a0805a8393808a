"""Conversion between ``torch.nn.MultiheadAttention`` and ``qkv.MultiHeadAttention``, both ways.

Shape legend: ``h`` heads, ``d`` per-head size, ``dim`` the model size ``= h·d``.

PyTorch stores W^Q, W^K, W^V either packed as ``in_proj_weight (3·dim, dim)`` (when key and
value sizes equal ``dim``) or as ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``;
the biases are always packed in ``in_proj_bias (3·dim,)``. Heads are contiguous blocks of
``d`` rows in each, which is also qkv's ``(h d)`` layout, so the copy is row for row.

Where the two differ, and how to call qkv for the same result:

* masks: PyTorch's bool ``attn_mask`` and ``key_padding_mask`` are **True = blocked**; qkv's
  ``mask`` is **True = may attend**. ``qkv_mask = ~attn_mask`` and, for padding,
  ``~key_padding_mask[:, None, None, :]``; a float ``attn_mask`` is added to the logits
  in both (qkv takes it as ``bias``, not supported by the module call: use the functional API).
* ``is_causal``: PyTorch's causal mask is aligned top-left, qkv's ``causal=True``
  bottom-right (a query at the end of a cache sees every key); they agree when query and
  key lengths are equal. For PyTorch's with ``i != j``, pass ``mask=~attn_mask``.
* PyTorch returns weights averaged over heads by default; qkv returns ``(b, h, i, j)``
  per head (``weights.mean(1)`` is PyTorch's). In training with dropout PyTorch's weights
  are the dropped ones; qkv's are before dropout (its output is the same in expectation).
* A query whose keys are all masked: PyTorch gives NaN in its default call
  (``need_weights=True``) and on its fast path (``_native_multi_head_attention``: eval mode
  without gradients, self-attention, batch first); its other ``need_weights=False`` calls and qkv
  give the output projection's bias (the attention is zeros).
* ``batch_first=False`` modules (PyTorch's default) take ``(i, b, dim)``; so does the qkv
  module :func:`from_torch` makes from one (``batch_first=False``). Its weights stay
  ``(b, h, i, j)``; unbatched ``(i, dim)`` inputs give ``(i, dim)`` and per-head ``(h, i, j)``.
* PyTorch's keywords (``attn_mask``, ``key_padding_mask``, ``need_weights``, ...) are
  answered with qkv's names (``MultiHeadAttention.forward``'s error).

Back to PyTorch (:func:`to_torch`, ``mha.to_torch()``) for a module PyTorch can hold: scaled
dot-product attention of ``h`` heads of ``dim / h`` (values too), no positional encoding,
``score_mod``, ``qk_norm``, gate, edits or other mechanism. Grouped K/V heads
(``kv_heads < heads``) are PyTorch's ``h`` heads with each K/V head's weights repeated for
the query heads that read it: the same outputs, ``h / g`` times the K/V projection's size.
"""

from __future__ import annotations

import torch
from torch import nn

from .projection import Linear
from .scores import ScaledDot


def from_torch(cls, module: nn.MultiheadAttention):
    """Build ``cls`` (``qkv.MultiHeadAttention``) with ``module``'s weights; outputs then match.

    The copy keeps ``module``'s layout: ``batch_first=False`` (PyTorch's default) gives a
    module that takes and returns ``(i, b, dim)`` as ``module`` does, and each parameter's
    ``requires_grad`` (a frozen module gives a frozen copy).
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module: expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if type(module).forward is not nn.MultiheadAttention.forward:
        # (torch.ao.nn.quantizable.MultiheadAttention computes with linear_Q/K/V, not the in_proj weights copied here)
        raise TypeError(f"module: {type(module).__module__}.{type(module).__name__} computes its own forward, from "
                        "weights other than nn.MultiheadAttention's; expected torch.nn.MultiheadAttention itself")  # fmt: skip
    if not 0.0 <= module.dropout < 1.0:
        raise ValueError(f"module: dropout={module.dropout} drops every weight in training; qkv.MultiHeadAttention "
                         "takes a dropout in [0, 1)")  # fmt: skip
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "module: add_bias_kv and add_zero_attn append extra keys; qkv.MultiHeadAttention has no equivalent"
        )
    dim, heads = module.embed_dim, module.num_heads
    has_bias = module.in_proj_bias is not None
    ours = cls(
        dim, heads, kdim=module.kdim, vdim=module.vdim, bias=has_bias, dropout=module.dropout,
        batch_first=module.batch_first,
    ).to(dtype=module.out_proj.weight.dtype, device=module.out_proj.weight.device)
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            wq, wk, wv = module.in_proj_weight.chunk(3, dim=0)
        else:
            wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        ours.q_proj.weight.copy_(wq)
        ours.k_proj.weight.copy_(wk)
        ours.v_proj.weight.copy_(wv)
        ours.out_proj.weight.copy_(module.out_proj.weight)
        if has_bias:
            bq, bk, bv = module.in_proj_bias.chunk(3, dim=0)
            ours.q_proj.bias.copy_(bq)
            ours.k_proj.bias.copy_(bk)
            ours.v_proj.bias.copy_(bv)
            ours.out_proj.bias.copy_(module.out_proj.bias)
    source = _their_names(module._qkv_same_embed_dim)
    theirs = dict(module.named_parameters())
    for name, p in ours.named_parameters():
        p.requires_grad_(theirs[source[name]].requires_grad)
    ours.train(module.training)
    return ours


def to_torch(module, default_mechanism: bool, own_forward: bool) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` with ``module``'s weights (a ``qkv.MultiHeadAttention`` whose mechanism is its
    default ``qkv.Attention``, ``default_mechanism``, and whose forward is the class's, ``own_forward``); outputs
    then match.

    Its ``batch_first``, dropout, dtype, device, training mode and each parameter's
    ``requires_grad`` are kept; grouped K/V heads are repeated (see the module docstring).
    """
    from torch.nn.utils import parametrize

    if not own_forward:
        raise ValueError(f"module: {type(module).__name__} computes its own forward, which nn.MultiheadAttention "
                         "would not; expected qkv.MultiHeadAttention itself")  # fmt: skip
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        proj = getattr(module, name)
        if type(proj) not in (nn.Linear, Linear) or parametrize.is_parametrized(proj) or (
                not isinstance(proj._parameters.get("weight"), nn.Parameter)):  # fmt: skip
            raise ValueError(f"module: {name} is a {type(proj).__name__} that computes its own projection (a wrapper, "
                             "a parametrization or a weight hook); nn.MultiheadAttention holds a plain weight and bias")  # fmt: skip
    attention = module.attention
    plain = default_mechanism and type(attention.score) is ScaledDot
    extras = {"positional": module.positional, "qk_norm": module.qk_norm, "gate": module.gate,
              "score_mod": getattr(attention, "score_mod", None), "edits": getattr(attention, "edits", None)}  # fmt: skip
    given = [name for name, value in extras.items() if value is not None]
    if not plain or given:
        what = given[0] if given else f"attention={type(attention).__name__}, score={getattr(attention, 'score', None)!r}"
        raise ValueError(f"module: nn.MultiheadAttention computes scaled dot-product attention with no other term; "
                         f"this module has {what}")  # fmt: skip
    dim, heads, d = module.dim, module.heads, module.dim_head
    if d * heads != dim or module.dim_value_head != d:
        raise ValueError(f"module: nn.MultiheadAttention's heads are dim / heads = {dim / heads:g} wide, queries, keys "
                         f"and values; this module's are {d} (dim_head) and {module.dim_value_head} (dim_value_head)")  # fmt: skip
    has_bias = module.q_proj.bias is not None
    weight = module.out_proj.weight
    theirs = nn.MultiheadAttention(dim, heads, dropout=attention.dropout, bias=has_bias, kdim=module.k_proj.in_features,
                                   vdim=module.v_proj.in_features, batch_first=module.batch_first,
                                   device=weight.device, dtype=weight.dtype)  # fmt: skip
    repeat = heads // module.kv_heads

    def per_query_head(x):  # (g·d, ...) -> (h·d, ...): K/V head c's rows for query heads c·repeat .. (c+1)·repeat - 1
        return x.unflatten(0, (module.kv_heads, d)).repeat_interleave(repeat, 0).flatten(0, 1)

    wq, wk, wv = module.q_proj.weight, per_query_head(module.k_proj.weight), per_query_head(module.v_proj.weight)
    with torch.no_grad():
        if theirs._qkv_same_embed_dim:
            theirs.in_proj_weight.copy_(torch.cat((wq, wk, wv)))
        else:
            theirs.q_proj_weight.copy_(wq)
            theirs.k_proj_weight.copy_(wk)
            theirs.v_proj_weight.copy_(wv)
        theirs.out_proj.weight.copy_(weight)
        if has_bias:
            theirs.in_proj_bias.copy_(torch.cat((module.q_proj.bias, per_query_head(module.k_proj.bias),
                                                 per_query_head(module.v_proj.bias))))  # fmt: skip
            theirs.out_proj.bias.copy_(module.out_proj.bias)
    ours = dict(module.named_parameters())
    names = _their_names(theirs._qkv_same_embed_dim)
    for name, p in theirs.named_parameters():  # a packed tensor learns if any of the parameters it holds does
        p.requires_grad_(any(ours[mine].requires_grad for mine, their in names.items() if their == name))
    theirs.train(module.training)
    return theirs


def _their_names(packed: bool) -> dict[str, str]:
    """``{qkv's parameter: nn.MultiheadAttention's that holds it}``; ``packed``: W^Q, W^K, W^V in one ``in_proj_weight``."""
    names = {"out_proj.weight": "out_proj.weight", "out_proj.bias": "out_proj.bias"}
    for x in "qkv":
        names[f"{x}_proj.weight"] = "in_proj_weight" if packed else f"{x}_proj_weight"
        names[f"{x}_proj.bias"] = "in_proj_bias"
    return names
