"""The SDPA drop-in's unmasked call and padded decoding step, handed to PyTorch's own kernel.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` queries, ``j`` keys,
``d`` query/key size, ``e`` value size.

``qkv.scaled_dot_product_attention(q, k, v)`` with no mask, no dropout and no causal flag hides
no key, so none of what the drop-in adds to PyTorch's call applies (hidden keys' nans, rows that
see no key, the caller's mask read lazily): its answer is ``F.scaled_dot_product_attention``'s,
which is also what ``qkv.attention`` runs for it (the ``sdpa`` backend). A padded decoding step
(one query, a bool ``(b|1, h|1, 1, j)`` CPU mask, no gradient) needs one thing more, its output
checked for nan (:func:`decoding_step`). A decoding step's call takes 10-20 µs in PyTorch's
kernel, and the plain lane's plan, lookup and fit checks took 2-3 µs of it on top (1.22x a bare
step on the AMD EPYC Zen 5); this door reads the call's shapes and looks them up, 0.5-0.7 µs
(1.05x), the padded step's check for nan 0.8 µs more.

One choice is left: a one-query call with grouped heads may run them as query rows of their KV
head (:mod:`.grouped_rows`, timed once per size class). Where that can pay (``i = 1``, grouped
heads, at least ``grouped_rows.ROWS_ELEMENTS`` repeated key elements), the plain lane's plan of
the call decides it with its checks (``sdpa_plain.plan``), and the answer is kept per call shape,
so a decoding loop asks once. Everything the door does not take (other ranks, broadcast batches
or heads, a head size or key count of 0, a scale that is not finite, tensor subclasses, nested
tensors) returns None and runs the drop-in's checks; so does a call PyTorch's kernel refuses
(mixed dtypes or devices), whose message then comes from the drop-in, naming the argument.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._trace import tracing
from . import sdpa_plain
from .hidden_keys import no_nan
from .sdpa import _kernel, zeroes_dead_rows

#: What a call of this ``(q shape, k shape, v shape, dtype, enable_gqa, mask shape or None, device)`` takes: ``"plain"``
#: (one head per KV head), ``"gqa"`` (``enable_gqa``), ``"rows"`` (grouped heads as query rows, where
#: :func:`.grouped_rows.grouping` times them faster) or ``"no"`` (the drop-in's own path). A decoding loop's
#: layers and steps share a few shapes: what the first call decides, the rest look up. Kept per device: a meta
#: call's "no" must not send a CPU call of its shapes through the checks, nor a CPU call's grouped rows send a GPU
#: or meta call to the CPU kernel.
_WAYS: dict[tuple, str] = {}
#: The two ways straight to ``F.scaled_dot_product_attention``: :func:`_way` stores these objects, which the
#: lookup then compares by identity.
_PLAIN, _GQA = "plain", "gqa"
#: Shapes kept at most (a server's decoding steps over many cache lengths): all dropped when full.
WAYS_KEPT = 256


def unmasked(query: object, key: object, value: object, scale: float | None, grouped: bool) -> Tensor | None:
    """``F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=grouped)`` where the drop-in's
    answer is exactly that (see the module docstring), in its fastest form; else None. ``scale`` is None or a
    float, ``grouped`` a bool (the caller's checks)."""
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None  # subclasses (fakes, parameters) and non-tensors: the drop-in's checks
    if scale is not None and not math.isfinite(scale):
        return None  # refused by the drop-in (PyTorch gives nan rows)
    if torch.compiler.is_compiling():
        return None  # no lookup keyed on sizes: a compiled decoding step would guard on them, recompiling each token
    try:  # (a strided nested tensor has no shape to read: RuntimeError, as from a call PyTorch refuses)
        call = (query.shape, key.shape, value.shape, query.dtype, grouped, None, query.device)
        way = _WAYS.get(call) or _way(call, query, key, value)
        if way is _GQA or way is _PLAIN:
            return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=way is _GQA)
        return _kernel(query, key, value, None, 0.0, False, scale, way) if way == "rows" else None
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None  # mixed dtypes or devices, an integer dtype, a nested tensor: the drop-in's checks and messages


def decoding_step(query: object, key: object, value: object, attn_mask: Tensor, scale: float | None,
                  grouped: bool) -> Tensor | object | None:  # fmt: skip
    """The same for a one-query call with a bool ``attn_mask (b|1, h|1, 1, j)`` on the CPU in inference (a padded
    decoding step), or None, or :data:`NOT_FINITE`.

    PyTorch's CPU kernel gives a row that sees no key 0, as the drop-in does (probed per dtype,
    :func:`.sdpa.zeroes_dead_rows`); what it does not do is keep a nan or inf in a hidden key or
    value from the output (``0 · nan``): an output that holds a nan answers :data:`NOT_FINITE`, and the
    drop-in's own path runs the call again without the hidden keys. That check (:func:`.hidden_keys.no_nan`) is
    most of what this adds to the kernel.
    """
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None
    if scale is not None and not math.isfinite(scale):
        return None
    if torch.compiler.is_compiling() or sdpa_plain._records_gradients(query, key, value):
        return None  # a differentiated call guards its hidden keys first: the drop-in's own path
    try:
        if attn_mask.dtype != torch.bool or not attn_mask.is_cpu:
            return None
        call = (query.shape, key.shape, value.shape, query.dtype, grouped, attn_mask.shape, query.device)
        way = _WAYS.get(call) or _way(call, query, key, value, attn_mask)
        if way == "no":
            return None
        if way == "rows":
            out = _kernel(query, key, value, attn_mask, 0.0, False, scale, way)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale, enable_gqa=way is _GQA)
        # (inside the try: under torch.func.vmap a value cannot be read, a RuntimeError: the drop-in's own path)
        return out if no_nan(out) else NOT_FINITE
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None


#: :func:`decoding_step`'s answer where the kernel's output holds a nan: the drop-in's own path runs the call
#: (without the hidden keys), not the plain lane, which would run the same kernel call again.
NOT_FINITE = object()


def _way(call: tuple, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None) -> str:
    """:data:`_WAYS`' answer for a call of ``call``'s shapes, from the plain lane's own plan of it (its checks and its
    choice of grouped rows), kept unless traced (the lane plans nothing there). The plan is made with the default
    scale: the way is the shapes', and a scale the lane declines (not positive) must not decline them for others."""
    (qs, ks, _, _, grouped, _, _), traced = call, tracing()
    step = mask is None or (len(qs) == 4 and qs[2] == 1)  # (a mask is taken only on a decoding step: not planned else)
    decided = sdpa_plain.plan(query, key, value, "scaled_dot", False, None, mask) if step else None
    takes = decided is not None and (qs[1] == ks[1] or grouped) and (  # (qkv groups heads unasked; SDPA needs the flag)
        # a decoding step's mask, which the kernel takes as it is: nothing read from its values, so kept by shape
        mask is None or (decided.attn_mask is mask and decided.live_rows is None and zeroes_dead_rows(query)))
    way = "no" if not takes else "rows" if decided.grouping == "rows" else _GQA if decided.grouping == "gqa" else _PLAIN
    # a call whose tensors differ in dtype or device, or are not dense, is declined for that, not for its shapes: kept,
    # its "no" would send later calls of those shapes through the checks (a kept way meets such a call as PyTorch's
    # error, caught)
    mixed = any(x.dtype != query.dtype or x.device != query.device or x.layout != torch.strided
                for x in (query, key, value))  # fmt: skip
    if not traced and not (way == "no" and mixed):
        if len(_WAYS) >= WAYS_KEPT:
            _WAYS.clear()  # (each shape then decides again; grouping keeps its timed answers per size class)
        _WAYS[call] = way
    return way
