"""Attention sinks: a logit per head in every row's softmax denominator, with no value.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``i`` query length, ``e``
value size.

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
reference backend's extra logit column in ``tests/test_backends_sinks.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_head(sinks: Tensor, lse: Tensor) -> Tensor:
    """``(h,) -> (h, 1)`` against ``lse (..., h, i)``; a scalar for inputs without a head dim."""
    s = sinks.to(lse.dtype)
    return s.reshape(s.shape[0], 1) if lse.dim() >= 2 else s.reshape(())


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out_total, lse_total)`` from ``out (..., h, i, e)`` and ``lse (..., h, i)`` (``-inf``: no key).

    Plain differentiable tensor operations: the gradient of ``sinks`` is the true one. A
    row with ``lse = -inf`` keeps ``out = 0`` and gets ``lse_total = s_h``.
    """
    s = per_head(sinks, lse)
    total = torch.logaddexp(lse, s)
    share = torch.exp(lse - total)  # σ(lse - s): the keys' part of the row's mass
    return out * share[..., None].to(out.dtype), total


def apply(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """An engine's ``(out, lse)`` (``+inf`` on rows with no key) with sinks: ``(out_total, lse_total, share)``.

    ``share = exp(lse - lse_total)`` rescales whatever else the engine kept per row
    (``fused_blocks``' far-key share). No graph.
    """
    with torch.no_grad():
        lse = torch.where(torch.isinf(lse), float("-inf"), lse)
        s = per_head(sinks, lse)
        total = torch.logaddexp(lse, s)
        share = torch.exp(lse - total)
        return out * share[..., None].to(out.dtype), total, share


def grad(out: Tensor, lse: Tensor, d_out: Tensor, sinks: Tensor) -> Tensor:
    """``d s_h = -Σ exp(s_h - lse_total) · rowsum(dO ∘ O_total)``, summed over batch and rows, in ``sinks.dtype``."""
    acc = lse.dtype
    delta = torch.einsum("...e,...e->...", d_out.to(acc), out.to(acc))  # D, via bmm: no (b, h, i, e) product
    mass = torch.exp(per_head(sinks, lse) - lse)  # the sink's weight in each row
    per_row = -(mass * delta)
    if lse.dim() < 2:
        return per_row.sum().reshape(1).to(sinks.dtype)
    return per_row.flatten(0, -3).sum(0).sum(-1).to(sinks.dtype) if per_row.dim() > 2 else per_row.sum(-1).to(sinks.dtype)
