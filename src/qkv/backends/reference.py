"""The reference backend: the textbook equations, materialised and literal.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

    e_ij  = mod(scale · score(q_i, k_j) + bias_ij)     (logits, (b, h, i, j); mod = score_mod or identity)
    α_ij  = exp(e_ij) / Σ_k exp(e_ik)  over allowed k   (weights; + exp(sink_h) in the sum with sinks)
    out_i = Σ_j α_ij v_j                                 ((b, h, i, e))

Masked logits are filled with ``finfo.min`` (not -inf, which turns a fully masked row into
NaN); such rows are then multiplied by zero, so their output, weights and gradients are 0. A
``-inf`` from a bias or a ``score_mod`` hides its key as the mask does.
Half-precision inputs are softmaxed in float32. Works in float64: it is the oracle every
other backend is tested against. Memory is O(i·j) (O(i·j·n) for the additive score).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import score_mods
from .._bools import all_along, any_along
from .._trace import concrete, tracing
from ..masks import Tile
from .request import Request, repeat_kv

name = "reference"


def supports(req: Request) -> str | None:
    return None  # runs everything


def logits(req: Request) -> tuple[Tensor, Tensor | None]:
    """The masked logits ``(b, h, i, j)`` (float32 or wider) and the dense mask (None if unmasked)."""
    e, allowed, _ = _logits(req)
    return e, allowed


def _logits(req: Request) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`logits`, and with a mask, a bias or a ``score_mod`` the rows with no key ``(b, h, i, 1)`` (else None):
    those whose logits are all masked or ``-inf`` (a ``-inf`` term hides its key as the mask does; a row of them
    alone would make the softmax nan). A finite logit, however low (a float mask's ``finfo.min``), is a key's."""
    qp, kp = req.score.prepare(req.q, req.k)
    if qp.dtype in (torch.float16, torch.bfloat16):
        # Half-precision logits lose too much before the softmax: combine the prepared q and k
        # in float32, as PyTorch's fused kernels do, so the weights are the float32 ones rounded.
        qp, kp = qp.float(), kp.float()
    kp = repeat_kv(kp, req.group)
    tile = Tile.whole(req.i, req.j, req.q.device)
    if req.score.dot_form and qp.shape[-1] <= req.j:
        # scale · (qp kpᵀ) = (scale · qp) kpᵀ: i·d products instead of a pass over the i·j logits
        e = req.score.pairwise(qp * req.scale, kp, tile)
    else:
        e = req.scale * req.score.pairwise(qp, kp, tile)
    if req.bias is not None:
        bias = req.bias if isinstance(req.bias, Tensor) else req.bias.dense(req.i, req.j, e.device)
        e = e + bias.to(e.dtype)
    if req.score_mod is not None:
        e = score_mods.apply(req.score_mod, e, tile)
    allowed = None if req.mask is None else req.mask.tile(tile)
    lowest = torch.finfo(e.dtype).min
    if (req.bias is None and req.score_mod is None and allowed is None) or not e.shape[-1]:  # (no keys: the empty call's answer)
        return e, allowed, None
    # masked keys at -inf, never at a finite lowest: where a row's seen logits are all -inf (q·k overflowed), a finite
    # fill would make the hidden keys its largest and give them the row's weights (and a hidden inf value the output)
    if allowed is not None:  # -inf here, so that a row of masked and -inf logits alone has no finite one
        e = e.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(e.amax(-1, keepdim=True))  # one pass, (b, h, i, 1) kept
    if not (concrete(dead) and dead.device.type == "cpu" and not bool(dead.any())):
        e = e.masked_fill(dead, lowest)  # rows of no key as masked ones: a softmax without nan, zeroed after
    return e, allowed, dead


def weights(req: Request) -> Tensor:
    """Attention weights ``(b, h, i, j)`` before dropout; rows with no allowed key are zero.

    With sinks, each row's softmax runs over one more logit, ``sinks_h``, whose weight is
    then dropped (a sink has no value): the row's weights sum to less than 1.
    """
    return weights_and_lse(req, with_lse=False)[0]


def weights_and_lse(req: Request, with_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """:func:`weights`, and each row's ``lse = log Σ exp(e)`` over its allowed keys (and its sink): ``(b, h, i)``
    (None with ``with_lse=False``: its own pass over the logits, as long as the softmax's).

    A row with no allowed key and no sink has ``lse = -inf``.
    """
    e, allowed, dead = _logits(req)
    if req.sinks is not None:
        column = req.sinks.to(e.dtype).reshape(-1, 1, 1)
        e = torch.cat((e, column.expand(*e.shape[:-1], 1)), dim=-1)
    lse = torch.logsumexp(e, dim=-1) if with_lse else None  # before the weights may overwrite e
    # e is this call's own tensor: without gradients the weights overwrite it (a second (b, h, i, j)
    # tensor would be fresh memory, faulted in page by page at every call); not under tracing or
    # torch.func (vmap has no batching rule for softmax's out=; a compiler plans the memory itself)
    overwrite = not (torch.is_grad_enabled() and e.requires_grad) and not tracing()
    w = torch.softmax(e, -1, out=e) if overwrite else torch.softmax(e, dim=-1)
    if req.sinks is not None:
        w = w[..., :-1]
    if allowed is not None or dead is not None:
        live = ~dead if dead is not None else any_along(allowed, -1, keepdim=True)
        if not (concrete(live) and live.device.type == "cpu" and bool(all_along(live.flatten(), 0))):
            w = w * live  # rows with no key: zero weights (a pass over them, skipped where every row has a key)
        if lse is not None:  # finfo.min logits are not "no key": the row's mass is its sink's, or none
            rest = float("-inf") if req.sinks is None else req.sinks.to(lse.dtype).reshape(-1, 1).expand(lse.shape)
            lse = torch.where(live.squeeze(-1).expand(lse.shape), lse, rest)
    return w, lse


def dropout_weights(w: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Inverted dropout on the weights: zero each with probability ``p``, scale the rest by 1/(1-p)."""
    if p == 0.0:
        return w
    keep = torch.rand(w.shape, device=w.device, generator=generator) >= p
    return w * keep / (1.0 - p)


def run(req: Request) -> tuple[Tensor, Tensor | None, Tensor | None]:
    w, lse = weights_and_lse(req, with_lse=req.return_lse)
    v = repeat_kv(req.v, req.group)
    out = dropout_weights(w, req.dropout, req.generator).to(v.dtype) @ v
    return out, (w.to(req.q.dtype) if req.return_weights else None), (lse if req.return_lse else None)
