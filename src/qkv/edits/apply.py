"""``qkv.edits.attention``: ``qkv.attention`` with edits applied, in order.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

    out = qkv.edits.attention(q, k, v, [Knockout(edges), AblateHeads([2])], causal=True)

Edits compose in list order: every :meth:`~qkv.edits.base.Edit.prepare` runs on the call
first (a knockout's mask joins the call's, temperatures multiply), then ``qkv.attention``
runs once on its own dispatcher (so a mask or logit edit keeps the memory-efficient
engines: ``qkv.explain`` on the edited call names them), then every
:meth:`~qkv.edits.base.Edit.finish` on the output ``z`` (an ablation after a patch of the
same head wins; a patch after an ablation puts its rows back). Returned weights are those
the edited call used (patched rows included); the log-sum-exp is the edited softmax's.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ..functional import attention as qkv_attention
from .base import Call, Edit, as_edits, indices


def attention(q: Tensor, k: Tensor, v: Tensor, edits: Edit | Sequence[Edit] | None = None, **options):
    """``qkv.attention(q, k, v, **options)`` with ``edits`` applied; returns what ``qkv.attention`` returns.

    ``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` need a head axis (edits name
    heads); ``options`` are ``qkv.attention``'s keywords (``mask``, ``bias``, ``causal``,
    ``scale``, ``return_weights``, ``weights_for``, ...).
    """
    return edited(q, k, v, edits, **options)[0]


def edited(q: Tensor, k: Tensor, v: Tensor, edits: Edit | Sequence[Edit] | None = None, **options):
    """``(result, call)``: what :func:`attention` returns, and the edited :class:`Call` that ran (for recording)."""
    edits = as_edits(edits)
    if q.dim() < 3:
        raise ValueError(f"q: edits name heads, so q needs a head dim (..., h, i, d), got shape {tuple(q.shape)}")
    call = Call(q, k, v, dict(options))
    for edit in edits:
        call = edit.prepare(call)
    result = qkv_attention(call.q, call.k, call.v, **call.options)
    if not edits:
        return result, call
    parts = list(result) if isinstance(result, tuple) else [result]
    for edit in edits:
        parts[0] = edit.finish(call, parts[0])
    if call.options.get("return_weights"):
        heads, rows = selection(call)
        for edit in edits:
            parts[1] = edit.weights(call, parts[1], heads, rows)
    return (parts[0] if len(parts) == 1 else tuple(parts)), call


def selection(call: Call) -> tuple[Tensor | None, Tensor | None]:
    """The heads and rows ``weights_for`` chose in ``call`` (None: all)."""
    spec = call.options.get("weights_for") or {}
    if not isinstance(spec, dict):
        return None, None  # qkv.attention has already refused it
    heads = None if spec.get("heads") is None else indices("weights_for: 'heads'", spec["heads"], call.heads)
    rows = None if spec.get("rows") is None else indices("weights_for: 'rows'", spec["rows"], call.rows)
    return heads, rows
