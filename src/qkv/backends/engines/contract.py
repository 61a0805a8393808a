"""The contract every exact engine keeps: can it run a call, its forward, its backward.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` prepared query/key size, ``e`` value size.

An engine computes exact softmax attention and, for every row, its log-sum-exp. It sees a
:class:`~qkv.backends.Request` in the one layout ``(b, h, i, d)`` whose ``q`` and ``k`` are
already through the score's ``prepare`` step (:func:`prepared`), and keeps three promises:

* ``refuses(req) -> str | None``: None when it can run the call, else one sentence saying
  why not, which ``qkv.explain`` prints. It never reads tensor values.
* ``forward(req, dtype) -> (out, lse, saved)``: ``out (b, h, i, e)`` (in ``dtype`` where
  that is free, else wider), ``lse (b, h, i)`` float32 or wider with ``-inf`` on rows that
  see no key (``tiling.lse``), and whatever the engine wants back in its backward (or
  None). No autograd graph. No sinks, and no dropout seed of its own: the request carries
  the seed and where the call sits in a larger one (``req.seed``, ``req.piece``).
* ``backward(req, out, lse, d_out, saved, dtype) -> Grads``: the gradients from the row's
  **final** ``out`` and ``lse``. FlashAttention-2's backward (Dao 2023, algorithm 2) reads
  of a row only ``P = exp(s - lse)`` and ``D = rowsum(dO ∘ O)``, so when ``out`` and ``lse``
  are a larger softmax's (sinks, more blocks of keys) the result is this call's exact
  share of that softmax's gradients, with nothing recomputed beyond its own tiles.

What an engine needs besides the request (tile sizes, profiles, probes) lives in its own
frozen plan, built from the request inside the engine. The engines are chosen by
``engines.choose``, run by ``engines.call``, and split into blocks of keys by
``engines.key_blocks``; adding one is a module with these three functions and its place in
``engines.ENGINES``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from ... import score_mods
from ...positional import LazyBias
from ..request import Request


class Engine(Protocol):
    name: str  # as qkv.explain prints it

    def refuses(self, req: Request) -> str | None: ...

    def forward(self, req: Request, dtype: torch.dtype) -> tuple[Tensor, Tensor, object]: ...

    def backward(self, req: Request, out: Tensor, lse: Tensor, d_out: Tensor, saved: object, dtype: torch.dtype) -> Grads: ...


@dataclass(frozen=True)
class Grads:
    """One call's (or one block's) gradients: of the prepared q and k, v, a dense bias and :func:`parameters`."""

    q: Tensor  # (b, h, i, d): d loss / d prepared q
    k: Tensor  # (b, g, j, d): d loss / d prepared k
    v: Tensor  # (b, g, j, e)
    bias: Tensor | None  # d loss / d dense bias (its shape); None unless the dense bias requires grad
    params: list[Tensor | None]  # aligned with parameters(req); None where no gradient


def prepared(req: Request) -> Request:
    """``req`` with ``q, k`` replaced by ``req.score.prepare(q, k)``, their graph kept.

    Prepare once per call, not per block: the prepared keys are what travels between the
    blocks of a split softmax (for the additive score, ``W_k k``), and ``Grads.q``,
    ``Grads.k`` are gradients of these.
    """
    qp, kp = req.score.prepare(req.q, req.k)
    return replace(req, q=qp, k=kp)


def parameters(req: Request) -> list[Tensor]:
    """Tensors an engine's tiles read besides q, k, v and a dense bias: ``Grads.params`` is aligned with it.

    The score's parameters when its pairwise step uses them (not the dot form, whose
    parameters act in ``prepare``, reached through ``Grads.q``/``Grads.k``), a lazy bias's
    parameters, and the tensors a ``score_mod`` reads (``qkv.score_mods.closure_tensors``);
    modules' parameters first, each tensor once.
    """
    params: list[Tensor] = []
    if not req.score.dot_form:
        params += list(req.score.parameters())  # pairwise may use them (the additive score's v)
    if isinstance(req.bias, LazyBias):
        params += list(req.bias.parameters())
    if req.score_mod is not None:
        params += score_mods.closure_tensors(req.score_mod)
    return unique(params)


def modules(req: Request) -> list[torch.nn.Module]:
    """The modules whose parameters head :func:`parameters` (their attributes are what the tiles read)."""
    found = [] if req.score.dot_form else [req.score]
    if isinstance(req.bias, LazyBias):
        found.append(req.bias)
    return found + score_mods.modules(req.score_mod)


def unique(tensors) -> list[Tensor]:
    """Tensors in order, each once (by identity): an input listed twice would get its gradient twice."""
    seen: set[int] = set()
    out = []
    for x in tensors:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def accumulation(x: Tensor) -> torch.dtype:
    """The dtype sums and merges run in for inputs like ``x``: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)
