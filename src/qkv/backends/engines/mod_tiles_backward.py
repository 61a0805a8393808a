"""The score-modifier engine's backward, tile by tile (FlashAttention-2's recomputation; ``mod_tiles`` is its forward).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``d`` query/key size, ``e`` value size;
``it``/``jt`` the sides of a tile.

From the final ``out`` and ``lse`` alone (Dao 2023), each tile's logits recomputed::

    P = exp(s - lse),   D = rowsum(dO ∘ O),   dP = dO Vᵀ,   dS = P ∘ (dP - D)
    dV += Pᵀ dO,   dQ += scale · dS K,   dK += scale · dSᵀ Q

As in FlashAttention, ``s`` and ``dP`` are float32 products whatever the inputs' dtype (a
bfloat16 product's output is rounded to 8 bits: ``dP - D`` cancels where one key takes a
row's weight, and a rounded ``s`` moves ``P`` off the forward's ``lse``: 3-6x the flash
rule's bound on gradients, and a nonzero gradient where the exact one is 0); ``P``, ``dS``
and ``dO`` enter the other three products in ``mm`` (``mod_tiles_parts.operands``).

A soft cap ``c · tanh(x / c)`` multiplies ``dS`` by its derivative ``1 - tanh²`` in place (no
autograd); any other modifier gets ``dS`` through autograd of the modifier alone on a
detached copy of the tile, and the tensors it reads (``closure_tensors``) their share.
Checked against the float64 reference backend in the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import score_mods
from ..request import Request
from ..tiling import lse as row_lse
from ..tiling import cap_range, threads, tile_math
from ..tiling.tiles import NEG_INF, live_tiles
from .contract import Grads, parameters
from .mod_tiles_parts import ModPlan, key_cols, mask_bias, operands, query_rows, tile_logits, tiles_by, tiles_cost


def tiles_backward(plan: ModPlan, req: Request, out: Tensor, lse: Tensor, d_out: Tensor, dtype: torch.dtype) -> Grads:
    """Gradients in ``dtype`` of ``req`` run with ``plan``, from the final ``out`` and ``lse``.

    The tensors the modifier reads get theirs, aligned with ``parameters(req)`` (None where
    none is needed). One task per block of keys, which accumulates its rows of ``dk`` and
    ``dv`` in float32 and writes them once; ``dq`` and the modifier's tensors are summed per
    thread, then over threads in a fixed order.
    """
    params = tuple(parameters(req))
    # only the modifier's tile is differentiated here
    ops = operands(plan, req.q.detach(), req.k.detach(), req.v.detach())
    q, k, v, mm, acc = ops.q, ops.k, ops.v, ops.mm, ops.acc
    (b, h, g), i_len = ops.heads, q.shape[2]
    d_out = d_out.contiguous()
    lse = row_lse.for_recompute(lse, acc)
    delta = _row_dots(d_out, out, acc)  # D = rowsum(dO ∘ O)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    trainable = [p for p in params if p.requires_grad]
    cap = plan.cap
    cols_of = tiles_by(live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, k.shape[2], q.device), "j0")

    def work(j0: int, share: _Share) -> None:
        scratch = share.scratch
        j1 = cols_of[j0][0][0].j1
        jt = j1 - j0
        dk_t = torch.zeros(b * g, jt, k.shape[-1], dtype=acc, device=q.device)
        dv_t = torch.zeros(b * g, jt, v.shape[-1], dtype=acc, device=q.device)
        # this task's keys and values, for every row tile: in acc for the logits and dP, the keys in mm for dQ
        col = cols_of[j0][0][0]
        k_s, v_t = key_cols(k, col, acc, (scratch, "k_s")), key_cols(v, col, acc, (scratch, "v_s"))
        k_t = k_s if mm == acc else key_cols(k, col, mm, (scratch, "k_mm"))
        for t, state in cols_of[j0]:
            it = t.i1 - t.i0
            rows = slice(t.i0, t.i1)
            q_s = query_rows(q, g, t, acc, (scratch, "q_s"))  # the r heads' rows stacked, and in mm when that differs
            q_t = q_s if mm == acc else query_rows(q, g, t, mm, (scratch, "q_mm"))
            with torch.no_grad():
                s = tile_logits(plan, ops, q_s, k_s, t, scratch)
            hide = mask_bias(plan, t, state, acc)
            neg_lse = lse[:, :, rows, None].neg()
            # two tile buffers where the modifier is known (a third only for the rewritten exp):
            # fewer bytes per thread stay in cache
            other = scratch.take("p", s.shape, acc)
            spare = lambda: scratch.take("tmp", s.shape, acc)  # noqa: E731
            if cap is not None:
                u = tile_math.tanh_(s, other, ops.forms, ops.clamp)  # other: E + 2
                p = torch.add(neg_lse, u, alpha=cap, out=other)  # c·tanh(x/c) - lse
            elif plan.score_mod is None:  # a lazy bias alone: the logits are the tile
                p = s.add_(neg_lse)
            else:
                pre = s.detach().requires_grad_()
                with torch.enable_grad():
                    modded = score_mods.apply(plan.score_mod, pre, t)
                p = torch.add(neg_lse, modded.detach(), out=other)
                if hide is not None:  # masked after the modifier, as flex's backward: where a modifier is undefined
                    p.masked_fill_(hide == NEG_INF, NEG_INF)  # (nan) the mask hides, P and so dS stay 0, not nan
                    hide = None  # selected away already: the exp need not add it
            # a capped logit minus the lse is at least -c - max(lse) (+inf on dead rows: no bound)
            low = NEG_INF if cap is None else cap_range.lowest(neg_lse.neg(), cap)
            tile_math.exp_nonpositive_(p, other if p is s else (None if ops.forms.library_exp else spare()), ops.forms, hide,
                                       low=low)  # fmt: skip
            d_o_s = query_rows(d_out, g, t, acc, (scratch, "do_s"))  # (b·g, r·it, e)
            d_o = d_o_s if mm == acc else query_rows(d_out, g, t, mm, (scratch, "do_mm"))
            p3 = tile_math.cast(p.view(b * g, -1, jt), mm, scratch, "p_mm")
            tile_math.add_mm(dv_t, p3.transpose(1, 2), d_o)  # dV += Pᵀ dO
            if cap is not None:  # P ∘ (1 - tanh²) where the tanh was; then dP where P was
                p = torch.addcmul(p, p, u.square_(), value=-1.0, out=u)
                ds_buf = other
            else:
                ds_buf = other if p is s else spare()
            ds = tile_math.mm(d_o_s, v_t.transpose(1, 2), ds_buf.view(b * g, -1, jt)).view(b, h, it, jt)  # dP = dO Vᵀ
            ds.sub_(delta[:, :, rows]).mul_(p)  # dS = P ∘ (dP - D), times 1 - tanh² under a cap; the scale goes on the products
            if cap is None and plan.score_mod is not None:
                first, *mod_grads = torch.autograd.grad(modded, [pre, *trainable], ds, allow_unused=True)
                ds = torch.zeros_like(ds) if first is None else first
                for n, grad in enumerate(mod_grads):
                    if grad is not None:
                        share.d_params[n] += grad
            ds3 = tile_math.cast(ds.reshape(b * g, -1, jt), mm, scratch, "ds_mm")
            # dQ += α dS K (rows of the r heads stacked), dK += α dSᵀ Q (summed over those heads)
            d_rows = scratch.take("dq", (b * g, (h // g) * it, q.shape[-1]), acc)
            share.dq[:, :, rows] += tile_math.mm(ds3, k_t, d_rows).view(b, h, it, -1)
            tile_math.add_mm(dk_t, ds3.transpose(1, 2), q_t, alpha=plan.scale)
        dk[:, :, j0:j1] = dk_t.view(b, g, jt, -1)
        dv[:, :, j0:j1] = dv_t.view(b, g, jt, -1)

    def make_share() -> _Share:
        dq = torch.zeros(b, h, i_len, q.shape[-1], dtype=acc, device=q.device)
        return _Share(tile_math.Scratch(q.device), dq, [torch.zeros_like(p) for p in trainable])

    tasks = sorted(cols_of)
    shares = threads.run(tasks, [tiles_cost(cols_of[j0], b, h) for j0 in tasks], work, make_share)
    dq = shares[0].dq
    for share in shares[1:]:
        dq += share.dq
    dq = dq.mul_(plan.scale).to(dtype)
    d_params = [sum(share.d_params[n] for share in shares) for n in range(len(trainable))]
    it_params = iter(d_params)
    return Grads(q=dq, k=dk, v=dv, bias=None, params=[next(it_params) if p.requires_grad else None for p in params])


@dataclass
class _Share:
    """One thread's scratch buffers and its accumulators of what several tasks write."""

    scratch: tile_math.Scratch
    dq: Tensor  # (b, h, i, d)
    d_params: list[Tensor]  # aligned with the trainable modifier tensors


def _row_dots(d_out: Tensor, out: Tensor, acc: torch.dtype, rows: int = 1024) -> Tensor:
    """``D = rowsum(dO ∘ O)`` ``(b, h, i, 1)`` in ``acc``, a block of rows at a time (no ``acc`` copies of the whole)."""
    delta = torch.empty((*out.shape[:-1], 1), dtype=acc, device=out.device)
    for r0 in range(0, out.shape[-2], rows):
        r = slice(r0, r0 + rows)
        delta[..., r, :] = (d_out[..., r, :].to(acc) * out[..., r, :].to(acc)).sum(-1, keepdim=True)
    return delta
