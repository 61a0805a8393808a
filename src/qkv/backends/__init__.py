"""Backends: how attention is computed. Each agrees with ``reference``.

A backend is a module with ``name``, ``supports(req) -> str | None`` (None = it can run the
request, else why not) and ``run(req) -> (out, weights | None, lse | None)`` (the weights
and the log-sum-exp when the request asks for them); optionally ``kernel(req) -> str |
None``, what runs in words, which ``qkv.explain`` adds to the backend's name. :func:`choose`
walks the preference order of the call's device (:func:`preference`: :data:`PREFERENCE`,
or :data:`CUDA_PREFERENCE` for CUDA tensors), fastest first, and takes the first backend
that supports the request; it is the one place that decides which path a call takes
(``qkv.explain`` prints its reasons). A new backend is one file here plus its place in the
orders.

=============  =====================================================================
``segments``   packed documents (``masks.documents``): one ordinary call per document
``local``      sliding windows: block-local fused CPU kernel, O(i·window)
``sdpa``       ``F.scaled_dot_product_attention``: dot-form scores, no lazy bias,
               no weights; on CUDA PyTorch's flash or efficient kernel (lower-right
               causal through ``causal_lower_right``)
``flex``       CUDA only: ``flex_attention`` compiled by ``torch.compile``, for
               score_mods, lazy biases, sinks, the log-sum-exp and large lazy masks,
               lowered to ``score_mod``, ``mask_mod`` and a ``BlockMask``
               (``tiling.flex_lowering``)
``chunked``    everything else, exact in bounded memory, on the fastest engine that
               takes the call (``backends.engines``: the fused CPU kernel's engines on
               the CPU, public ops elsewhere); sinks; weights from the log-sum-exp
``reference``  the literal equations, materialised (the oracle)
=============  =====================================================================

Which runs what, by device (checked call by call in the test suite, on the CPU and on CUDA);
"small" is a lazy mask of at most ``sdpa.MASK_ELEMENTS`` (a decoding step's):

==================================  ===================  ===============================
call                                CPU                  CUDA
==================================  ===================  ===============================
plain; causal with i = j; dense     sdpa                 sdpa (flash or efficient kernel)
mask or dense bias
causal, i < j                       sdpa if small, else  sdpa (``causal_lower_right``);
                                    chunked              grouped heads: as a lazy mask
lazy mask (lengths, window,         sdpa if small, else  sdpa if small, else flex
documents, ``from_mask_mod``)       segments (documents),
                                    local (windows),
                                    chunked
ALiBi, T5 buckets, score_mod,       chunked              flex
sinks, the log-sum-exp
flex unavailable (no Triton, a      --                   lazy masks: sdpa up to
GPU before Ampere) or declining                          ``sdpa.DEVICE_MASK_ELEMENTS``;
(dropout, float64)                                       the rest: chunked (public ops)
non-dot scores, selected weights    chunked              chunked (public ops)
every weight of a small call        reference            reference
==================================  ===================  ===============================

On CUDA no CPU-only op is reached: the fused CPU kernel's users (``local``, the
``fused_blocks`` and ``alibi_column`` engines, the Reformer's chunks) ask
``tiling.flash_cpu.unusable`` first, which refuses any tensor not on the CPU, and
``qkv.projection``'s oneDNN route and the approximations' oneDNN products take float32
CPU tensors only.

The layout of the package: the six backends here; ``engines/`` (the exact engines behind
``chunked`` and sequence parallelism, one contract); ``tiling/`` (what the engines share:
tiles, the fused CPU kernel, tile arithmetic, dropout, sinks, weights, flex's lowering).
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from . import chunked, flex_gpu, local, reference, sdpa, segments
from .request import Request, repeat_kv

#: Backends by name.
REGISTRY: dict[str, ModuleType] = {m.name: m for m in (segments, local, sdpa, flex_gpu, chunked, reference)}
#: The order ``auto`` tries them in on the CPU (and on every device but CUDA: ``meta``
#: tensors take the CPU's path): fastest first, the reference last (it runs everything).
#: ``segments`` first: a packed batch is many small calls, each of which then takes this walk.
PREFERENCE: tuple[str, ...] = ("segments", "local", "sdpa", "chunked", "reference")
#: The order on CUDA. PyTorch's SDPA kernels first, for every call they run without a large
#: mask tensor; then one compiled flex_attention for score_mods, lazy biases, sinks, the
#: log-sum-exp and large lazy masks (packed documents included: one kernel with a block
#: mask rather than one launch per document); ``segments`` for what flex declines
#: (dropout); ``local`` declines non-CPU tensors (its kernel is the CPU's); the chunked
#: engines (public ops there) only where nothing else fits.
CUDA_PREFERENCE: tuple[str, ...] = ("sdpa", "flex", "segments", "local", "chunked", "reference")
#: Largest ``b·h·i·j`` (times the score's pairwise width) for which a call that returns every
#: weight is materialised: the ``(b, h, i, j)`` weights exist anyway, and one softmax then
#: ``weights @ v`` beats a fused kernel plus rebuilding the weights from its log-sum-exp
#: (measured 1.1x eager attention against 2x, MiniLM's layers at 512 tokens); 256 MiB of
#: float32 logits beside the weights returned.
MATERIALISE_ELEMENTS = 2**26


def choose(req: Request, backend: str = "auto") -> tuple[ModuleType, list[str]]:
    """The backend that will run ``req``, and why each faster one was passed over.

    A backend named explicitly must support the call; an empty call (no batch rows, heads,
    query rows or keys) then still goes to the reference, whose equations give the empty
    result for any option (the fast kernels assume a row and a key).
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
    for candidate in preference(req):
        impl = REGISTRY[candidate]
        reason = impl.supports(req)
        if reason is None and impl is not reference:
            reason = _empty(req) or _materialise(req)
        if reason is None:
            return impl, passed_over
        passed_over.append(f"{candidate}: {reason}")
    raise RuntimeError("no backend supports this request")  # unreachable: reference runs all


def preference(req: Request) -> tuple[str, ...]:
    """The order ``auto`` tries the backends in for this call's device."""
    return CUDA_PREFERENCE if req.q.device.type == "cuda" else PREFERENCE


def _empty(req: Request) -> str | None:
    """Why an empty call goes to the reference, or None.

    No batch row or no head is as empty as no query row: the engines' tile budgets divide
    by ``b·h`` and their reshapes infer a dim from 0 elements.
    """
    if req.i == 0 or req.j == 0:
        return f"an empty call (i = {req.i}, j = {req.j}) has nothing to compute"
    if req.q.shape[0] == 0 or req.heads == 0:
        return f"an empty call (b = {req.q.shape[0]}, h = {req.heads}) has nothing to compute"
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


__all__ = ["CUDA_PREFERENCE", "MATERIALISE_ELEMENTS", "PREFERENCE", "REGISTRY", "Request", "choose", "preference", "repeat_kv"]
