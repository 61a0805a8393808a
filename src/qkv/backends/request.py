"""The validated call every backend and engine receives, in one layout: ``(b, h, i, d)``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

``qkv.checks`` checks user input once and builds a :class:`Request`; backends trust it.
Inputs are already reshaped to ``(b, h, i, d)`` (the caller's layout is
kept in :attr:`Request.layout` and restored on the way out), and the causal flag is
already folded into ``mask`` (a ``qkv.masks.Window``), so a backend sees one layout and
one mask object, lazy or dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .._layout import Layout
from ..masks import Mask, Window
from ..positional import LazyBias
from ..scores import Score
from .tiling.dropout import Origin


@dataclass(frozen=True)
class Request:
    q: Tensor  # (b, h, i, d)
    k: Tensor  # (b, g, j, d)
    v: Tensor  # (b, g, j, e)
    score: Score  # what to compute between q and k
    mask: Mask | None  # True = may attend, broadcastable to (b, h, i, j); causal already folded in
    bias: Tensor | LazyBias | None  # float, added to the logits: dense (b|1, h|1, i|1, j|1) or lazy
    scale: float  # multiplies score.pairwise before bias and mask
    dropout: float  # probability of zeroing a weight (already 0 outside training)
    return_weights: bool  # also return the (b, h, i, j) weights
    generator: torch.Generator | None = None  # dropout randomness, for reproducible runs
    # (heads, rows): 1-d long index tensors (None = all) of the weights to return
    weights_for: tuple[Tensor | None, Tensor | None] | None = None
    sinks: Tensor | None = None  # (h,) sink logit per query head: in every row's softmax denominator
    # fn(score, b, h, q_idx, kv_idx) -> score on each tile's logits, after the bias, before the mask
    score_mod: Callable | None = None
    return_lse: bool = False  # also return each row's log-sum-exp (b, h, i), differentiable
    layout: Layout | None = None  # the caller's layout, restored on the way out (None: (b, h, i, d) itself)
    # whether gradients are recorded for this call: the grad mode it was made under, kept
    # because engines run inside autograd functions, where grad mode is always off
    grad: bool = field(default_factory=torch.is_grad_enabled)
    seed: int = 0  # the dropout seed of the whole call (tiling.dropout), drawn once
    piece: Origin | None = None  # where this call sits in a larger softmax (a block of keys); None: whole

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = plain multi-head, h = multi-query); 1 for no heads at all (h = g = 0)."""
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def i(self) -> int:
        return self.q.shape[-2]

    @property
    def j(self) -> int:
        return self.k.shape[-2]

    @property
    def differentiated(self) -> bool:
        """True when q, k or v will get gradients: recorded (``grad``) and one of them requires them."""
        return self.grad and any(x.requires_grad for x in (self.q, self.k, self.v))

    @property
    def is_causal_only(self) -> bool:
        """True when the only mask is the plain causal one (so kernels can use their causal flag)."""
        m = self.mask
        return isinstance(m, Window) and m.left is None and m.right == 0

    def restore(self, x: Tensor) -> Tensor:
        """An output ``(b, h, ...)`` in the caller's layout."""
        return x if self.layout is None else self.layout.restore(x)


def bias_needs_grad(req: Request) -> bool:
    """True when the call's bias (a dense tensor, or a lazy bias's parameters) is to get a gradient."""
    bias = req.bias
    if not req.grad or bias is None:
        return False
    if isinstance(bias, Tensor):
        return bias.requires_grad
    return any(p.requires_grad for p in bias.parameters())


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """``(..., g, j, d) -> (..., g·group, j, d)``: query head ``n`` reads KV head ``n // group``.

    This is the grouping convention of ``F.scaled_dot_product_attention(enable_gqa=True)``.
    """
    return x if group == 1 else x.repeat_interleave(group, dim=-3)
