"""The one autograd wrapper around every engine: sinks, the dropout seed, parameters, weights.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` prepared query/key size, ``e`` value size.

:func:`run` is a whole call on an engine (``engines.contract``): the score's ``prepare``
step once, a dropout seed drawn once (the engine places its mask by hashing it with each
weight's coordinates, ``tiling.dropout``), the chosen engine's forward, sinks joined to
each row's ``(out, lse)`` (``tiling.sinks``), and, when asked, the weights rebuilt from
``lse`` (``tiling.weights_from_lse``) for the chosen heads and rows only. The backward is
the engine's, from the final ``out`` and ``lse``, plus the sinks' own gradient, plus, when
``lse`` itself gets a gradient, the keys' share of it (:func:`_lse_grads`). Tensors a
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
from .contract import Grads, accumulation, modules, parameters, prepared, unique


def run(req: Request) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(out (b, h, i, e), lse (b, h, i), weights | None)`` of a whole call, differentiable in ``out`` and ``lse``.

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
        ctx.set_materialize_grads(False)  # an output nobody used gets None: no backward pass for it
        return out.to(v.dtype), lse

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):
        q, k, v, dense, sinks, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # the engine reads requires_grad to skip what nobody asked for
        q, k = q.detach().requires_grad_(needs[2]), k.detach().requires_grad_(needs[3])
        if dense is not None:
            dense = dense.detach().requires_grad_(needs[5])
        req = replace(ctx.req, q=q, k=k, v=v.detach(), bias=ctx.req.bias if dense is None else dense)
        grads = []
        with bound(modules(req), ctx.params):
            if d_out is not None:
                grads.append(ctx.engine.backward(req, out, lse, d_out, ctx.saved, q.dtype))
            if d_lse is not None:
                grads.append(_lse_grads(ctx.engine, req, lse, d_lse, ctx.saved))
        d_sinks = None
        if needs[6]:
            d_sinks = torch.zeros_like(sinks)
            d_sinks = d_sinks if d_out is None else d_sinks + sink.grad(out, lse, d_out, sinks)
            d_sinks = d_sinks if d_lse is None else d_sinks + sink.lse_grad(lse, d_lse, sinks)
        if not grads:
            return (None,) * (7 + len(ctx.params))
        total = grads[0] if len(grads) == 1 else _sum(grads)
        return (None, None, total.q.to(q.dtype), total.k.to(k.dtype), total.v.to(v.dtype), total.bias, d_sinks,
                *total.params)  # fmt: skip


def _lse_grads(engine, req: Request, lse: Tensor, d_lse: Tensor, saved: object) -> Grads:
    """The gradients that reach the inputs through ``lse`` alone.

    ``∂lse_r/∂s_rc = P_rc``, so the lse's share of the logits' gradient is ``dS = P ∘ d_lse``,
    which is what any engine's backward gives for values that are one column of ones, an
    output of zeros and ``d_out = d_lse``: ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)) = P ∘ d_lse``
    (the values' own gradient is then discarded). One more backward pass, of head size 1,
    run only when the log-sum-exp is differentiated, without dropout (which acts after the lse).
    """
    b, h, i_len = lse.shape
    ones = req.v.new_ones((*req.v.shape[:-1], 1))
    zeros = lse.new_zeros((b, h, i_len, 1))
    adapt = getattr(engine, "saved_for_lse", None)  # what the engine kept, for those values
    # dropout=0: the lse is dropout's input (the weights before it), so its gradient is the undropped P's
    grads = engine.backward(replace(req, v=ones, dropout=0.0), zeros, lse, d_lse[..., None], saved if adapt is None else adapt(saved),
                            req.q.dtype)  # fmt: skip
    return replace(grads, v=torch.zeros_like(req.v))


def _sum(parts: list[Grads]) -> Grads:
    """Gradients summed field by field (None where every part has None)."""

    def add(xs):
        xs = [x for x in xs if x is not None]
        return None if not xs else xs[0] if len(xs) == 1 else sum(xs[1:], xs[0])

    return Grads(
        q=add(p.q for p in parts), k=add(p.k for p in parts), v=add(p.v for p in parts),
        bias=add(p.bias for p in parts), params=[add(ps) for ps in zip(*(p.params for p in parts))],
    )  # fmt: skip


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
