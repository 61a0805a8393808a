"""Attention over one block of keys, as a piece of a larger softmax (ring attention, sinks).

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` the block's key length, ``d`` prepared query/key size, ``e`` value size.

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

    preq = partial.prepare(req)                       # q, k through the score's prepare (graph kept)
    out_a, lse_a = partial.forward(blk_a)             # blk_a, blk_b: preq with k, v (and mask) of a block
    out_b, lse_b = partial.forward(blk_b)
    out, lse = partial.merge(out_a, lse_a, out_b, lse_b)
    g_a = partial.backward(blk_a, out, lse, d_out)    # the final out, lse: blk_a's share

A row that sees no key of a block gets ``out = 0``, ``lse = -inf`` (zero mass: the merge
ignores it); the merge and :func:`with_sinks` never produce NaN for such rows. Dot-form
scores run PyTorch's fused CPU kernel (``fused_blocks``), with a score modifier their own
tile loop (``mod_tiles``); other scores, dropout and learned biases the online-softmax
engine (``online_softmax``): the same code as ``qkv.attention``'s chunked backend, through
its module-level forwards and backwards (:func:`engine` says which). Checked against
``qkv.attention`` (float64, blocks merged, gradients summed) in
``tests/test_backends_partial.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..positional import LazyBias
from . import chunked, mod_tiles
from . import sinks as sink
from .dropout import Origin
from .fused_blocks import fused_backward, fused_forward
from .online_softmax import tiled_backward, tiled_forward
from .request import Request

__all__ = ["Grads", "Origin", "backward", "engine", "forward", "merge", "parameters", "prepare", "with_sinks"]


@dataclass(frozen=True)
class Grads:
    """One block's share of the gradients (float32, or float64 for float64 inputs; sum the shares)."""

    q: Tensor  # (..., h, i, d): d loss / d prepared q
    k: Tensor  # (..., g, j, d): d loss / d prepared k
    v: Tensor  # (..., g, j, e)
    bias: Tensor | None  # d loss / d dense bias (its shape), None unless a dense bias requires grad
    params: list[Tensor | None]  # aligned with parameters(preq); None where no gradient


def prepare(req: Request) -> Request:
    """``req`` with ``q, k`` replaced by ``req.score.prepare(q, k)``, their graph kept.

    Prepare once per call, not per block: the prepared keys are what travels between blocks
    (for the additive score, ``W_k k``), and ``Grads.q``/``Grads.k`` are gradients of these.
    """
    qp, kp = req.score.prepare(req.q, req.k)
    return replace(req, q=qp, k=kp)


def parameters(preq: Request) -> list[Tensor]:
    """Tensors the block's tiles read besides q, k, v and a dense bias: ``Grads.params`` is aligned with it.

    The score's parameters when its pairwise step uses them (not the dot form, whose
    parameters act in ``prepare``, reached through ``Grads.q``/``Grads.k``), a lazy bias's
    parameters and the tensors a ``score_mod`` reads (``qkv.score_mods.closure_tensors``),
    each once.
    """
    return chunked.parameters(preq)


def engine(preq: Request) -> str:
    """``"fused_blocks"``, ``"mod_tiles"`` or ``"online_softmax"``: the engine :func:`forward` and :func:`backward` use.

    The fused kernel cannot differentiate a bias, so a bias with a gradient (dense that
    requires grad, or a learned lazy one) goes to the online engine, as do dropout,
    non-dot scores and inputs that are not ``(b, h, i, d)``; a score modifier otherwise
    runs in ``mod_tiles``.
    """
    if not preq.score.dot_form or preq.dropout > 0 or preq.q.dim() != 4 or _bias_grad(preq):
        return "online_softmax"
    return "fused_blocks" if preq.score_mod is None else "mod_tiles"


def _bias_grad(preq: Request) -> bool:
    if isinstance(preq.bias, Tensor):
        return preq.bias.requires_grad
    return isinstance(preq.bias, LazyBias) and any(p.requires_grad for p in preq.bias.parameters())


def _acc(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _with_heads(preq: Request) -> tuple[Tensor, Tensor, Tensor, bool]:
    """Detached ``q, k, v``; inputs without a head dim get one (the engines index heads at dim -3)."""
    q, k, v = preq.q.detach(), preq.k.detach(), preq.v.detach()
    no_heads = q.dim() == 2
    if no_heads:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    return q, k, v, no_heads


def forward(preq: Request, seed: int = 0, origin: Origin | None = None) -> tuple[Tensor, Tensor]:
    """``(out (..., h, i, e), lse (..., h, i))`` of the block, float32 (float64 for float64 inputs), no graph.

    ``out`` is the block's own softmax-normalised output, ``lse = log Σ_visible exp(logit)``;
    a row with no visible key has ``out = 0``, ``lse = -inf``. ``seed`` is the dropout seed
    of the whole call, ``origin`` where the block sits in it (``dropout.Origin``), so that
    its dropout mask is the whole call's at the same coordinates. ``preq.sinks`` is not
    applied here (it would count once per block): apply :func:`with_sinks` to the merged
    result.
    """
    q, k, v, no_heads = _with_heads(preq)
    dense = preq.bias.detach() if isinstance(preq.bias, Tensor) else None
    with torch.no_grad():
        if engine(preq) == "fused_blocks":
            qf, kf, vf = chunked.same_head_size(q, k, v)
            out, lse, _ = fused_forward(chunked.fused_plan(preq), qf, kf, vf)
            out = out[..., : v.shape[-1]]
        elif engine(preq) == "mod_tiles":
            out, lse = mod_tiles.forward(mod_tiles.plan(preq), q, k, v)
        else:
            plan, _, _ = chunked.online_plan(preq, q, seed, origin)
            out, lse = tiled_forward(plan, q, k, v, dense)
        out, lse = out.to(_acc(v)), torch.where(torch.isinf(lse), float("-inf"), lse.to(_acc(v)))
    if no_heads:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return out, lse


def backward(
    preq: Request, out: Tensor, lse: Tensor, d_out: Tensor, seed: int = 0, origin: Origin | None = None
) -> Grads:
    """The block's share of the gradients, given the row's FINAL ``out``, ``lse`` and ``d_out``.

    ``out (..., h, i, e)`` and ``lse (..., h, i)`` are the whole softmax's (every block
    merged, sinks included), ``d_out`` the gradient of that final output. Per tile the
    backward recomputes ``P = exp(s - lse)`` and uses ``D = rowsum(dO ∘ O)``; rows whose
    ``lse`` is ``±inf`` (no key anywhere) get zero gradients. Summing the blocks' shares of
    ``q`` (and of the parameters) gives the whole call's gradient; ``k``, ``v`` are the
    block's keys' own.
    """
    q, k, v, no_heads = _with_heads(preq)
    if no_heads:
        out, lse, d_out = out.unsqueeze(0), lse.unsqueeze(0), d_out.unsqueeze(0)
    acc = _acc(v)
    dense = preq.bias if isinstance(preq.bias, Tensor) else None
    params = parameters(preq)
    if engine(preq) == "fused_blocks":
        e = v.shape[-1]
        qf, kf, vf = chunked.same_head_size(q, k, v)
        pad = vf.shape[-1] - e  # the kernel wants d == e: zero value columns, sliced off after
        out_f, d_out_f = (torch.nn.functional.pad(x.to(q.dtype), (0, pad)) if pad else x.to(q.dtype) for x in (out, d_out))
        with torch.no_grad():
            dq, dk, dv, _ = fused_backward(chunked.fused_plan(preq), qf, kf, vf, out_f, lse.to(acc), d_out_f)
        dq, dk, dv = dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., :e]
        d_dense, d_params = None, [None] * len(params)
    elif engine(preq) == "mod_tiles":
        dq, dk, dv, d_params = mod_tiles.backward(mod_tiles.plan(preq), q, k, v, out, lse, d_out, tuple(params))
        d_dense = None
    else:
        plan, _, _ = chunked.online_plan(preq, q, seed, origin)
        grad_dense = dense is not None and dense.requires_grad
        dense = None if dense is None else dense.detach().requires_grad_(grad_dense)
        dq, dk, dv, d_dense, d_params = tiled_backward(
            plan, q, k, v, dense, tuple(params), out, lse, d_out, grad_dense=grad_dense
        )
    dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)
    if no_heads:
        dq, dk, dv = dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
    return Grads(q=dq, k=dk, v=dv, bias=d_dense, params=list(d_params))


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two blocks' ``(out, lse)`` merged into the softmax over both blocks' keys.

    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    A side with ``lse = -inf`` has weight 0; both ``-inf`` gives ``out = 0, lse = -inf``,
    never NaN (the common ``out - σ(lse_b - lse_a)(out - out_b)`` form is NaN there).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)  # both -inf: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    return out_a * w_a[..., None].to(out_a.dtype) + out_b * w_b[..., None].to(out_b.dtype), lse


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
