"""Attention sinks: a logit per head in every row's softmax denominator, with no value.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``e`` value size.

GPT-OSS (OpenAI 2025) learns one sink logit ``s_h`` per head; StreamingLLM (Xiao et al.
2024, "Efficient Streaming Language Models with Attention Sinks") observed that softmax
attention needs somewhere to put mass it does not want to spend, and a sink gives it that
place without a token. Each row's softmax becomes ``exp(s_c) / (exp(s_h) + Σ_c exp(s_c))``,
so from a row's output ``out`` and log-sum-exp ``lse`` over its keys::

    lse_total = logaddexp(lse, s_h)        out_total = out · exp(lse - lse_total) = out · σ(lse - s_h)

The backward of the keys is FlashAttention's with the final ``(out_total, lse_total)``
(the sink's ``dP`` is 0: it has no value), and the sink's own gradient is
``d s_h = -Σ_rows exp(s_h - lse_total) · D``, ``D = rowsum(dO ∘ O_total)``.
Weights over the keys then sum to ``1 - exp(s_h - lse_total) < 1``. Checked against the
reference backend's extra logit column in the test suite. Engines never
apply sinks themselves: the one autograd wrapper (``engines.call``) and the merged rows of
a split softmax (``engines.key_blocks``) do, once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_head(sinks: Tensor, lse: Tensor) -> Tensor:
    """``(h,) -> (h, 1)``, against ``lse (b, h, i)``."""
    return sinks.to(lse.dtype).reshape(-1, 1)


def finite(total: Tensor) -> Tensor:
    """``lse_total`` with ``-inf`` (a row with no key under a sink of ``-inf``: no mass at all) read as 0, so that
    ``exp(x - total)`` of such a row is ``exp(-inf) = 0``, not ``exp(-inf + inf) = nan``, and so is its gradient."""
    return total.masked_fill(torch.isneginf(total), 0.0)


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out_total, lse_total)`` from ``out (b, h, i, e)`` and ``lse (b, h, i)`` (``-inf``: no key).

    Plain tensor operations, differentiable in all three. A row with ``lse = -inf`` keeps
    ``out = 0`` and gets ``lse_total = s_h``.
    """
    s = per_head(sinks, lse)
    total = torch.logaddexp(lse, s)
    share = torch.exp(lse - finite(total))  # σ(lse - s): the keys' part of the row's mass
    return out * share[..., None].to(out.dtype), total


def grad(out: Tensor, lse: Tensor, d_out: Tensor, sinks: Tensor) -> Tensor:
    """``d s_h = -Σ exp(s_h - lse_total) · rowsum(dO ∘ O_total)``, summed over batch and rows, in ``sinks.dtype``."""
    acc = lse.dtype
    delta = torch.einsum("...e,...e->...", d_out.to(acc), out.to(acc))  # D, via bmm: no (b, h, i, e) product
    mass = torch.exp(per_head(sinks, lse) - finite(lse))  # the sink's weight in each row
    return (-(mass * delta)).sum((0, 2)).to(sinks.dtype)


def lse_grad(lse: Tensor, d_lse: Tensor, sinks: Tensor) -> Tensor:
    """The sinks' gradient through the total ``lse``: ``d s_h = Σ d_lse · exp(s_h - lse_total)``, in ``sinks.dtype``."""
    mass = torch.exp(per_head(sinks, lse) - finite(lse))  # ∂ logaddexp(lse_keys, s) / ∂ s: the sink's weight
    return (mass * d_lse.to(lse.dtype)).sum((0, 2)).to(sinks.dtype)
