"""The flex backend: CUDA calls with a score_mod, a lazy bias or a large lazy mask, as one compiled flex_attention.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

On CUDA, PyTorch's SDPA kernels (flash, efficient) run the calls they can, unmasked, with
their causal flag or a small mask tensor (``backends.sdpa``). What they cannot run without
an ``(i, j)`` tensor per call, a ``score_mod``, a lazy bias (ALiBi, T5 buckets), sinks, the
log-sum-exp, or a lazy mask too large to materialise, is one call of
``torch.nn.attention.flex_attention.flex_attention`` compiled by ``torch.compile`` (a fused
Triton kernel, forward and backward): the request is lowered to flex's ``score_mod``,
``mask_mod`` and a ``BlockMask`` by ``backends.tiling.flex_lowering``, whose block lists
skip what the mask hides, and query and KV heads are grouped by ``enable_gqa``.

* Sinks: flex returns each row's log-sum-exp ``lse`` over the keys; with a sink logit
  ``s_h`` the row's softmax has one more term, so ``out = out_flex · σ(lse - s_h)`` (the
  keys' share, ``exp(lse) / (exp(lse) + exp(s_h))``) and the call's log-sum-exp is
  ``logaddexp(lse, s_h)``, both differentiable (flex's backward takes ``lse``'s gradient).
* A row no key may see gets zero output and ``lse = -inf`` from flex, qkv's convention.

It declines, each with its reason (``qkv.explain`` prints it): CPU tensors (flex_attention
has no backward on CPU: the CPU engines run the call), any device but CUDA, a call
``torch.compile`` or ``torch.export`` is tracing (the traced graph keeps public ops), a
torch without flex_attention or Triton, a GPU below compute capability 8.0 (flex's Triton
kernels need Ampere or newer), non-dot scores, weights, dropout, float64 (flex's kernels
are built and tested by PyTorch for float16, bfloat16 and float32), a mask or bias with
no lowering. Set :data:`ENABLED` to False to keep CUDA calls off it.

``torch.compile`` specialises the kernel to what the call's closures hold (the bias kind,
the mask's structure, a window's width, the scale) and recompiles when one of those
changes; lengths are inputs (``flex_lowering``). Past torch's recompile limit
(``torch._dynamo.config.recompile_limit``) a call runs flex's unfused eager path, correct
but slow: a model uses a few kinds of call, a test sweep may need the limit raised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import score_mods
from .._trace import TRACED, tracing
from .request import Request, bias_needs_grad
from .tiling import flex_lowering
from .tiling.sinks import with_sinks

name = "flex"
selects_weights = False

#: False keeps every call off this backend (CUDA calls then go to SDPA or the chunked engines).
ENABLED = True
#: The dtypes flex_attention's CUDA kernels are built for.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_compiled = None
_environment: dict[object, str | None] = {}


def supports(req: Request) -> str | None:
    device = req.q.device.type
    if device == "cpu":
        return "flex_attention on CPU has no backward; the CPU engines run this"
    if device != "cuda":
        return f"flex_attention is compiled here for CUDA tensors only, got {device}"
    if not ENABLED:
        return "qkv.backends.flex_gpu.ENABLED is False"
    if tracing():
        return TRACED
    if (reason := environment(req.q.device)) is not None:
        return reason
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product (flex_attention computes q·k)"
    if req.return_weights:
        return "flex_attention does not return weights"
    if req.dropout > 0:
        return "flex_attention has no dropout"
    if req.q.dtype not in DTYPES:
        return f"flex_attention's kernels are built for float16, bfloat16 and float32, got {req.q.dtype}"
    if req.piece is not None:
        return "a block of a larger softmax runs on the engines (backends.engines.key_blocks)"
    return flex_lowering.mask_problem(req.mask) or flex_lowering.bias_problem(req.bias) or declined(req)


def environment(device: torch.device) -> str | None:
    """Why flex_attention cannot be compiled for ``device`` here (checked once per device), or None."""
    key = str(device)
    if key not in _environment:
        _environment[key] = _environment_problem(device)
    return _environment[key]


def _environment_problem(device: torch.device) -> str | None:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no torch.nn.attention.flex_attention"
    if not torch.cuda.is_available():
        return "this torch has no CUDA runtime to compile flex_attention for"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flex_attention's Triton kernels need compute capability 8.0 or newer, this GPU has {major}.{minor}"
    from torch.utils._triton import has_triton

    if not has_triton():
        return "Triton is not installed: flex_attention cannot be compiled"
    return None


def kernel(req: Request) -> str:
    """What runs, in words, for ``qkv.explain``."""
    return "compiled flex_attention"


def compiled():
    """``torch.compile(flex_attention)``, made once, at first use."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention)
    return _compiled


#: Smaller tiles and one pipeline stage, for the calls whose default kernels ask for more
#: shared memory than the GPU has (seen on an H200 in float32 and with learned captured
#: tensors: Triton's "out of resource"). 64 divides the block masks' 128-row tiles.
SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
_small_tiles: set = set()  # call kinds that needed SMALL_TILES
_uncompilable: dict = {}  # call kinds inductor found no kernel for even then -> its message
#: Inductor's words for "no kernel fits": the call is retried with SMALL_TILES, then declined.
_NO_KERNEL = ("out of resource", "No choices", "NoValidChoicesError")


def _kind(req: Request) -> tuple:
    """What decides whether flex's default tiles fit in shared memory: a learned tensor the kernel reads (its
    gradient is accumulated in the backward kernel) among them. A soft cap that shared its kind with a
    learned T5 table ran the small tiles too."""
    learned = bias_needs_grad(req) or (
        req.grad and req.score_mod is not None and any(x.requires_grad for x in score_mods.closure_tensors(req.score_mod)))
    return (req.q.dtype, req.q.shape[-1], req.grad, req.score_mod is not None, learned, req.q.shape[-2] < 128)


def declined(req: Request) -> str | None:
    """Why flex is not used for this kind of call after inductor found no kernel for it, or None."""
    found = _uncompilable.get(_kind(req))
    return None if found is None else f"inductor found no flex_attention kernel for this kind of call here ({found})"


def run(req: Request) -> tuple[Tensor, None, Tensor | None]:
    kind = _kind(req)
    if kind not in _small_tiles:
        try:
            return forward(req, compiled())
        except Exception as error:  # InductorError wraps Triton's OutOfResources: only "no kernel" is retried
            if not any(word in str(error) for word in _NO_KERNEL):
                raise
        _small_tiles.add(kind)
    try:
        return forward(req, compiled(), SMALL_TILES)
    except Exception as error:
        if not any(word in str(error) for word in _NO_KERNEL):
            raise
        # Declined from now on (qkv.explain says why); this call runs on the chunked engines' public ops.
        _uncompilable[kind] = str(error).strip().splitlines()[0][:120]
    from . import chunked

    return chunked.run(req)


def forward(req: Request, flex, kernel_options: dict | None = None) -> tuple[Tensor, None, Tensor | None]:
    """``(out, None, lse | None)`` of ``req`` through ``flex`` (the compiled kernel; tests pass flex's eager one)."""
    from torch.nn.attention.flex_attention import AuxRequest

    low = flex_lowering.lower(req)
    want_lse = req.return_lse or req.sinks is not None
    result = flex(
        low.q, low.k, low.v, score_mod=low.score_mod, block_mask=low.block_mask, scale=low.scale,
        enable_gqa=low.enable_gqa, return_aux=AuxRequest(lse=True) if want_lse else None,
        **({"kernel_options": kernel_options} if kernel_options else {}),
    )  # fmt: skip
    out, lse = (result[0], result[1].lse) if want_lse else (result, None)
    out = out[..., : low.e]
    if req.sinks is not None:  # the keys' share of each row, in float32 at least
        acc = torch.promote_types(out.dtype, torch.float32)
        out, lse = with_sinks(out.to(acc), lse.to(acc), req.sinks)
        out = out.to(req.v.dtype)
    return out, None, (lse if req.return_lse else None)
