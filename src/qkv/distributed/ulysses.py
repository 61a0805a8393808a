"""The Ulysses strategy: all-to-all from sequence shards to head shards, local attention, and back.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size, ``P`` ranks, ``s·c`` a rank's padded rows.

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models"): rank ``p`` sends to every
rank ``r`` its rows of head group ``r`` (``h/P`` query heads, ``g/P`` KV heads); after the
all-to-all it holds all ``i`` rows of its own head group, runs ordinary attention on them
with the global mask and its heads' share of the bias, and a second all-to-all returns
each rank its rows with all heads. Four all-to-alls per pass (q, k+v, out; and the
reverse ones in the backward, where the output's comes back as the gradients of q, k, v),
each moving ``(P - 1)/P`` of a rank's tensor.

The head counts must split evenly: ``P`` must divide ``h``; when it does not divide ``g``,
each KV head is repeated (``lcm(g, P)`` KV heads travel; it divides ``h`` because ``g`` and
``P`` do).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backends.request import repeat_kv
from .comm import Group, all_to_all, attach
from .compute import attend_rows
from .layout import Layout


def kv_heads(h: int, g: int, size: int) -> int:
    """KV heads to send so that ``size`` ranks can each take an equal share; ``ValueError`` if none."""
    if h % size:
        raise ValueError(
            f"strategy: Ulysses splits the h={h} query heads over {size} ranks, which needs {size} to divide h; "
            f"use strategy='ring' or a group whose size divides {h}"
        )
    # g and size both divide h, so their least common multiple does too: repeating each KV
    # head lcm/g times always gives a count that both the ranks and the query heads divide
    return math.lcm(g, size)


def to_heads(x: Tensor, lay: Layout, grp: Group, kind: str) -> Tensor:
    """``(b, n, rows, ·)`` sequence shard -> ``(b, n/P, length, ·)`` head shard of the whole sequence."""
    n = x.shape[1]
    x = lay.pad(x, -2, grp.rank).unflatten(1, (grp.size, n // grp.size)).movedim(1, 0)
    return lay.assemble(all_to_all(x, grp, kind), -2)


def to_rows(x: Tensor, lay: Layout, grp: Group) -> Tensor:
    """The inverse of :func:`to_heads`: ``(b, n/P, length, ·)`` -> ``(b, n, rows, ·)``."""
    x = all_to_all(lay.scatter(x, -2), grp, "a2a")
    return lay.unpad(x.movedim(0, 1).flatten(1, 2), -2, grp.rank)


def run(q: Tensor, k: Tensor, v: Tensor, call, grp: Group | None = None) -> Tensor:
    grp = call.group if grp is None else grp
    h, g, d = q.shape[1], k.shape[1], k.shape[-1]
    wanted = kv_heads(h, g, grp.size)
    kv = repeat_kv(torch.cat((k, v), -1), wanted // g)
    qh = to_heads(q, call.q_layout, grp, "a2a")
    kvh = to_heads(kv, call.k_layout, grp, "a2a")
    per = h // grp.size
    heads = (grp.rank * per, (grp.rank + 1) * per)
    out = attend_rows(qh, kvh[..., :d], kvh[..., d:], call, heads=heads)
    out = out if out.requires_grad else attach(out, qh, kvh)  # keep the backward's all-to-alls
    return to_rows(out, call.q_layout, grp)
