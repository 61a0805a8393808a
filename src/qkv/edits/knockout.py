"""Edge knockout: some query→key edges removed from the softmax (Wang et al. 2022; Geva et al. 2023).

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length; a tile
is rows ``i0:i1`` × keys ``j0:j1``.

``Knockout(edges)`` takes edges to remove, **True = knocked out** (the opposite of a qkv
mask's True = may attend, because an edit names what it removes): a bool tensor
broadcastable to ``(b, h, i, j)`` or any lazy ``qkv.masks`` object, read as "these edges".
The call runs with ``mask & ~edges``: the logit of a knocked-out edge is ``-inf``, the
others are renormalised, exactly eager attention with ``-inf`` added at those edges. A
row whose every key is knocked out gives zero output (qkv's convention; eager gives NaN).

The complement of a lazy mask stays lazy (:class:`Except`: each tile is the complement of
the mask's tile, an "empty" tile is "full" and the reverse), so the engines keep skipping
and unmasking whole tiles and never build the ``(i, j)`` mask of a long sequence.

Under ``generate()`` with a KV cache the edit applies to every call, and a decoding step is
one query row against every key so far. Masks aligned bottom-right (``qkv.masks.offsets``,
``window``, ``causal``: ``Knockout(offsets(-1, -1))`` removes each token's edge to the one
before it) and programs that read only ``kv_idx`` knock out the same edges with and without
the cache. A ``from_mask_mod`` program that reads ``q_idx`` does not: it sees FlexAttention's
positions within the call, so ``q_idx`` is 0 in every step. A dense tensor fits one call's
``(i, j)`` only; one that does not broadcast to the call is refused, naming the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import broadcasts
from ..masks import Dense, Mask, State, Tile, as_mask
from .base import Call, Edit


class Except(Mask):
    """Lazy ``~mask``: may attend exactly where ``mask`` does not."""

    def __init__(self, mask: Mask):
        self.mask = mask

    def tile(self, t: Tile) -> Tensor:
        return ~self.mask.tile(t)

    def state(self, t: Tile) -> State:
        return {"empty": "full", "full": "empty"}.get(self.mask.state(t), "partial")  # type: ignore[return-value]

    def batch_shape(self) -> tuple[int, ...]:
        return self.mask.batch_shape()

    def check(self, i_len: int, j_len: int) -> None:
        self.mask.check(i_len, j_len)

    def tensors(self) -> list[tuple[str, Tensor]]:
        return self.mask.tensors()

    def reset(self) -> None:
        self.mask.reset()

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        return Except(self.mask.merge_lead(lead))

    # key_bounds and hidden_keys stay None (unknown), always safe: the complement of a key
    # range is not a range, and a key the edges hide from every row is still a finite key.

    def __repr__(self) -> str:
        return f"~{self.mask!r}"


class Knockout(Edit):
    """Remove the query→key edges where ``edges`` is True (a bool tensor or a lazy ``qkv.masks`` mask)."""

    def __init__(self, edges: Mask | Tensor):
        if isinstance(edges, Tensor) and edges.dtype != torch.bool:
            raise TypeError(f"Knockout: edges expected a bool tensor (True = knocked out) or a qkv.masks mask, got {edges.dtype}")
        if not isinstance(edges, (Tensor, Mask)):
            raise TypeError(f"Knockout: edges expected a bool tensor (True = knocked out) or a qkv.masks mask, got {type(edges).__name__}")
        self.edges = edges
        # ~tensor once, here: a dense complement is a tensor like any other mask
        self.keep: Mask = Dense(~edges) if isinstance(edges, Tensor) else Except(edges)

    def prepare(self, call: Call) -> Call:
        if isinstance(self.edges, Tensor):
            target = (*call.q.shape[:-3], call.heads, call.rows, call.k.shape[-2])  # (..., h, i, j)
            if not broadcasts(tuple(self.edges.shape), target):
                raise ValueError(
                    f"Knockout: edges of shape {tuple(self.edges.shape)} do not broadcast to this call's (..., h, i, j) = "
                    f"{target}; a dense tensor fits one call (a generate() decoding step has 1 query row and every key "
                    "so far): for any call give a lazy qkv.masks mask, e.g. offsets(lo, hi) of key - query positions"
                )
        mask = as_mask(call.options.get("mask"))
        return call.with_options(mask=self.keep if mask is None else mask & self.keep)

    def __repr__(self) -> str:
        return f"Knockout({self.edges!r})" if isinstance(self.edges, Mask) else f"Knockout(tensor{tuple(self.edges.shape)})"
