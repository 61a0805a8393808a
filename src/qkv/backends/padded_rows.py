"""Short rows of a padded batch: a kernel call per row, or groups of rows with their mask built, whichever is faster here.

Shape legend: ``b`` batch rows, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j``
key length, ``d`` query/key size, ``e`` value size, ``L`` the size class of a row.

The segments backend splits a padded batch (``lengths(n) & rest`` or ``starts(n) & rest``)
by rows. A row's own call runs over its real keys alone and, for a causal batch, is one
``is_causal`` kernel call that skips the blocks above the diagonal; but each call pays the
kernel's fixed cost. A group of rows is one SDPA call with the group's ``(rows, 1, i, j)``
mask built (at most :data:`PADDING_ELEMENTS` of it): few calls, every block computed. Rows
of at least :data:`ROW_ELEMENTS` logits per head always go one by one (on the Intel Xeon,
rows of 512: 0.5-0.6x the engines' time). Below, which wins depends on the CPU's kernels:
on an AMD EPYC (Zen 4, AVX-512) rows of 192 to 320 ran 0.78-0.97x the groups' time one by
one, forward and forward + backward, float32 and bfloat16; on the Intel Xeon bfloat16 rows
of 256 one by one lost (its kernel is slow at key lengths that are not a multiple of its
block). So it is timed, once per size class (:func:`groups_faster`): the dtype, whether
gradients flow, the padding side, whether ``rest`` is an offset range (causal), the heads
and head sizes, the query and key lengths rounded down to powers of two, the score and the kind of
bias (a lazy one is timed with the call's own; a dense tensor is left out). A probe costs
its class's first call about 0.1 s without gradients and 0.6 s with them (rows of 256,
h = 8, d = 64, on the AMD EPYC), once per process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from .._probe import best_times, bucket
from ..masks import Lengths, Mask, Offsets, lengths, starts
from . import sdpa
from .request import Request
from .tiling.framing import frame_row, row_slice

#: A padded batch is split by rows only where its ``(b, i, j)`` mask is more than this many
#: elements (below, SDPA takes it materialised, one call).
PADDING_ELEMENTS = sdpa.MASK_ELEMENTS
#: Rows with at least this many logits per head go one by one without asking
#: (:func:`groups_faster` decides below).
ROW_ELEMENTS = 2**17
#: Rows of a probe, from the class's length down to half of it (a padded batch's spread).
PROBE_ROWS = 8
#: One call per row is kept only where it beats the groups by this much (near-ties: fewer calls).
MARGIN = 1.05

_answers: dict[tuple, bool] = {}


def in_groups(req: Request, pad: Mask, rest: Mask | None, one_by_one: Callable[[Request], object]) -> bool:
    """Whether a padded batch's rows go in groups (short rows, where groups are the faster here) or one by one.

    A group holds at most :data:`PADDING_ELEMENTS` of the mask, so its own call is never
    split again (where one row's mask were larger, a group of one would be). ``pad, rest``:
    ``padding_of(req.mask)``; ``one_by_one(req)``: the caller's call per row, for the probe.
    """
    short = req.i * req.j < ROW_ELEMENTS and req.i * req.j <= PADDING_ELEMENTS
    return short and groups_faster(req, pad, rest, one_by_one)


def groups_faster(req: Request, pad: Mask, rest: Mask | None, one_by_one: Callable[[Request], object]) -> bool:
    """True where groups of rows beat a call per row for this call's size class (timed at its first call)."""
    causal = isinstance(rest, Offsets)
    rows, keys = bucket(req.i, cap=ROW_ELEMENTS), bucket(req.j, cap=ROW_ELEMENTS)  # i·j < ROW_ELEMENTS: so is theirs
    key = (req.q.dtype, req.differentiated, isinstance(pad, Lengths), causal, req.heads, req.kv_heads,
           req.q.shape[-1], req.v.shape[-1], rows, keys, req.q.device.type, type(req.score).__name__,
           type(req.bias).__name__)  # fmt: skip
    if key not in _answers:
        _answers[key] = _time(req, rest if causal else None, isinstance(pad, Lengths), rows, keys, one_by_one)
    return _answers[key]


def _time(req: Request, rest: Mask | None, right: bool, rows: int, keys: int, one_by_one) -> bool:
    """Both ways over :data:`PROBE_ROWS` fresh rows of ``rows`` queries and ``keys`` keys, ``keys`` down to ``keys/2`` real."""
    grad = req.differentiated
    real = torch.tensor([keys - (keys // 2) * r // PROBE_ROWS for r in range(PROBE_ROWS)])
    pad = lengths(real) if right else starts(keys - real)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(False), torch.enable_grad() if grad else torch.no_grad():
        q, k, v = (torch.randn(PROBE_ROWS, heads, n, size, generator=gen).to(device=req.q.device, dtype=req.q.dtype)
                   for heads, n, size in ((req.heads, rows, req.q.shape[-1]), (req.kv_heads, keys, req.q.shape[-1]),
                                          (req.kv_heads, keys, req.v.shape[-1])))  # fmt: skip
        inputs = [x.requires_grad_() for x in (q, k, v)] if grad else []
        bias = None if isinstance(req.bias, Tensor) else req.bias  # a lazy bias costs the same at any length
        probe = replace(req, q=q, k=k, v=v, mask=pad if rest is None else pad & rest, bias=bias, score_mod=None,
                        return_weights=False, return_lse=False, dropout=0.0, weights_for=None, layout=None,
                        grad=grad, piece=None)  # fmt: skip

        def run(way: Callable[[Request], object]) -> Callable[[], None]:
            def call():
                out = way(probe)
                out = out[0] if isinstance(out, tuple) else out
                if grad:
                    torch.autograd.grad(out, inputs, torch.ones_like(out))

            return call

        t_groups, t_rows = best_times(run(run_row_groups), run(one_by_one))
    return t_groups * MARGIN <= t_rows


def run_row_groups(req: Request) -> tuple[Tensor, Tensor | None]:
    """A padded batch of short rows: groups of rows whose mask is small enough for SDPA to take built, a call each.

    The inputs are split once (one ``cat`` in the backward, not a full-size fill per group).
    """
    from . import choose  # the dispatcher, for each group's own call

    b = req.q.shape[0]
    per = max(1, PADDING_ELEMENTS // (req.i * req.j))
    groups = [(a, min(a + per, b)) for a in range(0, b, per)]
    parts = [x.split(per) if x.shape[0] == b else (x,) * len(groups) for x in (req.q, req.k, req.v)]
    outs, lses = [], []
    for (a, z), q, k, v in zip(groups, *parts):
        bias = row_slice(req.bias, a, z) if isinstance(req.bias, Tensor) else req.bias
        sub = replace(req, q=q, k=k, v=v, mask=frame_row(req.mask, a, z), bias=bias, layout=None, weights_for=None)
        impl, _ = choose(sub)
        out, _, lse = impl.run(sub)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    if not req.return_lse:
        return out, None
    return out, torch.cat(lses) if len(lses) > 1 else lses[0]
