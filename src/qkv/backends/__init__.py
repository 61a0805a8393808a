"""Backends: how attention is computed. Each agrees with ``reference``.

A backend is a module with ``name``, ``supports(req) -> str | None`` (None = it can run the
request, else why not) and ``run(req) -> (out, weights | None)``. :func:`choose` walks
:data:`PREFERENCE` (fastest first) and takes the first backend that supports the request.
A new backend is one file here plus its place in :data:`PREFERENCE`.

=============  =====================================================================
``local``      sliding windows: block-local fused kernel, O(i·window)
``sdpa``       ``F.scaled_dot_product_attention``: dot-form scores, no lazy bias,
               no weights
``chunked``    everything else: fused kernel per query block for dot-form scores, a
               tile loop of its own for dot-form scores with a ``score_mod``, online
               softmax over tiles for the rest; sinks; weights from the log-sum-exp
``reference``  the literal equations, materialised (the oracle)
=============  =====================================================================
"""

from __future__ import annotations

from types import ModuleType

from . import chunked, local, reference, sdpa
from .request import Request, repeat_kv

#: Backends by name.
REGISTRY: dict[str, ModuleType] = {m.name: m for m in (local, sdpa, chunked, reference)}
#: The order ``auto`` tries them in: fastest first, the reference last (it runs everything).
PREFERENCE: tuple[str, ...] = ("local", "sdpa", "chunked", "reference")


def choose(req: Request, backend: str = "auto") -> tuple[ModuleType, list[str]]:
    """The backend that will run ``req``, and why each faster one was passed over."""
    if backend != "auto":
        if backend not in REGISTRY:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(REGISTRY)}, got {backend!r}")
        impl = REGISTRY[backend]
        reason = impl.supports(req)
        if reason is not None:
            raise ValueError(f"backend: {backend!r} cannot run this call: {reason}")
        return impl, []
    passed_over = []
    for candidate in PREFERENCE:
        impl = REGISTRY[candidate]
        reason = impl.supports(req)
        if reason is None:
            return impl, passed_over
        passed_over.append(f"{candidate}: {reason}")
    raise RuntimeError("no backend supports this request")  # unreachable: reference runs all


__all__ = ["PREFERENCE", "REGISTRY", "Request", "choose", "repeat_kv"]
