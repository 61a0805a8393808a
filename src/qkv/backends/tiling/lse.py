"""The log-sum-exp of a row: one convention for rows that see no key, and merging rows' pieces.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``e`` value size.

Every engine returns, beside ``out``, the natural log of each row's softmax denominator,
``lse = log Σ_visible exp(logit)``. A row that sees no key has no mass: ``lse = -inf`` and
``out = 0``. That is the one convention for such rows everywhere (engines, blocks of keys,
sinks, merges), because it is what makes merges exact without a special case: a softmax
over keys split into disjoint sets ``B_1 … B_n`` is (Milakov & Gimelshein 2018; the merge
of ring attention, Liu et al. 2023)::

    lse = log Σ_n exp(lse_n)          out = Σ_n exp(lse_n - lse) · out_n

and a piece with ``lse_n = -inf`` has weight 0. Backward passes recompute weights as
``exp(s - lse)`` from the row's final ``lse``; there a dead row's ``lse`` is read as
``+inf`` (:func:`for_recompute`), so that every weight of that row is ``exp(-inf) = 0``
(``exp(-inf - (-inf))`` would be NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


def for_recompute(lse: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``lse`` with every dead row (``±inf``) at ``+inf``, so that ``exp(s - lse)`` is 0 there."""
    lse = lse if dtype is None else lse.to(dtype)
    return torch.where(torch.isinf(lse), float("inf"), lse)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two pieces' ``(out, lse)`` merged into the softmax over both pieces' keys.

    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    A side with ``lse = -inf`` has weight 0; both ``-inf`` gives ``out = 0, lse = -inf``,
    never NaN (the common ``out - σ(lse_b - lse_a)(out - out_b)`` form is NaN there).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)  # both -inf: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    return out_a * w_a[..., None].to(out_a.dtype) + out_b * w_b[..., None].to(out_b.dtype), lse
