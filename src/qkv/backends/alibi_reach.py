"""ALiBi's far keys left unread where their weights are below the output's rounding: the heads split by reach.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``x = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``d`` query/key size.

ALiBi (Press et al. 2022) adds ``-m_h |o|`` to a logit, ``o`` the query-key offset, so a steep
head (``m = 1/2``) weighs a key 100 positions away ``e^-50`` times its own key. A query's
largest logit is at least its own key's (offset 0, no bias, a dot product of at least
``-|scale| ‖q‖ ‖k‖``), hence for any key ``c`` of row ``r``::

    s_rc - max_c' s_rc'  <=  |scale| ‖q_r‖ (‖k_c‖ + ‖k_own‖) - m |o_rc|  <=  2 |scale| Q K - m |o_rc|

with ``Q``, ``K`` the head's largest query and key norms in the call. Keys past

    D_h = (2 |scale| Q K + T) / m_h,        T = ln j + (p + 2) ln 2 + 1

(``p`` the significand bits of the dtype the kernels accumulate in: 24 for float32 and below, 53
for float64) have weights below ``e^-T`` of their row's largest, all of them together below
``2^-(p+2)`` of the row's weight: what they add to an output, to the log-sum-exp or to a
gradient of a key the row does read is under a quarter of the unit roundoff of the values summed,
below the kernels' own rounding of those sums. Such a key's own gradient from those rows,
as small, is left 0. Head ``h`` then attends to ``|o| <= D_h`` alone: a window, which the
engines run block-locally. A head gets its window only where it leaves at most
:data:`WINDOW_SHARE` of the head's query-key pairs (the windowed engines read blocks with
margins); the split is left out of a call with ``backend=`` named, which reads every key.

:func:`runs` decides it for a call, from the largest norms per head (one pass over ``q``, ``k``
and ``v``, about a percent of the attention's time; a head whose inputs hold a nan or inf is left
whole, where they reach its output as they would without the split), and gives the runs of heads to attend apart: each
head with its window, the heads no window narrows together. It answers None (one call as
before) unless the call is ALiBi alone (no other mask than the causal one, no dropout,
weights or score_mod, the dot or scaled-dot score) of float dtype on the CPU, with eager
tensors, every query at or after its own key (``i <= j``, bottom-right: the bound needs the row's own key),
and the windows take at least :data:`SAVING` of the work off.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._trace import concrete
from ..masks import Window
from ..positional import ALiBi
from ..scores import Dot, ScaledDot
from .request import Request

#: Query rows below which a call is left whole: a short call gains less than the split costs.
MIN_ROWS = 256
#: The share of the work the windows must take off (from the keys they leave to read) for a split.
SAVING = 0.1
#: A head is given its window only where that leaves at most this share of its query-key pairs: the
#: engines' windowed paths read blocks with margins (``local``: a block as wide as the window, so about
#: twice the pairs), and measured on the AMD EPYC Zen 5 at i = j = 4096 a head kept 5% of its pairs in
#: 0.18x the time of the whole head, 10% in 0.29-0.43x, 20% in 0.53-0.80x, 39% in 0.57-1.52x.
WINDOW_SHARE = 0.15
#: The backend a windowed head runs on: ``chunked`` (its ``fused_blocks`` engine makes a block's bias and
#: mask, keeps neither for the backward). ``local``, which ``choose`` prefers for narrow windows, keeps its
#: unfolded keys and an ``(n, B, W)`` mask for the backward: measured on the AMD EPYC Zen 5 at 4096 tokens
#: (8 heads, two windowed), the call's peak rose 14-25 MiB above the whole call's, the chunked runs' stayed
#: within 6 of it, for 4-6% more time (still 0.89x the whole call's, forward and backward).
BACKEND = "chunked"


class Run(NamedTuple):
    """Query heads ``a .. b - 1`` over KV heads ``ka .. kb - 1``, attended to keys within ``reach`` (None: all)."""

    a: int
    b: int
    ka: int
    kb: int
    reach: int | None


def runs(req: Request, backend: str) -> list[Run] | None:
    """The runs of heads to attend apart, or None: the call is not ALiBi that far keys could be left out of."""
    if backend != "auto" or type(req.bias) is not ALiBi or not _plain(req):
        return None
    reach = _reach(req)
    if reach is None:
        return None
    i, j, causal = req.i, req.j, req.mask is not None
    full = _keys_read(i, j, None, causal)
    read = [_keys_read(i, j, r, causal) for r in reach]
    reach = [r if keys <= WINDOW_SHARE * full else None for r, keys in zip(reach, read)]
    if all(r is None for r in reach) or sum(min(keys, full) if r is not None else full
                                            for r, keys in zip(reach, read)) > (1 - SAVING) * full * len(reach):  # fmt: skip
        return None
    return _grouped(reach, req.group)


def window(run: Run, causal: bool) -> Window | None:
    """The run's mask: its reach on both sides (one side, causal), the causal mask alone, or None."""
    if run.reach is None:
        return Window(None, 0) if causal else None
    return Window(run.reach, 0 if causal else run.reach)


def head_slopes(req: Request) -> torch.Tensor:
    """``(h,)`` the slope of each query head: the bias's own, or its one slope for every head (an ``ALiBi(1)``)."""
    slopes = req.bias.slopes
    return slopes.expand(req.heads) if slopes.numel() == 1 else slopes


def _plain(req: Request) -> bool:
    """ALiBi alone, where the bound holds and can be read: see the module docstring."""
    q = req.q
    if req.mask is not None and not req.is_causal_only:
        return False
    if req.dropout > 0 or req.return_weights or req.score_mod is not None or req.piece is not None:
        return False
    if type(req.score) not in (Dot, ScaledDot) or req.i < MIN_ROWS or req.i > req.j or req.heads == 0:
        # (a bilinear score is a dot product of qW and k: the bound would need qW's norms)
        return False
    if q.device.type != "cpu" or not q.dtype.is_floating_point or not concrete(q, req.k, req.v):
        return False
    return not any(p.requires_grad for p in req.bias.parameters())


def _reach(req: Request) -> list[int | None] | None:
    """Each query head's reach ``D_h`` (None where it spans every key), or None when no head has one."""
    with torch.no_grad():
        wide = torch.promote_types(req.q.dtype, torch.float32)  # a bfloat16 norm would be 2^-8 off
        Q = torch.linalg.vector_norm(req.q, dim=-1, dtype=wide).amax((0, 2))  # (h,)
        K = torch.linalg.vector_norm(req.k, dim=-1, dtype=wide).amax((0, 2)).repeat_interleave(req.group)  # (h,)
        # a nan or inf value among a head's keys reaches its output in the whole call (0 · nan); left whole, it still does
        V = torch.linalg.vector_norm(req.v, dim=-1, dtype=wide).amax((0, 2)).repeat_interleave(req.group)  # (h,)
        Q, K, V = Q.double(), K.double(), V.double()
        bound = torch.where(torch.isfinite(Q * K * V), 2 * abs(req.scale) * Q * K, math.inf).tolist()
    slopes = head_slopes(req).tolist()
    bits = 53 if req.q.dtype == torch.float64 else 24
    T = math.log(req.j) + (bits + 2) * math.log(2) + 1  # (+1: a margin over the norms' own rounding)
    reach: list[int | None] = []
    for b, m in zip(bound, slopes):
        if not math.isfinite(b) or m <= 0:
            reach.append(None)  # an inf or nan among the head's inputs (the whole call's to show), or a flat head
            continue
        D = math.ceil((b + T) / m)
        reach.append(D if D < req.j else None)
    return reach if any(r is not None for r in reach) else None


def _keys_read(i: int, j: int, reach: int | None, causal: bool) -> float:
    """Query-key pairs a head reads with ``reach`` (None: every key its mask leaves), rows bottom-right aligned."""
    rows = torch.arange(i, dtype=torch.float64) + (j - i)  # each row's own key
    left = rows if reach is None else rows.clamp(max=reach)
    right = 0 if causal else ((j - 1 - rows) if reach is None else (j - 1 - rows).clamp(max=reach))
    return float((left + right + 1).sum())


def _grouped(reach: list[int | None], x: int) -> list[Run]:
    """Runs of consecutive query heads with one reach, each cut where a KV group's edge falls inside it."""
    out: list[Run] = []
    a, h = 0, len(reach)
    while a < h:
        b = a + 1
        while b < h and reach[b] == reach[a]:
            b += 1
        while a < b:  # pieces within one KV group's x query heads, or of whole groups: a call's own grouping
            stop = a + (b - a) // x * x if a % x == 0 and b - a >= x else min(b, (a // x + 1) * x)
            out.append(Run(a, stop, a // x, (stop - 1) // x + 1, reach[a]))
            a = stop
    return out
