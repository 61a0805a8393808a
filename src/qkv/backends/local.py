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
``O(i·W)``. Checked against the reference backend in ``tests/test_backends_local.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from ..masks import And, Dense, Mask, Or, Tile, Window
from .chunked import same_head_size
from .request import Request
from .tiles import NEG_INF, BiasSource, as_heads

name = "local"
selects_weights = False

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def find_window(mask: Mask | None) -> Window | None:
    """The narrowest bounded ``Window`` that every allowed entry lies in (through ``&``), or None."""
    if isinstance(mask, Window) and mask.left is not None and mask.right is not None:
        return mask
    if isinstance(mask, And):
        found = [w for w in (find_window(mask.a), find_window(mask.b)) if w is not None]
        if found:
            return min(found, key=lambda w: w.left + w.right)
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
    if not _lazy_only(req.mask):
        return "a dense mask is combined with the window"
    if req.return_weights:
        return "it does not return weights"
    if req.dropout > 0:
        return "it has no dropout"
    if req.q.dim() != 4:
        return "it needs (b, h, i, d) inputs"
    if req.bias is not None and _trainable(req.bias):
        return "the fused kernel cannot differentiate a learned bias"
    span = block_size(window) + window.left + window.right
    if 2 * span > req.j:
        return f"the window (block + left + right = {span} keys) covers most of the j={req.j} keys"
    return None


def _trainable(bias) -> bool:
    if not torch.is_grad_enabled():
        return False
    if isinstance(bias, Tensor):
        return bias.requires_grad
    return any(p.requires_grad for p in bias.parameters())


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
        dq, dk, dv = _backward(d_out.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=add, scale=ctx.scale)
        return dq, dk, dv, None, None


def _block_masks(req: Request, window: Window, size: int, n: int, first: int, width: int) -> Tensor:
    """Float ``(b|1, n, h|1, B, W)``: 0 where block ``m`` row ``a`` may see window key ``w``, else -inf."""
    bias = BiasSource(req.bias, req.i, req.j, req.q.device) if req.bias is not None else None
    blocks = []
    for m in range(n):
        i0 = m * size
        c0 = first + i0  # first key column of this block's window (may be < 0 or run past j)
        t = Tile(i0, i0 + size, c0, c0 + width, req.i, req.j, req.q.device)
        allowed = as_heads(req.mask.tile(t), 4) & ((t.cols >= 0) & (t.cols < req.j))
        add = torch.zeros(allowed.shape, dtype=req.q.dtype, device=req.q.device).masked_fill(~allowed, NEG_INF)
        if bias is not None:
            lo, hi = max(c0, 0), min(c0 + width, req.j)
            rows = min(i0 + size, req.i)
            part = as_heads(bias.tile(Tile(i0, rows, lo, hi, req.i, req.j, req.q.device)), 4).to(add.dtype)
            part = F.pad(part, (lo - c0, c0 + width - hi, 0, i0 + size - rows))
            add = add + part
        blocks.append(add)
    shapes = torch.broadcast_shapes(*(x.shape for x in blocks))
    return torch.stack([x.expand(shapes) for x in blocks], dim=1)  # (b|1, n, h|1, B, W)


def run(req: Request) -> tuple[Tensor, None]:
    window = find_window(req.mask)
    qp, kp = req.score.prepare(req.q, req.k)
    e = req.v.shape[-1]
    qp, kp, v = same_head_size(qp, kp, req.v)
    b, h, i_len, _ = qp.shape
    size = block_size(window)
    n = math.ceil(i_len / size)
    shift = req.j - req.i
    first = shift - window.left  # window start of query row 0
    width = size + window.left + window.right
    pad_front = max(0, -first)
    pad_back = max(0, first + (n - 1) * size + width - req.j)
    start = first + pad_front  # where block 0's window starts in the padded keys
    # keys and values cut into n overlapping windows of W positions, one every B positions
    k_win = F.pad(kp, (0, 0, pad_front, pad_back))[..., start:, :].unfold(-2, width, size)[:, :, :n]
    v_win = F.pad(v, (0, 0, pad_front, pad_back))[..., start:, :].unfold(-2, width, size)[:, :, :n]
    k_blocks = rearrange(k_win, "b g n d w -> (b n) g w d")
    v_blocks = rearrange(v_win, "b g n e w -> (b n) g w e")
    q_blocks = rearrange(F.pad(qp, (0, 0, 0, n * size - i_len)), "b h (n r) d -> (b n) h r d", n=n)
    add = _block_masks(req, window, size, n, first, width)
    add = rearrange(add.expand(b, *add.shape[1:]), "b n h r w -> (b n) h r w")
    out = _Kernel.apply(q_blocks, k_blocks.contiguous(), v_blocks.contiguous(), add, req.scale)
    out = rearrange(out, "(b n) h r e -> b h (n r) e", b=b)[:, :, :i_len, :e]
    return out, None
