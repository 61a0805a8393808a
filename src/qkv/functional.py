"""The functional API: ``attention``, ``attention_weights`` and ``explain``.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` -> ``out (..., h, i, e)`` and,
on request, ``weights (..., h, i, j)``: the layout of ``F.scaled_dot_product_attention``.
Inputs without a head dim, ``(i, d)``, also work. Each call is validated once
(``qkv.checks``), then a backend runs it (``qkv.backends.choose``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from . import backends, checks
from .backends import reference
from .backends import weights as weights_module
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
    weights_for: dict | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
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
        weights_for: with ``return_weights=True``, only some weights:
            ``{"heads": ..., "rows": ...}`` (either key optional), each an int, a slice, a
            range, a list of ints or a 1-d integer tensor. The weights are then
            ``(..., len(heads), len(rows), j)``; the chunked backend builds only those, so
            inspecting two heads of a long sequence never holds the ``(..., h, i, j)`` tensor.
        sinks: ``(h,)`` attention sinks, one logit per query head (learnable): each row's
            softmax denominator gains ``exp(sinks[h])`` and the sink has no value, so the
            weights over the keys sum to less than 1 (GPT-OSS; StreamingLLM's sink token).
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` applied elementwise to the
            scaled logits after the bias and before the mask (``flex_attention``'s
            convention; ``qkv.score_mods``), e.g. ``qkv.SoftCap(c)``. The chunked backend runs
            it tile by tile, forward and backward; tensors it closes over get gradients.

    Returns:
        ``out (..., h, i, e)``, or ``(out, weights)``. A query whose keys are all masked gets
        zero output, zero weights and zero gradients. With ``return_weights=True`` and
        ``backend="auto"`` the output still comes from a fused kernel and the weights are
        rebuilt exactly from the log-sum-exp it saved (``qkv.backends.weights``).
    """
    req = checks.request(
        q, k, v, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        dropout=dropout, return_weights=return_weights, generator=generator, sinks=sinks,
        score_mod=score_mod,
    )  # fmt: skip
    if weights_for is not None:
        req = replace(req, weights_for=_weights_for(weights_for, req))
    impl, _ = _choose(req, backend)
    out, weights = impl.run(req)
    if weights is not None and req.weights_for is not None and not getattr(impl, "selects_weights", False):
        heads, rows = req.weights_for
        weights = weights if heads is None else weights.index_select(-3, heads.to(weights.device))
        weights = weights if rows is None else weights.index_select(-2, rows.to(weights.device))
    return (out, weights) if return_weights else out


def _choose(req: backends.Request, backend: str) -> tuple:
    """``backends.choose``, except that an empty call (no query rows or no keys) goes to the reference.

    There is nothing to compute then: every tensor the reference's equations build has a
    zero-sized axis, and they give the result for any score, mask, bias or sinks (no rows;
    or rows that see no key: zero output, zero gradients). The fused kernels assume a row
    and a key. A backend named explicitly still refuses what it could not run otherwise.
    """
    impl, passed_over = backends.choose(req, backend)
    if (req.i == 0 or req.j == 0) and impl is not reference:
        passed_over = [*passed_over, f"{impl.name}: an empty call (i = {req.i}, j = {req.j}) has nothing to compute"]
        return reference, passed_over
    return impl, passed_over


def _weights_for(spec: object, req: backends.Request) -> tuple[Tensor | None, Tensor | None]:
    """Check ``weights_for`` and turn it into ``(heads, rows)`` index tensors (None = all)."""
    if not isinstance(spec, dict):
        raise TypeError(f"weights_for: expected a dict with keys 'heads' and/or 'rows', got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"heads", "rows"})
    if unknown:
        raise ValueError(f"weights_for: expected keys 'heads' and/or 'rows', got {unknown}")
    if not req.return_weights:
        raise ValueError("weights_for: selects which weights to return, so it needs return_weights=True, got False")
    if "heads" in spec and req.q.dim() < 3:
        raise ValueError(f"weights_for: 'heads' needs q with a head dim (..., h, i, d), got shape {tuple(req.q.shape)}")
    sizes = {"heads": req.heads, "rows": req.i}
    return tuple(_indices(key, spec.get(key), sizes[key]) for key in ("heads", "rows"))  # type: ignore[return-value]


def _indices(key: str, value: object, size: int) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, slice):
        value = range(size)[value]
    if isinstance(value, bool):
        raise TypeError(f"weights_for: {key!r} expected an int, slice, range, list or integer tensor, got bool")
    if isinstance(value, int):
        value = [value]
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(
                f"weights_for: {key!r} expected a 1-d integer tensor, got {value.dtype} of shape {tuple(value.shape)}"
            )
        index = value.reshape(-1).long().cpu()
    elif isinstance(value, (list, tuple, range)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        index = torch.tensor(list(value), dtype=torch.long)
    else:
        raise TypeError(
            f"weights_for: {key!r} expected an int, slice, range, list or integer tensor, got {type(value).__name__}"
        )
    if index.numel() == 0:
        raise ValueError(f"weights_for: {key!r} selects nothing, expected at least one index in [0, {size})")
    index = torch.where(index < 0, index + size, index)
    if bool((index < 0).any() or (index >= size).any()):
        raise ValueError(f"weights_for: {key!r} expected indices in [0, {size}), got {value!r}")
    return index


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    weights_for: dict | None = None,
    backend: str = "auto",
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """Only the weights ``α (..., h, i, j)`` of :func:`attention` (rows sum to 1, or 0 if fully masked, < 1 with sinks).

    ``weights_for`` selects heads and rows as in :func:`attention`. With ``backend="auto"``
    a call whose logits (times the additive score's hidden size) fit in
    ``backends.weights.CHUNK_ELEMENTS`` is materialised by the reference backend, one
    softmax, the fastest way when the weights are the whole output anyway. A larger call,
    or one with ``weights_for``, runs :func:`attention` on a one-column stand-in for the
    values: the fast backend saves its log-sum-exp and the weights are rebuilt from it in
    row chunks, so additive scores never build the ``(i, j, hidden)`` tensor and a few
    rows of a long sequence never build all ``(h, i, j)`` weights.
    """
    v = k.new_empty((*k.shape[:-1], 0))  # the weights do not depend on v
    req = checks.request(
        q, k, v, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        dropout=0.0, return_weights=True, sinks=sinks, score_mod=score_mod,
    )  # fmt: skip
    width = 1 if req.score.dot_form else _prepared_width(req)
    small = req.q[..., 0].numel() * req.j * width <= weights_module.CHUNK_ELEMENTS
    if backend == "reference" or (backend == "auto" and small and weights_for is None):
        w = reference.weights(req).to(q.dtype)
        if weights_for is None:
            return w
        heads, rows = _weights_for(weights_for, req)
        w = w if heads is None else w.index_select(-3, heads.to(w.device))
        return w if rows is None else w.index_select(-2, rows.to(w.device))
    # One zero column stands in for the values: (..., g, j, 1), a broadcast view, no copy.
    stand_in = k.new_zeros(()).expand(*k.shape[:-1], 1)
    _, w = attention(
        q, k, stand_in, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        return_weights=True, backend=backend, weights_for=weights_for, sinks=sinks, score_mod=score_mod,
    )  # fmt: skip
    return w


def _prepared_width(req: backends.Request) -> int:
    """Size of a prepared query (the additive score's hidden size): one row prepared to find out."""
    with torch.no_grad():
        qp, _ = req.score.prepare(req.q[..., :1, :], req.k[..., :1, :])
    return max(1, qp.shape[-1])


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
    weights_for = kwargs.pop("weights_for", None)
    req = checks.request(q, k, v, **kwargs)
    if weights_for is not None:
        req = replace(req, weights_for=_weights_for(weights_for, req))
    impl, passed_over = _choose(req, backend)
    head = f"backend: {impl.name}"
    online = backends.chunked.online_reason(req) if impl.name == "chunked" else None
    if impl.name == "chunked":
        column = online is None and backends.chunked.column_path(req)
        head += f" ({backends.chunked.engine(req)}{', ALiBi as a key column' if column else ''})"
    lines = [head]
    if online is not None:
        lines.append(f"  online-softmax tiles, not the fused kernel: {online}")
    lines += [f"  not {reason}" for reason in passed_over]
    return "\n".join(lines)
