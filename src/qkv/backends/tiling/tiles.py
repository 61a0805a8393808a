"""Per-tile pieces shared by the tiled backends: biases, masks and logits of one tile.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size; ``it``/``jt`` the sides of
a tile, ``r = h / g`` query heads per KV head, ``L = i + j - 1`` the number of distinct
query-key offsets.

Positional biases such as ALiBi (Press et al. 2022) and T5's relative buckets (Raffel et al.
2020) depend on a query and a key only through their offset ``c - r - (j - i)``
(``Tile.diagonal``). For those, :class:`BiasSource` evaluates the bias once per offset, a
``(h, L)`` profile, and cuts each tile out of it (a tile is a stack of shifted windows of
the profile): a copy per tile instead of re-running bucket logarithms and embedding
look-ups on ``it·jt`` elements, and gradients reach the bias parameters through the
``(h, L)`` profile rather than through every tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks import Mask, Offsets, Tile
from ...positional import LazyBias

NEG_INF = float("-inf")


def shift_invariant(bias: LazyBias) -> bool:
    """True when the bias depends on positions only through ``Tile.diagonal`` (it says so)."""
    return bool(bias.shift_invariant)


class BiasSource:
    """Tiles of a dense or lazy bias, with an optional ``(h, L)`` profile for shift-invariant ones.

    ``profile_leaf`` is set when the profile was built with gradients on: tiles are then cut
    from a detached float32 (or wider) leaf, whose gradient the caller accumulates and finally
    pushes through :attr:`profile_graph` to the bias parameters (one backward through the bias
    per call, its gradient in the graph's dtype).
    """

    def __init__(self, bias: Tensor | LazyBias | None, i_len: int, j_len: int, device, *, grad: bool = False,
                 dtype: torch.dtype | None = None):  # fmt: skip
        """``dtype``: the profile's, when the caller adds every tile in that dtype anyway (converted once, not per tile)."""
        self.bias, self.i_len, self.j_len = bias, i_len, j_len
        self.profile = self.profile_graph = None
        self.offset0 = 0
        if isinstance(bias, LazyBias) and shift_invariant(bias):
            shift = j_len - i_len
            lo = -(i_len - 1) - shift  # smallest offset, bottom-left corner
            # a one-row tile whose columns run over every offset lo .. lo + L - 1
            t = Tile(0, 1, 0, i_len + j_len - 1, 1, 1 - lo, device)
            with torch.set_grad_enabled(grad):
                graph = bias.tile(t)[:, 0, :]  # (h, L)
            self.offset0 = lo
            if grad:
                self.profile_graph = graph
                # the leaf whose gradient sums every tile's: in float32 (or wider), rounded once at the end
                self.profile = graph.detach().to(torch.promote_types(graph.dtype, torch.float32)).requires_grad_()
            else:
                self.profile = graph if dtype is None else graph.to(dtype)

    def tile(self, t: Tile) -> Tensor | None:
        """Bias of one tile, broadcastable to ``(..., h, it, jt)``, or None."""
        if self.bias is None:
            return None
        if isinstance(self.bias, Tensor):
            return dense_tile(self.bias, t)
        if self.profile is None:
            return self.bias.tile(t)
        it, jt = t.i1 - t.i0, t.j1 - t.j0
        first = t.j0 - t.i0 - (t.j_len - t.i_len) - self.offset0  # profile index at (i0, j0)
        # Row a of the tile starts `a` entries earlier in the profile than row 0.
        windows = self.profile.unfold(-1, jt, 1)  # (h, L - jt + 1, jt)
        return windows[:, first - it + 1 : first + 1].flip(-2)


def dense_tile(x: Tensor, t: Tile) -> Tensor:
    """Rows ``i0:i1`` and cols ``j0:j1`` of a tensor broadcastable to ``(..., i, j)`` (size-1 dims kept)."""
    rows = slice(t.i0, t.i1) if x.shape[-2] != 1 else slice(None)
    cols = slice(t.j0, t.j1) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, cols]


def mask_state(mask: Mask | None, t: Tile) -> str:
    return "full" if mask is None else mask.state(t)


def live_tiles(mask: Mask | None, block_i: int, block_j: int, i_len: int, j_len: int, device):
    """``(tile, state)`` for every ``block_i × block_j`` tile the mask does not empty, query tiles outermost."""
    for i0 in range(0, i_len, block_i):
        i1 = min(i0 + block_i, i_len)
        for j0 in range(0, j_len, block_j):
            t = Tile(i0, i1, j0, min(j0 + block_j, j_len), i_len, j_len, device)
            state = mask_state(mask, t)
            if state != "empty":
                yield t, state


def key_range(mask: Mask | None, i0: int, i1: int, i_len: int, j_len: int, step: int, device) -> tuple[int, int]:
    """``(jlo, jhi)``: the keys that rows ``i0:i1`` may see, to ``step`` granularity; ``jlo == jhi`` if none."""
    if mask is None:
        return 0, j_len
    bounds = mask.key_bounds(Tile(i0, i1, 0, j_len, i_len, j_len, device))
    lo, hi = (0, j_len) if bounds is None else bounds
    lo = lo // step * step  # the same steps as without bounds: ranges and tiles line up
    live = [j0 for j0 in range(lo, hi, step) if mask.state(Tile(i0, i1, j0, min(j0 + step, j_len), i_len, j_len, device)) != "empty"]
    if not live:
        return 0, 0
    return live[0], min(live[-1] + step, j_len)


def as_heads(x: Tensor, dims: int) -> Tensor:
    """Prepend size-1 dims so that ``x`` has ``dims`` dims (masks and biases of fewer dims broadcast)."""
    while x.dim() < dims:
        x = x.unsqueeze(0)
    return x


def offset_live_rows(mask: Offsets, i_len: int, j_len: int) -> tuple[int, int]:
    """``(first, stop)``: the query rows that see at least one key under an offset mask.

    Row ``r`` sees offsets ``-r - (j - i) .. j - 1 - r - (j - i)``; with ``lo <= hi`` the
    range meets ``[lo, hi]`` iff ``r >= -(j - i) - hi`` and ``r <= j - 1 - (j - i) - lo``.
    """
    shift = j_len - i_len
    first = 0 if mask.hi is None else max(0, -shift - mask.hi)
    stop = i_len if mask.lo is None else min(i_len, j_len - shift - mask.lo)
    return first, max(first, stop)


def sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``x`` over the dims it was broadcast along, back to ``shape`` (a dense bias's gradient)."""
    while x.dim() > len(shape):
        x = x.sum(0)
    dims = [n for n, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1]
    return x.sum(dims, keepdim=True) if dims else x


def grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q (b, h, i, d) -> (b, g, r, i, d)``; ``k``, ``v`` get a size-1 ``r`` axis: products broadcast over the group."""
    g = k.shape[-3]
    return q.unflatten(-3, (g, q.shape[-3] // g)), k.unsqueeze(-3), v.unsqueeze(-3)
