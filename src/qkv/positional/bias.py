"""Lazy positional biases: ALiBi and T5 relative-position buckets.

Shape legend: ``h`` heads, ``i`` query length, ``j`` key length, ``it``/``jt`` the sides of
a tile. Both are computed from ``tile.diagonal`` (key position minus query position, bottom-
right aligned), never stored as an ``(h, i, j)`` tensor.

* ALiBi — Press et al. 2022, "Train Short, Test Long": ``bias = -m_h · |pos_q - pos_k|``
  with head slopes ``m_h`` the geometric sequence ``2^(-8/h), 2^(-16/h), ...`` (for a head
  count that is not a power of two, the slopes of the nearest lower power of two followed
  by every other slope of the next one, as in the paper's reference code). In causal use
  only past keys are seen and this is the paper's ``-m·(i - j)``.
* Relative-position buckets — Raffel et al. 2020 (T5), section 2.1: a learned scalar per
  head and bucket; distances below ``buckets/2`` (bidirectional: per direction) get a
  bucket each, larger ones share log-spaced buckets up to ``max_distance``.

Checked in the test suite against the formulas written out per element.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._args import positive_int
from ..masks import Tile
from .base import LazyBias


def alibi_slopes(heads: int) -> Tensor:
    """The ``(heads,)`` ALiBi slopes, float64 (the formula's values to double precision)."""
    positive_int("heads", heads)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (p + 1) for p in range(n)]

    if heads & (heads - 1) == 0:
        return torch.tensor(power_of_two(heads), dtype=torch.float64)
    lower = 2 ** math.floor(math.log2(heads))
    return torch.tensor(power_of_two(lower) + power_of_two(2 * lower)[0::2][: heads - lower], dtype=torch.float64)


class ALiBi(LazyBias):
    """Attention with Linear Biases: ``bias[h, r, c] = -slope_h · |c - r - (j - i)|``.

    The slopes and the bias tiles are float64 whatever dtype the module is cast to; each
    backend casts a tile to its logits' dtype when it adds it. Slopes rounded to float32
    first would put float64 attention 3e-8 off the formula (12 heads), and slopes cast
    with a bf16 model would be off by 2^-9 of the slope, several logits at 4K positions.
    """

    shift_invariant = True

    def __init__(self, heads: int, *, slopes: Tensor | None = None):
        """``slopes (heads,)``: the head slopes to use instead of the paper's (e.g. a model's own, or flash-attn's ``alibi_slopes``)."""
        super().__init__()
        self.heads = heads
        if slopes is not None:
            if not isinstance(slopes, Tensor) or not slopes.dtype.is_floating_point or tuple(slopes.shape) != (heads,):
                got = tuple(slopes.shape) if isinstance(slopes, Tensor) else type(slopes).__name__
                raise ValueError(f"slopes: expected a float tensor of shape ({heads},), got {got}")
            slopes = slopes.detach().to(torch.float64).clone()
        self._given = slopes
        self.register_buffer("slopes", alibi_slopes(heads) if slopes is None else slopes, persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the slopes; .to(dtype) / .half() / .float() must not round them.
        super()._apply(fn, recurse)
        exact = alibi_slopes(self.heads) if self._given is None else self._given
        self.slopes = exact.to(self.slopes.device)
        return self

    def tile(self, t: Tile) -> Tensor:
        distance = t.diagonal.abs().to(torch.float64)  # exact: integers
        return -self.slopes.to(t.device)[:, None, None] * distance  # (h, it, jt) float64

    def extra_repr(self) -> str:
        return f"heads={self.heads}"


def relative_buckets(relative: Tensor, buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's bucket index for each relative position ``relative = key_pos - query_pos``."""
    index = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        index = index + (relative > 0).long() * buckets  # future keys use the upper half
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # only the past is distinguished
    exact = buckets // 2
    # log-spaced beyond `exact`, saturating at max_distance; clamp(min=1) only avoids log(0)
    # in entries that `torch.where` discards.
    far = exact + (
        torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    ).long()
    far = far.clamp(max=buckets - 1)
    return index + torch.where(distance < exact, distance, far)


class RelativePositionBias(LazyBias):
    """T5-style learned bias per (head, relative-position bucket)."""

    shift_invariant = True

    def __init__(self, heads: int, buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True):
        super().__init__()
        for name, value in (("heads", heads), ("buckets", buckets), ("max_distance", max_distance)):
            positive_int(name, value)
        per_direction = buckets // 2 if bidirectional else buckets
        if per_direction < 2:
            raise ValueError(f"buckets: expected at least {4 if bidirectional else 2} buckets "
                             f"({'bidirectional' if bidirectional else 'one direction'}), got {buckets}")  # fmt: skip
        if max_distance <= per_direction // 2:  # (T5's log bucketing divides by log(max_distance / exact))
            raise ValueError(f"max_distance: expected more than the {per_direction // 2} distances with a bucket each "
                             f"(buckets={buckets}), got {max_distance}")  # fmt: skip
        self.heads, self.buckets, self.max_distance, self.bidirectional = heads, buckets, max_distance, bidirectional
        self.embedding = nn.Embedding(buckets, heads)
        # T5 initialises this like any embedding; small values keep the start close to no bias.
        nn.init.normal_(self.embedding.weight, std=0.02)

    def tile(self, t: Tile) -> Tensor:
        index = relative_buckets(t.diagonal, self.buckets, self.max_distance, self.bidirectional)
        return self.embedding(index.to(self.embedding.weight.device)).permute(2, 0, 1)  # (h, it, jt)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, buckets={self.buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )
