"""The local backend: sliding-window attention by blocks, cost O(i·window) instead of O(i·j).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``B`` the query block, ``n`` the number of
blocks, ``W = B + left + right`` the keys one block can see.

With a window mask (``qkv.masks.window(left, right)``, Beltagy et al. 2020, "Longformer";
Child et al. 2019) query ``r`` sees only keys ``r + (j - i) - left … r + (j - i) + right``.
So the queries are cut into blocks of ``B`` rows, and block ``n`` needs only the ``W`` keys
starting at ``n·B + (j - i) - left``: the keys are padded at both ends and cut into ``n``
overlapping windows with ``unfold`` (one copy, ``W/B`` times the keys), and all blocks run
as one batch of the fused kernel with a ``(n, B, W)`` mask that puts the window's edges,
the padding, and any other mask combined with ``&`` in place. Work and memory are
``O(i·W)``. Checked against the reference backend in the test suite.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from ..masks import And, Dense, Lengths, Mask, Or, Tile, Window
from ..positional import LazyBias
from .request import Request, bias_needs_grad
from .tiling import flash_cpu
from .tiling.flash_cpu import grouped_backward, mask_dtype, same_head_size
from .tiling.tiles import NEG_INF, BiasSource, as_heads, shift_invariant

name = "local"
selects_weights = False

# the private fused CPU kernel: supports() takes a call only where flash_cpu.unusable allows
_forward = flash_cpu.forward


def find_window(mask: Mask | None) -> Window | None:
    """The narrowest bounded ``Window`` that every allowed entry lies in (through ``&``), or None."""
    if isinstance(mask, Window) and mask.left is not None and mask.right is not None:
        return mask
    if isinstance(mask, And):
        a, b = find_window(mask.a), find_window(mask.b)
        if a is None or b is None:
            return a if b is None else b
        return a if a.left + a.right <= b.left + b.right else b  # (no min(key=): torch.compile traces this)
    return None


def _lazy_only(mask: Mask) -> bool:
    """True when the mask is built from position masks only (windows, lengths), no dense tensor."""
    if isinstance(mask, (And, Or)):
        return _lazy_only(mask.a) and _lazy_only(mask.b)
    return not isinstance(mask, Dense)


def block_size(window: Window) -> int:
    """Query rows per block: about the window's width, a multiple of 32, at least 64."""
    return max(64, math.ceil((window.left + window.right + 1) / 32) * 32)


def supports(req: Request) -> str | None:
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product (local runs the fused kernel per block)"
    window = find_window(req.mask)
    if window is None:
        return "the mask has no bounded sliding window"
    if (reason := flash_cpu.unusable(req.q)) is not None:
        return reason
    if not _lazy_only(req.mask):
        return "a dense mask is combined with the window"
    if req.return_weights:
        return "it does not return weights"
    if req.return_lse:
        return "it does not return the log-sum-exp"
    if req.dropout > 0:
        return "it has no dropout"
    if req.sinks is not None:
        return "it has no sinks"
    if req.score_mod is not None:
        return "a score_mod needs each tile's logits, which the fused kernel never exposes"
    if bias_needs_grad(req):
        return "the fused kernel cannot differentiate a learned bias"
    span = block_size(window) + window.left + window.right
    if 2 * span > req.j or span > req.i:
        return f"the window (block + left + right = {span} keys) covers most of the i={req.i}, j={req.j} positions"
    return None


class _Kernel(torch.autograd.Function):
    """The fused kernel with a fixed float mask, differentiable in ``q, k, v``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, add: Tensor, scale: float):
        out, lse = _forward(q, k, v, 0.0, False, attn_mask=add, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, add, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, add, out, lse = ctx.saved_tensors
        dq, dk, dv = grouped_backward(d_out.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=add, scale=ctx.scale)
        return dq, dk, dv, None, None


def _block_masks(req: Request, window: Window, size: int, n: int, first: int, width: int) -> Tensor:
    """Float ``(b|1, n, h|1, B, W)``: 0 where block ``m`` row ``a`` may see window key ``w``, else -inf."""
    if _by_offset(req):
        return _offset_masks(req, size, n, first, width)
    bias = BiasSource(req.bias, req.i, req.j, req.q.device) if req.bias is not None else None
    blocks = []
    for m in range(n):
        i0 = m * size
        c0 = first + i0  # first key column of this block's window (may be < 0 or run past j)
        lo, hi = max(c0, 0), min(c0 + width, req.j)
        rows = min(i0 + size, req.i)
        # the mask is asked only about real rows and keys (a mask reading ids or tables by position
        # could not answer for the block's rows past i or its window's keys outside 0 .. j - 1): False there
        allowed = torch.zeros(1, 1, size, width, dtype=torch.bool, device=req.q.device)
        if lo < hi:
            seen = as_heads(req.mask.tile(Tile(i0, rows, lo, hi, req.i, req.j, req.q.device)), 4)
            seen = seen.expand(*seen.shape[:-2], rows - i0, hi - lo)
            allowed = F.pad(seen, (lo - c0, c0 + width - hi, 0, i0 + size - rows), value=False)
        add = torch.zeros(allowed.shape, dtype=mask_dtype(req.q), device=req.q.device).masked_fill(~allowed, NEG_INF)
        if bias is not None and lo < hi:  # (lo >= hi: the block's window holds no key, all masked above)
            part = as_heads(bias.tile(Tile(i0, rows, lo, hi, req.i, req.j, req.q.device)), 4).to(add.dtype)
            part = part.expand(*part.shape[:-2], rows - i0, hi - lo)  # a dense bias may broadcast along i or j
            part = F.pad(part, (lo - c0, c0 + width - hi, 0, i0 + size - rows))
            add = add + part
        blocks.append(add)
    shapes = torch.broadcast_shapes(*(x.shape for x in blocks))
    return torch.stack([x.expand(shapes) for x in blocks], dim=1)  # (b|1, n, h|1, B, W)


def _by_offset(req: Request) -> bool:
    """True when mask and bias depend on the offset alone (plus key lengths): no per-block work."""
    parts = [req.mask.a, req.mask.b] if isinstance(req.mask, And) else [req.mask]
    if not all(isinstance(m, (Window, Lengths)) for m in parts) or sum(isinstance(m, Lengths) for m in parts) > 1:
        return False
    return req.bias is None or (isinstance(req.bias, LazyBias) and shift_invariant(req.bias))


def _offset_masks(req: Request, size: int, n: int, first: int, width: int) -> Tensor:
    """:func:`_block_masks` when it is one ``(h|1, B, W)`` pattern for every block, cut by key validity.

    In block coordinates query row ``a`` and window key ``w`` are at offset
    ``c - r - (j - i) = w - a - left`` whatever the block, so windows and shift-invariant
    biases are one pattern; only whether key ``c = first + m·B + w`` exists (``0 <= c <
    j``, or below a batch row's length) changes from block to block.
    """
    device, dtype = req.q.device, mask_dtype(req.q)  # float32 masks for half-precision inputs
    pattern = Tile(0, size, first, first + width, req.i, req.j, device)  # block 0's coordinates
    parts = [req.mask.a, req.mask.b] if isinstance(req.mask, And) else [req.mask]
    allowed = torch.ones(size, width, dtype=torch.bool, device=device)
    limit = torch.tensor([req.j], device=device)
    for m in parts:
        if isinstance(m, Window):
            allowed &= m.tile(pattern)
        else:
            limit = m.key_lengths.to(device).clamp(max=req.j)  # (b,)
    cols = first + torch.arange(n, device=device)[:, None] * size + torch.arange(width, device=device)  # (n, W)
    valid = (cols >= 0) & (cols < limit[:, None, None])  # (b|1, n, W)
    ok = allowed[None, None, :, :] & valid[:, :, None, :]  # (b|1, n, B, W)
    add = torch.zeros((), dtype=dtype, device=device).masked_fill(torch.tensor(True), NEG_INF)
    add = torch.where(ok, torch.zeros((), dtype=dtype, device=device), add)[:, :, None]  # (b|1, n, 1, B, W)
    if req.bias is not None:
        add = add + BiasSource(req.bias, req.i, req.j, device).tile(pattern).to(dtype)[None, None]
    return add


def run(req: Request) -> tuple[Tensor, None, None]:
    window = find_window(req.mask)
    qp, kp = req.score.prepare(req.q, req.k)
    e = req.v.shape[-1]
    qp, kp, v = same_head_size(qp, kp, req.v)
    b, h, i_len, _ = qp.shape
    size = block_size(window)
    n = math.ceil(i_len / size)
    first = (req.j - req.i) - window.left  # window start of query row 0
    width = size + window.left + window.right
    pad_front = max(0, -first)
    pad_back = max(0, first + (n - 1) * size + width - req.j)
    start = first + pad_front  # where block 0's window starts in the padded keys
    # keys and values cut into n overlapping windows of W positions, one every B positions:
    # views (b, n, g, W, d) of the padded keys, which the kernel reads without a copy
    k_blocks = F.pad(kp, (0, 0, pad_front, pad_back))[..., start:, :].unfold(-2, width, size)[:, :, :n].permute(0, 2, 1, 4, 3)
    v_blocks = F.pad(v, (0, 0, pad_front, pad_back))[..., start:, :].unfold(-2, width, size)[:, :, :n].permute(0, 2, 1, 4, 3)
    q_blocks = rearrange(F.pad(qp, (0, 0, 0, n * size - i_len)), "b h (n r) d -> b n h r d", n=n)
    if _by_offset(req) and not _has_lengths(req.mask):
        # one (h|1, B, W) pattern serves every block whose window lies inside the keys;
        # only the blocks at the two ends need their own masks
        pattern, valid = _pattern(req, size, n, first, width)
        # blocks m whose whole window first + m·B + [0, W) lies in [0, j): by arithmetic, no sync
        lo, hi = max(0, -(first // size)), min(n, (req.j - width - first) // size + 1)
        lo, hi = (lo, hi) if lo < hi else (n, n)
        pieces = []
        for m0, m1, add in ((0, lo, None), (lo, hi, pattern[None]), (hi, n, None)):
            if m1 <= m0:
                continue
            if add is None:
                cut = torch.zeros((), dtype=pattern.dtype, device=pattern.device).masked_fill(~valid[m0:m1, None, None, :], NEG_INF)
                add = (pattern[None] + cut).unsqueeze(0).expand(b, -1, -1, -1, -1).flatten(0, 1)  # ((b m), h|1, B, W)
            pieces.append(_blocks_call(q_blocks[:, m0:m1], k_blocks[:, m0:m1], v_blocks[:, m0:m1], add, req.scale))
        out = torch.cat(pieces, dim=1)
    else:
        add = _block_masks(req, window, size, n, first, width)  # (b|1, n, h|1, B, W)
        out = _blocks_call(q_blocks, k_blocks, v_blocks, add.expand(b, *add.shape[1:]).flatten(0, 1), req.scale)
    out = rearrange(out, "b n h r e -> b h (n r) e")[:, :, :i_len, :e]
    return out, None, None


def _blocks_call(q: Tensor, k: Tensor, v: Tensor, add: Tensor, scale: float) -> Tensor:
    """The kernel on ``(b, m, h, B, d)`` query blocks and ``(b, m, g, W, d)`` key windows."""
    b, m = q.shape[:2]
    out = _Kernel.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), add, scale)
    return out.unflatten(0, (b, m))


def _has_lengths(mask: Mask) -> bool:
    parts = [mask.a, mask.b] if isinstance(mask, And) else [mask]
    return any(isinstance(part, Lengths) for part in parts)


def _pattern(req: Request, size: int, n: int, first: int, width: int) -> tuple[Tensor, Tensor]:
    """Float ``(h|1, B, W)`` window-and-bias pattern shared by all blocks, and bool ``(n, W)`` key validity."""
    device, dtype = req.q.device, mask_dtype(req.q)  # float32 masks for half-precision inputs
    t = Tile(0, size, first, first + width, req.i, req.j, device)  # block 0's coordinates
    allowed = req.mask.tile(t)  # windows only (no lengths): (B, W)
    pattern = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, NEG_INF)[None]
    if req.bias is not None:
        pattern = pattern + BiasSource(req.bias, req.i, req.j, device).tile(t).to(dtype)
    cols = first + torch.arange(n, device=device)[:, None] * size + torch.arange(width, device=device)
    return pattern, (cols >= 0) & (cols < req.j)
