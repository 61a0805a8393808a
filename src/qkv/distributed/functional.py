"""``qkv.distributed.attention``: one call checked on every rank, then run by a strategy.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size, ``P`` ranks; a rank holds ``q (b, h, i/P, d)``,
``k (b, g, j/P, d)``, ``v (b, g, j/P, e)`` (its shards, see ``layout``).

Each call first gathers a few integers from every rank (shapes, dtype, strategy, layout,
the dropout seed): one small all-gather, which checks that the ranks agree, and gives
every rank the global lengths ``i = Σ i/P`` and ``j = Σ j/P``. The keywords are then checked
exactly as ``qkv.attention`` checks them, against the global shapes, so a mask or bias is
given for the whole ``(..., h, i, j)`` call (the same object on every rank) and is read at
each block's global positions (``framing``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import checks
from .._args import probability
from ..backends.tiling import dropout as drop
from ..backends.request import Request
from ..masks import Mask
from ..positional import LazyBias
from ..scores import Location, Score
from .comm import Group, all_gather_ints, resolve
from .layout import Layout, check_layout

#: The strategies ``attention`` accepts.
STRATEGIES = ("ring", "ulysses", "hybrid", "allgather")
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_FIELDS = ("dtype", "b", "h", "g", "d", "dk", "e", "strategy", "layout", "causal", "dropout")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    strategy: str = "ring",
    layout: str = "zigzag",
    group=None,
    ring_group=None,
    ulysses_group=None,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    generator: torch.Generator | None = None,
    score_mod: Callable | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence split across the ranks of ``group``; returns this rank's output rows.

    Args:
        q, k, v: this rank's shards ``(b, h, i/P, d)``, ``(b, g, j/P, d)``, ``(b, g, j/P, e)``
            in ``layout`` (``qkv.distributed.shard``); ranks may hold different numbers of
            rows (a length that ``P`` does not divide), or none.
        strategy: ``"ring"`` (K/V blocks visit every rank that needs them, partial results
            merge by log-sum-exp), ``"ulysses"`` (all-to-all from sequence shards to head
            shards and back), ``"hybrid"`` (Ulysses inside ``ulysses_group``, ring across
            ``ring_group``) or ``"allgather"`` (every rank gathers all K/V).
        layout: ``"zigzag"`` (balanced under a causal mask) or ``"contiguous"``.
        group: the ranks the sequence is split over (default: all).
        ring_group, ulysses_group: the two factors of ``group`` for ``"hybrid"``.
        score, mask, bias, causal, scale, dropout, generator, score_mod, sinks: as in
            ``qkv.attention``, for the whole ``(b, h, i, j)`` call at global positions (a
            ``score_mod`` sees global ``q_idx``, ``kv_idx`` and head ``h``); give the same
            objects on every rank (a dense mask or bias covers all ``i`` and ``j``).

    Returns:
        ``(b, h, i/P, e)``: this rank's rows of the output, in ``layout``. Autograd works
        through it; gradients of shared parameters (learned scores, T5 buckets, a dense
        bias) are this rank's share, summed over the group by the data-parallel all-reduce
        (or ``torch.distributed.all_reduce``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    check_layout(layout)
    grp = resolve(group)
    call = plan_call(
        q, k, v, grp, strategy=strategy, layout=layout, score=score, mask=mask, bias=bias, causal=causal,
        scale=scale, dropout=dropout, generator=generator, score_mod=score_mod, sinks=sinks,
    )  # fmt: skip
    if strategy == "allgather":
        from .allgather import run
    elif strategy == "ulysses":
        from .ulysses import run
    elif strategy == "ring":
        from .ring import run
    else:
        from .hybrid import run

        return run(q, k, v, call, ring_group=ring_group, ulysses_group=ulysses_group)
    return run(q, k, v, call)


class Call:
    """One checked call: the global request, the group, both layouts and the dropout seed."""

    def __init__(self, req: Request, group: Group, q_layout: Layout, k_layout: Layout, seed: int, dims: dict):
        self.req, self.group, self.q_layout, self.k_layout, self.seed = req, group, q_layout, k_layout, seed
        self.dims = dims  # b, h, g, d, e: the same on every rank

    @property
    def i_len(self) -> int:
        return self.q_layout.length

    @property
    def j_len(self) -> int:
        return self.k_layout.length


def plan_call(q, k, v, group: Group, *, strategy: str, layout: str, score, mask, bias, causal, scale, dropout,
              generator, score_mod=None, sinks=None) -> Call:  # fmt: skip
    """Check the local shards, agree with the other ranks, and check the keywords at global shapes.

    A shard refused on one rank is refused on every rank: the others would otherwise wait in
    the gather below for a rank that has left (until the process group's timeout)."""
    n = len(_FIELDS)
    try:
        p, seed, mine = _local(q, k, v, strategy, layout, causal, dropout, generator)
    except (TypeError, ValueError) as error:
        refused, p, seed, mine = error, 0.0, 0, [0] * (n + 4)
    else:
        refused = None
    table = all_gather_ints([*mine, int(refused is not None)], group)
    if refused is not None:
        raise refused
    failed = [rank for rank in range(group.size) if int(table[rank, -1])]
    if failed:
        raise ValueError(f"rank {failed[0]} refused its shards (its own error says why); every rank stops with it")
    table = table[:, :-1]
    for rank in range(group.size):
        for field, ours, theirs in zip(_FIELDS, mine[:n], table[rank, :n].tolist()):
            if ours != theirs:
                raise ValueError(
                    f"{_argument(field)}: ranks disagree on {field}: rank {group.rank} has {_show(field, ours)}, "
                    f"rank {rank} has {_show(field, theirs)}"
                )
    q_layout = _layout("q", layout, table[:, n].tolist(), group)
    k_layout = _layout("k", layout, table[:, n + 1].tolist(), group)
    seed = int(table[0, n + 2]) | (int(table[0, n + 3]) << 31)  # rank 0's draw: the same mask everywhere
    # The keywords, checked as qkv.attention checks them, against the global shapes:
    # zero-stride views stand in for the whole tensors (no memory).
    b, h, g, d, e = q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    whole = [x.new_zeros(()).expand(b, heads, length, size)
             for x, heads, length, size in ((q, h, q_layout.length, d), (k, g, k_layout.length, k.shape[3]),
                                            (v, g, k_layout.length, e))]  # fmt: skip
    req = checks.request(
        *whole, score=score, mask=mask, bias=bias, causal=causal, scale=scale, dropout=p,
        return_weights=False, generator=None, score_mod=score_mod, sinks=sinks,
    )  # fmt: skip
    if isinstance(req.score, Location):
        raise ValueError(
            "score: the location score reads each query's whole row of key positions, which a sequence "
            "split across ranks does not have; use dot, scaled_dot, general (Bilinear) or concat (Additive)"
        )
    return Call(req, group, q_layout, k_layout, seed, {"b": b, "h": h, "g": g, "d": d, "e": e})


def _local(q, k, v, strategy: str, layout: str, causal, dropout, generator) -> tuple[float, int, list[int]]:
    """This rank's checks of its shards, its dropout and seed, and what it tells the other ranks."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected this rank's shard (b, heads, rows, size), got shape {tuple(x.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: expected a floating-point tensor, got {q.dtype}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"v: expected {k.shape[-2]} rows like k on this rank, got {v.shape[-2]}")
    if k.shape[1] == 0:  # qkv.attention takes h = g = 0 as an empty call; the strategies split and repeat KV heads
        raise ValueError(f"k: expected at least one KV head to spread over the ranks, got shape {tuple(k.shape)}")
    p = probability("dropout", dropout)
    seed = drop.draw_seed(generator) if p > 0 else 0
    mine = [
        _DTYPES.index(q.dtype), q.shape[0], q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3],
        STRATEGIES.index(strategy), ("contiguous", "zigzag").index(layout), int(bool(causal)), int(p * 2**30),
        q.shape[2], k.shape[2], seed & 0x7FFFFFFF, seed >> 31,
    ]  # fmt: skip
    return p, seed, mine


def _layout(name: str, kind: str, rows: list[int], group: Group) -> Layout:
    # (under the fake backend every row of the table is this rank's: an even split is assumed)
    total = sum(rows)
    lay = Layout(kind, total, group.size)
    for rank, n in enumerate(rows):
        if n != lay.rows(rank):
            raise ValueError(
                f"{name}: rank {rank} holds {n} rows, but a {kind} split of {total} rows over {group.size} "
                f"ranks gives it {lay.rows(rank)}; split tensors with qkv.distributed.shard(x, layout={kind!r})"
            )
    return lay


def _argument(field: str) -> str:
    return {"strategy": "strategy", "layout": "layout", "causal": "causal", "dropout": "dropout",
            "g": "k", "dk": "k", "e": "v"}.get(field, "q")  # fmt: skip


def _show(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value])
    if field == "strategy":
        return repr(STRATEGIES[value])
    if field == "layout":
        return repr(("contiguous", "zigzag")[value])
    if field == "dropout":
        return f"{value / 2**30:g}"
    return str(value)
