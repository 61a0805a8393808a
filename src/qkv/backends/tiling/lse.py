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

import functools

from typing import Sequence

import torch
from torch import Tensor


def for_recompute(lse: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``lse`` with every dead row (``±inf``) at ``+inf``, so that ``exp(s - lse)`` is 0 there."""
    lse = lse if dtype is None else lse.to(dtype)
    return torch.where(torch.isinf(lse), float("inf"), lse)


def merge_all(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Pieces' ``(out (..., e), lse (...))`` over disjoint key sets merged into the softmax over all their keys.

    Exact and differentiable in every piece's ``out`` and ``lse``. A row whose pieces all
    have ``lse = -inf`` gets ``out = 0``, ``lse = -inf`` and zero gradients; a piece with
    ``lse = -inf`` has weight 0. No NaN appears in the values or the gradients: the row
    maximum is taken as a constant, and dead rows are computed on zeros and then replaced
    (gradients through ``torch.where`` reach only the branch that was kept).
    """
    lse_n = torch.stack([torch.as_tensor(x) for x in lses])  # (n, ...)
    dead = torch.isneginf(lse_n).all(0)
    top = torch.where(dead, 0.0, lse_n.amax(0)).detach()
    safe = torch.where(dead, 0.0, lse_n)
    total = top + torch.log(torch.exp(safe - top).sum(0))  # finite on every row
    lse = torch.where(dead, float("-inf"), total)
    weights = torch.exp(lse_n - torch.where(dead, 0.0, total))  # exp(-inf) = 0 for dead pieces and rows
    dtype = functools.reduce(torch.promote_types, [o.dtype for o in outs])
    acc = torch.promote_types(torch.promote_types(dtype, weights.dtype), torch.float32)  # half pieces: rounded once
    out = sum(o.to(acc) * w[..., None].to(acc) for o, w in zip(outs, weights))
    return out.to(dtype), lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two pieces' ``(out, lse)`` merged into the softmax over both pieces' keys.

    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    A side with ``lse = -inf`` has weight 0; both ``-inf`` gives ``out = 0, lse = -inf``,
    never NaN (the common ``out - σ(lse_b - lse_a)(out - out_b)`` form is NaN there).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)  # both -inf: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    dtype = torch.promote_types(out_a.dtype, out_b.dtype)
    acc = torch.promote_types(torch.promote_types(dtype, lse.dtype), torch.float32)  # half pieces: rounded once
    return (out_a.to(acc) * w_a[..., None].to(acc) + out_b.to(acc) * w_b[..., None].to(acc)).to(dtype), lse


def merge_into(out: Tensor, lse: Tensor, o: Tensor, m: Tensor) -> None:
    """``(out, lse) <- merge((out, lse), (o, m))`` in place, no graph; ``o`` (a fresh piece's output) is overwritten.

    The running merge of ring attention: one piece at a time into the rows' accumulators,
    with no copy of them (rows where both are ``-inf`` keep ``out = 0``, ``lse = -inf``).
    """
    new = torch.logaddexp(lse, m)
    ref = torch.where(torch.isneginf(new), 0.0, new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1).to(out.dtype))
    out.add_(o.mul_(torch.exp(m - ref).unsqueeze(-1).to(o.dtype)))
    lse.copy_(new)
