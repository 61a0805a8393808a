"""What a soft cap's bounded logits let the score-modifier tile loop (``mod_tiles``) skip.

Shape legend: ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``; a tile's row values
any shape.

A soft cap (Gemma 2, ``qkv.SoftCap(c)``) puts every logit in ``[-c, c]``, and the
Cauchy–Schwarz bound ``|scale · qᵀk| <= scale · max‖q‖ · max‖k‖`` bounds them before the
cap. From those ranges: whether ``expm1`` needs its clamp (:func:`needs_clamp`), whether
the forward can subtract a constant instead of a running row maximum (:func:`fixed_base`),
and a lower bound of each tile's exponent arguments, which spares the exp's floor pass
(:func:`lowest`). Each is only an optimisation: where values cannot be read (``meta``
tensors, tracing) the general path runs, with the same result.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._trace import concrete
from . import tile_math
from .tiles import NEG_INF

#: How far above 1 a soft-capped forward's largest weight may be (``e^40``) when it runs without a running maximum.
HEADROOM = 40.0


def needs_clamp(has_bias: bool, q: Tensor, k: Tensor, factor: float) -> bool:
    """False when ``|z| <= factor · max‖q_i‖ · max‖k_j‖`` (Cauchy–Schwarz) is far below the clamp: a pass saved per tile."""
    bound = None if has_bias else tile_math.logit_bound(q, k, factor)
    return bound is None or not bound < 30.0


def fixed_base(cap: float, v: Tensor, forms: tile_math.Forms, acc: torch.dtype) -> Tensor | None:
    """A constant ``B`` to subtract from every capped logit in place of the running row maximum, or None.

    A capped logit lies in ``[-c, c]``, so with ``B = c - H`` every weight ``exp(s - B)``
    lies in ``[e^(H - 2c), e^H]``: no maximum pass over each tile, no rescaling of the
    row's sums, and no floor pass (``tile_math.exp_nonpositive_``). Taken when the
    smallest weight stays a normal number above the exp's floor (``c <= (H - floor) / 2``:
    59 for float32, ``H = 40``), and the row's sums cannot overflow:
    ``e^H · j · max|v| < max / e``. ``H`` is 0 (``B = c``) for the ``sigmoid`` form of the
    exp, which needs non-positive arguments.
    """
    if not concrete(v):
        return None
    headroom = HEADROOM if forms.library_exp else 0.0
    if 2 * cap - headroom > -tile_math.floor(acc):
        return None
    v_max = float(v.abs().amax()) if v.numel() else 0.0
    limit = math.log(torch.finfo(acc).max) - 1.0
    if not headroom + math.log(max(v.shape[-2], 1)) + math.log(max(v_max, 1.0)) < limit:
        return None
    return torch.tensor(cap - headroom, dtype=acc, device=v.device)


def lowest(subtracted: Tensor, cap: float) -> float:
    """A lower bound of ``c·tanh(·) - subtracted`` over a tile: ``-c - max(subtracted)``; ``-inf`` where unreadable."""
    return -cap - float(subtracted.max()) if concrete(subtracted) else NEG_INF
