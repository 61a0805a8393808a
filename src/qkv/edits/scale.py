"""A per-head temperature on the logits: ``logits_h ← scale[h] · logits_h``.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``i`` query length, ``j``
key length, ``d`` query/key size.

``ScaleHeads(scale)`` multiplies the logits of head ``h``, ``scale · score(q, k) + bias``,
by ``scale[h]`` before the mask and before any other ``score_mod`` (so ``SoftCap`` caps the
tempered logits): ``scale[h] > 1`` sharpens head ``h``'s pattern, ``< 1`` flattens it, 0 makes
it uniform over the keys it may see, 1 leaves it alone. Sinks are not logits of a key and
are left alone. A TransformerLens hook multiplying ``hook_attn_scores`` by ``scale[h]`` is the
same for ``scale[h] > 0`` in a model without a cap; with a cap it scales the capped logits (it
comes after the cap), and a 0 turns its ``-inf`` into NaN where this gives a uniform row.

Two routes, the same numbers:

* a dot-product score (``"dot"``, ``"scaled_dot"``, ``qkv.scores.Dot``) with no bias:
  ``(s_h q_h)·k = s_h (q_h·k)``, so the queries of head ``h`` are multiplied by ``s_h``
  and the call keeps every fused path (SDPA, the fused CPU engines);
* anything else (a bias, another score): a ``score_mod`` ``score · scale[h]`` in front of
  the call's own, which the tiled engines run tile by tile (``qkv.score_mods``).

Gradients reach ``scale`` when it requires them, by either route.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..scores import Dot
from .base import Call, Edit


class ScaleHeads(Edit):
    """Multiply head ``h``'s logits by ``scale[h]`` (a per-head inverse temperature); ``scale`` has one entry per query head."""

    def __init__(self, scale: Tensor | Sequence[float]):
        scale = scale if isinstance(scale, Tensor) else torch.tensor(list(scale), dtype=torch.float64)
        if scale.dim() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(f"ScaleHeads: scale expected a 1-d float tensor or list, one per query head, got {scale.dtype} of shape {tuple(scale.shape)}")
        self.scale = scale

    def prepare(self, call: Call) -> Call:
        if self.scale.shape[0] != call.heads:
            raise ValueError(f"ScaleHeads: scale expected {call.heads} entries (one per query head), got {self.scale.shape[0]}")
        score = call.options.get("score", "scaled_dot")
        dot = score in ("dot", "scaled_dot") if isinstance(score, str) else isinstance(score, Dot)
        if dot and call.options.get("bias") is None:
            s = self.scale.to(device=call.q.device, dtype=call.q.dtype)
            return Call(call.q * s[:, None, None], call.k, call.v, call.options)  # q (..., h, i, d) · s (h, 1, 1)
        return call.with_options(score_mod=_tempered(self.scale.to(call.q.device), call.options.get("score_mod")))

    def __repr__(self) -> str:
        return f"ScaleHeads({self.scale.tolist()!r})"


def _tempered(scale: Tensor, then):
    """A ``score_mod``: ``score · scale[h]``, then the call's own ``then`` (if any)."""

    def tempered(score, b, h, q_idx, kv_idx):
        score = score * scale[h].to(score.dtype)
        return score if then is None else then(score, b, h, q_idx, kv_idx)

    if then is None or getattr(then, "broadcasts", False):
        tempered.broadcasts = True  # one broadcast call gives the whole tile; else qkv._mods probes it
    return tempered
