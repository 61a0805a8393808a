"""Score modifiers: a function applied elementwise to the logits of every tile (``score_mod=``).

Shape legend: ``b`` batch (flattened leading dims), ``h`` query heads, ``i`` query length,
``j`` key length; ``it``/``jt`` the sides of a tile.

The convention is ``torch.nn.attention.flex_attention``'s, so code moves over::

    def fn(score, b, h, q_idx, kv_idx) -> score

``score`` is the scaled logit, after the bias and before the mask, in float32 (or
float64); ``b`` the flat index of the leading (batch) dims, ``h`` the query head,
``q_idx`` and ``kv_idx`` raw positions ``0 .. i-1`` and ``0 .. j-1`` (not the
bottom-right alignment of ``qkv.masks``). As in FlexAttention, ``fn`` is written for one
element with 0-d indices, so ``bias[b][h][q_idx][kv_idx]`` and ``table[q_idx - kv_idx]``
mean what they say: a tile is evaluated the way flex evaluates it (one
call with broadcast index tensors ``(b, 1, 1, 1)``, ``(h, 1, 1)``, ``(it, 1)``, ``(jt,)``
where that gives the same tile, ``torch.vmap`` over the four index dims otherwise).

Gradients reach what ``fn`` reads, found by :func:`closure_tensors`:

* ``fn`` an ``nn.Module``: its parameters;
* a ``functools.partial``: tensors (and modules' parameters) among its arguments, then its
  function;
* a bound method: the parameters of ``self`` if it is a module, else the tensors among its
  attributes, then the function;
* a function: the tensors and modules' parameters in its closure cells (``fn.__closure__``,
  including lists, tuples and dicts of them, and functions it closes over), and the
  globals its code names that are tensors or modules (a ``score_mod`` written at the top
  of a script);
* any other callable object (a class with ``__call__``): the tensors among its attributes.

Tensors reached any other way (attributes of other objects, a closure's module-level
list) are constants to it: pass them through one of the routes above to train them.

:class:`SoftCap` is the soft-capping of Gemma 2 (Gemma Team 2024), ``c · tanh(s / c)``, which
the tiled engine recognises and runs with a hand-written derivative (no autograd on the
tile).

**Tracing and shape inference** (``torch.compile``, ``torch.export``, ``meta`` tensors). On
``meta`` tensors a call runs its usual engine with its data-dependent shortcuts skipped
(the soft cap's clamp is kept); the tensors ``fn`` reads must be on ``meta`` too. While
``torch.compile`` or ``torch.export`` trace a call it runs on the reference backend (public
ops, the ``(b, h, i, j)`` logits materialised; ``backends.chunked`` says why), and ``fn``
under ``torch.vmap`` as flex's own, since no values can be probed; under
``torch.compile(fullgraph=True)`` the call is one graph with no break. What fails:

* ``torch.export`` of a function that indexes a tensor with its index arguments
  (``table[q_idx - kv_idx]``, ``bias[h]``): export's vmap cannot index with a batched 0-d
  index (non-strict: "calling .item()", raised as a ``RuntimeError`` naming ``score_mod``;
  strict: "requires_grad_() inside a functorch transform"). ``torch.compile`` traces it.
  Where one call with broadcast index tensors gives the whole tile, as it does for such
  look-ups, declare it, ``fn.broadcasts = True`` (as :class:`SoftCap` does), and it exports.
* ``torch.jit.trace`` with a ``score_mod`` not declared elementwise (``fn.broadcasts = True``,
  as :class:`SoftCap` is): jit cannot trace ``torch.vmap``; use ``torch.export``.
* The arguments of ``fn`` are not checked while tracing (:func:`check`).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import torch
from torch import Tensor, nn

from . import _mods
from ._trace import tracing
from .masks import Tile

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class SoftCap:
    """Logit soft-capping, ``s ← c · tanh(s / c)`` (Gemma 2): logits stay in ``(-c, c)``.

    Pass it as ``score_mod=qkv.SoftCap(c)``. Its derivative is ``1 - tanh²(s / c)``, which
    the tiled engine applies directly in its backward.
    """

    broadcasts = True  # elementwise: one call on a whole tile is flex's answer (qkv._mods)

    def __init__(self, cap: float):
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"cap: expected a positive finite number, got {cap!r}")
        self.cap = float(cap)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / self.cap) * self.cap

    def __repr__(self) -> str:
        return f"SoftCap({self.cap:g})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SoftCap) and other.cap == self.cap

    def __hash__(self) -> int:
        return hash(("SoftCap", self.cap))


#: The arguments FlexAttention passes a score_mod: ``score, b, h, q_idx, kv_idx``.
ARGS = 5


def check(fn: object) -> ScoreMod | None:
    """``fn`` if it is None, or callable with FlexAttention's five arguments; else ``TypeError`` naming the argument.

    The arguments are checked up front against ``inspect.signature`` (an ``nn.Module``'s
    ``forward``), so that ``lambda s: s * 2`` is named here rather than failing inside vmap;
    a callable without a signature (some builtins) is taken as it is, and a wrong one fails
    at its first call. While ``torch.compile`` / ``torch.export`` trace the call
    the arguments are not checked: a wrong function fails when traced.
    """
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"score_mod: expected a callable fn(score, b, h, q_idx, kv_idx) -> score, got {type(fn).__name__}")
    # not while tracing: dynamo's stand-in for inspect.signature(...).bind rejects good functions
    problem = None if tracing() else _mods.arguments_problem(fn, ARGS)
    if problem is not None:
        raise TypeError(
            f"score_mod: expected a function of (score, b, h, i, j) (FlexAttention's signature), got one that {problem}"
        )
    return fn


def apply(fn: ScoreMod, s: Tensor, t: Tile, heads: Tensor | None = None) -> Tensor:
    """``fn`` on one tile of logits ``s (b, h, it, jt)``, as flex evaluates it, its result checked to keep the tile's shape.

    ``heads (hs,)``: the head indices of ``s``'s head axis when it holds only some heads.
    """
    device = s.device
    b = torch.arange(s.shape[0], device=device)
    h = torch.arange(s.shape[1], device=device) if heads is None else heads.to(device)
    q_idx, kv_idx = torch.arange(t.i0, t.i1, device=device), torch.arange(t.j0, t.j1, device=device)
    out = _mods.evaluate(fn, s, b, h, q_idx, kv_idx)
    if isinstance(out, Tensor) and out.shape != s.shape and _broadcasts_to(out.shape, s.shape):
        # a modifier that ignores the score (a bias of the indices alone): flex expands it to the score's shape
        out = out.expand(s.shape).contiguous()
    if not isinstance(out, Tensor) or out.shape != s.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"score_mod: expected a tensor of the score's shape {tuple(s.shape)}, got {got}")
    return out if out.dtype == s.dtype else out.to(s.dtype)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def modules(fn: object) -> list[nn.Module]:
    """The ``nn.Module`` that ``fn`` is, or whose bound method it is (its parameters come first in :func:`closure_tensors`)."""
    if isinstance(fn, nn.Module):
        return [fn]
    if inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module):
        return [fn.__self__]
    return []


def closure_tensors(fn: object) -> list[Tensor]:
    """Floating-point tensors ``fn`` reads that may need gradients (the rule in the module docstring), deduplicated."""
    found: list[Tensor] = []
    seen_tensors: set[int] = set()
    seen_objects: set[int] = set()

    def add(x: object, depth: int = 0) -> None:
        if isinstance(x, Tensor):
            if x.dtype.is_floating_point and id(x) not in seen_tensors:
                seen_tensors.add(id(x))
                found.append(x)
        elif isinstance(x, nn.Module):
            for p in x.parameters():
                add(p)
        elif isinstance(x, (list, tuple)) and depth < 2:
            for item in x:
                add(item, depth + 1)
        elif isinstance(x, dict) and depth < 2:
            for item in x.values():
                add(item, depth + 1)
        elif callable(x) and depth < 4:
            walk(x, depth + 1)

    def walk(f: object, depth: int = 0) -> None:
        if id(f) in seen_objects:
            return
        seen_objects.add(id(f))
        if isinstance(f, nn.Module):
            add(f)
        elif isinstance(f, functools.partial):
            for a in (*f.args, *f.keywords.values()):
                add(a, depth)
            walk(f.func, depth)
        elif inspect.ismethod(f):
            owner = f.__self__
            if isinstance(owner, nn.Module):
                add(owner)
            elif not isinstance(owner, type):
                for value in vars(owner).values() if hasattr(owner, "__dict__") else ():
                    add(value, depth)
            walk(f.__func__, depth)
        elif inspect.isfunction(f):
            for cell in f.__closure__ or ():
                try:
                    add(cell.cell_contents, depth)
                except ValueError:  # an empty cell (a variable not yet assigned)
                    continue
            for name in f.__code__.co_names:  # globals the code reads (attribute names miss: not in globals)
                value = f.__globals__.get(name)
                if isinstance(value, (Tensor, nn.Module)):
                    add(value, depth)
        elif not isinstance(f, type) and hasattr(f, "__dict__"):
            for value in vars(f).values():
                add(value, depth)

    walk(fn)
    return found
