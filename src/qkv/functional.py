"""The functional API: ``attention``, ``attention_weights`` and ``explain``.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` -> ``out (..., h, i, e)`` and,
on request, ``weights (..., h, i, j)``: the layout of ``F.scaled_dot_product_attention``.
Inputs without a head dim, ``(i, d)``, also work. Each call is validated once
(``qkv.checks``), then a backend runs it (``qkv.backends.choose``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backends, checks
from .backends import reference
from .masks import Mask
from .positional import LazyBias
from .scores import Score


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    generator: torch.Generator | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention: ``out = softmax(scale · score(q, k) + bias, masked) @ v``.

    Args:
        q, k, v: ``(..., h, i, d)``, ``(..., g, j, d)``, ``(..., g, j, e)``; ``h % g == 0``
            (grouped / multi-query KV heads). Leading dims must be equal.
        score: a name (``"dot"``, ``"scaled_dot"``) or a ``qkv.scores.Score`` object
            (``Bilinear``, ``Additive``, ``Location`` carry learned parameters).
        mask: bool, **True = may attend**, broadcastable to ``(..., h, i, j)``, or a lazy
            ``qkv.masks`` object (``causal()``, ``window(...)``, ``lengths(...)``, ``&``, ``|``).
        bias: float tensor broadcastable to ``(..., h, i, j)`` added to the logits, or a lazy
            bias (``qkv.ALiBi``, ``qkv.RelativePositionBias``).
        causal: add a causal mask aligned bottom-right (the last query sees every key).
        scale: factor on the score; default the score's own (``1/√d`` for scaled dot, else 1).
        dropout: probability of dropping a weight. Applied whenever > 0, like
            ``F.scaled_dot_product_attention``; modules pass 0 in eval mode.
        return_weights: also return the weights ``(..., h, i, j)`` (before dropout).
        backend: ``"auto"`` or a backend name (``qkv.backends.REGISTRY``).
        generator: randomness for dropout, for reproducible runs.

    Returns:
        ``out (..., h, i, e)``, or ``(out, weights)``. A query whose keys are all masked gets
        zero output, zero weights and zero gradients.
    """
    req = checks.request(
        q, k, v, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        dropout=dropout, return_weights=return_weights, generator=generator,
    )  # fmt: skip
    impl, _ = backends.choose(req, backend)
    out, weights = impl.run(req)
    return (out, weights) if return_weights else out


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Only the weights ``α (..., h, i, j)`` of :func:`attention` (rows sum to 1, or 0 if fully masked)."""
    v = k.new_empty((*k.shape[:-1], 0))  # the weights do not depend on v
    req = checks.request(
        q, k, v, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        dropout=0.0, return_weights=True,
    )  # fmt: skip
    return reference.weights(req).to(q.dtype)


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` would run, and why faster ones were passed over."""
    backend = kwargs.pop("backend", "auto")
    kwargs.setdefault("score", "scaled_dot")
    kwargs.setdefault("mask", None)
    kwargs.setdefault("bias", None)
    kwargs.setdefault("causal", False)
    kwargs.setdefault("scale", None)
    kwargs.setdefault("dropout", 0.0)
    kwargs.setdefault("return_weights", False)
    req = checks.request(q, k, v, **kwargs)
    impl, passed_over = backends.choose(req, backend)
    lines = [f"backend: {impl.name}"]
    lines += [f"  not {reason}" for reason in passed_over]
    return "\n".join(lines)
