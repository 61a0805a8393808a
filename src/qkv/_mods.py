"""Index functions (``score_mod``, ``mask_mod``) evaluated on a tile as FlexAttention evaluates them.

Shape legend: ``b`` batch, ``h`` heads, ``it``/``jt`` the rows and keys of a tile.

Imports nothing from qkv but ``_trace``, so every layer may use it.

FlexAttention calls ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
kv_idx)`` as if on one element at a time: its reference implementation ``torch.vmap``\\s the
function over the four index dimensions, so each call sees 0-d indices, and idioms such
as ``bias[b][h][q_idx][kv_idx]`` or ``doc[q_idx] == doc[kv_idx]`` mean what they say. qkv
evaluates a whole tile at once, the same way (:func:`evaluate`), and takes a shortcut
where it is exact: most functions are elementwise arithmetic that gives the same tile
when called once with broadcastable index tensors (``b (b, 1, 1, 1)``, ``h (h, 1, 1)``,
``q_idx (it, 1)``, ``kv_idx (jt,)``), without vmap's per-op batching overhead (measured
1.3 ms against 2.1 ms for a sine of the indices on an 8 × 256 × 256 tile, 0.4 against 2.8
for a table look-up). So the first time a function is met, both ways run on a small
corner of the tile (at most 2 × 3 × 5 × 7 elements: distinct sizes, so that an index used
on the wrong axis shows); where they agree the broadcast call is kept for that function,
else vmap. The answer is cached per function and per which of the four axes had more than
one index (a corner of a batch of one shows no mistake along the batch: a wider call is
probed again); wrappers that only move indices, such as qkv's framing of a block, say so
with ``__wrapped_mod__`` and share their function's.

A function not yet known met on ``meta`` tensors (no values to probe) runs under vmap,
and nothing is cached. While ``torch.compile`` or ``torch.export`` trace a call
(``qkv._trace``) every function runs under vmap, as flex's own, unless it declares
``broadcasts = True``, and the cache is neither read nor filled.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor

from ._trace import concrete, tracing

#: How many functions' answers are kept (the oldest is forgotten first).
CACHE = 1024
_modes: OrderedDict[tuple, tuple[object, bool]] = OrderedDict()  # (id, wide axes) -> (function, broadcast is exact)


def evaluate(fn: Callable, score: Tensor | None, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``fn`` over the grid ``b × h × q × kv`` (1-d index vectors), as FlexAttention evaluates it.

    ``score (b, h, it, jt)`` for a ``score_mod`` (the result has its shape), None for a
    ``mask_mod`` (the result is bool, broadcastable to ``(b, h, it, jt)``). An empty grid is
    answered without calling ``fn`` (vmap cannot run a function over a size-0 dim, and a
    probe there would learn nothing).
    """
    if min(len(b), len(h), len(q), len(kv)) == 0:
        return score if score is not None else torch.zeros(len(b), len(h), len(q), len(kv), dtype=torch.bool, device=q.device)
    if _broadcasts(fn, score, b, h, q, kv):
        return _broadcast_call(fn, score, b, h, q, kv)
    if not tracing():
        return _vmap_call(fn, score, b, h, q, kv)
    try:
        return _vmap_call(fn, score, b, h, q, kv)
    except RuntimeError as e:  # torch.export's vmap cannot index a tensor with a batched 0-d index
        kind = "mask_mod" if score is None else "score_mod"
        raise RuntimeError(
            f"{kind}: could not be traced under torch.vmap, FlexAttention's evaluation, which a traced call "
            f"uses ({type(e).__name__}: {str(e).splitlines()[0]}). If one call with broadcast index tensors "
            "b (b, 1, 1, 1), h (h, 1, 1), q_idx (i, 1), kv_idx (j,) gives the whole tile, as it does for a "
            "table look-up such as table[q_idx - kv_idx], declare it: fn.broadcasts = True"
        ) from e


def _broadcast_call(fn, score, b, h, q, kv):
    args = (b.view(-1, 1, 1, 1), h.view(-1, 1, 1), q.view(-1, 1), kv)
    return fn(*args) if score is None else fn(score, *args)


def _vmap_call(fn, score, b, h, q, kv):
    prefix = () if score is None else (0,)
    call = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        call = torch.vmap(call, in_dims=prefix + dims)
    return call(b, h, q, kv) if score is None else call(score, b, h, q, kv)


def _key(fn: object) -> object:
    """The function whose answer ``fn`` shares: through wrappers that only move indices."""
    while getattr(fn, "__wrapped_mod__", None) is not None:
        fn = fn.__wrapped_mod__
    return fn


def _broadcasts(fn, score, b, h, q, kv) -> bool:
    key = _key(fn)
    if getattr(key, "broadcasts", False):  # declared elementwise (qkv.SoftCap)
        return True
    if tracing():
        # vmap, flex's way, always right: no values to probe, and a traced graph must not
        # depend on this cache (dynamo would guard on it and recompile as it changes); a
        # traced vmap leaves batched ops in the graph, not its per-call Python overhead
        return False
    # an answer holds for grids as wide as the one probed: an axis of one index (a batch of 1) shows no mistake
    # along it, so a call with more rows there is probed again
    slot = (id(key), len(b) > 1, len(h) > 1, len(q) > 1, len(kv) > 1)
    known = _modes.get(slot)
    if known is not None and known[0] is key:
        _modes.move_to_end(slot)
        return known[1]
    if not concrete(b) or (score is not None and not concrete(score)):
        return False  # no values to compare (meta tensors): flex's way, always right
    exact = _probe(fn, score, b, h, q, kv)
    _modes[slot] = (key, exact)
    if len(_modes) > CACHE:
        _modes.popitem(last=False)
    return exact


def _probe(fn, score, b, h, q, kv) -> bool:
    """True when the broadcast call equals vmap's on a sample of the tile: along each axis its first and its last few
    indices (a function that is elementwise only below some index, ``torch.where(q_idx >= 8, s + q_idx.amax(), s)``,
    passed a probe of the first few and was then wrong past them)."""
    at = [_ends(len(x), n) for x, n in zip((b, h, q, kv), (2, 3, 5, 7))]
    corner = tuple(x.index_select(0, p.to(x.device)) for x, p in zip((b, h, q, kv), at))
    part = score
    if score is not None:
        for dim, p in enumerate(at):
            if score.shape[dim] != 1:  # (a broadcast dim of the scores stays as it is)
                part = part.index_select(dim, p.to(score.device))
    with torch.no_grad():
        try:
            want = _vmap_call(fn, part, *corner)
        except Exception:  # noqa: BLE001 (flex's own way fails too: let the real call raise it)
            return False
        try:
            got = _broadcast_call(fn, part, *corner)
            got = torch.broadcast_to(torch.as_tensor(got), want.shape)
        except Exception:  # noqa: BLE001 (an idiom that needs scalar indices)
            return False
    if got.dtype != want.dtype:
        return False
    return bool(torch.equal(got, want)) if not want.dtype.is_floating_point else bool(torch.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True))


def _ends(length: int, n: int) -> Tensor:
    """Up to ``n`` positions of ``length``: the first ``⌈n/2⌉`` and the last ``⌊n/2⌋``."""
    if length <= n:
        return torch.arange(length)
    return torch.cat([torch.arange((n + 1) // 2), torch.arange(length - n // 2, length)])


def arguments_problem(fn: object, count: int) -> str | None:
    """How ``fn``'s signature fails to take ``count`` positional arguments (``"takes 1 argument"``), or None.

    A callable without a signature (some builtins) answers None: a wrong one fails at its first call."""
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, a C extension's callable)
        return None
    try:
        sig.bind(*range(count))
        return None
    except TypeError:
        pass
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > count:
        return f"requires {len(required)} arguments"
    if len(positional) < count and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return f"takes {len(positional)} argument{'' if len(positional) == 1 else 's'}"
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if not keyword_only:  # no other way for the bind to fail; should one appear, the call will say
        return None
    return f"also requires the keyword-only argument{'' if len(keyword_only) == 1 else 's'} {', '.join(keyword_only)}"
