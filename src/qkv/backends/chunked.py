"""The chunked backend: exact attention in bounded memory, for every score, mask and bias.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size, ``n`` the additive score's
hidden size.

Two engines, one contract (``out``, and the log-sum-exp ``lse (..., h, i)`` of every row):

* ``fused_blocks`` — dot-form scores (dot, scaled dot, bilinear) without dropout: PyTorch's
  fused CPU kernel, given the bias and mask without an ``(h, i, j)`` tensor. A window mask
  with ALiBi or T5 buckets is a function of the query-key offset, handed to the kernel as
  a zero-copy strided view of an ``(h, i + j - 1)`` profile (a learned T5 table gets its
  gradient from ``bias_grad``, with the far keys' share kept by a split forward); other
  masks and biases are built one query block at a time. The speed of ``F.scaled_dot_product_attention`` with at most one block's mask.
* ``mod_tiles`` — dot-form scores with a score modifier (``score_mod``), without dropout
  or a learned bias: a tile loop of its own, soft-capping differentiated by hand.
* ``online_softmax`` — everything else (additive and location scores, dropout, learned
  biases under other masks, dense biases that need a gradient, score modifiers, inputs
  without a batch or head dim): a Python loop over tiles with an online softmax and a custom backward that
  recomputes each tile. Memory is one tile of logits plus, for the additive score, one
  cache-sized ``(ib, jb, n)`` scratch block, instead of the reference's ``(i, j, n)``.

Both skip tiles that the mask reports empty, and both take attention sinks
(``backends.sinks``) on their ``(out, lse)``. Weights, when asked for, are rebuilt from
``lse`` (``backends.weights``), optionally for a few heads or rows only. Checked against
the float64 reference backend in ``tests/test_backends_chunked.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import score_mods
from ..positional import LazyBias
from . import additive_tiles, kernels, linear_bias, mod_tiles
from . import dropout as drop
from .diagonal import DiagonalMask, FusedPlan
from .fused_blocks import FusedBlocks
from .mod_tiles import ModTiles
from .online_softmax import Plan, TiledAttention, unique
from .request import Request
from .tiles import BiasSource
from .weights import rebuild

name = "chunked"
#: This backend returns only the weights ``req.weights_for`` selects (others return all).
selects_weights = True

#: Elements of one tile of logits summed over batch and heads (times ``n`` for a generic
#: non-dot score that builds ``(it, jt, n)``):
#: 64 MiB per float32 intermediate. Large tiles keep the Python loop short, which matters
#: most on a busy machine, where every small parallel op waits for a thread to be scheduled.
TILE_ELEMENTS = 2**24


def supports(req: Request) -> str | None:
    return None  # every score, mask, bias, dropout and layout


def engine(req: Request) -> str:
    """``"fused_blocks"``, ``"mod_tiles"`` or ``"online_softmax"``: which engine :func:`run` will use, for ``explain``."""
    if online_reason(req) is not None:
        return "online_softmax"
    return "fused_blocks" if req.score_mod is None else "mod_tiles"


def online_reason(req: Request) -> str | None:
    """Why the call runs on the online-softmax tiles rather than a fused engine; None if it does not."""
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product"
    if req.dropout > 0 or req.q.dim() != 4:
        return "dropout, or inputs without (b, h) dims"
    if req.score_mod is not None:  # the modifier's own tile loop (public ops), unless a bias must be learned
        return "a score modifier with a learned bias" if _trainable_bias(req) else None
    if (reason := kernels.unusable(req.q)) is not None:
        return reason
    if _trainable_bias(req) and not (isinstance(req.bias, LazyBias) and DiagonalMask.applies(fused_plan(req))):
        return "the fused kernel cannot differentiate this learned bias under this mask"
    return None


def fused_plan(req: Request) -> FusedPlan:
    causal_square = req.bias is None and req.is_causal_only and req.i == req.j
    return FusedPlan(mask=req.mask, bias=req.bias, scale=req.scale, causal_square=causal_square)


def _trainable_bias(req: Request) -> bool:
    if not torch.is_grad_enabled() or req.bias is None:
        return False
    if isinstance(req.bias, Tensor):
        return req.bias.requires_grad
    return any(p.requires_grad for p in req.bias.parameters())


def forward(req: Request) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, qp, kp)``: the output, the log-sum-exp of every row and the prepared q, k."""
    q, k, v = req.q, req.k, req.v
    no_heads = q.dim() == 2
    if no_heads:  # (i, d) -> (1, i, d): the engines index heads at dim -3
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    qp, kp = req.score.prepare(q, k)
    if engine(req) == "fused_blocks":
        profile = None
        if _trainable_bias(req):  # learned T5 buckets: the (h, L) profile carries the gradient
            profile = BiasSource(req.bias, req.i, req.j, q.device, grad=True).profile_graph
        if req.sinks is None and column_path(req, qp, kp, v):  # ALiBi as a key column (backends.linear_bias)
            out, lse = linear_bias.ColumnBlocks.apply(*same_head_size(qp, kp, v), req.bias, req.scale, req.mask is not None)
        else:
            out, lse = FusedBlocks.apply(fused_plan(req), *same_head_size(qp, kp, v), profile, req.sinks)
        out = out[..., : v.shape[-1]]
    elif engine(req) == "mod_tiles":
        out, lse = ModTiles.apply(mod_tiles.plan(req), qp, kp, v, req.sinks, *score_mods.closure_tensors(req.score_mod))
    else:
        out, lse = _online(req, qp, kp, v)
    if no_heads:
        out, lse, qp, kp = out.squeeze(0), lse.squeeze(0), qp.squeeze(0), kp.squeeze(0)
    return out, lse, qp, kp


def column_path(req: Request, *tensors: Tensor) -> bool:
    """True when an ALiBi call runs as a key column (``backends.linear_bias``): where it applies and
    was timed faster than the masked kernel on this CPU, for this call's mode (with or without gradients)."""
    if req.sinks is not None or not linear_bias.applies(req.bias, req.mask, req.q) or req.q.dim() != 4:
        return False
    tensors = tensors or (req.q, req.k, req.v)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    return linear_bias.preferred(req.q, grad)


def same_head_size(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad ``d`` or ``e`` so they match, as the fused kernel requires.

    Zeros appended to q and k leave every dot product unchanged; zeros appended to v add
    output columns that the caller slices off. Autograd drops the padding's gradients.
    """
    d, e = q.shape[-1], v.shape[-1]
    if d < e:
        q, k = F.pad(q, (0, e - d)), F.pad(k, (0, e - d))
    elif e < d:
        v = F.pad(v, (0, d - e))
    return q, k, v


def _online(req: Request, qp: Tensor, kp: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    seed = drop.draw_seed(req.generator) if req.dropout > 0 else 0
    plan, dense, params = online_plan(req, qp, seed)
    return TiledAttention.apply(plan, qp, kp, v, dense, req.sinks, *params)


def online_plan(req: Request, qp: Tensor, seed: int, origin: drop.Origin | None = None) -> tuple[Plan, Tensor | None, list[Tensor]]:
    """``(plan, dense_bias, params)`` of the online-softmax engine for ``req`` (``qp`` its prepared queries)."""
    lazy = req.bias if isinstance(req.bias, LazyBias) else None
    dense = req.bias if isinstance(req.bias, Tensor) else None
    block_i, block_j = _blocks(req, qp)
    plan = Plan(req.score, req.mask, lazy, req.scale, req.dropout, seed, block_i, block_j, origin, req.score_mod)
    return plan, dense, parameters(req)


def parameters(req: Request) -> list[Tensor]:
    """Tensors the tiles read besides q, k, v and a dense bias, whose gradients the engine returns.

    The score's parameters when its pairwise step uses them (not the dot form, whose
    parameters act in ``prepare`` only), the lazy bias's, and the tensors the score
    modifier reads (``qkv.score_mods.closure_tensors``); modules' parameters first, each
    tensor once.
    """
    params: list[Tensor] = []
    if not req.score.dot_form:
        params += list(req.score.parameters())  # pairwise may use them (the additive score's v)
    if isinstance(req.bias, LazyBias):
        params += list(req.bias.parameters())
    if req.score_mod is not None:
        params += score_mods.closure_tensors(req.score_mod)
    return unique(params)


def _blocks(req: Request, qp: Tensor) -> tuple[int, int]:
    """Tile sides: as large as :data:`TILE_ELEMENTS` allows, so the Python loop stays short."""
    rows = math.prod(qp.shape[:-2])  # batch x heads
    # A generic score builds (it, jt, n) per tile; the additive kernel sub-blocks its own
    # (ib, jb, n) scratch (backends.additive_tiles), so its tiles are sized as logits only:
    # fewer, larger tiles (measured 2.3x faster fwd+bwd at i = 2048 than n-wide sizing).
    plain = req.score.dot_form or additive_tiles.applies(req.score)
    width = 1 if plain else max(1, qp.shape[-1])
    budget = max(256, TILE_ELEMENTS // (rows * width))
    block_j = min(req.j, 1024, max(16, int(math.sqrt(budget))))
    block_i = min(req.i, max(16, budget // block_j))
    return block_i, block_j


def run(req: Request) -> tuple[Tensor, Tensor | None]:
    out, lse, qp, kp = forward(req)
    if not req.return_weights:
        return out, None
    heads, rows = req.weights_for if req.weights_for is not None else (None, None)
    return out, rebuild(req, qp, kp, lse, heads=heads, rows=rows)
