"""Checks and helpers shared by the approximate mechanisms in :mod:`qkv.approx`.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``m`` random features / landmarks.

Masks follow the house convention, bool with True = may attend, broadcastable to
``(b, h, i, j)``. Most approximations can only honour a *key padding* mask, one that is the
same for every query of a row (it depends on ``b``, ``h`` and ``j`` only)::

    keys    0 1 2 3 4            keep = [1 1 1 0 0]   (keys 3 and 4 are padding)
    query 0 1 1 1 0 0
    query 1 1 1 1 0 0            every row is the same: a key padding mask
    query 2 1 1 1 0 0

:func:`key_padding` reduces such a mask to ``keep (b|1, h|1, j)`` and refuses the others
with a ``ValueError`` that names the method and what to use instead. Lazy masks (anything
with ``dense(i_len, j_len, device)``, e.g. ``qkv.masks.lengths``) are made dense first, so
this package does not import the mask module.

Speed helpers of the streamed methods (:func:`qkv.approx.linear.streamed_kernel_attention`),
each measured on the benchmark machine and each falling back to the plain torch op:
:func:`grouped_matmul` (one large float32 product through oneDNN, about 1.5× MKL's rate
there), :class:`Scratch` (buffers reused across a call's blocks) and :func:`project_into`
(:func:`qkv.projection.linear` written into such a buffer).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..backends.request import repeat_kv as repeat_groups
from .._probe import Probe, bucket
from ..projection import IMAGES, linear, uses_convolution


class Dims(NamedTuple):
    """Sizes of one call, read once from ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``."""

    b: int
    h: int
    g: int
    i: int
    j: int
    d: int
    e: int


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> Dims:
    """Validate the mechanism inputs and return their sizes; errors name the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    for name, x, want in (("q", q, "(b, h, i, d)"), ("k", k, "(b, g, j, d)"), ("v", v, "(b, g, j, e)")):
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor {want}, got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {x.device}")
    b, h, i, d = q.shape
    _, g, j, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected (b, g, j, d) with b={b} and d={d} like q, got shape {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v: expected (b, g, j, e) with (b, g, j)={tuple(k.shape[:3])} like k, got shape {tuple(v.shape)}"
        )
    if g == 0 or h % g != 0:
        raise ValueError(f"k: query heads h={h} must be a multiple of KV heads g, got g={g}")
    return Dims(b, h, g, i, j, d, v.shape[3])


def check_flags(causal: object, return_weights: object) -> None:
    """The two keyword flags of the mechanism contract must be real bools."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights: expected a bool, got {type(return_weights).__name__}")


def repeat_kv(x: Tensor, h: int) -> Tensor:
    """``(b, g, n, c) -> (b, h, n, c)``: query head ``n`` reads KV head ``n // (h // g)``, the
    grouping of exact attention (``qkv.backends.repeat_kv``)."""
    return repeat_groups(x, h // x.shape[1])


def dense_mask(mask: object, dims: Dims, device: torch.device) -> Tensor | None:
    """The mask as a 4-d bool tensor broadcastable to ``(b, h, i, j)``, or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        if not callable(getattr(mask, "dense", None)):
            raise TypeError(
                "mask: expected a bool tensor (True = may attend) or a mask object with "
                f".dense(i_len, j_len, device), got {type(mask).__name__}"
            )
        mask = mask.dense(dims.i, dims.j, device)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}")
    target = (dims.b, dims.h, dims.i, dims.j)
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"mask: expected shape broadcastable to {target}, got {shape}")
    return mask.reshape((1,) * (4 - len(shape)) + shape).to(device)


def key_padding(mask: Tensor | None, dims: Dims, method: str, instead: str) -> Tensor | None:
    """Reduce a dense mask to ``keep (b|1, h|1, j)`` if it only depends on the keys, else refuse.

    ``method`` names the mechanism in the error and ``instead`` says what can run the mask.
    """
    if mask is None:
        return None
    if mask.shape[2] != 1 and not bool((mask == mask[:, :, :1]).all()):
        raise ValueError(
            f"mask: {method} only supports key padding masks (the same keys kept for every query, "
            f"shape (b, h, 1, j)), got a mask of shape {tuple(mask.shape)} that varies along the "
            f"query axis i; {instead}"
        )
    return mask[:, :, 0].expand(mask.shape[0], mask.shape[1], dims.j)


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """``num / den[..., None]`` with 0 where ``den == 0`` (a row that sees no key gives zeros).

    Used by the kernel methods whose features are non-negative, so ``den == 0`` implies
    ``num == 0``; the ``where`` keeps the gradient of such a row at zero, not NaN.
    """
    empty = den == 0
    return num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)


def masked_softmax(logits: Tensor, keep: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` with ``keep == False`` entries excluded; rows with nothing kept give zeros.

    Masked logits are filled with ``finfo.min`` (not ``-inf``, so no NaN appears), and the
    result is multiplied by ``keep`` so that an all-masked row is zero rather than uniform.
    """
    if keep is None:
        return logits.softmax(dim)
    filled = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return filled.softmax(dim) * keep


def make_generator(seed: object, generator: object) -> torch.Generator:
    """The random stream of a mechanism: its own ``generator``, a fresh one seeded with ``seed``,
    or (neither given) a fresh one seeded from torch's global RNG, so ``torch.manual_seed``
    makes the module reproducible too."""
    if seed is not None and generator is not None:
        raise ValueError("seed: give seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        return generator
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def check_interval(value: object) -> int | None:
    """``redraw_interval``: None (never redraw on its own) or a positive int of training steps."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"redraw_interval: expected a positive int or None, got {value!r}")
    return value


def check_scale(scale: object) -> float | None:
    """``scale``: None (use ``1/sqrt(d)``) or a finite positive number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    if not 0 < float(scale) < float("inf"):
        raise ValueError(f"scale: expected a finite positive number, got {scale}")
    return float(scale)


#: Elements (of the float32 ``(b h, rows, m)`` block) in one chunk of a method that streams
#: over the sequence (:func:`qkv.approx.linear.streamed_kernel_attention`, Linformer's
#: softmax). 2**19 float32 are 2 MiB, about a core's L2 cache: the block stays in cache
#: between the op that makes it and the one that reads it. Measured on the benchmark
#: machine (2 threads, quiet, b=1, h=8, m=256; Performer / Linformer / linear, ms):
#: 2**18: 50 / 34 / 8.1 at 4K, 172 / 146 / 31 at 16K; 2**19: 41 / 33 / 7.8 and 186 / 155 / 36;
#: 2**20: 48 / 36 / 8.4 and 191 / 187 / 43; 2**22: 70 / 45 / 8.3 and 212 / 174 / 54.
#: Smaller chunks mean more ops, each a parallel region that waits for a free core on a
#: busy machine, so the smallest size is not taken.
CHUNK_ELEMENTS = 1 << 19


def softmax_floor(dtype: torch.dtype, n: int) -> float:
    """How far below its row's max a logit may lie before its softmax weight would be subnormal.

    ``exp(x - max)`` is subnormal below ``log(finfo.tiny)`` (-87.3 in float32 and bfloat16)
    and the softmax divides it by a row sum of at most ``n``; one more unit of margin.
    """
    return -math.log(torch.finfo(dtype).tiny) - math.log(max(n, 1)) - 1.0


def floor_logits(x: Tensor, *, inplace: bool = False) -> Tensor:
    """``max(x, rowmax(x) - softmax_floor)`` along the last dim: the same softmax, without subnormals.

    Why: a weight below ``finfo.tiny`` is a subnormal number, and making or multiplying one
    can cost a CPU a microcode assist per vector instruction (on Intel Xeons, about a hundred
    cycles; on the AMD benchmark machine a softmax with 14% subnormal outputs ran 1.9× slower,
    ``exp`` alone 9×). Linformer's logits spread with √j (an untrained ``E`` sums ``j`` keys):
    at 16K keys 17% of its weights were subnormal, at 4K 0.2%, which read as quadratic time on
    Intel (exponent 2.0 between 4K and 32K). Raising those logits to the floor changes each
    such weight from below ``tiny`` to about ``tiny``: the row's output moves by less than
    ``n · tiny · max|v|``, far below the dtype's resolution. The max is detached: a floored
    logit's true gradient is below ``tiny`` too.
    """
    top = x.detach().amax(-1, keepdim=True).sub_(softmax_floor(x.dtype, x.shape[-1]))
    return torch.maximum(x, top, out=x) if inplace else torch.maximum(x, top)


def needs_grad(*tensors: Tensor) -> bool:
    """True when autograd will record ops on any of ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class Scratch:
    """Buffers reused across the blocks of one call (streamed methods, Reformer's rounds), when no gradient is needed.

    Why: a block's temporaries are a few MiB each, and freeing two or three of them at once
    can leave more free memory at the top of glibc's heap than its trim threshold (twice
    the mmap threshold, itself 2 MiB after a 2 MiB block was freed), so the heap is shrunk
    and the next block faults the same memory back in. One core, a ``(2048, 64) -> (2048,
    256)`` projection then a softmax: 3.9 ms with a fresh softmax output, 0.86 ms writing it
    into a reused buffer (the projection alone 0.5 ms). ``get`` returns None when buffers
    are off (autograd needs every block's values), and the caller allocates as usual.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """A contiguous ``shape`` tensor (dtype and device of ``like``) that the last call with
        this ``name`` may have written; None when buffers are off."""
        if not self.enabled:
            return None
        n = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < n or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[name] = like.new_empty(n)
        return buffer[:n].view(shape)

    def take(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """:meth:`get`, or a fresh ``shape`` tensor when buffers are off."""
        buffer = self.get(name, shape, like)
        return like.new_empty(shape) if buffer is None else buffer


#: Fewest elements of ``x`` for which :func:`grouped_matmul` calls oneDNN (below, ``bmm``):
#: oneDNN's fixed cost per call is tens of microseconds.
GROUPED_MIN_ELEMENTS = 1 << 14
#: Fewest columns ``p`` of ``x`` for which :func:`grouped_matmul` calls oneDNN. One core,
#: ``(64, n) @ (n, p)`` with n = 1024-8192, per 16K rows of 8 heads: p = 256, oneDNN 36-40 ms
#: against 55-60 for MKL's ``bmm``; p = 64, oneDNN 20-51 ms against 15.
GROUPED_MIN_PIXELS = 256
#: Largest contracted size and column count a :func:`grouped_matmul` probe times.
GROUPED_PROBE_SIZE = 4096
GROUPED_PROBE = Probe("grouped_matmul")


def grouped_matmul(w: Tensor, x: Tensor) -> Tensor:
    """``w (n, o, c) @ x (n, c, p) -> (n, o, p)``, the product ``torch.bmm`` computes.

    For one float32 product on the CPU (``n = 1``) it runs as a ``1 × 1`` convolution in
    oneDNN: ``x`` is one image of ``p`` pixels with ``c`` channels, the filters are the
    ``o`` rows of ``w``, so output channel ``o`` at pixel ``p`` is ``Σ_c w[o, c] · x[c,
    p]``. ``x`` contiguous is that image in NCHW layout and the output comes back as ``(o,
    p)`` contiguous. On the benchmark machine (AMD EPYC, see :mod:`qkv.projection` for why
    MKL is slow there), one core, ``(64, 2048) @ (2048, 256)``: 137 GFLOP/s against 90 for
    ``bmm``. The same as a grouped convolution (``n`` groups) ran at about 40 GFLOP/s, so
    batches of several products stay ``bmm``, as do other dtypes and devices, small ``x``
    and few columns. The call is ``aten::mkldnn_convolution``, the op ``F.conv2d``
    dispatches to, named directly because ``F.conv2d`` sends a single image on one thread
    to its im2col + BLAS path; it has a backward like any convolution.
    Where MKL is fast (Intel Xeons) ``bmm`` may win instead, so the route is chosen per
    shape class by timing both once (:func:`grouped_uses_onednn`, :mod:`qkv._probe`).
    """
    if not grouped_uses_onednn(w, x):
        return torch.bmm(w, x)
    return _grouped_onednn(w, x)


def grouped_uses_onednn(w: Tensor, x: Tensor) -> bool:
    """True when :func:`grouped_matmul` will run ``w @ x`` through oneDNN: a single float32 CPU
    product large enough, and faster there than ``bmm`` on this CPU (a probe per shape
    class, :mod:`qkv._probe`)."""
    n, o, c = w.shape
    p = x.shape[-1]
    if not (
        n == 1
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() >= GROUPED_MIN_ELEMENTS
        and p >= GROUPED_MIN_PIXELS
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    ):
        return False
    return grouped_prefers_onednn(o, c, p)


def grouped_prefers_onednn(o: int, c: int, p: int) -> bool:
    """The probe's answer for ``(1, o, c) @ (1, c, p)`` products (sizes above a few thousand timed at that size)."""
    c, p = bucket(c, GROUPED_PROBE_SIZE), bucket(p, GROUPED_PROBE_SIZE)

    def routes():
        gen = torch.Generator().manual_seed(0)
        ws, xs = torch.randn(1, o, c, generator=gen), torch.randn(1, c, p, generator=gen)
        return (lambda: torch.bmm(ws, xs)), (lambda: _grouped_onednn(ws, xs))

    return GROUPED_PROBE.prefers_onednn((o, c, p), routes)


def _grouped_onednn(w: Tensor, x: Tensor) -> Tensor:
    n, o, c = w.shape
    p = x.shape[-1]
    image = x.contiguous().reshape(1, n * c, p, 1)
    # Not made contiguous here: oneDNN reorders the filters into its own layout anyway and
    # takes a transposed view too (one core, (64, 2048) @ (2048, 256): 0.60 ms for the view,
    # 0.46 contiguous + 0.09 to copy), so only a caller that has the layout for free gains.
    filters = w.reshape(n * o, c, 1, 1)
    out = torch.ops.aten.mkldnn_convolution(image, filters, None, [0, 0], [1, 1], [1, 1], 1)
    return out.reshape(n, o, p)


_CONV_ADD = None  # torch.ops.mkldnn._convolution_pointwise_.binary, False where missing


def project_into(x: Tensor, weight: Tensor, out: Tensor | None) -> Tensor:
    """:func:`qkv.projection.linear` without bias, ``x (..., c) @ weight (o, c)ᵀ -> (..., o)``,
    written into ``out`` (contiguous, shape ``(..., o)``, a :class:`Scratch` buffer) when it
    can be.

    Why: the projection's convolution returns a fresh tensor, and a streamed method makes
    one per block; freed together with the block's other temporaries it is often handed
    back to the kernel and faulted in again (see :class:`Scratch`). oneDNN's in-place
    convolution with an ``add`` post-op, ``out = conv(x) + out`` on a zeroed ``out`` (the op
    inductor fuses convolutions into), writes the same product into a reused buffer. Two
    threads, a loop of 64 key and query blocks of Performer's shapes: 124 ms with fresh
    outputs, 79 ms into buffers. Where the route does not apply (``out`` None, not
    :func:`qkv.projection.uses_convolution`, the op missing from this torch) the result is
    :func:`qkv.projection.linear`'s, in a new tensor. No autograd on the in-place route:
    callers pass ``out`` only when no gradient is needed.
    """
    global _CONV_ADD
    if out is None or not uses_convolution(x, weight):
        return linear(x, weight)
    if _CONV_ADD is None:
        try:
            _CONV_ADD = torch.ops.mkldnn._convolution_pointwise_.binary
        except (AttributeError, RuntimeError):
            _CONV_ADD = False
    if _CONV_ADD is False:
        return linear(x, weight)
    o, c = weight.shape
    tokens = x.numel() // c
    # The layout of qkv.projection.linear: the tokens as IMAGES channels-last images.
    images = x.reshape(IMAGES, tokens // IMAGES, 1, c).permute(0, 3, 1, 2)
    target = out.view(IMAGES, tokens // IMAGES, 1, o).permute(0, 3, 1, 2)
    out.zero_()
    try:
        _CONV_ADD(target, images, weight.reshape(o, c, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, "add", None, None, [], None)
    except (RuntimeError, TypeError):  # an internal op: another torch may have changed it
        _CONV_ADD = False
        return linear(x, weight)
    return out
