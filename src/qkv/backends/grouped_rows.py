"""Whether a one-query call runs its grouped heads as query rows of their KV head: timed once per size class.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``x = h / g`` query heads per
KV head, ``j`` keys, ``d`` key size, ``e`` value size.

A decoding step ``q (b, h, 1, d)`` over ``k (b, g, j, d)``, ``v (b, g, j, e)`` reaches
PyTorch's fused CPU kernel in two ways that give the same numbers:

* ``enable_gqa``: each query head a one-row problem of its own, over its KV head's keys;
* rows: ``q`` viewed as ``(b, g, x, d)`` (query head ``n`` is row ``n mod x`` of KV head
  ``n // x``, as ``enable_gqa`` pairs them), ``x``-row problems that read each key once.

Which is faster depends on the CPU and the kernel, not on the code. Measured side by side
with a float padding mask: on the AMD EPYC Zen 4 (torch 2.13) rows took 1.5× ``enable_gqa``'s
time for SmolLM2's 9 heads on 3 at b = 4 over 64 keys (1.07× at 512, 0.81× at 4096) and 0.64×
for 8 heads on 2 at 512 keys (the kernel's one-row problems are cheap there, its two- and
three-row ones are not); on an Intel Xeon rows were the faster for SmolLM2 at 300 keys
(0.09 ms against 0.14). So the first call of each size class times both on inputs of its
size (:func:`qkv._probe.best_times`) and the answer is kept for the process; rows are taken
only when :data:`qkv._probe.MARGIN` faster (near ties go to PyTorch's own form). A traced
call cannot time anything and takes rows, the form that reads each key once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._probe import MARGIN, best_times, bucket
from .._trace import tracing

#: Keys of the largest probe (a class of longer calls is timed at this many): a probe costs a
#: few calls of its size, once.
PROBE_KEYS = 4096
#: Repeated key elements (``b·h·j·d``) of the largest probe: the batch is cut to fit.
PROBE_ELEMENTS = 2**22

#: Fewest repeated key elements (``b·h·j·d``) for which a grouped one-query call runs its heads as
#: query rows (:func:`grouping`): below, the views cost more than ``enable_gqa``'s copy saves.
ROWS_ELEMENTS = 2**16

_answers: dict[tuple, bool] = {}


def grouping(q: Tensor, k: Tensor, v: Tensor, attn_mask, dropout: float, is_causal: bool, scale: float,
             grouped: bool) -> str | None:  # fmt: skip
    """How ``sdpa._kernel`` meets grouped heads (``grouped``: ``h > g``): ``"rows"``, ``"gqa"`` or None (none).

    Rows (the module docstring) where :func:`faster` finds them so, from :data:`ROWS_ELEMENTS` repeated key
    elements, and only where the rows can share the mask: none, or one ``(b|1, 1, 1, j)`` for every
    head; not with dropout (its random draws are laid out by the kernel's shapes) or off the CPU
    (other devices' kernels take grouped heads natively).
    """
    if not grouped:
        return None
    b, h, i, d = q.shape
    j = k.shape[2]
    rows_share_mask = attn_mask is None or (
        isinstance(attn_mask, Tensor) and attn_mask.dim() == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1
    )
    if (i == 1 and b * h * j * d >= ROWS_ELEMENTS and not is_causal and dropout == 0 and rows_share_mask
            and q.is_cpu and faster(q, k, v, attn_mask, scale)):  # fmt: skip
        return "rows"
    return "gqa"


def faster(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float | None) -> bool:
    """True where rows beat ``enable_gqa`` for this call's size class (``q (b, h, 1, d)``, a mask of ``(b|1, 1, 1, j)``
    or none): timed at the class's first call."""
    if tracing():
        return True
    b, h, _, d = q.shape
    g, j, e = k.shape[1], k.shape[2], v.shape[-1]
    masked = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape[0] == 1)
    key = (q.dtype, bucket(b, cap=1 << 30), h, g, bucket(j, cap=1 << 30), d, e, masked)
    if key not in _answers:
        _answers[key] = _time(q.dtype, key[1], h, g, key[4], d, e, masked, scale)
    return _answers[key]


def _time(dtype, b: int, h: int, g: int, j: int, d: int, e: int, masked, scale) -> bool:
    j = min(j, PROBE_KEYS)
    b = max(1, min(b, PROBE_ELEMENTS // (h * j * d)))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=gen).to(dtype)
    k = torch.randn(b, g, j, d, generator=gen).to(dtype)
    v = torch.randn(b, g, j, e, generator=gen).to(dtype)
    mask = None
    if masked is not None:  # every key seen: True (bool) or 0 (additive)
        mask_dtype, shared = masked
        shape = (1 if shared else b, 1, 1, j)
        mask = torch.ones(shape, dtype=torch.bool) if mask_dtype == torch.bool else torch.zeros(shape, dtype=mask_dtype)

    def rows():
        F.scaled_dot_product_attention(q.view(b, g, h // g, d), k, v, attn_mask=mask, scale=scale)

    def gqa():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    with torch.no_grad():
        t_rows, t_gqa = best_times(rows, gqa)
    return t_rows * MARGIN <= t_gqa
