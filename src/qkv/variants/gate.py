"""Gated attention: a sigmoid gate on each head's output, computed from the layer's input.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``e`` per-head value
size, ``dim`` model size.

Qiu et al. 2025, "Gated Attention for Large Language Models" (arXiv 2505.06708), the
variant they recommend (gate after the scaled dot-product attention, position G1)::

    Y' = Y ⊙ σ(X W_θ)          Y (b, h, i, e): attention output, before the concatenation and W^O
                               X (b, i, dim):  the hidden states the queries were projected from

*Elementwise* (the paper's best): ``W_θ: dim -> h·e``, one gate per head and channel.
*Headwise*: ``W_θ: dim -> h``, one scalar per head, broadcast over its ``e`` channels.
The gate makes the head's contribution input-dependent and sparse, which the paper finds
removes the "attention sink" on the first token and stabilises training. Used as
``MultiHeadAttention(..., gate=OutputGate(dim, heads, dim_value_head))``; checked against the
formula in the test suite.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from .._args import positive_int
from ..projection import Linear


class OutputGate(nn.Module):
    """``Y ⊙ σ(X W_θ)`` on attention outputs ``Y (b, h, i, e)`` given the layer input ``X (b, i, dim)``.

    Args:
        dim: model size of ``X``.
        heads: query heads ``h``.
        dim_value_head: per-head value size ``e`` (ignored when ``headwise``).
        headwise: one gate per head instead of one per head and channel.
        bias: a bias in ``W_θ`` (the paper's formula has none).
    """

    def __init__(self, dim: int, heads: int, dim_value_head: int, *, headwise: bool = False, bias: bool = False):
        super().__init__()
        positive_int("dim", dim)
        self.heads = positive_int("heads", heads)
        self.dim_value_head = positive_int("dim_value_head", dim_value_head)
        self.headwise = bool(headwise)
        self.proj = Linear(dim, heads if self.headwise else heads * dim_value_head, bias=bias)

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        """Gated ``y (b, h, i, e)``; ``x (b, i, dim)`` is the input the queries came from."""
        b, h, i, e = y.shape
        if h != self.heads or (not self.headwise and e != self.dim_value_head):
            raise ValueError(
                f"y: OutputGate expects (b, {self.heads}, i, {self.dim_value_head}), got {tuple(y.shape)}"
            )
        if x.shape[:2] != (b, i) or x.shape[-1] != self.proj.in_features:
            raise ValueError(
                f"x: expected the layer input (b={b}, i={i}, {self.proj.in_features}), got {tuple(x.shape)}"
            )
        gate = torch.sigmoid(self.proj(x))
        if self.headwise:
            return y * rearrange(gate, "b i h -> b h i 1")
        return y * rearrange(gate, "b i (h e) -> b h i e", h=h)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim_value_head={self.dim_value_head}, headwise={self.headwise}"
