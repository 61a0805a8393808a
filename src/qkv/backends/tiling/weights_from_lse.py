"""Attention weights rebuilt from the log-sum-exp, for chosen heads and query rows only.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` prepared query/key size; ``hs`` and ``is`` the numbers of
selected heads and rows.

A fast backend keeps, for every query row, ``lse = log Σ_k exp(s_k)`` over its allowed keys.
Then each weight is one exponential, ``α_j = exp(s_j - lse)``, exactly the softmax, with no
second pass over the row; a row with no allowed key has ``lse = -inf`` (``tiling.lse``) and
weights 0. With
attention sinks ``lse`` includes the sink's mass, so the same formula gives rows summing to
less than 1. Only
the selected ``(hs, is, j)`` block is ever built, in row chunks, so inspecting two heads of
a 4096-token sequence costs ``2·4096·j`` numbers, not ``h·4096·j``.

When gradients are being recorded the weights are instead a plain softmax of the same
logits (identical values): ``lse`` comes out of a custom function without a gradient, and
a softmax lets gradients through the weights reach ``q``, ``k``, the score and the bias
(a learned lazy bias's own tiles, or a dense bias that requires grad).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._bools import any_along
from ... import score_mods
from ...masks import Tile
from ...positional import LazyBias
from ..request import Request, bias_needs_grad
from .lse import for_recompute
from .tiles import NEG_INF, BiasSource, dense_tile

#: Elements of logits built at once (times the additive score's hidden size).
CHUNK_ELEMENTS = 2**22


def _pick_heads(x: Tensor, heads: Tensor | None, h: int) -> Tensor:
    """Select ``heads`` along dim -3 when ``x`` has a head axis there (size-1 axes broadcast)."""
    if heads is None or x.dim() < 3 or x.shape[-3] != h:
        return x
    return x.index_select(-3, heads.to(x.device))


def rebuild(
    req: Request, qp: Tensor, kp: Tensor, lse: Tensor, *, heads: Tensor | None = None, rows: Tensor | None = None
) -> Tensor:
    """Weights ``(b, hs, is, j)`` from the prepared ``qp (b, h, i, d)``, ``kp (b, g, j, d)`` and ``lse (b, h, i)``.

    ``heads`` and ``rows`` are 1-d long tensors of indices (None = all).
    """
    h, g, i_len, j_len = qp.shape[-3], kp.shape[-3], qp.shape[-2], kp.shape[-2]
    head_ids = torch.arange(h, device=qp.device) if heads is None else heads.to(qp.device)
    row_ids = torch.arange(i_len, device=qp.device) if rows is None else rows.to(qp.device)
    q_sel = qp.index_select(-3, head_ids)
    k_sel = kp.index_select(-3, torch.div(head_ids, h // g, rounding_mode="floor"))
    lse_sel = for_recompute(lse.index_select(-2, head_ids))
    differentiable = torch.is_grad_enabled() and (
        any(x.requires_grad for x in (qp, kp))
        or bias_needs_grad(req)
        or (req.sinks is not None and req.sinks.requires_grad)
        or (req.score_mod is not None and any(x.requires_grad for x in score_mods.closure_tensors(req.score_mod)))
    )
    bias = None
    if isinstance(req.bias, LazyBias):
        # with gradients: the bias's own tiles, whose graph reaches its parameters (a
        # BiasSource profile is built without one, for the custom backward's own use)
        bias = req.bias if differentiable else BiasSource(req.bias, i_len, j_len, qp.device)
    width = 1 if req.score.dot_form else max(1, qp.shape[-1])
    chunk = max(1, CHUNK_ELEMENTS // max(1, math.prod(q_sel.shape[:-2]) * j_len * width))
    parts = []
    runs = ((r, min(r + chunk, i_len)) for r in range(0, i_len, chunk)) if rows is None else _runs(row_ids.tolist(), chunk)
    for start, stop in runs:
        t = Tile(start, stop, 0, j_len, i_len, j_len, qp.device)
        qt = q_sel[..., start:stop, :]
        if req.score.dot_form and qt.dtype in (torch.float32, torch.float64) and qt.shape[-1] <= j_len:
            s = (qt * req.scale) @ k_sel.transpose(-1, -2)  # the scale on i·d products, not on the i·j logits
        elif req.score.dot_form:  # half precision: the logits in float32, as the lse was summed (not rounded first)
            acc = torch.promote_types(qt.dtype, torch.float32)
            s = (qt.to(acc) * req.scale) @ k_sel.to(acc).transpose(-1, -2)
        else:
            acc = torch.promote_types(qt.dtype, torch.float32)  # in half precision every logit would be rounded
            s = req.score.pairwise(qt.to(acc), k_sel.to(acc), t) * req.scale
        if bias is not None:
            s = s + _pick_heads(bias.tile(t), heads, h).to(s.dtype)
        elif isinstance(req.bias, Tensor):
            s = s + _pick_heads(dense_tile(req.bias, t), heads, h).to(s.dtype)
        if req.score_mod is not None:
            s = score_mods.apply(req.score_mod, s, t, heads=heads)  # the selected heads' true indices
        allowed = None
        if req.mask is not None and req.mask.state(t) != "full":
            allowed = _pick_heads(req.mask.tile(t), heads, h)
            s = s.masked_fill(~allowed, NEG_INF)
        if differentiable and req.sinks is not None:  # the sink is one more logit, whose weight is dropped
            column = _pick_heads(req.sinks.to(s.dtype).reshape(-1, 1, 1), heads, h)
            w = torch.softmax(torch.cat((s, column.expand(*s.shape[:-1], 1)), dim=-1), dim=-1)[..., :-1]
        elif differentiable:
            w = torch.softmax(s.masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0), dim=-1)
            if allowed is not None:
                w = w * allowed * any_along(allowed, -1, keepdim=True)
        else:  # s is this chunk's own tensor: the exponential in place (the weights do not depend on v, whose
            # gradient the lse may carry)
            w = torch.exp(s.sub_(lse_sel[..., start:stop, None].detach()), out=s)
        parts.append(w)
    return (torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]).to(qp.dtype)


def _runs(rows: list[int], chunk: int):
    """Split a list of row indices into ``(start, stop)`` runs of consecutive rows, at most ``chunk`` long."""
    n = 0
    while n < len(rows):
        start = stop = rows[n]
        n += 1
        while n < len(rows) and rows[n] == stop + 1 and stop + 1 - start < chunk:
            stop += 1
            n += 1
        yield start, stop + 1
