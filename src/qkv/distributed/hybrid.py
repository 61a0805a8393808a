"""The hybrid strategy: Ulysses inside ``ulysses_group`` (e.g. a node), ring across ``ring_group``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``d`` query/key size, ``e``
value size, ``P = U·R`` ranks: ``U`` per Ulysses group, ``R`` per ring; ``S·c`` a rank's
padded rows.

The ranks of ``group`` form a grid: each is in one Ulysses group (size ``U``) and one ring
group (size ``R``), and the two meet in exactly that rank. The Ulysses all-to-all (fast
links inside a node) turns the ``U`` sequence shards of a Ulysses group into ``U`` head
shards of their union: rank ``u`` of the group then holds query heads
``u·h/U .. (u+1)·h/U`` for the chunks of all ``U`` members. Ring attention then runs over the
ring group (slow links across nodes) between ranks holding the same heads, each with
its Ulysses group's chunks: only ``1/U`` of the heads travel around the ring, and the ring
has ``R = P/U`` steps instead of ``P`` (USP, Fang & Zhao 2024, "A Unified Sequence
Parallelism Approach for Long Context Generative AI"; LoongTrain's 2D attention). A final
all-to-all inside the Ulysses group returns each rank its rows with all heads.

Without groups, ``hybrid`` builds them from ``torchrun``'s ``LOCAL_WORLD_SIZE``: Ulysses over
the ranks of one machine, ring across machines.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends.engines import key_blocks
from ..backends.request import repeat_kv
from .blocks import Work
from .comm import Group, all_gather_ints, all_to_all, attach, resolve
from .ring import attend, plan_for, row_bytes
from .ulysses import kv_heads

_DEFAULT_GROUPS: dict = {}


def _default_groups(grp: Group):
    """``(ring_group, ulysses_group)``: Ulysses over each machine's ranks, ring across machines (cached)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local < 1 or grp.size % local:
        raise ValueError(
            "ring_group, ulysses_group: strategy='hybrid' needs both groups (torch.distributed.new_group), "
            f"or torchrun's LOCAL_WORLD_SIZE dividing the group size {grp.size}, got LOCAL_WORLD_SIZE={local or None}"
        )
    key = (id(grp.handle), local)
    if key not in _DEFAULT_GROUPS:
        ranks = [dist.get_global_rank(grp.handle, r) for r in range(grp.size)]
        mine = {}
        # every rank creates every group, in the same order (new_group is collective)
        for start in range(0, grp.size, local):
            g = dist.new_group(ranks[start : start + local])
            if grp.rank in range(start, start + local):
                mine["ulysses"] = g
        for offset in range(local):
            g = dist.new_group(ranks[offset::local])
            if grp.rank % local == offset:
                mine["ring"] = g
        _DEFAULT_GROUPS[key] = (mine["ring"], mine["ulysses"])
    return _DEFAULT_GROUPS[key]


def grid(grp: Group, ring: Group, uly: Group) -> list[list[int]]:
    """``members[m][u]``: the rank in ``group`` at ring position ``m`` and Ulysses position ``u``.

    One small all-gather; checks that the two groups tile ``group`` as a grid.
    """
    if ring.size * uly.size != grp.size:
        raise ValueError(
            f"ring_group, ulysses_group: their sizes {ring.size} x {uly.size} must multiply to the group size "
            f"{grp.size}"
        )
    table = all_gather_ints([ring.rank, uly.rank], grp, "meta").tolist()
    members = [[-1] * uly.size for _ in range(ring.size)]
    for rank, (m, u) in enumerate(table):
        if members[m][u] != -1:
            raise ValueError(
                f"ring_group, ulysses_group: ranks {members[m][u]} and {rank} both sit at ring position {m} and "
                f"Ulysses position {u}; each Ulysses group must hold one rank of every ring group"
            )
        members[m][u] = rank
    return members


def run(q: Tensor, k: Tensor, v: Tensor, call, *, ring_group=None, ulysses_group=None) -> Tensor:
    grp = call.group
    if (ring_group is None) != (ulysses_group is None):
        raise ValueError("ring_group, ulysses_group: give both groups for strategy='hybrid', or neither")
    if ring_group is None:
        ring_group, ulysses_group = _default_groups(grp)
    ring, uly = resolve(ring_group, "ring_group"), resolve(ulysses_group, "ulysses_group")
    members = grid(grp, ring, uly)
    req, lay_q, lay_k = call.req, call.q_layout, call.k_layout
    h, g = q.shape[1], k.shape[1]
    wanted = kv_heads(h, g, uly.size)
    qp, kp = req.score.prepare(q, k)
    d = kp.shape[-1]
    kv = repeat_kv(torch.cat((kp, v), -1), wanted // g)
    # sequence shards -> head shards of the Ulysses group's chunks, (b, h/U, U·S·c, ·), slots in Ulysses order
    qh = _to_heads(lay_q.pad(qp, -2, grp.rank), uly)
    kvh = _to_heads(lay_k.pad(kv, -2, grp.rank), uly)
    per = h // uly.size
    heads = (uly.rank * per, (uly.rank + 1) * per)
    work = Work(req, call.i_len, call.j_len, call.seed, heads, h)
    per_row = row_bytes(q.shape[0], per, wanted // uly.size, d, v.shape[-1], v.dtype)
    plan = plan_for(ring, work, [_union(lay_q, row) for row in members], [_union(lay_k, row) for row in members],
                    lay_q.side, lay_k.side, per_row)  # fmt: skip
    dense = req.bias if isinstance(req.bias, Tensor) else None
    sinks = None if req.sinks is None else req.sinks[heads[0] : heads[1]]
    out = attend(qh, kvh[..., :d], kvh[..., d:], dense, plan, key_blocks.parameters(req), sinks)
    out = out if out.requires_grad else attach(out, qh, kvh)
    # back: (b, h/U, U·S·c, e) -> (U, b, h/U, S·c, e) -> all-to-all -> (b, h, S·c, e)
    back = all_to_all(out.unflatten(-2, (uly.size, -1)).movedim(-3, 0), uly, "a2a")
    return lay_q.unpad(back.movedim(0, 1).flatten(1, 2), -2, grp.rank)


def _to_heads(x: Tensor, uly: Group) -> Tensor:
    """``(b, n, S·c, ·)`` padded rows, all heads -> ``(b, n/U, U·S·c, ·)``: my heads, the group's rows."""
    n = x.shape[1]
    x = all_to_all(x.unflatten(1, (uly.size, n // uly.size)).movedim(1, 0), uly, "a2a")  # (U, b, n/U, S·c, ·)
    return x.movedim(0, 2).flatten(2, 3)


def _union(lay, ranks: list[int]) -> tuple[tuple[int, int], ...]:
    """The slots ``(global start, real rows)`` of a Ulysses group's members, in Ulysses order."""
    return tuple(span for r in ranks for span in lay.slot_spans(r))
