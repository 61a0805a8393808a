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

A query with no visible key comes out of the kernel as 0; its ``lse`` is set to ``+inf``
(weights exp(s - lse) = 0) and its incoming gradient is zeroed, so its gradients are 0.

The kernel cannot differentiate the bias. For a learned shift-invariant bias under a
window mask or none (T5 buckets) the gradient is rebuilt by ``bias_grad`` from the
diagonals of ``dS``; beyond ``max_distance`` only region sums are needed, and those come
from the forward pass: each query block is attended over its near keys (offset <
``max_distance``) and its far-future keys separately, two kernel calls whose partial
softmaxes are merged by their log-sum-exp, which leaves the far keys' share of every row
(``_split_block``). Other learned biases go to ``online_softmax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks import Tile
from ..positional import RelativePositionBias
from . import kernels
from . import sinks as sink
from .bias_grad import add_profile_grad, far_profile_grad, saturating_profile_grad
from .diagonal import DiagonalMask, FusedPlan
from .tiles import NEG_INF, BiasSource, as_heads, key_range

# the private fused CPU kernel; chunked.engine chooses this engine only where kernels.unusable allows
_forward, _backward = kernels.forward, kernels.backward

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


def mask_dtype(q: Tensor) -> torch.dtype:
    """dtype of the additive masks: float32 for half-precision inputs (the kernel adds them in float32)."""
    return torch.promote_types(q.dtype, torch.float32)


def rows_per_block(plan: FusedPlan, q: Tensor, j_len: int, diagonal: bool) -> int:
    """Query rows per kernel call: all of them when there is nothing to build per block."""
    i_len = q.shape[-2]
    if (plan.mask is None and plan.bias is None) or plan.causal_square:
        return i_len
    if diagonal:  # masks are free views; blocks skip keys a window hides and bound the row flips
        return min(i_len, DIAGONAL_ROWS)
    per_row = max(1, q.shape[0] * q.shape[1] * j_len * mask_dtype(q).itemsize)  # worst case: a (b, h, it, jt) mask
    rows = max(32, BLOCK_BYTES // per_row) // 32 * 32
    return min(i_len, rows)


def _block_mask(plan: FusedPlan, t: Tile, bias: BiasSource, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """Float ``(b|1, h|1, it, jt)`` additive mask for one block, and bool live rows (None if all live)."""
    add = None
    if plan.bias is not None:
        add = as_heads(bias.tile(t), 4).to(dtype)
        if add.shape[-2:] != (t.i1 - t.i0, t.j1 - t.j0):  # a dense bias broadcast along i or j
            add = add.expand(*add.shape[:-2], t.i1 - t.i0, t.j1 - t.j0).contiguous()
    live = None
    state = "full" if plan.mask is None else plan.mask.state(t)
    if state != "full":
        allowed = as_heads(plan.mask.tile(t), 4)
        any_key = allowed.any(-1, keepdim=True)
        if not bool(any_key.all()):
            live = any_key
        fill = torch.zeros((), dtype=dtype).masked_fill(torch.tensor(True), NEG_INF)
        if add is None:
            add = torch.where(allowed, torch.zeros((), dtype=dtype), fill)
        else:
            add = add.masked_fill(~allowed, NEG_INF)
    return add, live


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


def far_reach(plan: FusedPlan, diagonal: DiagonalMask | None, profile: Tensor | None) -> int | None:
    """``max_distance`` when a learned saturating bias has keys at offsets >= it, else None."""
    reach = saturation(plan.bias)
    if profile is None or diagonal is None or reach is None:
        return None
    w = diagonal.window
    farthest = diagonal.i_len - 1 if w is None or w.hi is None else min(diagonal.i_len - 1, w.hi)
    return reach if farthest >= reach else None


def _split_block(near: DiagonalMask, far: DiagonalMask, t: Tile, q: Tensor, k: Tensor, v: Tensor, scale: float, reach: int):
    """One block attended over offsets ``< reach`` and ``>= reach`` separately, then merged.

    Returns ``(out, lse, far_out, far_share)`` for rows ``t.i0:t.i1``: ``far_share`` is the
    softmax mass ``Σ_{c far} P_rc`` of the far keys and ``far_out = Σ_{c far} P_rc v_c``, which
    the bias gradient needs (``bias_grad.saturating_profile_grad``). Merging two partial
    softmaxes is ``lse = logaddexp(lse_1, lse_2)``, ``out = Σ_n exp(lse_n - lse) out_n``.
    Each part costs its keys only: the two key ranges overlap by the block's height.
    """
    shift = near.shift
    q_rev = q[..., t.i0 : t.i1, :].flip(-2)
    parts = []
    ranges = ((near, None, reach - 1, t.j0, min(t.j1, t.i1 - 1 + shift + reach)), (far, reach, None, max(t.j0, t.i0 + shift + reach), t.j1))
    for mask, lo, hi, j0, j1 in ranges:
        live = mask.sees(t, lo, hi) if j0 < j1 else None
        if live is None or not bool(live.any()):
            parts.append((0.0, torch.full(q_rev.shape[:-1], NEG_INF, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)))
            continue
        sub = Tile(t.i0, t.i1, j0, j1, t.i_len, t.j_len, q.device)
        o, m = _forward(q_rev, k[..., j0:j1, :], v[..., j0:j1, :], 0.0, False, attn_mask=mask.reversed_block(sub), scale=scale)
        parts.append((o.flip(-2), torch.where(live, m.flip(-1), NEG_INF)))  # the kernel gives a row with no key lse 0
    (o_near, m_near), (o_far, m_far) = parts
    lse = torch.logaddexp(m_near, m_far)  # -inf on rows that see no key at all
    ref = torch.where(torch.isinf(lse), 0.0, lse)
    w_near, far_share = torch.exp(m_near - ref), torch.exp(m_far - ref)
    acc = lse.dtype  # merged in float32 (or wider): half-precision parts would round twice
    o_near, o_far = (o.to(acc) if torch.is_tensor(o) else o for o in (o_near, o_far))
    far_out = o_far * far_share[..., None]
    return (o_near * w_near[..., None] + far_out).to(q.dtype), lse, far_out.to(q.dtype), far_share


def fused_forward(plan: FusedPlan, q: Tensor, k: Tensor, v: Tensor, profile: Tensor | None = None):
    """``(out, lse, far)`` of one call: ``lse`` is ``+inf`` on rows that see no key.

    ``far`` is ``(far_out, far_share)`` when a learned saturating bias keeps its far keys'
    share for the bias gradient (``_split_block``), else None. No autograd graph.
    """
    i_len, j_len = q.shape[-2], k.shape[-2]
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full(q.shape[:-1], float("inf"), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    diagonal = DiagonalMask(plan, i_len, j_len, mask_dtype(q), q.device, profile) if DiagonalMask.applies(plan) else None
    bias = None if diagonal is not None else BiasSource(plan.bias, i_len, j_len, q.device)
    reach = far_reach(plan, diagonal, profile)
    far_out = far_share = None
    if reach is not None:  # learned T5 buckets: keep the far keys' share for the bias gradient
        far_out, far_share = torch.zeros_like(out), torch.zeros_like(lse)
        near, far = diagonal.clipped(hi=reach - 1), diagonal.clipped(lo=reach)
    whole = diagonal is not None and plan.mask is None and reach is None  # nothing to skip: one call
    for t in _blocks(plan, q, j_len, diagonal is not None, split=reach is not None, whole=whole):
        rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
        if t.j0 == t.j1:
            continue
        kc, vc = k[..., cols, :], v[..., cols, :]
        if reach is not None:
            o, m, far_out[..., rows, :], far_share[..., rows] = _split_block(near, far, t, q, k, v, plan.scale, reach)
            live = torch.isfinite(m)[..., None]
            live = None if bool(live.all()) else live
        elif plan.causal_square:
            o, m = _forward(q[..., rows, :], kc, vc, 0.0, True, scale=plan.scale)
            live = None
        elif diagonal is not None:
            add, live = diagonal.reversed_block(t), diagonal.live(t)
            o, m = _forward(q[..., rows, :].flip(-2), kc, vc, 0.0, False, attn_mask=add, scale=plan.scale)
            o, m = o.flip(-2), m.flip(-1)
        else:
            add, live = _block_mask(plan, t, bias, mask_dtype(q))
            o, m = _forward(q[..., rows, :], kc, vc, 0.0, False, attn_mask=add, scale=plan.scale)
        if live is not None:
            o = o * live
            m = torch.where(live.squeeze(-1), m, float("inf"))
        out[..., rows, :] = o
        lse[..., rows] = m
    return out, lse, None if far_out is None else (far_out, far_share)


def grouped_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward; half-precision grouped heads get their key and value sums in float32.

    With ``g < h`` KV heads the kernel adds the ``h / g`` query heads' shares of dk and dv
    into one buffer of the input's precision; in bfloat16 that doubled their error against
    float64 at i = 4096, GQA 8/2 (``tests/test_backends_bf16.py`` holds the rule). So
    half-precision calls get the KV heads repeated, and the shares are summed here in float32.
    """
    group = q.shape[-3] // k.shape[-3]
    if group == 1 or q.dtype not in (torch.float16, torch.bfloat16):
        return _backward(d_out, q, k, v, *args, **kwargs)
    gq, gk, gv = _backward(d_out, q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3), *args, **kwargs)
    gk, gv = (x.unflatten(-3, (-1, group)).sum(-3, dtype=torch.float32).to(x.dtype) for x in (gk, gv))
    return gq, gk, gv


def fused_backward(
    plan: FusedPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
    profile: Tensor | None = None, far: tuple[Tensor, Tensor] | None = None, grad_profile: bool = False,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``(dq, dk, dv, d_profile)`` from the row's output ``out`` and log-sum-exp ``lse``.

    FlashAttention-2's backward needs only ``P = exp(s - lse)`` and ``D = rowsum(dO ∘ O)``
    of the row, so when ``out`` and ``lse`` are a larger softmax's (more key blocks, sinks)
    the result is this call's share of that softmax's gradients. Rows with an infinite
    ``lse`` see no key anywhere: their gradients are 0. ``far`` is what
    :func:`fused_forward` kept, already relative to ``lse``; ``sinks``, when ``lse`` includes
    them, only matter to a learned bias's gradient.
    """
    i_len, j_len = q.shape[-2], k.shape[-2]
    dead = ~torch.isfinite(lse)
    if bool(dead.any()):  # no gradient flows from rows that see no key (a copy: never write into the caller's)
        d_out = d_out.masked_fill(dead[..., None], 0.0)
    d_out = d_out.contiguous()
    # the kernel's backward wants a finite lse (dead rows' d_out is 0 anyway)
    lse = torch.where(dead, 0.0, lse)
    dq = dk = dv = None  # allocated by the first block that does not cover every row and key
    diagonal = DiagonalMask(plan, i_len, j_len, mask_dtype(q), q.device, profile) if DiagonalMask.applies(plan) else None
    d_profile = None
    if profile is not None and grad_profile:
        acc = torch.promote_types(q.dtype, torch.float32)
        d_profile = torch.zeros(profile.shape, dtype=acc, device=q.device)
        delta = torch.einsum("...e,...e->...", d_out.to(acc), out.to(acc))  # D = rowsum(dO ∘ O), via bmm
    bias = None if diagonal is not None else BiasSource(plan.bias, i_len, j_len, q.device)
    reach = saturation(plan.bias)
    if d_profile is not None and far is not None:
        far_profile_grad(d_profile, d_out, delta, reach, diagonal.offset0, far)
    # Without a mask there are no keys to skip: one call over every row, whose gradients are
    # the result (no accumulators and no per-block copies, which is what bounds the memory).
    whole = diagonal is not None and plan.mask is None
    for t in _blocks(plan, q, j_len, diagonal is not None, whole=whole):
        if t.j0 == t.j1:
            continue
        rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
        args = [d_out[..., rows, :], q[..., rows, :], k[..., cols, :], v[..., cols, :], out[..., rows, :], lse[..., rows]]
        add, flip = None, diagonal is not None and not plan.causal_square
        if flip:
            add = diagonal.reversed_block(t)
            args = [x.flip(-1 if n == 5 else -2) if n in (0, 1, 4, 5) else x for n, x in enumerate(args)]
        elif not plan.causal_square:
            add = _block_mask(plan, t, bias, mask_dtype(q))[0]
        gq, gk, gv = grouped_backward(*args, 0.0, plan.causal_square, attn_mask=add, scale=plan.scale)
        if d_profile is not None and reach is None:
            add_profile_grad(
                d_profile, args[1], args[2], args[3], args[0], args[5], delta[..., rows].flip(-1),
                add, diagonal.base(t), plan.scale,
            )  # fmt: skip
        del args  # the flipped copies, before gq's
        if flip:
            gq = gq.flip(-2)
        if (t.i1 - t.i0, t.j1 - t.j0) == (i_len, j_len):
            dq, dk, dv = gq, gk, gv
            continue
        if dq is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq[..., rows, :] = gq
        dk[..., cols, :] += gk
        dv[..., cols, :] += gv
    if dq is None:  # every row saw no key
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if d_profile is not None and reach is not None:  # after the loop: its blocks reuse the freed memory
        true_lse = torch.where(dead, float("inf"), lse)  # +inf on rows that see no key
        row_sums = None if sinks is None else delta * torch.exp(sink.per_head(sinks, true_lse) - true_lse)
        saturating_profile_grad(d_profile, diagonal, q, k, v, d_out, true_lse, delta, plan.scale, reach, row_sums)
    d_profile = None if d_profile is None else d_profile.to(profile.dtype)
    return dq, dk, dv, d_profile


class FusedBlocks(torch.autograd.Function):
    """``(q, k, v, profile, sinks) -> (out, lse)`` with ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``.

    ``sinks (h,)`` or None: each row's softmax denominator gains ``exp(sinks_h)``
    (``backends.sinks``); ``lse`` is then the total, sink included.
    """

    @staticmethod
    def forward(ctx, plan: FusedPlan, q: Tensor, k: Tensor, v: Tensor, profile: Tensor | None = None, sinks: Tensor | None = None):
        out, lse, far = fused_forward(plan, q, k, v, profile)
        if sinks is not None:
            out, lse, share = sink.apply(out, lse, sinks)
            far = None if far is None else (far[0] * share[..., None].to(far[0].dtype), far[1] * share)
        # the far keys' share and output: read by every backward over this graph (retain_graph)
        ctx.plan, ctx.far = plan, far
        ctx.save_for_backward(q, k, v, out, lse, profile, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, _d_lse: Tensor | None):
        q, k, v, out, lse, profile, sinks = ctx.saved_tensors
        # ctx.far is not cleared: a second backward (retain_graph=True) needs it again
        dq, dk, dv, d_profile = fused_backward(
            ctx.plan, q, k, v, out, lse, d_out, profile, ctx.far, grad_profile=ctx.needs_input_grad[4], sinks=sinks
        )
        d_sinks = sink.grad(out, lse, d_out, sinks) if ctx.needs_input_grad[5] else None
        return None, dq, dk, dv, d_profile, d_sinks
