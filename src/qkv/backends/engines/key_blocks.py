"""Attention over one block of keys, as a piece of a larger softmax (ring attention, sinks).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` the
block's key length, ``d`` prepared query/key size, ``e`` value size.

A softmax over keys split into blocks ``B_1 … B_n`` is the blocks' softmaxes merged by their
log-sum-exps (Milakov & Gimelshein 2018; the merge of ring attention, Liu et al. 2023)::

    lse = log Σ_n exp(lse_n)          out = Σ_n exp(lse_n - lse) · out_n

and its gradient splits the same way. FlashAttention-2's backward (Dao 2023, algorithm 2)
reads of a row only ``P = exp(s - lse)`` and ``D = rowsum(dO ∘ O)``; given the *final*
``out`` and ``lse`` of the row, the backward over one block's keys is exactly that block's
share of ``dq``, and all of ``dk``, ``dv`` of its keys (and of a bias or score parameter
on its tiles). Nothing of the whole call is recomputed.

Usage (``req`` from ``qkv.checks.request``; masks, biases and score modifiers of a block
are given in the block's own coordinates, the caller shifts them)::

    preq = key_blocks.prepare(req)                       # q, k through the score's prepare (graph kept)
    out_a, lse_a = key_blocks.forward(blk_a)             # blk_a, blk_b: preq with k, v (and mask) of a block
    out_b, lse_b = key_blocks.forward(blk_b)
    out, lse = key_blocks.merge(out_a, lse_a, out_b, lse_b)
    g_a = key_blocks.backward(blk_a, out, lse, d_out)    # the final out, lse: blk_a's share

A row that sees no key of a block gets ``out = 0``, ``lse = -inf`` (zero mass: the merge
ignores it); the merge and :func:`with_sinks` never produce NaN for such rows. Each block
runs on the engine ``engines.choose`` picks for it, the same code and the same choice as
``qkv.attention``'s chunked backend (:func:`engine` names it). Checked against
``qkv.attention`` (float64, blocks merged, gradients summed) in
the test suite.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..request import Request
from ..tiling import sinks as sink
from ..tiling.dropout import Origin
from ..tiling.lse import merge
from .chooser import choose
from .contract import Grads, accumulation, parameters
from .contract import prepared as prepare

__all__ = ["Grads", "Origin", "backward", "engine", "forward", "merge", "parameters", "prepare", "with_sinks"]


def engine(preq: Request) -> str:
    """The name of the engine :func:`forward` and :func:`backward` run ``preq`` on."""
    return choose(_block(preq, 0, None))[0].name


def _block(preq: Request, seed: int, origin: Origin | None) -> Request:
    """``preq`` as a piece of a larger softmax: no sinks of its own, its dropout placed at ``origin``."""
    return replace(preq, sinks=None, seed=seed, piece=Origin() if origin is None else origin,
                   q=preq.q.detach(), k=preq.k.detach(), v=preq.v.detach())  # fmt: skip


def forward(preq: Request, seed: int = 0, origin: Origin | None = None) -> tuple[Tensor, Tensor]:
    """``(out (b, h, i, e), lse (b, h, i))`` of the block, float32 (float64 for float64 inputs), no graph.

    ``out`` is the block's own softmax-normalised output, ``lse = log Σ_visible exp(logit)``;
    a row with no visible key has ``out = 0``, ``lse = -inf``. ``seed`` is the dropout seed
    of the whole call, ``origin`` where the block sits in it (``tiling.dropout.Origin``), so
    that its dropout mask is the whole call's at the same coordinates. ``preq.sinks`` is not
    applied here (it would count once per block): apply :func:`with_sinks` to the merged
    result.
    """
    req = _block(preq, seed, origin)
    acc = accumulation(req.v)
    with torch.no_grad():
        out, lse, _ = choose(req)[0].forward(req, acc)
    return out.to(acc), lse.to(acc)


def backward(preq: Request, out: Tensor, lse: Tensor, d_out: Tensor, seed: int = 0, origin: Origin | None = None) -> Grads:
    """The block's share of the gradients, given the row's FINAL ``out``, ``lse`` and ``d_out``.

    ``out (b, h, i, e)`` and ``lse (b, h, i)`` are the whole softmax's (every block merged,
    sinks included), ``d_out`` the gradient of that final output; rows whose ``lse`` is
    ``±inf`` (no key anywhere) get zero gradients. Summing the blocks' shares of ``q`` (and
    of the parameters) gives the whole call's gradient; ``k``, ``v`` are the block's keys'
    own. Float32 (float64 for float64 inputs).
    """
    req = _block(preq, seed, origin)
    if isinstance(req.bias, Tensor):
        req = replace(req, bias=req.bias.detach().requires_grad_(preq.bias.requires_grad))
    acc = accumulation(req.v)
    grads = choose(req)[0].backward(req, out, lse, d_out, None, acc)
    return Grads(q=grads.q.to(acc), k=grads.k.to(acc), v=grads.v.to(acc), bias=grads.bias, params=list(grads.params))


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a softmax whose denominator gains ``exp(sinks_h)`` in every row of head ``h``.

    A sink is a logit without a value (GPT-OSS; StreamingLLM's fixed sink, Xiao et al. 2024)::

        lse_total = logaddexp(lse, s_h)      out_total = out · exp(lse - lse_total) = out · σ(lse - s_h)

    ``sinks (h,)``; differentiable in ``sinks`` (and in ``out``, ``lse`` if they carry a
    graph): the gradient of ``s_h`` is ``-Σ_rows exp(s_h - lse_total) · rowsum(dO ∘ O_total)``.
    Apply it once, to the merged result; then :func:`backward` of each block with
    ``(out_total, lse_total)`` gives the keys' gradients. A row with ``lse = -inf`` stays
    ``out = 0`` with ``lse_total = s_h``.
    """
    return sink.with_sinks(out, lse, sinks)
