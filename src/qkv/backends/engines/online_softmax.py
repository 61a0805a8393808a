"""Tile-by-tile attention with an online softmax, for any score, mask, bias and dropout.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``r = h/g``
query heads per KV head, ``i`` query length, ``j`` key length, ``d`` the prepared query/key
size, ``e`` value size; ``it``/``jt`` the sides of a tile.

The forward pass is the online softmax of Milakov & Gimelshein 2018 ("Online normalizer
calculation for softmax") as used by FlashAttention (Dao et al. 2022, algorithm 1): for
each query tile, sweep the key tiles keeping a running row maximum ``m``, a running sum
``l = Σ exp(s - m)`` and an unnormalised output ``acc = Σ exp(s - m) v``, rescaling both by
``exp(m_old - m_new)`` when the maximum grows. Only ``out`` and the log-sum-exp
``lse = m + log l`` are kept. The backward pass (FlashAttention algorithm 2) recomputes
each tile's logits, ``P = exp(s - lse)``, and uses ``D = rowsum(dO ∘ O)``::

    dV += Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP - D)      d(logits) = dS

so memory is one tile of logits at a time. Dot-form scores take the explicit
``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``. The additive score (``qkv.scores.Additive``) is
computed and differentiated by hand in ``backends.additive_tiles``, in cache-sized
sub-blocks of its ``(it, jt, n)`` intermediate. Any other score (and any learned bias) is
differentiated by autograd on the recomputed tile. A score modifier (``score_mod``,
``qkv.score_mods``) runs on each tile's logits after the bias and before the mask; its
backward is autograd through the modifier alone, on a detached copy of the tile's
pre-modifier logits, whose gradient then goes on as ``dS`` would without it.

Tiles that the mask reports "empty" are skipped; on "full" ones the mask is not built. A
query with no allowed key has ``l = 0``: its output is 0 and its ``lse`` is ``-inf``
(``tiling.lse``), and its gradients vanish.
Dropout draws its mask from a seed per tile (``backends.dropout.keep``), so the backward
drops exactly the weights the forward dropped. Half-precision inputs accumulate in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ... import score_mods
from ...masks import Mask, Tile
from ...positional import LazyBias
from ...scores import Score
from ..request import Request, bias_needs_grad
from ..tiling import additive_tiles
from ..tiling import dropout as drop
from ..tiling import lse as row_lse
from ..tiling import tile_math
from ..tiling.additive_tiles import AdditiveTiles
from ..tiling.tiles import NEG_INF, BiasSource, dense_tile, grouped, live_tiles, sum_to
from .contract import Grads, parameters

name = "online_softmax"

#: Elements of one tile of logits summed over batch and heads (times ``n`` for a generic
#: non-dot score that builds ``(it, jt, n)``):
#: 64 MiB per float32 intermediate. Large tiles keep the Python loop short, which matters
#: most on a busy machine, where every small parallel op waits for a thread to be scheduled.
TILE_ELEMENTS = 2**24


@dataclass(frozen=True)
class Plan:
    """Everything about a call that is not a tensor input."""

    score: Score  # pairwise(qp, kp, tile)
    mask: Mask | None  # True = may attend
    lazy_bias: LazyBias | None  # a dense bias is a tensor input instead
    scale: float
    dropout: float
    seed: int  # dropout seed (unused when dropout == 0)
    block_i: int  # query tile side
    block_j: int  # key tile side
    origin: drop.Origin | None = None  # where this call sits in a larger one (dropout coordinates)
    score_mod: Callable | None = None  # fn(score, b, h, q_idx, kv_idx) on each tile (qkv.score_mods)
    learned_bias: bool = False  # the lazy bias's parameters get gradients (through its tiles)


def refuses(req: Request) -> str | None:
    return None  # every score, mask, bias, score_mod and dropout


def plan_of(req: Request) -> Plan:
    """The plan of a request (its ``q`` the prepared queries)."""
    lazy = req.bias if isinstance(req.bias, LazyBias) else None
    block_i, block_j = _blocks(req)
    return Plan(req.score, req.mask, lazy, req.scale, req.dropout, req.seed, block_i, block_j, req.piece, req.score_mod,
                lazy is not None and bias_needs_grad(req))  # fmt: skip


def _blocks(req: Request) -> tuple[int, int]:
    """Tile sides: as large as :data:`TILE_ELEMENTS` allows, so the Python loop stays short."""
    rows = req.q.shape[0] * req.q.shape[1]  # batch x heads
    # A generic score builds (it, jt, n) per tile; the additive kernel sub-blocks its own
    # (ib, jb, n) scratch (tiling.additive_tiles), so its tiles are sized as logits only:
    # fewer, larger tiles (measured 2.3x faster fwd+bwd at i = 2048 than n-wide sizing).
    plain = req.score.dot_form or additive_tiles.applies(req.score)
    width = 1 if plain else max(1, req.q.shape[-1])
    budget = max(256, TILE_ELEMENTS // max(1, rows * width))
    block_j = min(max(req.j, 1), 1024, max(16, int(math.sqrt(budget))))
    block_i = min(max(req.i, 1), max(16, budget // block_j))
    return block_i, block_j


def forward(req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
    """The contract's forward (``engines.contract``): ``out`` comes in float32 (or wider)."""
    dense = req.bias if isinstance(req.bias, Tensor) else None
    out, lse = tiled_forward(plan_of(req), req.q, req.k, req.v, dense)
    return out, lse, None


def _pairwise(plan: Plan, qp5: Tensor, kp5: Tensor, t: Tile) -> Tensor:
    """Unscaled scores of one tile, ``(..., g, r, it, jt)``, through autograd-visible ops.

    Half-precision inputs multiply in float32: a bf16 product rounds every logit to 8 bits
    before the softmax (12x the flash rule's bound on a T5-biased call; SDPA keeps its scores
    in float32), and this engine is the general path, not the fast one."""
    if plan.score.dot_form:
        if qp5.dtype in (torch.float16, torch.bfloat16):
            qp5, kp5 = qp5.float(), kp5.float()
        return qp5 @ kp5.transpose(-1, -2)
    return plan.score.pairwise(qp5, kp5, t)


def _logits(plan: Plan, raw: Tensor, bias: BiasSource, dense_t: Tensor | None, t: Tile, state: str) -> Tensor:
    """Scaled, biased, modified, masked logits of one tile in float32 (or wider), ``(..., h, it, jt)``.

    ``raw`` is the tile's unscaled scores ``(..., g, r, it, jt)``; ``dense_t`` the tile of a
    dense bias, already sliced.
    """
    return _masked(plan, _modded(plan, _pre(plan, raw, bias, dense_t, t), t), t, state)


def _pre(plan: Plan, raw: Tensor, bias: BiasSource, dense_t: Tensor | None, t: Tile) -> Tensor:
    """``scale · raw + bias``: the logits before the score modifier and the mask."""
    s = raw.flatten(-4, -3)  # (..., g, r, it, jt) -> (..., h, it, jt)
    if s.dtype in (torch.float16, torch.bfloat16):
        s = s.float()
    s = s * plan.scale
    if (b := bias.tile(t)) is not None:
        s = s + b.to(s.dtype)
    if dense_t is not None:
        s = s + dense_t.to(s.dtype)
    return s


def _modded(plan: Plan, s: Tensor, t: Tile) -> Tensor:
    return s if plan.score_mod is None else score_mods.apply(plan.score_mod, s, t)


def _masked(plan: Plan, s: Tensor, t: Tile, state: str) -> Tensor:
    return s.masked_fill(~plan.mask.tile(t), NEG_INF) if state == "partial" else s


def tiled_forward(plan: Plan, qp: Tensor, kp: Tensor, v: Tensor, dense: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` in float32 (or wider), no autograd graph; ``lse`` is ``-inf`` on rows that see no key."""
    g, i_len, j_len = kp.shape[-3], qp.shape[-2], kp.shape[-2]
    heads_shape = (*qp.shape[:-2],)
    acc_dtype = torch.promote_types(v.dtype, torch.float32)
    out = torch.zeros((*heads_shape, i_len, v.shape[-1]), dtype=acc_dtype, device=v.device)
    lse = torch.full((*heads_shape, i_len), NEG_INF, dtype=acc_dtype, device=v.device)
    q5, k5, v5 = grouped(qp, kp, v)
    additive = AdditiveTiles(q5, k5, plan.score.v) if additive_tiles.applies(plan.score) else None
    bias = BiasSource(plan.lazy_bias, i_len, j_len, qp.device)
    current, m, l, acc = None, None, None, None

    def finish():
        rows = slice(current.i0, current.i1)
        live = l != 0  # a nan row (a masked key's nan logit) stays nan, for hidden_keys.after to see
        out[..., rows, :] = torch.where(live, acc / l.clamp(min=1e-30), 0.0)
        lse[..., rows] = torch.where(live, m + torch.log(l.clamp(min=1e-30)), NEG_INF).squeeze(-1)

    for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, qp.device):
        if current is None or t.i0 != current.i0:
            if current is not None:
                finish()
            current = t
            shape = (*heads_shape, t.i1 - t.i0, 1)
            m = torch.full(shape, NEG_INF, dtype=acc_dtype, device=v.device)
            l = torch.zeros(shape, dtype=acc_dtype, device=v.device)
            acc = torch.zeros((*heads_shape, t.i1 - t.i0, v.shape[-1]), dtype=acc_dtype, device=v.device)
        dense_t = None if dense is None else dense_tile(dense, t)
        if additive is not None:
            raw = additive.logits(t)
        else:
            raw = _pairwise(plan, q5[..., t.i0 : t.i1, :], k5[..., t.j0 : t.j1, :], t)
        s = _logits(plan, raw, bias, dense_t, t, state)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing allowed yet
        p = tile_math.exp_floored(s - base)  # no subnormal weight for the products
        rescale = torch.exp(m - base)
        l = l * rescale + p.sum(-1, keepdim=True)
        if plan.dropout > 0:
            p = p * drop.keep(plan.seed, plan.dropout, heads_shape, t, plan.origin) / (1.0 - plan.dropout)
        pv = p.unflatten(-3, (g, -1)) @ v5[..., t.j0 : t.j1, :].to(acc_dtype)  # float32 P V for half inputs
        acc = acc * rescale + pv.flatten(-4, -3)
        m = m_new
    if current is not None:
        finish()
    return out, lse


def backward(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: None, dtype: torch.dtype) -> Grads:
    """The contract's backward, from the row's final output ``out`` and log-sum-exp ``lse``.

    Only ``P = exp(s - lse)`` and ``D = rowsum(dO ∘ O)`` of each row enter, so when ``out``
    and ``lse`` are a larger softmax's (more key blocks, sinks) the result is this call's
    share of its gradients. A row with an infinite ``lse`` sees no key anywhere: gradient 0.
    Besides ``q``, ``k``, ``v`` (float32 or wider), the gradients of a dense bias that
    requires one and of :func:`~.contract.parameters` (None where one needs none); the
    additive score's prepared ``q``, ``k`` get theirs only when asked (``requires_grad``).
    """
    plan = plan_of(req)
    qp, kp, v = req.q.detach(), req.k.detach(), req.v.detach()
    dense = req.bias if isinstance(req.bias, Tensor) else None
    grad_dense = dense is not None and dense.requires_grad
    dense = None if dense is None else dense.detach().requires_grad_(grad_dense)
    grad_qk = req.q.requires_grad or req.k.requires_grad or req.piece is not None
    params = tuple(parameters(req))
    g, i_len, j_len = kp.shape[-3], qp.shape[-2], kp.shape[-2]
    heads_shape = (*qp.shape[:-2],)
    acc = torch.promote_types(out.dtype, torch.float32)
    out = out.to(acc)
    lse = row_lse.for_recompute(lse, acc)
    d_out = d_out.to(acc)
    delta = (d_out * out).sum(-1, keepdim=True)  # D = rowsum(dO ∘ O)
    dq = torch.zeros_like(qp, dtype=torch.promote_types(qp.dtype, acc))
    dk = torch.zeros_like(kp, dtype=dq.dtype)
    dv = torch.zeros_like(v, dtype=acc)
    d_dense = torch.zeros_like(dense, dtype=acc) if dense is not None and grad_dense else None
    trainable = [p for p in params if p.requires_grad]
    d_params = [torch.zeros_like(p) for p in trainable]
    lazy, learned_bias = plan.lazy_bias, plan.learned_bias
    q5, k5, v5 = grouped(qp, kp, v)
    additive, w_slot = None, None
    if additive_tiles.applies(plan.score):  # hand-written tile backward (backends.additive_tiles)
        w_slot = next((n for n, p in enumerate(trainable) if p is plan.score.v), None)
        grad_score = grad_qk or w_slot is not None
        additive = AdditiveTiles(q5, k5, plan.score.v, grad=grad_score, grad_w=w_slot is not None)
    use_autograd = (not plan.score.dot_form and additive is None) or learned_bias or d_dense is not None
    qk_leaves = use_autograd and additive is None  # q and k tiles as autograd leaves
    bias = BiasSource(lazy, i_len, j_len, qp.device, grad=learned_bias)
    d_profile = None
    d_out5 = d_out.unflatten(-3, (g, -1))
    for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, qp.device):
        rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
        qt, kt = q5[..., rows, :], k5[..., cols, :]
        dense_t = None if dense is None else dense_tile(dense, t)
        leaves: list[Tensor] = []
        if qk_leaves:
            qt, kt = qt.detach().requires_grad_(), kt.detach().requires_grad_()
            leaves = [qt, kt]
        if use_autograd:
            if d_dense is not None:
                dense_t = dense_t.detach().requires_grad_()
                leaves.append(dense_t)
            if bias.profile_graph is not None:
                leaves.append(bias.profile)
            leaves += trainable
        raw = additive.logits(t) if additive is not None else None  # no graph: differentiated by hand
        with torch.set_grad_enabled(use_autograd):
            if raw is None:
                raw = _pairwise(plan, qt, kt, t)
            s = pre = _pre(plan, raw, bias, dense_t, t)
        if plan.score_mod is not None:  # two stages: autograd through fn alone, then on as without it
            pre_in = pre.detach().requires_grad_()
            with torch.enable_grad():
                s = _modded(plan, pre_in, t)
        with torch.set_grad_enabled(use_autograd or plan.score_mod is not None):
            s = _masked(plan, s, t, state)
        p = tile_math.exp_floored(s.detach() - lse[..., rows, None])
        dp = (d_out5[..., rows, :] @ v5[..., cols, :].transpose(-1, -2).to(acc)).flatten(-4, -3)
        p_used = p
        if plan.dropout > 0:
            keep = drop.keep(plan.seed, plan.dropout, heads_shape, t, plan.origin).to(acc) / (1.0 - plan.dropout)
            p_used, dp = p * keep, dp * keep
        # dV += Pᵀ dO, summed over the r query heads that share a KV head
        dv[..., cols, :] += torch.einsum("...rij,...rie->...je", p_used.unflatten(-3, (g, -1)), d_out5[..., rows, :])
        ds = p * (dp - delta[..., rows, :])
        if plan.score_mod is not None:  # d(pre-modifier logits), and the modifier's own tensors' share
            first, *mod_grads = torch.autograd.grad(s, [pre_in, *trainable], ds, allow_unused=True)
            ds, s = (torch.zeros_like(ds) if first is None else first), pre
            for n, grad in enumerate(mod_grads):
                if grad is not None:
                    d_params[n] += grad
        if use_autograd:
            grads = list(torch.autograd.grad(s, leaves, ds, allow_unused=True))
            if qk_leaves:
                gq, gk = grads.pop(0), grads.pop(0)
                if gq is not None:
                    dq[..., rows, :] += gq.flatten(-4, -3).to(dq.dtype)
                if gk is not None:
                    dk[..., cols, :] += gk.squeeze(-3).to(dk.dtype)
            if d_dense is not None:
                dense_tile(d_dense, t).add_(sum_to(grads.pop(0), dense_t.shape))
            if bias.profile_graph is not None:
                gp = grads.pop(0)
                d_profile = gp if d_profile is None else d_profile + gp
            for n, grad in enumerate(grads):
                if grad is not None:
                    d_params[n] += grad
        if additive is not None:
            if additive.grad:
                additive.backward(t, (ds * plan.scale).unflatten(-3, (g, -1)))
        elif not use_autograd:
            ds5 = (ds * plan.scale).unflatten(-3, (g, -1))
            dq[..., rows, :] += (ds5 @ kt.to(acc)).flatten(-4, -3).to(dq.dtype)
            dk[..., cols, :] += torch.einsum("...rij,...rid->...jd", ds5, qt.to(acc)).to(dk.dtype)
    if additive is not None and additive.grad:
        da, db, dw = additive.grads()
        dq += da.flatten(-4, -3).to(dq.dtype)
        dk += db.squeeze(-3).to(dk.dtype)
        if dw is not None:
            d_params[w_slot] += dw.to(d_params[w_slot].dtype)
    if d_profile is not None:
        # one backward through the bias for the whole call: (h, L) profile -> parameters
        bias_grads = torch.autograd.grad(bias.profile_graph, trainable, d_profile.to(bias.profile_graph.dtype), allow_unused=True)
        for n, grad in enumerate(bias_grads):
            if grad is not None:
                d_params[n] += grad
    it = iter(d_params)
    grads_params = [next(it) if p.requires_grad else None for p in params]
    d_dense = None if d_dense is None else d_dense.to(dense.dtype)
    return Grads(q=dq, k=dk, v=dv, bias=d_dense, params=grads_params)
