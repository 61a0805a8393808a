"""The float masks ``fused_blocks`` hands PyTorch's fused kernel: one block's, or the call's offset profile.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``it``/``jt``
a block's rows and keys, ``L = i + j - 1`` offsets.

A block's additive mask is its bias tile with the mask's forbidden entries at ``-inf``
(:func:`block_mask`); a call whose mask is an offset range and whose bias is shift-invariant
is one profile whose blocks are views (:func:`diagonal_mask`, ``tiling.offset_profile``).
Both drop a fixed bias's terms too far below their row's best to change it
(:func:`logit_bound`): ALiBi's far keys would otherwise reach the kernel's products as
float32 subnormal weights, which take a microcode assist on x86.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._bools import any_along
from ...masks import Mask, Tile
from ...positional import LazyBias
from ..tiling import tile_math
from ..tiling.flash_cpu import mask_dtype
from ..tiling.offset_profile import NEGLIGIBLE, DiagonalMask
from ..tiling.tiles import NEG_INF, BiasSource, as_heads


@dataclass(frozen=True)
class FusedPlan:
    """What a call adds to the kernel's logits, and how."""

    mask: Mask | None  # True = may attend
    bias: Tensor | LazyBias | None  # dense (no gradient), or lazy (learned only if shift-invariant)
    scale: float
    causal_square: bool  # the mask is exactly causal and i == j: the kernel's own flag is right
    diagonal: bool  # mask and bias are one offset profile (tiling.offset_profile)
    learned: bool  # a learned shift-invariant bias: its profile's gradient is rebuilt here


#: Logits per head (``i · j``) from which a fixed bias's negligible terms are dropped
#: (:func:`logit_bound`). Finding them costs about 1 ms of small operations (ALiBi, causal,
#: fwd+bwd, 8 heads, Intel Xeon: i = 256, 9.9 ms against 9.3 without; i = 512, 25 against 44;
#: a one-query step over 1024 keys, 2.1 ms against 1.0).
DROP_MIN_LOGITS = 2**17


def block_mask(plan: FusedPlan, t: Tile, bias: BiasSource, dtype: torch.dtype,
               bound: float | None) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """Float ``(b|1, h|1, it, jt)`` additive mask for one block, and bool live rows (None if all live).

    With a logit ``bound`` (:func:`logit_bound`), a bias term more than ``2·bound + 40``
    below the best of its row in this block is sent to ``-inf``: the row's largest logit is
    at least that best term minus ``bound``, so the dropped weight is below ``e^-40`` of it
    (``DiagonalMask.without_negligible`` does the same for a whole profile).
    """
    add = None
    if plan.bias is not None:
        add = as_heads(bias.tile(t), 4).to(dtype)
        if add.shape[-2:] != (t.i1 - t.i0, t.j1 - t.j0):  # a dense bias broadcast along i or j
            add = add.expand(*add.shape[:-2], t.i1 - t.i0, t.j1 - t.j0).contiguous()
    live = None
    state = "full" if plan.mask is None else plan.mask.state(t)
    if state != "full":
        allowed = as_heads(plan.mask.tile(t), 4)
        any_key = any_along(allowed, -1, keepdim=True)
        if not bool(any_key.all()):
            live = any_key
        fill = torch.zeros((), dtype=dtype).masked_fill(torch.tensor(True), NEG_INF)
        if add is None:
            add = torch.where(allowed, torch.zeros((), dtype=dtype), fill)
        else:
            add = add.masked_fill(~allowed, NEG_INF)
    if plan.bias is not None:
        best = add.amax(-1, keepdim=True)  # -inf on rows with no key here (a -inf bias hides a key as a mask does)
        dead = torch.isneginf(best)
        if bool(dead.any()):  # the kernel gives such a row lse 0: the caller sets it to -inf
            live = ~dead
        if bound is not None:  # nothing dropped on a row with no key
            add = add.masked_fill(add < best - (2.0 * bound + NEGLIGIBLE), NEG_INF)
    return add, live


def diagonal_mask(plan: FusedPlan, q: Tensor, k: Tensor) -> DiagonalMask | None:
    """The call's offset profile (``plan.diagonal``), with the terms too small to matter dropped where that is safe.

    A fixed bias's terms far below each row's largest are sent to ``-inf``
    (``DiagonalMask.without_negligible``, from the Cauchy–Schwarz bound of the logits): they
    would reach the kernel's products as subnormal weights. Forward and backward build the
    same profile from the same tensors. A learned bias keeps every term (its gradient reads
    them), and so does a call whose tensors cannot be read (``meta``, traced).
    """
    if not plan.diagonal:
        return None
    diagonal = DiagonalMask(plan.mask, plan.bias, q.shape[-2], k.shape[-2], mask_dtype(q), q.device)
    bound = logit_bound(plan, q, k)
    return diagonal if bound is None else diagonal.without_negligible(bound)


def logit_bound(plan: FusedPlan, q: Tensor, k: Tensor) -> float | None:
    """``scale · max‖q‖ · max‖k‖ >= |scale · qᵀk|`` (Cauchy–Schwarz), or None where every bias term must stay.

    None for a learned bias (its gradient reads every term), no bias, float64 (no subnormal
    weights at these sizes), tensors whose values cannot be read (``meta``, traced), and
    calls under :data:`DROP_MIN_LOGITS` logits per head, where finding the terms costs more
    than their subnormal weights.
    """
    if plan.learned or plan.bias is None or mask_dtype(q) == torch.float64:
        return None
    if q.shape[-2] * k.shape[-2] < DROP_MIN_LOGITS:
        return None
    return tile_math.logit_bound(q, k, plan.scale)
