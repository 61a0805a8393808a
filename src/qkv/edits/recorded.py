"""What one attention call computed, for chosen heads and query rows: scores, pattern and ``z``.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size; ``H`` and ``R`` the number
of chosen heads and rows.

The three tensors TransformerLens hooks in an attention layer (Nanda & Bloom 2022), each
built for the chosen heads and rows only:

* :func:`scores`, ``hook_attn_scores (..., H, R, j)``: ``scale · q·k + bias``, the call's
  ``score_mod``, then ``-inf`` where the mask hides a key, padding included (TransformerLens'
  ``IGNORE``, ``-inf``, where its causal mask joined with the padding mask hides a key; its
  encoder adds ``-inf`` at padded keys); ``H · R · j`` logits, from the rows' queries against
  every key;
* :func:`pattern`, ``hook_pattern (..., H, R, j)``: the softmax of those, rebuilt by qkv's
  engines from each row's log-sum-exp (``qkv.attention_weights(weights_for=...)``), never
  the ``(h, i, j)`` map; edits that replace weights (a patch) show in it. A row that sees no
  key is 0 (TransformerLens sets the softmax's NaN to 0);
* :func:`z`, ``hook_z (..., R, H, e)``: the per-head output before ``W_O``, after the edits,
  in TransformerLens' ``[batch, pos, head, d_head]`` order; 0 in a row that sees no key.

As TransformerLens (``abstract_attention.py``, ``grouped_query_attention.py``), checked in
``tests/test_record_dialect_audit.py``:

* grouped heads (``g < h``): every entry is per query head, head ``n`` reading KV head
  ``n // (h/g)`` (its ``repeat_interleave``);
* dtypes: scores and pattern in float32 at least, ``z`` in the call's dtype, as
  TransformerLens 2.x, which upcasts a 16-bit model's ``q`` and ``k`` (3.x keeps the model's
  dtype; its TransformerBridge also fills hidden keys with the dtype's minimum, as
  transformers' eager attention, where qkv keeps ``-inf``).

Where qkv differs, on purpose:

* a ``score_mod`` (``SoftCap``, Gemma 2's cap) sees ``scale · q·k + bias``: TransformerLens
  caps before adding ALiBi or a position bias. Through transformers the two agree, since the
  integration refuses a cap with a bias;
* sinks (GPT-OSS) are one more logit in each row's softmax but not a key: the scores have no
  column for them, so the pattern's rows sum to less than 1 and are not the softmax of the
  scores (as transformers' eager weights, which drop the sink column).

Checked against eager attention's logits and weights in the test suite.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _mods
from ..functional import attention_weights
from ..masks import Tile, as_mask, causal
from ..scores import Dot, ScaledDot
from .base import Call, Edit

#: The keywords of ``qkv.attention`` that decide the weights (the others: values, dropout, what is returned).
WEIGHT_OPTIONS = ("score", "mask", "bias", "causal", "scale", "sinks", "score_mod", "backend")


def pattern(call: Call, heads: Tensor | None, rows: Tensor | None, edits: Sequence[Edit] = ()) -> Tensor:
    """``(..., H, R, j)``: the weights of ``heads`` at ``rows`` (None: all) of the edited ``call``, float32 at least.

    A 16-bit call's weights are not rounded to its dtype: ``q`` and ``k`` go in upcast, as
    TransformerLens 2.x upcasts them, so the pattern is ``softmax(hook_attn_scores)`` to
    float32 rounding (the engines' own logits are float32 too).
    """
    options = {key: call.options[key] for key in WEIGHT_OPTIONS if key in call.options}
    chosen = {key: value for key, value in (("heads", heads), ("rows", rows)) if value is not None}
    dtype = torch.promote_types(call.q.dtype, torch.float32)
    weights = attention_weights(call.q.to(dtype), call.k.to(dtype), weights_for=chosen or None, **options)
    for edit in edits:
        weights = edit.weights(call, weights, heads, rows)
    return weights


def scores(call: Call, heads: Tensor | None, rows: Tensor | None) -> Tensor:
    """``(..., H, R, j)``: the masked pre-softmax logits of ``heads`` at ``rows`` (None: all); dot-product scores only.

    Every head and row (a hook on the scores or pattern composing the call) is one product and
    one tile of the mask: no gathered copy of ``q`` or ``k``, no mask row by row.
    """
    score = call.options.get("score", "scaled_dot")
    if not (score in ("dot", "scaled_dot") if isinstance(score, str) else isinstance(score, Dot)):
        raise ValueError(f"attn_scores: recorded for dot-product scores ('dot', 'scaled_dot'), got score={score!r}")
    q, k = call.q, call.k
    i, j, d = call.rows, k.shape[-2], q.shape[-1]
    scale = call.options.get("scale")
    if scale is None:  # the score's own default, as qkv.attention takes it
        scale = 1 / math.sqrt(d) if score == "scaled_dot" or isinstance(score, ScaledDot) else 1.0
    group = call.heads // call.kv_heads
    dev = q.device
    dtype = torch.promote_types(q.dtype, torch.float32)  # logits accumulate in float32 at least, as the engines do
    if heads is None and rows is None:  # (..., g, group, i, d) against (..., g, 1, d, j): head n reads KV head n // group
        grouped = (q.to(dtype) * scale).unflatten(-3, (call.kv_heads, group))  # the scale on i·d numbers, not i·j
        s = (grouped @ k.to(dtype).unsqueeze(-3).transpose(-1, -2)).flatten(-4, -3)
    else:
        heads = torch.arange(call.heads) if heads is None else heads
        rows = torch.arange(i) if rows is None else rows
        q = q.index_select(-3, heads.to(dev)).index_select(-2, rows.to(dev))  # (..., H, R, d)
        k = k.index_select(-3, (heads // group).to(dev))  # (..., H, j, d)
        s = scale * (q.to(dtype) @ k.to(dtype).transpose(-1, -2))
    bias = call.options.get("bias")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise ValueError(f"attn_scores: recorded with a tensor bias or none, got a lazy {type(bias).__name__}")
        s = s + _rows_of(bias.to(dtype), heads, rows)
    score_mod = call.options.get("score_mod")
    if score_mod is not None:
        lead = s.shape[:-3]
        flat = s.reshape(-1, *s.shape[-3:])  # (b, H, R, j): a score_mod sees one batch index
        at_heads = torch.arange(call.heads, device=dev) if heads is None else heads.to(dev)
        at_rows = torch.arange(i, device=dev) if rows is None else rows.to(dev)
        flat = _mods.evaluate(score_mod, flat, torch.arange(flat.shape[0], device=dev), at_heads, at_rows, torch.arange(j, device=dev))
        s = flat.reshape(*lead, *flat.shape[-3:])
    mask = as_mask(call.options.get("mask"))
    if call.options.get("causal"):
        mask = causal() if mask is None else causal() & mask
    if mask is not None:
        if rows is None:
            allowed = mask.tile(Tile(0, i, 0, j, i, j, dev))  # (..., h|1, i, j)
        else:
            tiles = [mask.tile(Tile(int(r), int(r) + 1, 0, j, i, j, dev)) for r in rows]  # (..., h|1, 1, j) each
            allowed = torch.cat([t.expand(*t.shape[:-2], 1, j) for t in tiles], dim=-2)
        hidden = ~_heads_of(allowed, heads)
        # in place on this function's own product or sum (a fresh (h, i, j) tensor costs its first touch of memory); not
        # on a score_mod's output, which autograd may keep (tanh keeps it) or which may be a view of the caller's tensor
        s = s.masked_fill_(hidden, float("-inf")) if score_mod is None else s.masked_fill(hidden, float("-inf"))
    return s


def z(out: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
    """``(..., R, H, e)``: ``out (..., h, i, e)`` at ``heads`` and ``rows`` (None: all), in ``[batch, pos, head, d_head]`` order."""
    if heads is not None:
        out = out.index_select(-3, heads.to(out.device))
    if rows is not None:
        out = out.index_select(-2, rows.to(out.device))
    return out.transpose(-3, -2)


def result(z_rows: Tensor, heads: Tensor | None, w_o: Tensor) -> Tensor:
    """``hook_result (..., R, H, d_model)``: ``z_rows (..., R, h, e)`` of each head through its columns of ``W_O``.

    ``W_O (d_model, h·e)``; head ``n``'s result is ``z_n W_O[:, n·e:(n+1)·e]ᵀ``, so the heads'
    results sum to the projected output less its bias (TransformerLens' ``hook_result``).
    """
    h, e = z_rows.shape[-2], z_rows.shape[-1]
    if w_o.shape[-1] != h * e:
        raise ValueError(f"hook_result: W_O has {w_o.shape[-1]} input columns, expected heads x head size = {h * e}")
    w = w_o.view(w_o.shape[0], h, e)  # (d_model, h, e)
    if heads is not None:
        heads = heads.to(z_rows.device)
        z_rows, w = z_rows.index_select(-2, heads), w.index_select(1, heads)
    return torch.einsum("...rhe,dhe->...rhd", z_rows, w.to(z_rows.dtype))


def _heads_of(x: Tensor, heads: Tensor | None) -> Tensor:
    """``x (..., h|1, R, j)`` at ``heads`` (None: all); a broadcast head dim (or none) stays as it is."""
    return x.index_select(-3, heads.to(x.device)) if heads is not None and x.dim() >= 3 and x.shape[-3] > 1 else x


def _rows_of(bias: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
    """A bias broadcastable to ``(..., h, i, j)``, at ``heads`` and ``rows`` (None: all; broadcast dims stay 1)."""
    if rows is not None and bias.dim() >= 2 and bias.shape[-2] > 1:
        bias = bias.index_select(-2, rows.to(bias.device))
    return _heads_of(bias, heads)
