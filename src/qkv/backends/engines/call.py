"""The one autograd wrapper around every engine: sinks, the dropout seed, parameters, weights.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` prepared query/key size, ``e`` value size.

:func:`run` is a whole call on an engine (``engines.contract``): the score's ``prepare``
step once, a dropout seed drawn once (the engine places its mask by hashing it with each
weight's coordinates, ``tiling.dropout``), the chosen engine's forward, sinks joined to
each row's ``(out, lse)`` (``tiling.sinks``), and, when asked, the weights rebuilt from
``lse`` (``tiling.weights_from_lse``) for the chosen heads and rows only. The backward is
the engine's, from the final ``out`` and ``lse``, plus the sinks' own gradient. Tensors a
score, a lazy bias or a ``score_mod`` reads (``contract.parameters``) are inputs of the
autograd function, so they get gradients, and the modules are rebound to them while the
backward recomputes tiles (:func:`bound`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import Tensor
from torch.nn.utils.stateless import _reparametrize_module

from ..request import Request
from ..tiling import dropout as drop
from ..tiling import sinks as sink
from ..tiling.weights_from_lse import rebuild
from .chooser import choose
from .contract import accumulation, modules, parameters, prepared, unique


def run(req: Request) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(out (b, h, i, e), lse (b, h, i), weights | None)`` of a whole call, differentiable in ``out``.

    ``lse`` is the log of each row's whole denominator, sinks included (``-inf`` on a row that
    sees no key and has no sink); ``weights`` are those ``req.weights_for`` selects.
    """
    engine, _ = choose(req)
    preq = prepared(req)
    if req.dropout > 0:
        preq = replace(preq, seed=drop.draw_seed(req.generator))
    dense = preq.bias if isinstance(preq.bias, Tensor) else None
    out, lse = EngineCall.apply(engine, preq, preq.q, preq.k, preq.v, dense, preq.sinks, *parameters(preq))
    weights = None
    if req.return_weights:
        heads, rows = req.weights_for if req.weights_for is not None else (None, None)
        weights = rebuild(req, preq.q, preq.k, lse, heads=heads, rows=rows)
    return out, lse, weights


class EngineCall(torch.autograd.Function):
    """``(engine, req, q, k, v, dense_bias, sinks, *params) -> (out, lse)``; ``q``, ``k`` prepared."""

    @staticmethod
    def forward(ctx, engine, req: Request, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None,
                sinks: Tensor | None, *params: Tensor):  # fmt: skip
        # sinks rescale each row: keep it in float32 (or wider) until then, so bfloat16 rounds once
        out, lse, saved = engine.forward(req, v.dtype if sinks is None else accumulation(v))
        if sinks is not None:
            out, lse = sink.with_sinks(out, lse, sinks)
        ctx.engine, ctx.req, ctx.saved, ctx.params = engine, req, saved, params
        ctx.save_for_backward(q, k, v, dense, sinks, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.to(v.dtype), lse

    @staticmethod
    def backward(ctx, d_out: Tensor, _d_lse: Tensor | None):
        q, k, v, dense, sinks, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # the engine reads requires_grad to skip what nobody asked for
        q, k = q.detach().requires_grad_(needs[2]), k.detach().requires_grad_(needs[3])
        if dense is not None:
            dense = dense.detach().requires_grad_(needs[5])
        req = replace(ctx.req, q=q, k=k, v=v.detach(), bias=ctx.req.bias if dense is None else dense)
        with bound(modules(req), ctx.params):
            grads = ctx.engine.backward(req, out, lse, d_out, ctx.saved, q.dtype)
        d_sinks = sink.grad(out, lse, d_out, sinks) if needs[6] else None
        return (None, None, grads.q.to(q.dtype), grads.k.to(k.dtype), grads.v.to(v.dtype), grads.bias, d_sinks,
                *grads.params)  # fmt: skip


@contextlib.contextmanager
def bound(owners: list[torch.nn.Module], params: tuple[Tensor, ...]):
    """Inside, ``owners``' parameters are the first tensors of ``params`` (in order, each once), as in the forward.

    The backward calls ``score.pairwise``, the lazy bias and the score modifier again, which
    read the modules' attributes. Under ``torch.func.functional_call`` those attributes are
    the module's own parameters again by the time backward runs, not the tensors the forward
    saw (``params``); without rebinding, those tensors would silently get no gradient.
    """
    owned = unique(p for m in owners for p in m.parameters())
    if all(a is b for a, b in zip(owned, params[: len(owned)])):
        yield  # the usual case: nothing was swapped
        return
    given = {id(p): x for p, x in zip(owned, params)}
    with contextlib.ExitStack() as stack:
        for module in owners:
            names = {name: given[id(p)] for name, p in module.named_parameters()}
            stack.enter_context(_reparametrize_module(module, names))
        yield
