"""Backends: how attention is computed. Each agrees with ``reference``.

A backend is a module with ``name``, ``supports(req) -> str | None`` (None = it can run the
request, else why not) and ``run(req) -> (out, weights | None, lse | None)`` (the weights
and the log-sum-exp when the request asks for them). :func:`choose` walks
:data:`PREFERENCE` (fastest first) and takes the first backend that supports the request;
it is the one place that decides which path a call takes (``qkv.explain`` prints its
reasons). A new backend is one file here plus its place in :data:`PREFERENCE`.

=============  =====================================================================
``segments``   packed documents (``masks.documents``): one ordinary call per document
``local``      sliding windows: block-local fused kernel, O(i·window)
``sdpa``       ``F.scaled_dot_product_attention``: dot-form scores, no lazy bias,
               no weights
``chunked``    everything else, exact in bounded memory, on the fastest engine that
               takes the call (``backends.engines``); sinks; weights from the
               log-sum-exp
``reference``  the literal equations, materialised (the oracle)
=============  =====================================================================

The layout of the package: the five backends here; ``engines/`` (the exact engines behind
``chunked`` and sequence parallelism, one contract); ``tiling/`` (what the engines share:
tiles, the fused CPU kernel, tile arithmetic, dropout, sinks, weights).
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from . import chunked, local, reference, sdpa, segments
from .request import Request, repeat_kv

#: Backends by name.
REGISTRY: dict[str, ModuleType] = {m.name: m for m in (segments, local, sdpa, chunked, reference)}
#: The order ``auto`` tries them in: fastest first, the reference last (it runs everything).
#: ``segments`` first: a packed batch is many small calls, each of which then takes this walk.
PREFERENCE: tuple[str, ...] = ("segments", "local", "sdpa", "chunked", "reference")
#: Largest ``b·h·i·j`` (times the score's pairwise width) for which a call that returns every
#: weight is materialised: the ``(b, h, i, j)`` weights exist anyway, and one softmax then
#: ``weights @ v`` beats a fused kernel plus rebuilding the weights from its log-sum-exp
#: (measured 1.1x eager attention against 2x, MiniLM's layers at 512 tokens); 256 MiB of
#: float32 logits beside the weights returned.
MATERIALISE_ELEMENTS = 2**26


def choose(req: Request, backend: str = "auto") -> tuple[ModuleType, list[str]]:
    """The backend that will run ``req``, and why each faster one was passed over.

    A backend named explicitly must support the call; an empty call (no query rows or no
    keys) then still goes to the reference, whose equations give the empty result for any
    option (the fast kernels assume a row and a key).
    """
    if backend != "auto":
        if backend not in REGISTRY:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(REGISTRY)}, got {backend!r}")
        impl = REGISTRY[backend]
        reason = impl.supports(req)
        if reason is not None:
            raise ValueError(f"backend: {backend!r} cannot run this call: {reason}")
        empty = _empty(req)
        return (impl, []) if empty is None or impl is reference else (reference, [f"{backend}: {empty}"])
    passed_over = []
    for candidate in PREFERENCE:
        impl = REGISTRY[candidate]
        reason = impl.supports(req)
        if reason is None and impl is not reference:
            reason = _empty(req) or _materialise(req)
        if reason is None:
            return impl, passed_over
        passed_over.append(f"{candidate}: {reason}")
    raise RuntimeError("no backend supports this request")  # unreachable: reference runs all


def _empty(req: Request) -> str | None:
    if req.i == 0 or req.j == 0:
        return f"an empty call (i = {req.i}, j = {req.j}) has nothing to compute"
    return None


def _materialise(req: Request) -> str | None:
    """Why the reference is faster for a call that returns every weight, or None."""
    if not req.return_weights or req.weights_for is not None:
        return None
    elements = req.q.shape[0] * req.heads * req.i * req.j * req.score.pair_width
    if elements > MATERIALISE_ELEMENTS:
        return None
    return f"every weight is returned and the logits fit in {MATERIALISE_ELEMENTS} elements: materialising is faster"


#: Modules that moved when the package was split by role: ``qkv.backends.NAME`` still finds
#: them, with a warning naming the new place.
_MOVED = {
    "additive_tiles": "tiling.additive_tiles", "bias_grad": "tiling.bias_grad", "diagonal": "tiling.offset_profile",
    "dropout": "tiling.dropout", "fused_blocks": "engines.fused_blocks", "kernels": "tiling.flash_cpu",
    "linear_bias": "engines.alibi_column", "mod_tiles": "engines.mod_tiles", "online_softmax": "engines.online_softmax",
    "partial": "engines.key_blocks", "sinks": "tiling.sinks", "tile_math": "tiling.tile_math", "tiles": "tiling.tiles",
    "weights": "tiling.weights_from_lse", "workers": "tiling.threads",
}  # fmt: skip


def __getattr__(name: str) -> ModuleType:
    if name not in _MOVED:
        raise AttributeError(f"module 'qkv.backends' has no attribute {name!r}")
    warnings.warn(
        f"qkv.backends.{name} moved to qkv.backends.{_MOVED[name]}; the old name will be removed",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module(f".{_MOVED[name]}", __name__)


__all__ = ["MATERIALISE_ELEMENTS", "PREFERENCE", "REGISTRY", "Request", "choose", "repeat_kv"]
