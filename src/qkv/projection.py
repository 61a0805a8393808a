"""Linear projections ``y = x Wᵀ + b`` routed to the faster of torch's two float32 matmuls.

Shape legend: ``t`` tokens (all leading dims of the input, e.g. ``b·i``), ``c`` input size,
``o`` output size. ``x (..., c)``, ``weight (o, c)``, ``bias (o,)`` -> ``y (..., o)``, as
``F.linear``.

Why this exists. torch's ``nn.Linear`` calls BLAS (MKL in the x86 wheels); its convolutions
call oneDNN. On the machine the benchmarks run on (AMD EPYC, Zen 5, AVX-512) MKL's sgemm
appears to take a generic code path: ``(4096 × 512)·(512 × 512)`` ran at 20-27 GFLOP/s on
one core, the same product through oneDNN's matmul at 45-55 GFLOP/s, and a ``1 × 1``
convolution forward 1.5× faster than ``F.linear`` (4096 × 512 -> 1536). A ``1 × 1``
convolution over a channels-last view of the tokens is that product,

    y[t, o] = Σ_c x[t, c] · W[o, c] + b[o],

so :func:`linear` runs it through ``F.conv2d``: oneDNN computes the forward, and its
backward computes the same two products autograd would (``dx = dy W``,
``dW = Σ_t dy[t]ᵀ x[t]``, ``db = Σ_t dy[t]``). The result equals ``F.linear`` up to float32
rounding (a different summation order), and autograd, double backward and
``functional_call`` work as for any torch op.

When it is used (anything else calls ``F.linear``):

* float32 on the CPU, with oneDNN built in and enabled (``torch.backends.mkldnn``);
* at least 1024 tokens, a multiple of 16. One core, 512 -> 512, forward + backward:
  ``F.linear`` wins at 256 tokens (12 ms against 16), the convolution from 1024 (23 ms
  against 37); below that oneDNN's fixed cost per call dominates.

The tokens are viewed as 16 images of ``t/16`` pixels: torch sends a ``1 × 1`` float32
convolution with fewer than 16 images on one thread to its own im2col + BLAS path (which
is ``F.linear`` again), and oneDNN is slow when each image is one pixel (measured 2-3×
slower than 16 images).

Which library wins depends on the CPU (on Intel Xeons MKL runs its AVX-512 kernels and the
two are close), so the route is not a constant: for each shape class (input size, output
size, tokens rounded down to a power of two, at most :data:`PROBE_TOKENS`; forward alone, or
forward and backward when the call will be differentiated) both are timed once at first use
and the convolution is kept only where it is faster here
(:func:`set_route` fixes the choice, ``"blas"`` for public ops only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._probe import Probe, bucket, get_route, route, set_route

#: Fewest tokens for which the convolution route is considered (below, oneDNN's fixed cost
#: per call has lost on every CPU measured: 12 ms against 16 at 256 tokens, one core).
MIN_TOKENS = 1024
#: Images the tokens are split into (torch's oneDNN threshold for ``1 × 1`` kernels).
IMAGES = 16
#: Most tokens a probe times (larger inputs are timed at this size: the rate has settled).
PROBE_TOKENS = 4096

PROBE = Probe("projection")


def uses_convolution(x: Tensor, weight: Tensor) -> bool:
    """True when :func:`linear` will run ``x`` through oneDNN's convolution."""
    tokens = x.numel() // max(x.shape[-1], 1) if x.dim() >= 1 else 0
    eligible = (
        tokens >= MIN_TOKENS  # first: a decoding step's one token is turned away at once
        and tokens % IMAGES == 0
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() >= 2
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )
    if not eligible:
        return False
    out, size = weight.shape
    n = bucket(tokens, PROBE_TOKENS)
    # A training step pays the backward too, and which library wins it can differ from the
    # forward: with oneDNN held to AVX2 the convolution's forward won and its backward lost,
    # so the step ran 1.3-1.6x slower than on BLAS. Such calls are timed forward + backward.
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)

    def routes():
        gen = torch.Generator().manual_seed(0)
        xs, ws = torch.randn(n, size, generator=gen), torch.randn(out, size, generator=gen)
        if not training:
            return (lambda: F.linear(xs, ws)), (lambda: _convolution(xs, ws, None))
        xs.requires_grad_(), ws.requires_grad_()
        dy = torch.randn(n, out, generator=gen)

        def step(product):
            def run():
                with torch.enable_grad():
                    torch.autograd.grad(product(xs, ws), (xs, ws), dy)

            return run

        return step(F.linear), step(lambda a, b: _convolution(a, b, None))

    return PROBE.prefers_onednn((size, out, n, "fwd+bwd") if training else (size, out, n), routes)


def _convolution(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out, size = weight.shape
    tokens = x.numel() // size
    # (t, c) -> 16 channels-last images of t/16 pixels: a view when x is contiguous
    images = x.reshape(IMAGES, tokens // IMAGES, 1, size).permute(0, 3, 1, 2)
    y = F.conv2d(images, weight.reshape(out, size, 1, 1), bias)
    # oneDNN answers channels-last (16, t/16, 1, o) in memory, so this is a view again
    return y.permute(0, 2, 3, 1).reshape(*x.shape[:-1], out)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (..., c) @ weight (o, c)ᵀ + bias (o,)`` -> ``(..., o)``; same contract as ``F.linear``."""
    if not uses_convolution(x, weight):
        return F.linear(x, weight, bias)
    return _convolution(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and init) whose forward is :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


__all__ = ["Linear", "PROBE", "get_route", "linear", "route", "set_route", "uses_convolution"]
