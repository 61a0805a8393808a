"""What the score-modifier engine's forward and backward share: a call's plan, its operands, a tile's logits and mask.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``d`` query/key size, ``e`` value size;
``it``/``jt`` the sides of a tile.

A tile's operands are the ``r`` query heads of a KV head stacked into one ``(r·it, d)``
matrix against that head's keys (:func:`query_rows`, :func:`key_cols`: no copy of keys or
values), so each product is one batched matmul over ``(b, g)``. :func:`tile_logits` makes
``scale·qᵀk + bias`` (or a soft cap's ``z = stretch·x/c``, see ``qkv.backends.engines.mod_tiles``)
with the factor riding on the product. The engine itself is ``mod_tiles`` (forward) and
``mod_tiles_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ...masks import Mask, Tile
from ...score_mods import SoftCap
from ..tiling import cap_range, tile_math
from ..tiling.tiles import NEG_INF, BiasSource

@dataclass(frozen=True)
class ModPlan:
    """What a call is, besides its tensors."""

    mask: Mask | None  # True = may attend
    bias: object  # a dense tensor or a LazyBias, neither trained here, or None
    scale: float
    score_mod: Callable  # fn(score, b, h, q_idx, kv_idx); a SoftCap is run by hand
    block_i: int  # query tile side
    block_j: int  # key tile side

    @property
    def cap(self) -> float | None:
        return self.score_mod.cap if isinstance(self.score_mod, SoftCap) else None


def query_rows(x: Tensor, g: int, t: Tile, dtype: torch.dtype, into: tuple[tile_math.Scratch, str] | None = None) -> Tensor:
    """Rows ``i0:i1`` of ``x (b, h, i, ·)`` as ``(b·g, r·it, ·)`` in ``dtype``: the ``r`` heads of a KV head stacked
    (a copy, into ``into = (scratch, name)``'s buffer when given, unless a view of ``x`` serves)."""
    b, h, it = x.shape[0], x.shape[1], t.i1 - t.i0
    rows, shape = x[:, :, t.i0 : t.i1], (b * g, (h // g) * it, x.shape[-1])
    if into is None or (rows.dtype == dtype and (h == g or it == x.shape[2])):  # (a view of contiguous x there)
        return rows.to(dtype).reshape(shape)
    out = into[0].take(into[1], shape, dtype)
    out.view(b, h, it, x.shape[-1]).copy_(rows)  # stacked and converted in one pass
    return out


def key_cols(x: Tensor, t: Tile, dtype: torch.dtype, into: tuple[tile_math.Scratch, str] | None = None) -> Tensor:
    """Keys ``j0:j1`` of ``x (b, g, j, ·)`` as ``(b·g, jt, ·)`` in ``dtype``: a view when it is ``x``'s, else a
    converted copy, into ``into = (scratch, name)``'s buffer when given."""
    cols = x[:, :, t.j0 : t.j1].flatten(0, 1)
    return cols.to(dtype) if into is None or cols.dtype == dtype else into[0].take(into[1], cols.shape, dtype).copy_(cols)


@dataclass(frozen=True)
class Operands:
    """One call's operands as its tiles read them, and the numbers every tile uses."""

    q: Tensor  # (b, h, i, d), contiguous
    k: Tensor  # (b, g, j, d)
    v: Tensor  # (b, g, j, e)
    mm: torch.dtype  # the products' dtype
    acc: torch.dtype  # the dtype of everything elementwise and of every accumulator
    factor: float  # what multiplies qᵀk in a tile: scale, or stretch·scale/c under a soft cap
    bias: BiasSource  # the bias's tiles
    forms: tile_math.Forms  # how tanh and exp are computed
    clamp: bool  # the soft cap's expm1 may overflow: clamp it (cap_range.needs_clamp)

    @property
    def heads(self) -> tuple[int, int, int]:
        """``(b, h, g)``."""
        return self.q.shape[0], self.q.shape[1], self.k.shape[1]


def operands(plan: ModPlan, q: Tensor, k: Tensor, v: Tensor) -> Operands:
    """The operands, their products' dtype, and what multiplies ``qᵀk`` in a tile.

    The forward's products (``qᵀk``, ``P v``) and the backward's ``qᵀk`` and ``dO Vᵀ`` are
    float32 whatever the inputs' dtype: a bfloat16 product's output is rounded to 8 bits,
    which put a soft cap's and a score_mod's outputs 2.4x past the flash rule's bound in
    bfloat16 (|x| up to 4) and their gradients 3-6x (the backward's ``D = rowsum(dO ∘ O)``
    reads the forward's output: ``P v`` rounded per tile left dq and dk 1.2-1.8x past it).
    The backward's other three (``Pᵀ dO``, ``dS K``, ``dSᵀ Q``), whose operand is rounded
    first in FlashAttention too, run in ``mm``: bfloat16 where such products (float32
    accumulation inside) beat float32 ones on this CPU, else float32
    (``tile_math.matmul_dtype``, timed once); float16 runs float32.
    The operands keep their dtype and each tile's slice is converted (to float32, or ``mm``)
    as it is used, into the thread's reused buffers (``tile_math.Scratch``: a fresh tile-sized
    copy per tile left the allocator's per-thread arenas holding 10 MiB more at the peak), so
    no float32 copy of a whole input is held (a tile's conversion costs
    ``1/tile`` of its product). ``factor`` is ``scale``, or ``stretch·scale/c`` for a soft
    cap (the tile then holds ``z = stretch·x/c``, ``tile_math.Forms.stretch``); it is
    applied to each tile's product, so no scaled copy of ``q`` is made.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    mm = tile_math.matmul_dtype(q.dtype, q.device)
    forms = tile_math.forms(q.device, q.dtype)
    factor = plan.scale if plan.cap is None else forms.stretch * plan.scale / plan.cap
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # a shift-invariant bias's profile in acc once: each tile is then one copy (the row flip)
    # of it, not a float64 copy and a conversion
    bias = BiasSource(plan.bias, q.shape[-2], k.shape[-2], q.device, dtype=acc)
    clamp = plan.cap is not None and forms.expm1_tanh and cap_range.needs_clamp(plan.bias is not None, q, k, factor)
    return Operands(q, k, v, mm, acc, factor, bias, forms, clamp)


def tile_logits(plan: ModPlan, ops: Operands, q_t: Tensor, k_t: Tensor, t: Tile, scratch: tile_math.Scratch) -> Tensor:
    """``(b, h, it, jt)``: ``scale·qᵀk + bias``, or for a soft cap ``z = stretch·(scale·qᵀk + bias)/c``.

    ``q_t (b·g, r·it, d)`` and ``k_t (b·g, jt, d)`` are the tile's operands (:func:`query_rows`,
    :func:`key_cols`) in ``ops.acc`` (float32 or wider: see :func:`operands`).
    """
    b, h, _ = ops.heads
    it, jt = t.i1 - t.i0, t.j1 - t.j0
    out = scratch.take("s", (q_t.shape[0], q_t.shape[1], jt), ops.acc)
    # the factor rides on the product (beta = 0: out's old values are ignored)
    s = torch.baddbmm(out, q_t, k_t.transpose(1, 2), beta=0.0, alpha=ops.factor, out=out).view(b, h, it, jt)
    if (tile := ops.bias.tile(t)) is not None:
        s.add_(tile.to(s.dtype), alpha=1.0 if plan.cap is None else ops.forms.stretch / plan.cap)
    return s


def mask_bias(plan: ModPlan, t: Tile, state: str, acc: torch.dtype) -> Tensor | None:
    """``-inf`` where tile ``t``'s mask forbids, 0 elsewhere (None on a full tile): added, not ``masked_fill``-ed.

    A broadcast add of this small ``(it, jt)`` pattern ran about 20 times faster than
    ``masked_fill_`` with the same broadcast bool mask (1 ms per 8-head 256 × 256 tile).
    """
    if state == "full":
        return None
    allowed = plan.mask.tile(t)
    return torch.zeros(allowed.shape, dtype=acc, device=allowed.device).masked_fill_(~allowed, NEG_INF)


def tiles_by(tiles, key: str) -> dict[int, list]:
    """Non-empty ``(tile, state)`` pairs grouped by their first row (``"i0"``) or column (``"j0"``)."""
    groups: dict[int, list] = {}
    for t, state in tiles:
        groups.setdefault(getattr(t, key), []).append((t, state))
    return groups


def tiles_cost(tiles, b: int, h: int) -> int:
    return sum(b * h * (t.i1 - t.i0) * (t.j1 - t.j0) for t, _ in tiles)
