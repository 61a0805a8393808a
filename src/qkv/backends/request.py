"""The validated call every backend receives.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

``qkv.functional`` checks user input once and builds a :class:`Request`; backends trust it.
The causal flag is already folded into ``mask`` (a ``qkv.masks.Window``), so a backend sees
one mask object, lazy or dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..masks import Mask, Window
from ..positional import LazyBias
from ..scores import Score


@dataclass(frozen=True)
class Request:
    q: Tensor  # (..., h, i, d)
    k: Tensor  # (..., g, j, d)
    v: Tensor  # (..., g, j, e)
    score: Score  # what to compute between q and k
    mask: Mask | None  # True = may attend; causal already folded in
    bias: Tensor | LazyBias | None  # float, added to the logits: dense (..., h|1, i, j) or lazy
    scale: float  # multiplies score.pairwise before bias and mask
    dropout: float  # probability of zeroing a weight (already 0 outside training)
    return_weights: bool  # also return the (..., h, i, j) weights
    generator: torch.Generator | None = None  # dropout randomness, for reproducible runs
    # (heads, rows): 1-d long index tensors (None = all) of the weights to return
    weights_for: tuple[Tensor | None, Tensor | None] | None = None
    sinks: Tensor | None = None  # (h,) sink logit per query head: in every row's softmax denominator
    # fn(score, b, h, q_idx, kv_idx) -> score on each tile's logits, after the bias, before the mask
    score_mod: Callable | None = None

    @property
    def heads(self) -> int:
        return self.q.shape[-3] if self.q.dim() >= 3 else 1

    @property
    def kv_heads(self) -> int:
        return self.k.shape[-3] if self.k.dim() >= 3 else 1

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = plain multi-head, h = multi-query)."""
        return self.heads // self.kv_heads

    @property
    def i(self) -> int:
        return self.q.shape[-2]

    @property
    def j(self) -> int:
        return self.k.shape[-2]

    @property
    def is_causal_only(self) -> bool:
        """True when the only mask is the plain causal one (so kernels can use their causal flag)."""
        m = self.mask
        return isinstance(m, Window) and m.left is None and m.right == 0


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """``(..., g, j, d) -> (..., g·group, j, d)``: query head ``n`` reads KV head ``n // group``.

    This is the grouping convention of ``F.scaled_dot_product_attention(enable_gqa=True)``.
    """
    return x if group == 1 else x.repeat_interleave(group, dim=-3)
