"""Which engine runs the backward of a biased call: the fused kernel's blocks, or the tiles — whichever is faster here.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``d``
head size (requests are ``(b, h, i, d)``, see ``backends.request``).

``fused_blocks`` hands PyTorch's fused CPU kernel each query block's bias as a float mask.
Whether the kernel's *backward* with a mask is fast depends on the CPU. Measured side by
side (ALiBi, causal, ``i = j = 4096``, ``h = 8``, ``d = 64``, two threads, medians of 3):

=====================================  ==========  ==========  ========
Intel Xeon (AVX-512, AMX), forward +   fused       tiles       SDPA, no
backward / forward alone, ms           blocks      (mod_tiles) bias
=====================================  ==========  ==========  ========
float32, fwd + bwd                     1490        827         295
float32, fwd                           172         334         112
bfloat16, fwd + bwd                    359         709         203
=====================================  ==========  ==========  ========

(all of a call on one engine). Much of the fused kernel's slowness there was ALiBi's far keys
reaching its products as subnormal weights: with those terms dropped from the profile
(``DiagonalMask.without_negligible``) its fwd + bwd took 582 ms against 977 on the tiles, in
a later session on the same CPU. So the forward stays with the fused kernel, and the backward may move to ``mod_tiles``'
tile loop, which recomputes each tile's logits from the ``out`` and ``lse`` the forward left
(FlashAttention-2's backward, Dao 2023): both backwards take the same inputs
(``engines.contract``) and give the same gradients, to rounding. :func:`moves` says when;
the choice is timed once per dtype and process (:func:`tiles_faster`, on a
``(1, 8, 1024, 64)`` causal ALiBi call) and kept where the tiles win by :data:`MARGIN`.

Calls it never moves: a learned bias (its gradient is rebuilt from the fused blocks'
``saved``), a call with no bias (the kernel runs unmasked), a block of keys of a larger
softmax (``req.piece``), tensors off the CPU or traced.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..._probe import best_times
from ...masks import Window
from ...positional import ALiBi
from ...scores import ScaledDot
from ..request import Request, bias_needs_grad
from ..tiling import flash_cpu
from . import mod_tiles

#: The tiles' backward is kept when its time is below this share of the fused kernel's.
MARGIN = 0.9
#: Query rows per tile of the moved backward: half ``mod_tiles.TILE_ROWS``, which keeps its
#: per-thread scratch within the fused path's memory (ALiBi at i = 4096, fwd+bwd, above
#: SDPA without a bias: 41 MiB, 8% of the (h, i, j) bias, against 71 MiB with 256 rows; the
#: time 785 ms against 710, the fused backward 1703).
ROWS = 128


def backward(req: Request, out, lse, d_out, dtype: torch.dtype):
    """``mod_tiles``' backward of a call ``fused_blocks`` ran forward (:func:`moves` said so)."""
    return mod_tiles.backward(req, out, lse, d_out, None, dtype, rows=ROWS)


def moves(req: Request, saved: object, fused: tuple[Callable, Callable]) -> bool:
    """True when the backward of ``req``, run forward by ``fused_blocks``, runs on ``mod_tiles``.

    ``fused``: ``fused_blocks``' ``(forward, backward)``, which the one-time timing runs.
    """
    if saved is not None or req.bias is None or req.piece is not None or bias_needs_grad(req):
        return False
    if req.score_mod is not None or req.dropout > 0 or flash_cpu.unusable(req.q) is not None:
        return False
    return tiles_faster(req.q.dtype, *fused)


#: dtype -> whether the tiles' backward was the faster here (timed once per dtype and process).
TIMED: dict[torch.dtype, bool] = {}


def tiles_faster(dtype: torch.dtype, fused_forward: Callable, fused_backward: Callable) -> bool:
    """True when ``mod_tiles``' backward beat the fused kernel's with a bias on this CPU (timed once per dtype)."""
    if dtype not in TIMED:
        TIMED[dtype] = _time(dtype, fused_forward, fused_backward)
    return TIMED[dtype]


def _time(dtype: torch.dtype, fused_forward: Callable, fused_backward: Callable) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 8, 1024, 64, generator=gen, dtype=dtype) for _ in range(4))
    with torch.inference_mode(False), torch.no_grad():
        req = Request(q=q, k=k, v=v, score=ScaledDot(), mask=Window(None, 0), bias=ALiBi(8), scale=0.125, dropout=0.0,
                      return_weights=False)  # fmt: skip
        out, lse, saved = fused_forward(req, dtype)
        fused = lambda: fused_backward(req, out, lse, d_out, saved, dtype)  # noqa: E731
        tiles = lambda: backward(req, out, lse, d_out, dtype)  # noqa: E731
        t_fused, t_tiles = best_times(fused, tiles)
    return t_tiles < MARGIN * t_fused
