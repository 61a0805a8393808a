"""Dot-form attention with a score modifier, tile by tile: soft-capping by hand, any other modifier by autograd.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``d`` query/key size, ``e`` value size;
``it``/``jt`` the sides of a tile.

PyTorch's fused kernel never exposes its logits, so a modifier (``score_mod``,
``qkv.score_mods``) needs a tile loop of our own. This one is built for speed on a CPU,
for ``(b, h, i, d)`` inputs with a dot-form score, no dropout and no learned bias (those go
to ``online_softmax``):

* tiles of :data:`TILE_ROWS` × :data:`TILE_COLS` keep each elementwise pass in cache, and
  the tiles the mask reports empty are skipped (half of them under a causal mask);
* the ``r`` query heads that share a KV head are one ``(r·it, d)`` matrix, so each product
  is one batched matmul over ``(b, g)`` without copying keys or values, and outputs and
  gradients accumulate in place (``baddbmm_``);
* the forward keeps only ``out`` and ``lse``; the backward recomputes each tile's logits
  (FlashAttention-2, Dao 2023: ``P = exp(s - lse)``, ``D = rowsum(dO ∘ O)``,
  ``dS = P ∘ (dP - D)``).

**Soft-capping** (Gemma 2, ``qkv.SoftCap(c)``: ``s ← c · tanh(x / c)``, ``x = scale · qᵀk +
bias``) has a hand-written derivative, ``1 - tanh²``, applied to ``dS`` in place: no
autograd. The tile holds ``z = stretch·x/c`` (the factor rides on the tile's product), and
``tanh(z / stretch)`` is PyTorch's ``tanh`` (stretch 1) or, where ``torch.tanh`` is slow
(4 to 8 ns per element on the AMD EPYC this loop was tuned on), ``E / (E + 2)`` with
``E = expm1(z)`` (stretch 2): about half the cost there, and accurate to a few ulp; for
half-precision inputs also ``2σ(z) - 1`` (stretch 2), whose absolute error ``c·2⁻²³`` near 0
is far below their rounding (``tile_math.forms``). Every
exponential is of a non-positive argument (a logit minus the running maximum, or minus the
log-sum-exp), where ``exp(a) = σ(a) / (1 - σ(a))`` is exact to 3 ulp and twice as fast as
``torch.exp`` where ``sigmoid`` is fast. The faster forms differ by CPU (on an Intel Xeon,
``expm1`` costs five times ``exp``), so ``tile_math.forms`` times them once per process.
For float32 inputs the faster ``2σ(z) - 1`` is not used: it cancels as ``z → 0``, an absolute error of
``c·2⁻²⁴`` on every logit, tens of times plain float32's for Gemma's ``c = 50``. A capped
logit lies in ``[-c, c]``, so for caps up to 59 (float32) the forward subtracts a constant
instead of a running row maximum (``tiling.cap_range.fixed_base``): one pass and the rescaling saved per tile.

**Any other modifier** runs on the scaled, biased logits of the tile, then the mask; its backward is autograd through the modifier alone
on a detached copy of the tile (the tensors it reads, ``closure_tensors``, get their share),
then the same explicit ``dQ``, ``dK``.

A row with no allowed key has ``l = 0``: output 0, ``lse = -inf``, zero gradients.
Half-precision inputs are computed in float32. Checked against the float64 reference
backend in the test suite.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ... import score_mods
from ..._trace import concrete
from ..request import Request, bias_needs_grad
from ..tiling import cap_range, threads, tile_math
from ..tiling.tiles import NEG_INF, live_tiles
from .contract import Grads
from .mod_tiles_backward import tiles_backward
from .mod_tiles_parts import ModPlan, key_cols, mask_bias, operands, query_rows, tile_logits, tiles_by, tiles_cost

name = "mod_tiles"

#: Query rows per tile. With ``TILE_COLS`` and 8 heads a float32 tile is 4 MiB, the size at
#: which this machine's elementwise passes were cheapest per element (measured 0.03 ns for
#: a multiply, 0.3 for a sigmoid) while each Python-level op stays well above its overhead.
TILE_ROWS = 256
#: Keys per tile.
TILE_COLS = 256


def plan_of(req: Request) -> ModPlan:
    """The plan of a request this engine runs."""
    return ModPlan(req.mask, req.bias, req.scale, req.score_mod, TILE_ROWS, TILE_COLS)


def refuses(req: Request) -> str | None:
    if req.score_mod is None:
        return "it is the loop for score_mods, and this call has none"
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product"
    if req.dropout > 0:
        return "it has no dropout"
    if bias_needs_grad(req):
        return "it cannot differentiate a learned bias"
    return None


def tiles_forward(plan: ModPlan, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(out (b, h, i, e), lse (b, h, i))``, no graph; ``lse`` (float32 or wider) is ``-inf`` on rows with no key.

    ``out`` is in ``out_dtype`` (default float32 or wider); each block of rows is
    accumulated in float32 and written once. One task per block of query rows, which owns
    those rows (``tiling.threads`` runs the tasks on threads).
    """
    ops = operands(plan, q, k, v)
    q, k, v, acc = ops.q, ops.k, ops.v, ops.acc  # every forward product in acc (operands)
    (b, h, g), i_len, j_len, e = ops.heads, q.shape[2], k.shape[2], v.shape[-1]
    out = torch.zeros(b, h, i_len, e, dtype=acc if out_dtype is None else out_dtype, device=q.device)
    lse = torch.full((b, h, i_len), NEG_INF, dtype=acc, device=q.device)
    cap = plan.cap
    rows_of = tiles_by(live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device), "i0")
    fixed = None if cap is None else cap_range.fixed_base(cap, v, ops.forms, acc)
    fixed_low = NEG_INF if fixed is None else -cap - float(fixed)  # every capped logit minus B is at least this

    def block(i0: int, scratch: tile_math.Scratch, select: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``(m, l, rows)`` of the rows from ``i0``; ``select``: masked logits set to -inf before anything reads them."""
        tiles = rows_of[i0]
        it = tiles[0][0].i1 - i0
        m = torch.full((b, h, it, 1), NEG_INF, dtype=acc, device=q.device)
        l = torch.zeros(b, h, it, 1, dtype=acc, device=q.device)
        rows = torch.zeros(b, h, it, e, dtype=acc, device=q.device)
        q_t = query_rows(q, g, tiles[0][0], acc, (scratch, "q"))  # this task's query rows, for every key tile
        for t, state in tiles:
            s = tile_logits(plan, ops, q_t, key_cols(k, t, acc, (scratch, "k")), t, scratch)
            hide = mask_bias(plan, t, state, acc)
            if select and hide is not None and plan.score_mod is None:  # (a score_mod's output: selected below)
                s = s.masked_fill_(hide == NEG_INF, NEG_INF)
            tmp = scratch.take("tmp", s.shape, acc)
            if fixed is not None:  # no running maximum: the capped logits' range is known
                a = tile_math.capped_(s, fixed, cap, tmp, ops.forms, ops.clamp)  # c·tanh(z/stretch) - B
                p = tile_math.exp_nonpositive_(a, tmp, ops.forms, hide, low=fixed_low)
            elif cap is not None:
                if hide is not None:
                    s.add_(hide)
                # the row maximum of c·tanh(z/stretch) is at the row maximum of z: no pass over the capped tile
                z_max = s.amax(-1, keepdim=True)
                capped_max = torch.tanh(z_max / ops.forms.stretch) * cap
                m_new = torch.maximum(m, torch.where(torch.isneginf(z_max), NEG_INF, capped_max))
                base = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing allowed yet
                a = tile_math.capped_(s, base, cap, tmp, ops.forms, ops.clamp)  # c·tanh(z/stretch) - base
                # tanh(-inf) = -1: masked entries are finite again, and hidden by the exp;
                # every other entry is at least -c - base
                p = tile_math.exp_nonpositive_(a, tmp, ops.forms, hide, low=cap_range.lowest(base, cap))
            else:
                if plan.score_mod is not None:
                    s = score_mods.apply(plan.score_mod, s, t)
                    if select and hide is not None:  # what the modifier returned may not be ours to write
                        s = s.masked_fill(hide == NEG_INF, NEG_INF)
                if hide is not None:  # out of place: what the modifier returned may not be ours to write
                    s = s + hide
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                base = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing allowed yet
                a = torch.sub(s, base, out=scratch.take("p", s.shape, acc))  # masked entries stay -inf
                p = tile_math.exp_nonpositive_(a, tmp, ops.forms)
            if fixed is None:
                rescale = torch.exp(m - base)
                l.mul_(rescale)
                rows.mul_(rescale)
                m = m_new
            l += p.sum(-1, keepdim=True)
            pv = scratch.take("pv", (b * g, (h // g) * it, e), acc)
            rows += tile_math.mm(p.view(b * g, -1, t.j1 - t.j0), key_cols(v, t, acc, (scratch, "v")), pv).view(b, h, it, e)
        return (fixed if fixed is not None else m), l, rows

    def work(i0: int, scratch: tile_math.Scratch) -> None:
        m, l, rows = block(i0, scratch, select=False)
        # The mask is added to the logits (a tenth of the cost of selecting by it), so a nan or inf logit at a
        # masked key (a hidden key holding one, or what a score_mod made of it) reaches its row's sum: those
        # rows' block runs again with the masked logits selected away first (a nan at a seen key stays).
        # Traced or on meta tensors no value is read: such calls had their hidden keys zeroed first.
        if concrete(l) and bool(torch.isnan(l).any()):
            m, l, rows = block(i0, scratch, select=True)
        i1 = i0 + l.shape[-2]
        live = l != 0  # a dead row has no key (l = 0); a nan row (a nan at a key it sees) stays nan
        l = torch.where(live, l, 1.0)  # no division by 0 on dead rows (l may be far below 1 with a fixed base)
        out[:, :, i0:i1] = torch.where(live, rows / l, 0.0)
        lse[:, :, i0:i1] = torch.where(live, m + torch.log(l), NEG_INF).squeeze(-1)

    tasks = sorted(rows_of)
    threads.run(tasks, [tiles_cost(rows_of[i0], b, h) for i0 in tasks], work, lambda: tile_math.Scratch(q.device))
    return out, lse


def forward(req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
    """The contract's forward (``engines.contract``): ``out`` is written in ``dtype``."""
    out, lse = tiles_forward(plan_of(req), req.q, req.k, req.v, out_dtype=dtype)
    return out, lse, None


def backward(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: None, dtype: torch.dtype,
             rows: int | None = None) -> Grads:  # fmt: skip
    """The contract's backward (``engines.contract``): ``mod_tiles_backward.tiles_backward`` of the call's plan,
    with ``rows`` query rows per tile if given (less scratch per thread)."""
    plan = plan_of(req)
    return tiles_backward(plan if rows is None else replace(plan, block_i=rows), req, out, lse, d_out, dtype)
