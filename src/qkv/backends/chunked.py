"""The chunked backend: exact attention in bounded memory, for every score, mask, bias and option.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

It runs a call on the fastest engine that takes it (``backends.engines``: the fused CPU
kernel per query block, ALiBi as a key column, score_mod tiles, or the online softmax for
everything else), under the one autograd wrapper that adds sinks and dropout and rebuilds
weights from the log-sum-exp, for chosen heads and rows only. Checked against the float64
reference backend in the test suite.

A call with a ``score_mod`` that ``torch.compile`` or ``torch.export`` traces is left to the
reference backend (public ops, autograd's own backward), as traced graphs get
``F.scaled_dot_product_attention`` instead of the fused CPU kernel
(``backends.tiling.flash_cpu``): the score_mod engines are Python tile loops
on threads inside a custom autograd function, which dynamo cannot put in one graph. Under
``torch.jit.trace`` and ``torch.func`` transforms every call is left to it
(``qkv._trace.opaque_functions_refused``): jit.trace would keep that function's request, this
call's tensors, as a constant, and torch.func refuses it.
"""

from __future__ import annotations

from torch import Tensor

from .._trace import opaque_functions_refused, tracing
from . import engines
from .request import Request, bias_needs_grad

name = "chunked"
#: This backend returns only the weights ``req.weights_for`` selects (others return all).
selects_weights = True


def supports(req: Request) -> str | None:
    if opaque_functions_refused():
        # the engines run inside a custom autograd function (``engines.call``), which jit.trace
        # would freeze with this call's tensors and torch.func refuses (qkv._trace says how)
        return "torch.jit.trace or a torch.func transform runs the call, which cannot take the engines' autograd function"
    if req.score_mod is not None and tracing():
        # the module docstring says why; the reference's materialised (b, h, i, j) logits are
        # what a traced graph of public ops would hold anyway
        return (
            "torch.compile / torch.export is tracing the call, and a score_mod's engines are tile loops "
            "(traced graphs use public ops)"
        )
    if tracing() and bias_needs_grad(req):
        # the engines' backward takes a learned bias's gradient with torch.autograd.grad, which
        # dynamo does not trace (fullgraph: "Unsupported"); the reference's autograd does it
        return "torch.compile / torch.export is tracing the call, and a learned bias's gradient needs the reference's autograd"
    return None  # every score, mask, bias, dropout, sink and score_mod


def run(req: Request) -> tuple[Tensor, Tensor | None, Tensor | None]:
    out, lse, weights = engines.run(req)
    return out, weights, (lse if req.return_lse else None)
