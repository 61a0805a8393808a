"""Dot-form attention by query blocks through PyTorch's fused CPU kernel, with the log-sum-exp.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``it`` the rows of one query block and
``jt`` the keys that block can see.

For a dot-product score the inner loop over key tiles is best left to PyTorch's fused
kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``), which is itself an online
softmax in C++ and, unlike ``F.scaled_dot_product_attention``, also returns the
log-sum-exp that rebuilding weights needs. What the kernel cannot do is build a lazy bias
or mask tile by tile. So the queries are cut into blocks; each block gets its bias and
mask as one ``(h, it, jt)`` float tensor (masked entries ``-inf``) over only the keys its
mask leaves visible (``tiles.key_range``), and one kernel call. Memory beyond the plain
kernel is one block's bias, not the ``(h, i, j)`` tensor. The backward calls the kernel's
own backward per block with the same bias, summing the key and value gradients. Without a
mask there are no keys to skip, and a single call over all rows is both the fastest and
the smallest: its gradients are the result, with no accumulators or per-block copies.

A query with no visible key comes out of the kernel as 0; its ``lse`` is set to ``-inf``
(no mass, ``tiling.lse``) and its incoming gradient is zeroed, so its gradients are 0.

The kernel cannot differentiate the bias. For a learned shift-invariant bias under a
window mask or none (T5 buckets) the gradient is rebuilt by ``tiling.bias_grad`` from the
diagonals of ``dS``; beyond ``max_distance`` only region sums are needed, and those come
from the forward pass: each query block is attended over its near keys (offset <
``max_distance``) and its far-future keys separately, two kernel calls whose partial
softmaxes are merged by their log-sum-exp, which leaves the far keys' own output and
log-sum-exp (``_split_block``, the engine's ``saved``). Other learned biases go to
``online_softmax``. Checked against the float64 reference in
the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...masks import Tile
from ...positional import RelativePositionBias
from ..request import Request, bias_needs_grad
from ..tiling import flash_cpu, lse as row_lse
from ..tiling.bias_grad import Rows, add_profile_grad, far_profile_grad, saturating_profile_grad
from ..tiling.flash_cpu import grouped_backward, mask_dtype, same_head_size
from ..tiling.offset_profile import DiagonalMask
from ..tiling.tiles import NEG_INF, BiasSource, key_range
from . import bias_backward, fused_masks, fused_runs, mod_tiles
from .contract import Grads, parameters
from .fused_masks import FusedPlan

name = "fused_blocks"

# the private fused CPU kernel: refuses() lets a call through only where flash_cpu.unusable allows
_forward = flash_cpu.forward

#: Bytes allowed for one block's float bias/mask; blocks shrink to stay under it.
BLOCK_BYTES = 32 * 2**20
#: Query rows per call when the mask is a window read from the diagonal profile, and per
#: near/far pair of calls of a learned T5 bias (whose key ranges overlap by this much):
#: fewer calls are faster; smaller blocks skip more of the keys a causal mask hides and
#: keep the reversed copies of q, out and their gradients small. Without a mask it is one
#: call over all rows.
DIAGONAL_ROWS = 512
#: Key granularity for skipping keys a whole query block cannot see.
KEY_STEP = 256


def rows_per_block(plan: FusedPlan, q: Tensor, j_len: int, diagonal: bool) -> int:
    """Query rows per kernel call: all of them when there is nothing to build per block."""
    i_len = q.shape[-2]
    if (plan.mask is None and plan.bias is None) or plan.causal_square:
        return i_len
    if diagonal:  # masks are free views; blocks skip keys a window hides and bound the row flips
        return min(i_len, DIAGONAL_ROWS)
    if plan.bias is None:  # a mask alone runs in fused_runs, which bounds each partial run's mask itself
        return min(i_len, fused_runs.RUN_ROWS)
    per_row = max(1, q.shape[0] * q.shape[1] * j_len * mask_dtype(q).itemsize)  # worst case: a (b, h, it, jt) mask
    rows = max(32, BLOCK_BYTES // per_row) // 32 * 32
    return min(i_len, rows)


def saturation(bias) -> int | None:
    """Offset beyond which a learned bias is one value per side (T5's ``max_distance``), or None."""
    if isinstance(bias, RelativePositionBias):
        return bias.max_distance
    return None


def _blocks(plan: FusedPlan, q: Tensor, j_len: int, diagonal: bool, split: bool = False, whole: bool = False):
    i_len = q.shape[-2]
    step = i_len if whole else min(i_len, DIAGONAL_ROWS) if split else rows_per_block(plan, q, j_len, diagonal)
    for i0 in range(0, i_len, step):
        i1 = min(i0 + step, i_len)
        if plan.causal_square:
            yield Tile(i0, i1, 0, j_len, i_len, j_len, q.device)
            continue
        jlo, jhi = key_range(plan.mask, i0, i1, i_len, j_len, KEY_STEP, q.device)
        yield Tile(i0, i1, jlo, jhi, i_len, j_len, q.device)


def far_reach(plan: FusedPlan, diagonal: DiagonalMask | None) -> int | None:
    """``max_distance`` when a learned saturating bias has keys at offsets >= it, else None."""
    reach = saturation(plan.bias)
    if not plan.learned or diagonal is None or reach is None:
        return None
    w = diagonal.window
    farthest = diagonal.i_len - 1 if w is None or w.hi is None else min(diagonal.i_len - 1, w.hi)
    return reach if farthest >= reach else None


@dataclass(frozen=True)
class Learned:
    """What the forward keeps for the gradient of a learned bias.

    ``own_lse (b, h, i)`` is the log-sum-exp over this call's keys: relative to a row's final
    log-sum-exp ``L`` (with sinks), everything outside them holds ``1 - exp(own_lse - L)`` of
    its mass. For a saturating bias with keys beyond its reach, ``far_out (b, h, i, e)`` is
    the far-future keys' own softmax-normalised output and ``far_lse (b, h, i)`` their
    log-sum-exp: they hold ``exp(far_lse - L)`` of the row's mass. ``lse_pass``: the backward
    is ``engines.call``'s pass for the lse's gradient (values of ones, an output of zeros).
    """

    own_lse: Tensor
    far_out: Tensor | None = None
    far_lse: Tensor | None = None
    lse_pass: bool = False


def _split_block(near: DiagonalMask, far: DiagonalMask, t: Tile, q: Tensor, k: Tensor, v: Tensor, scale: float, reach: int):
    """One block attended over offsets ``< reach`` and ``>= reach`` separately, then merged.

    Returns ``(out, lse, far_out, far_lse)`` for rows ``t.i0:t.i1``: the far keys' own
    output and log-sum-exp are what the bias gradient needs (:class:`Learned`). Each part costs
    its keys only: the two key ranges overlap by the block's height.
    """
    shift = near.shift
    q_rev = q[..., t.i0 : t.i1, :].flip(-2)
    parts = []
    ranges = ((near, None, reach - 1, t.j0, min(t.j1, t.i1 - 1 + shift + reach)), (far, reach, None, max(t.j0, t.i0 + shift + reach), t.j1))
    for mask, lo, hi, j0, j1 in ranges:
        live = mask.sees(t, lo, hi) if j0 < j1 else None
        if live is None or not bool(live.any()):
            empty = torch.full(q_rev.shape[:-1], NEG_INF, dtype=mask_dtype(q), device=q.device)
            parts.append((q.new_zeros((*q_rev.shape[:-1], v.shape[-1])), empty))
            continue
        sub = Tile(t.i0, t.i1, j0, j1, t.i_len, t.j_len, q.device)
        o, m = _forward(q_rev, k[..., j0:j1, :], v[..., j0:j1, :], 0.0, False, attn_mask=mask.reversed_block(sub), scale=scale)
        parts.append((o.flip(-2), torch.where(live, m.flip(-1), NEG_INF)))  # the kernel gives a row with no key lse 0
    (o_near, m_near), (o_far, m_far) = parts
    acc = m_near.dtype  # merged in float32 (or wider): half-precision parts would round twice
    out, lse = row_lse.merge(o_near.to(acc), m_near, o_far.to(acc), m_far)
    return out.to(q.dtype), lse, o_far, m_far


def fused_forward(plan: FusedPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Learned | None]:
    """``(out, lse, learned)`` of one call: ``lse`` is ``-inf`` on rows that see no key.

    ``learned`` is what the gradient of a learned bias needs (:class:`Learned`, with the far
    keys' part for a saturating one, ``_split_block``), else None. No autograd graph.
    """
    i_len, j_len = q.shape[-2], k.shape[-2]
    out = lse = None  # made by the first block that does not cover every row (one call's own are the result)
    # (a causal square is the kernel's own flag: no offset profile to build)
    diagonal = None if plan.causal_square else fused_masks.diagonal_mask(plan, q, k)
    bias = None if diagonal is not None else BiasSource(plan.bias, i_len, j_len, q.device)
    bound = None if diagonal is not None else fused_masks.logit_bound(plan, q, k)  # for each block's mask
    reach = far_reach(plan, diagonal)
    far_out = far_lse = None
    if reach is not None:  # learned T5 buckets: keep the far keys' part for the bias gradient
        far_out, far_lse = _empty_rows(q, v)
        near, far = diagonal.clipped(hi=reach - 1), diagonal.clipped(lo=reach)
    whole = diagonal is not None and plan.mask is None and reach is None  # nothing to skip: one call
    for t in _blocks(plan, q, j_len, diagonal is not None, split=reach is not None, whole=whole):
        rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
        if t.j0 == t.j1:
            continue
        kc, vc = k[..., cols, :], v[..., cols, :]
        live = None
        if reach is not None:
            o, m, far_out[..., rows, :], far_lse[..., rows] = _split_block(near, far, t, q, k, v, plan.scale, reach)
        elif plan.causal_square:
            o, m = _forward(q[..., rows, :], kc, vc, 0.0, True, scale=plan.scale)
        elif diagonal is not None:
            add, live = diagonal.reversed_block(t), diagonal.live(t)
            o, m = _forward(q[..., rows, :].flip(-2), kc, vc, 0.0, False, attn_mask=add, scale=plan.scale)
            o, m = o.flip(-2), m.flip(-1)
        elif plan.bias is None and plan.mask is not None:  # a mask alone: its full tiles unmasked, its partial ones masked (fused_runs)
            o, m = fused_runs.forward(plan.mask, t, q, k, v, plan.scale)
        else:
            add, live = fused_masks.block_mask(plan, t, bias, mask_dtype(q), bound)
            o, m = _forward(q[..., rows, :], kc, vc, 0.0, False, attn_mask=add, scale=plan.scale)
        if live is not None:
            o = o * live
            m = torch.where(live.squeeze(-1), m, NEG_INF)
        if t.i1 - t.i0 == i_len:
            out, lse = o, m.to(mask_dtype(q))
            continue
        if out is None:
            out, lse = _empty_rows(q, v)
        out[..., rows, :] = o
        lse[..., rows] = m
    if out is None:  # every row saw no key
        out, lse = _empty_rows(q, v)
    return out, lse, Learned(lse, far_out, far_lse) if plan.learned else None


def _empty_rows(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of rows that see no key: zeros, and ``-inf``."""
    return q.new_zeros((*q.shape[:-1], v.shape[-1])), torch.full(q.shape[:-1], NEG_INF, dtype=mask_dtype(q), device=q.device)


def fused_backward(
    plan: FusedPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
    learned: Learned | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``(dq, dk, dv, d_profile)`` from the row's final output ``out`` and log-sum-exp ``lse``.

    Rows with an infinite ``lse`` see no key anywhere: their gradients are 0. ``d_profile``
    is the gradient of a learned bias's ``(h|1, L)`` profile (``plan.learned``, with what
    :func:`fused_forward` kept in ``learned``), else None.
    """
    i_len, j_len = q.shape[-2], k.shape[-2]
    dead = ~torch.isfinite(lse)
    if bool(dead.any()):  # no gradient flows from rows that see no key (a copy: never write into the caller's)
        d_out = d_out.masked_fill(dead[..., None], 0.0)
    d_out = d_out.contiguous()
    kernel_lse = torch.where(dead, 0.0, lse)  # the kernel's backward wants a finite lse (dead rows' d_out is 0)
    dq = dk = dv = None  # allocated by the first block that does not cover every row and key
    diagonal = fused_masks.diagonal_mask(plan, q, k)
    d_profile = None
    if plan.learned:
        acc = mask_dtype(q)
        d_profile = torch.zeros(diagonal.profile.shape, dtype=acc, device=q.device)
        delta = torch.einsum("...e,...e->...", d_out.to(acc), out.to(acc))  # D = rowsum(dO ∘ O), via bmm
    bias = None if diagonal is not None else BiasSource(plan.bias, i_len, j_len, q.device)
    bound = None if diagonal is not None else fused_masks.logit_bound(plan, q, k)  # for each block's mask
    reach = saturation(plan.bias)
    if d_profile is not None and learned.far_out is not None:
        far_share = torch.exp(learned.far_lse - row_lse.for_recompute(lse))  # relative to the final lse
        far_profile_grad(d_profile, d_out, delta, reach, diagonal.offset0, (learned.far_out, far_share))
    # Without a mask there are no keys to skip: one call over every row, whose gradients are
    # the result (no accumulators and no per-block copies, which is what bounds the memory).
    whole = diagonal is not None and plan.mask is None
    for t in _blocks(plan, q, j_len, diagonal is not None, whole=whole):
        if t.j0 == t.j1:
            continue
        rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
        if diagonal is None and not plan.causal_square and plan.bias is None and plan.mask is not None:  # fused_runs
            if dq is None:
                dq, dk, dv = _accumulators(q, k, v)
            given = [d_out[..., rows, :], q[..., rows, :], out[..., rows, :], kernel_lse[..., rows]]
            fused_runs.backward(plan.mask, t, given, k, v, plan.scale, (dq, dk, dv))
            continue
        args = [d_out[..., rows, :], q[..., rows, :], k[..., cols, :], v[..., cols, :], out[..., rows, :], kernel_lse[..., rows]]
        add, flip = None, diagonal is not None and not plan.causal_square
        if flip:
            add = diagonal.reversed_block(t)
            args = [x.flip(-1 if n == 5 else -2) if n in (0, 1, 4, 5) else x for n, x in enumerate(args)]
        elif not plan.causal_square:
            add = fused_masks.block_mask(plan, t, bias, mask_dtype(q), bound)[0]
        gq, gk, gv = grouped_backward(*args, 0.0, plan.causal_square, attn_mask=add, scale=plan.scale)
        if d_profile is not None and reach is None:
            flipped = Rows(q=args[1], d_out=args[0], lse=args[5], delta=delta[..., rows].flip(-1))  # already reversed
            add_profile_grad(d_profile, flipped, args[2], args[3], add, diagonal.base(t), plan.scale)
        del args  # the flipped copies, before gq's
        if flip:
            gq = gq.flip(-2)
        if (t.i1 - t.i0, t.j1 - t.j0) == (i_len, j_len):
            dq, dk, dv = gq, gk, gv
            continue
        if dq is None:
            dq, dk, dv = _accumulators(q, k, v)
        dq[..., rows, :] = gq
        dk[..., cols, :] += gk
        dv[..., cols, :] += gv
    if dq is None:  # every row saw no key
        dq, dk, dv = _accumulators(q, k, v)
    if d_profile is not None and reach is not None:  # after the loop: its blocks reuse the freed memory
        recompute = row_lse.for_recompute(lse)
        # the mass a row holds outside this call's keys (sinks): its dS sums to D times that mass
        outside = torch.where(torch.isinf(recompute), 0.0, -torch.expm1(learned.own_lse - recompute))
        # a row of dS sums to Σ_c P dP - D·mass = dO·(the values' true output) - D·mass: D·outside for the
        # output's own gradient; in the lse's pass (values of ones, whose true output is the mass, an output of
        # zeros so D = 0) it is d_lse·mass
        row_sums = delta * outside if not learned.lse_pass else d_out[..., 0].to(delta.dtype) * (1.0 - outside)
        saturating_profile_grad(d_profile, diagonal, Rows(q, d_out, recompute, delta), k, v, plan.scale, reach, row_sums)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_profile


def _accumulators(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zeroed ``dq, dk, dv`` in float32 (or wider): the blocks' shares are summed there and rounded once at the end
    (summed in half precision, each of a key's row blocks rounded its gradient again: bf16's 8 bits, 16 times at
    i = 4096)."""
    acc = mask_dtype(q)
    return (torch.zeros(q.shape, dtype=acc, device=q.device), torch.zeros(k.shape, dtype=acc, device=k.device),
            torch.zeros(v.shape, dtype=acc, device=v.device))  # fmt: skip


def plan_of(req: Request) -> FusedPlan:
    causal_square = req.bias is None and req.is_causal_only and req.i == req.j
    return FusedPlan(req.mask, req.bias, req.scale, causal_square, DiagonalMask.applies(req.mask, req.bias), bias_needs_grad(req))


def refuses(req: Request) -> str | None:
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product"
    if req.dropout > 0:
        return "the fused kernel's dropout cannot be repeated in its backward"
    if req.score_mod is not None:
        return "a score_mod needs each tile's logits, which the fused kernel never exposes"
    if (reason := flash_cpu.unusable(req.q)) is not None:
        return reason
    if bias_needs_grad(req):
        if isinstance(req.bias, Tensor) or not DiagonalMask.applies(req.mask, req.bias):
            return "the fused kernel cannot differentiate this learned bias under this mask"
        if req.piece is not None:
            return "a learned bias's gradient needs the whole call's forward, which a block of keys does not keep"
    return None


def saved_for_lse(saved: Learned | None) -> Learned | None:
    """``saved`` as it would be for values that are one column of ones (``engines.call``'s lse gradient).

    The far keys' own output is then 1 on every row that sees one, and 0 elsewhere.
    """
    if saved is None:
        return saved
    if saved.far_out is None:
        return replace(saved, lse_pass=True)
    ones = torch.isfinite(saved.far_lse)[..., None].to(saved.far_out.dtype)
    return Learned(saved.own_lse, ones, saved.far_lse, lse_pass=True)


def forward(req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, Learned | None]:
    """The contract's forward (``engines.contract``): ``out`` comes in the inputs' dtype."""
    if req.differentiated:
        # Time the backward's engine now, once per dtype and process, while this call holds only
        # its inputs: timed inside the backward, the one-time timing's tensors sat on top of the
        # forward's saved state (ALiBi, i = 4096: 40-50 MiB more peak memory on a first call).
        backward_engine(req)
    e = req.v.shape[-1]
    out, lse, far = fused_forward(plan_of(req), *same_head_size(req.q, req.k, req.v))
    return out[..., :e], lse, far


def backward(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: Learned | None, dtype: torch.dtype) -> Grads:
    """The contract's backward: the kernel's per block, or ``mod_tiles``' where that was timed faster (``bias_backward``)."""
    if bias_backward.moves(req, saved, (forward, fused_backward_of)):
        return bias_backward.backward(req, out, lse, d_out, dtype)
    return fused_backward_of(req, out, lse, d_out, saved, dtype)


def backward_engine(req: Request) -> str | None:
    """The engine whose backward runs this call's gradients when it is not this one (for ``qkv.explain``)."""
    return mod_tiles.name if req.differentiated and bias_backward.moves(req, None, (forward, fused_backward_of)) else None


def fused_backward_of(req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: Learned | None, dtype: torch.dtype) -> Grads:
    """The kernel's backward per block; a learned bias's profile gradient reaches its parameters here."""
    q, k, v = req.q, req.k, req.v
    d, e = q.shape[-1], v.shape[-1]
    qf, kf, vf = same_head_size(q, k, v)
    pad = vf.shape[-1] - e  # the kernel wants d == e: zero value columns, sliced off after
    out_f, d_out_f = (torch.nn.functional.pad(x.to(q.dtype), (0, pad)) if pad else x.to(q.dtype) for x in (out, d_out))
    plan = plan_of(req)
    dq, dk, dv, d_profile = fused_backward(plan, qf, kf, vf, out_f, lse, d_out_f, saved)
    params = parameters(req)
    d_params: list[Tensor | None] = [None] * len(params)
    if d_profile is not None:  # one backward through the bias for the whole call: (h, L) profile -> parameters
        profile = BiasSource(req.bias, req.i, req.j, q.device, grad=True).profile_graph
        wanted = [n for n, p in enumerate(params) if p.requires_grad]
        grads = torch.autograd.grad(profile, [params[n] for n in wanted], d_profile.to(profile.dtype), allow_unused=True)
        for n, grad in zip(wanted, grads):
            d_params[n] = grad
    return Grads(q=dq[..., :d], k=dk[..., :d], v=dv[..., :e], bias=None, params=d_params)
