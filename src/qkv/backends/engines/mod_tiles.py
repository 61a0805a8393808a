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
``E = expm1(z)`` (stretch 2): about half the cost there, and accurate to a few ulp. Every
exponential is of a non-positive argument (a logit minus the running maximum, or minus the
log-sum-exp), where ``exp(a) = σ(a) / (1 - σ(a))`` is exact to 3 ulp and twice as fast as
``torch.exp`` where ``sigmoid`` is fast. The faster forms differ by CPU (on an Intel Xeon,
``expm1`` costs five times ``exp``), so ``tile_math.forms`` times them once per process.
The faster ``2σ(z) - 1`` is not used: it cancels as ``z → 0``, an absolute error of
``c·2⁻²⁴`` on every logit, tens of times plain float32's for Gemma's ``c = 50``. A capped
logit lies in ``[-c, c]``, so for caps up to 59 (float32) the forward subtracts a constant
instead of a running row maximum (``tiling.cap_range.fixed_base``): one pass and the rescaling saved per tile.

**Any other modifier** runs on the scaled, biased logits of the tile, then the mask; its backward is autograd through the modifier alone
on a detached copy of the tile (the tensors it reads, ``closure_tensors``, get their share),
then the same explicit ``dQ``, ``dK``.

A row with no allowed key has ``l = 0``: output 0, ``lse = -inf``, zero gradients.
Half-precision inputs are computed in float32. Checked against the float64 reference
backend in ``tests/test_backends_mod_tiles.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from ... import score_mods
from ..._trace import concrete
from ...masks import Mask, Tile
from ...score_mods import SoftCap
from ..request import Request, bias_needs_grad
from ..tiling import lse as row_lse
from ..tiling import cap_range, threads, tile_math
from ..tiling.tiles import NEG_INF, BiasSource, live_tiles
from .contract import Grads, parameters

name = "mod_tiles"

#: Query rows per tile. With ``TILE_COLS`` and 8 heads a float32 tile is 4 MiB, the size at
#: which this machine's elementwise passes were cheapest per element (measured 0.03 ns for
#: a multiply, 0.3 for a sigmoid) while each Python-level op stays well above its overhead.
TILE_ROWS = 256
#: Keys per tile.
TILE_COLS = 256


@dataclass(frozen=True)
class ModPlan:
    """What a call is, besides its tensors."""

    mask: Mask | None  # True = may attend
    bias: object  # a dense tensor or a LazyBias, neither trained here, or None
    scale: float
    score_mod: Callable  # fn(score, b, h, q_idx, kv_idx); a SoftCap is run by hand
    block_i: int  # query tile side
    block_j: int  # key tile side

    @property
    def cap(self) -> float | None:
        return self.score_mod.cap if isinstance(self.score_mod, SoftCap) else None


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


def _rows(x: Tensor, g: int, t: Tile, dtype: torch.dtype) -> Tensor:
    """Rows ``i0:i1`` of ``x (b, h, i, ·)`` as ``(b·g, r·it, ·)`` in ``dtype``: the ``r`` heads of a KV head stacked."""
    b, h = x.shape[:2]
    return x[:, :, t.i0 : t.i1].to(dtype).reshape(b * g, (h // g) * (t.i1 - t.i0), x.shape[-1])


def _cols(x: Tensor, t: Tile, dtype: torch.dtype) -> Tensor:
    """Keys ``j0:j1`` of ``x (b, g, j, ·)`` as ``(b·g, jt, ·)`` in ``dtype`` (a view when it is ``x``'s)."""
    return x[:, :, t.j0 : t.j1].flatten(0, 1).to(dtype)


@dataclass(frozen=True)
class _Operands:
    """One call's operands as its tiles read them, and the numbers every tile uses."""

    q: Tensor  # (b, h, i, d), contiguous
    k: Tensor  # (b, g, j, d)
    v: Tensor  # (b, g, j, e)
    mm: torch.dtype  # the products' dtype
    acc: torch.dtype  # the dtype of everything elementwise and of every accumulator
    factor: float  # what multiplies qᵀk in a tile: scale, or stretch·scale/c under a soft cap
    bias: BiasSource  # the bias's tiles
    forms: tile_math.Forms  # how tanh and exp are computed
    clamp: bool  # the soft cap's expm1 may overflow: clamp it (cap_range.needs_clamp)

    @property
    def heads(self) -> tuple[int, int, int]:
        """``(b, h, g)``."""
        return self.q.shape[0], self.q.shape[1], self.k.shape[1]


def _operands(plan: ModPlan, q: Tensor, k: Tensor, v: Tensor) -> _Operands:
    """The operands, their products' dtype, and what multiplies ``qᵀk`` in a tile.

    bfloat16 products stay bfloat16 where they (float32 accumulation inside) beat float32
    ones on this CPU, else run in float32 (``tile_math.matmul_dtype``, timed once); float16
    runs float32. The operands keep their dtype and each tile's slice is converted to ``mm``
    as it is used, so no float32 copy of a whole input is held (a tile's conversion costs
    ``1/tile`` of its product). ``factor`` is ``scale``, or ``stretch·scale/c`` for a soft
    cap (the tile then holds ``z = stretch·x/c``, ``tile_math.Forms.stretch``); it is
    applied to each tile's product, so no scaled copy of ``q`` is made.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    mm = tile_math.matmul_dtype(q.dtype, q.device)
    forms = tile_math.forms(q.device)
    factor = plan.scale if plan.cap is None else forms.stretch * plan.scale / plan.cap
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # a shift-invariant bias's profile in acc once: each tile is then one copy (the row flip)
    # of it, not a float64 copy and a conversion
    bias = BiasSource(plan.bias, q.shape[-2], k.shape[-2], q.device, dtype=acc)
    clamp = plan.cap is not None and not forms.library_tanh and cap_range.needs_clamp(plan.bias is not None, q, k, factor)
    return _Operands(q, k, v, mm, acc, factor, bias, forms, clamp)


def _logits(plan: ModPlan, ops: _Operands, q_t: Tensor, k_t: Tensor, t: Tile, scratch: tile_math.Scratch) -> Tensor:
    """``(b, h, it, jt)``: ``scale·qᵀk + bias``, or for a soft cap ``z = stretch·(scale·qᵀk + bias)/c``.

    ``q_t (b·g, r·it, d)`` and ``k_t (b·g, jt, d)`` are the tile's operands (``_rows``, ``_cols``).
    """
    b, h, _ = ops.heads
    it, jt = t.i1 - t.i0, t.j1 - t.j0
    out = scratch.take("s", (q_t.shape[0], q_t.shape[1], jt), ops.acc)
    if q_t.dtype == ops.acc:  # the factor rides on the product (beta = 0: out's old values are ignored)
        s = torch.baddbmm(out, q_t, k_t.transpose(1, 2), beta=0.0, alpha=ops.factor, out=out)
    else:
        s = out.copy_(torch.bmm(q_t, k_t.transpose(1, 2))).mul_(ops.factor)
    s = s.view(b, h, it, jt)
    if (tile := ops.bias.tile(t)) is not None:
        s.add_(tile.to(s.dtype), alpha=1.0 if plan.cap is None else ops.forms.stretch / plan.cap)
    return s


def _row_dots(d_out: Tensor, out: Tensor, acc: torch.dtype, rows: int = 1024) -> Tensor:
    """``D = rowsum(dO ∘ O)`` ``(b, h, i, 1)`` in ``acc``, a block of rows at a time (no ``acc`` copies of the whole)."""
    delta = torch.empty((*out.shape[:-1], 1), dtype=acc, device=out.device)
    for r0 in range(0, out.shape[-2], rows):
        r = slice(r0, r0 + rows)
        delta[..., r, :] = (d_out[..., r, :].to(acc) * out[..., r, :].to(acc)).sum(-1, keepdim=True)
    return delta


def _hide(plan: ModPlan, t: Tile, state: str, acc: torch.dtype) -> Tensor | None:
    """``-inf`` where tile ``t``'s mask forbids, 0 elsewhere (None on a full tile): added, not ``masked_fill``-ed.

    A broadcast add of this small ``(it, jt)`` pattern ran about 20 times faster than
    ``masked_fill_`` with the same broadcast bool mask (1 ms per 8-head 256 × 256 tile).
    """
    if state == "full":
        return None
    allowed = plan.mask.tile(t)
    return torch.zeros(allowed.shape, dtype=acc, device=allowed.device).masked_fill_(~allowed, NEG_INF)


def _by(tiles, key: str) -> dict[int, list]:
    """Non-empty ``(tile, state)`` pairs grouped by their first row (``"i0"``) or column (``"j0"``)."""
    groups: dict[int, list] = {}
    for t, state in tiles:
        groups.setdefault(getattr(t, key), []).append((t, state))
    return groups


def _cost(tiles, b: int, h: int) -> int:
    return sum(b * h * (t.i1 - t.i0) * (t.j1 - t.j0) for t, _ in tiles)


def tiles_forward(plan: ModPlan, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(out (b, h, i, e), lse (b, h, i))``, no graph; ``lse`` (float32 or wider) is ``-inf`` on rows with no key.

    ``out`` is in ``out_dtype`` (default float32 or wider); each block of rows is
    accumulated in float32 and written once. One task per block of query rows, which owns
    those rows (``tiling.threads`` runs the tasks on threads).
    """
    ops = _operands(plan, q, k, v)
    q, k, v, mm, acc = ops.q, ops.k, ops.v, ops.mm, ops.acc
    (b, h, g), i_len, j_len, e = ops.heads, q.shape[2], k.shape[2], v.shape[-1]
    out = torch.zeros(b, h, i_len, e, dtype=acc if out_dtype is None else out_dtype, device=q.device)
    lse = torch.full((b, h, i_len), NEG_INF, dtype=acc, device=q.device)
    cap = plan.cap
    rows_of = _by(live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device), "i0")
    fixed = None if cap is None else cap_range.fixed_base(cap, v, ops.forms, acc)
    fixed_low = NEG_INF if fixed is None else -cap - float(fixed)  # every capped logit minus B is at least this

    def block(i0: int, scratch: tile_math.Scratch, select: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``(m, l, rows)`` of the rows from ``i0``; ``select``: masked logits set to -inf before anything reads them."""
        tiles = rows_of[i0]
        it = tiles[0][0].i1 - i0
        m = torch.full((b, h, it, 1), NEG_INF, dtype=acc, device=q.device)
        l = torch.zeros(b, h, it, 1, dtype=acc, device=q.device)
        rows = torch.zeros(b, h, it, e, dtype=acc, device=q.device)
        q_t = _rows(q, g, tiles[0][0], mm)  # this task's query rows, for every key tile
        for t, state in tiles:
            s = _logits(plan, ops, q_t, _cols(k, t, mm), t, scratch)
            hide = _hide(plan, t, state, acc)
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
            rows += tile_math.mm(p.view(b * g, -1, t.j1 - t.j0).to(mm), _cols(v, t, mm), pv).view(b, h, it, e)
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
    threads.run(tasks, [_cost(rows_of[i0], b, h) for i0 in tasks], work, lambda: tile_math.Scratch(q.device))
    return out, lse


def backward(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: None, dtype: torch.dtype,
             rows: int | None = None) -> Grads:  # fmt: skip
    """The contract's backward (``engines.contract``): gradients in ``dtype``, from the final ``out`` and ``lse``.

    The tensors the modifier reads get theirs, aligned with ``parameters(req)`` (None where
    none is needed). One task per block of keys, which accumulates its rows of ``dk`` and
    ``dv`` in float32 and writes them once; ``dq`` and the modifier's tensors are summed per
    thread, then over threads in a fixed order.
    """
    plan = plan_of(req)
    plan = plan if rows is None else replace(plan, block_i=rows)  # fewer rows per tile: less scratch per thread
    params = tuple(parameters(req))
    # only the modifier's tile is differentiated here
    ops = _operands(plan, req.q.detach(), req.k.detach(), req.v.detach())
    q, k, v, mm, acc = ops.q, ops.k, ops.v, ops.mm, ops.acc
    (b, h, g), i_len = ops.heads, q.shape[2]
    d_out = d_out.contiguous()
    lse = row_lse.for_recompute(lse, acc)
    delta = _row_dots(d_out, out, acc)  # D = rowsum(dO ∘ O)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    trainable = [p for p in params if p.requires_grad]
    cap = plan.cap
    cols_of = _by(live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, k.shape[2], q.device), "j0")

    def work(j0: int, share: _Share) -> None:
        scratch = share.scratch
        j1 = cols_of[j0][0][0].j1
        jt = j1 - j0
        dk_t = torch.zeros(b * g, jt, k.shape[-1], dtype=acc, device=q.device)
        dv_t = torch.zeros(b * g, jt, v.shape[-1], dtype=acc, device=q.device)
        k_t, v_t = _cols(k, cols_of[j0][0][0], mm), _cols(v, cols_of[j0][0][0], mm)  # this task's keys, for every row tile
        for t, state in cols_of[j0]:
            it = t.i1 - t.i0
            rows = slice(t.i0, t.i1)
            q_t = _rows(q, g, t, mm)
            with torch.no_grad():
                s = _logits(plan, ops, q_t, k_t, t, scratch)
            hide = _hide(plan, t, state, acc)
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
            # a capped logit minus the lse is at least -c - max(lse) (+inf on dead rows: no bound)
            low = NEG_INF if cap is None else cap_range.lowest(neg_lse.neg(), cap)
            tile_math.exp_nonpositive_(p, other if p is s else (None if ops.forms.library_exp else spare()), ops.forms, hide,
                                       low=low)  # fmt: skip
            d_o = _rows(d_out, g, t, mm)  # (b·g, r·it, e)
            p3 = p.view(b * g, -1, jt).to(mm)
            tile_math.add_mm(dv_t, p3.transpose(1, 2), d_o)  # dV += Pᵀ dO
            if cap is not None:  # P ∘ (1 - tanh²) where the tanh was; then dP where P was
                p = torch.addcmul(p, p, u.square_(), value=-1.0, out=u)
                ds_buf = other
            else:
                ds_buf = other if p is s else spare()
            ds = tile_math.mm(d_o, v_t.transpose(1, 2), ds_buf.view(b * g, -1, jt)).view(b, h, it, jt)  # dP = dO Vᵀ
            ds.sub_(delta[:, :, rows]).mul_(p)  # dS = P ∘ (dP - D), times 1 - tanh² under a cap; the scale goes on the products
            if cap is None and plan.score_mod is not None:
                first, *mod_grads = torch.autograd.grad(modded, [pre, *trainable], ds, allow_unused=True)
                ds = torch.zeros_like(ds) if first is None else first
                for n, grad in enumerate(mod_grads):
                    if grad is not None:
                        share.d_params[n] += grad
            ds3 = ds.reshape(b * g, -1, jt).to(mm)
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
    shares = threads.run(tasks, [_cost(cols_of[j0], b, h) for j0 in tasks], work, make_share)
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


def forward(req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
    """The contract's forward (``engines.contract``): ``out`` is written in ``dtype``."""
    out, lse = tiles_forward(plan_of(req), req.q, req.k, req.v, out_dtype=dtype)
    return out, lse, None
