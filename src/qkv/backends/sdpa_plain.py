"""``qkv.attention``'s plain-call lane: a plain call straight to PyTorch's fused kernel, no request built.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size.

A one-token decoding step spends more in building and checking a request and walking the
backends (25-35 µs) than in the kernel (15-20 µs). :func:`plain` recognises, before any of
that, the calls the ``sdpa`` backend would run with nothing to adapt, and runs them with the
backend's own kernel call and mask rules (``backends.sdpa``); anything else answers None and
takes the full path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._trace import tracing, version
from ..module_inputs import autocast_on
from ..masks import Dense, Mask, Window
from ..scores import Dot, ScaledDot
from .grouped_rows import grouping
from .hidden_keys import no_nan, without
from .plain_padding import PADDING, device_padding, kept_on_mask, mask_tensor, plain_padding
from .sdpa import _dense_dead_rows, _give_dead_rows_every_key, _is_causal, _kernel, zeroes_dead_rows
from .tiling import flash_cpu


class Plan(NamedTuple):
    """What :func:`plan` decided for a plain call: the kernel's arguments, and what a call of the same shapes must match.

    A named tuple, not a dataclass: every plain call makes one, and a tuple is built in a
    quarter of the time (0.3 µs against 1.0 for a frozen dataclass of nine fields).
    """

    shapes: tuple  # (q.shape, k.shape, v.shape), as kept: the keys' length ANY_LENGTH where any number fits (_shapes)
    dtype: torch.dtype
    attn_mask: Tensor | None
    live_rows: Tensor | None  # (..., i, 1) ones and zeros: rows that see no key are zeroed after the kernel
    is_causal: bool
    scale: float
    grouping: str | None  # sdpa.grouping's: "rows", "gqa", or None (no grouped heads)
    mask_tensor: Tensor | None  # the Dense mask's tensor, and its version when planned (None: not kept)
    mask_version: int | None
    gpu: bool = False  # planned for a CUDA call (a CPU call of the same shapes plans afresh, and the other way)
    keys: tuple | None = None  # a GPU's padded step: (j0, j1, hidden (b, 1, jt, 1) or None, device): keys read, zeroed


def plain(q: Tensor, k: Tensor, v: Tensor, score: object, causal: object, scale: object,
          mask: object = None) -> Tensor | None:  # fmt: skip
    """The output of a plain call straight from the kernel, or None when the call is not plain.

    ``qkv.attention``'s first step, before any check is built: a call with ``(b, h, i, d)``
    tensors of one floating dtype on the CPU or one CUDA device, the dot or scaled-dot score,
    no mask (or ``causal=True``, or the mask ``qkv.masks.causal()``, where it hides nothing,
    ``i = 1``, or is the kernel's own, ``i = j``),
    no bias, sinks, score_mod, dropout or weights is exactly what :func:`choose` would send
    here with no mask tensor and nothing to restore, so the request, its checks and the walk
    over the backends are skipped (they cost more than the kernel in a one-token decoding
    step: 25-35 µs against 15-20). Anything else, a malformed call included (its message
    comes from the full checks), answers None.

    One mask is taken too, on the CPU in inference: a ``Dense`` bool ``(b|1, h|1, i|1, j)`` CPU mask
    (a padded batch's, one tensor shared by a model's layers) that is not the causal
    square, given to the kernel as the full path gives it, rows that see no key given every
    key and zeroed after; what it takes is kept on the mask per tensor version (an in-place
    change shows). A caller's bool tensor (SDPA's ``attn_mask``) is read afresh at every
    call: its plan is kept by the tensor's shape only where the kernel takes it as it is.
    Its output is checked as the full path checks an inference call's
    (``hidden_keys.after``): a nan (what a hidden key that is not finite brings) answers None, and the full path runs
    the call again on zeroed hidden keys. So is a decoding step's padding (one query a row):
    ``qkv.masks.lengths`` or ``starts`` on CPU rows, with or without ``causal`` (which hides
    nothing from the last position), given to the kernel as its ``(b, 1, 1, j)`` tile, up to the last key some row sees.

    On one CUDA device, recording gradients or not, two more calls take the lane, as the full
    path runs them there: a decoding step's padding (``lengths`` or ``starts``, the hidden
    keys zeroed in copies of ``k`` and ``v`` before the kernel, no scan after:
    ``plain_padding.device_padding``), and ``causal=True`` with ``i < j`` and no grouped heads
    (PyTorch's ``causal_lower_right``). The H200's host spent 0.2-0.3 ms a call on the full
    path's request and walk, against a kernel of 0.04-0.1.
    """
    if tracing():
        # compile, export, jit.trace and torch.func take the full path (plan refuses them too), and before any
        # plan is looked up: a key of the call's sizes made dynamo guard on them (a compiled decoding step
        # recompiled at every token, and a dynamic length was specialised)
        return None
    key = _plan_key(q, k, v, score, causal, scale, mask)
    plans = None if key is None else _plans_of(mask)
    kept = None if plans is None else plans.get(key)
    if kept is not None and fits(kept, q, k, v):
        return run(kept, q, k, v, mask)
    decided = plan(q, k, v, score, causal, scale, mask)
    if decided is None:
        return None
    callers = type(mask) is Tensor
    if callers and not (decided.attn_mask is mask and decided.live_rows is None and zeroes_dead_rows(q)):
        # a caller's bool tensor: its plan is kept only where it holds nothing read from the tensor's values (the
        # kernel takes the tensor as it is, its own dead rows 0), so a later call's tensor, read afresh, fits it
        plans = None
    if plans is not None:
        if len(plans) >= PLANS_KEPT:
            _evict_oldest(plans)
        held = dict(attn_mask=CALLERS_MASK, mask_tensor=None, mask_version=None) if callers else {}
        plans[key] = decided._replace(shapes=key[:3], **held)  # (the key's shapes: any key length where _shapes says so)
    return run(decided, q, k, v)


def _evict_oldest(plans: dict) -> None:
    """Drop the oldest kept plans down to one less than :data:`PLANS_KEPT`.

    The dicts are shared by every thread calling (a model served from a thread pool through the SDPA drop-in):
    another may evict the same plan, or change the dict, between this thread's look at the oldest key and its
    delete. Neither fails this call (a ``KeyError`` out of the drop-in did: 8 threads over 20 shapes, in 1 run in
    2 with a 1 µs switch interval, rarely at the default 5 ms), and the dict does not grow past its bound either.
    """
    while len(plans) >= PLANS_KEPT:
        try:
            del plans[next(iter(plans))]
        except KeyError:
            continue  # another thread evicted it first: look again (the dict is one shorter)
        except (RuntimeError, StopIteration):
            plans.clear()  # changed (or emptied) under the look: start afresh, each shape planned again
            return


#: Plans of recent unmasked plain calls, by what :func:`plan` reads besides the tensors' contents: their
#: shapes and dtype, the score's kind, ``causal`` and the scale. A loop calling with new tensors of the same
#: shapes (a decoding loop's layers) checks them with :func:`fits` (0.5 µs) instead of planning again (5-8 µs).
#: A masked call's plans are kept on its ``qkv.masks`` object (they hold its tensors: they live as long as
#: it does).
_PLANS: dict[tuple, Plan] = {}
#: Plans of recent calls with a caller's bool tensor (SDPA's ``attn_mask``), by the same and the tensor's shape:
#: only those that hold no tensor and nothing read from its values (:data:`CALLERS_MASK` in their place), since
#: SDPA reads ``attn_mask`` afresh at every call, a write through numpy or ``.data`` included. A padded decoding
#: step through the SDPA drop-in planned at every call spent 10-15 µs on it, most of what it adds to the kernel.
_TENSOR_MASK_PLANS: dict[tuple, Plan] = {}
#: What a kept plan holds for its mask where the mask is the call's own bool tensor, passed to the kernel as it is.
CALLERS_MASK = object()
#: Plans kept per mask (and unmasked): a model's calls of a few shapes (a prefill and its steps).
PLANS_KEPT = 8


def _plan_key(q, k, v, score, causal, scale, mask) -> tuple | None:
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or type(causal) is not bool:
        return None
    if q.is_nested or k.is_nested or v.is_nested:
        return None  # (no sizes to key on: the full path's message)
    if not (scale is None or type(scale) is float) or not (type(score) is str or type(score) in (Dot, ScaledDot)):
        return None  # (a tensor scale is not hashed; other scores never take the lane)
    key = *_shapes(q, k, v, mask is None), q.dtype, score if type(score) is str else type(score), causal, scale
    if type(mask) is Tensor:  # (the device and layout too: a plan is for a strided CPU tensor)
        return (*key, mask.shape, mask.dtype, mask.is_cpu, mask.layout)
    return key


#: A kept plan's key length where it holds for any number of keys (:func:`_shapes`); never a tensor's size.
ANY_LENGTH = -1


def _shapes(q: Tensor, k: Tensor, v: Tensor, unmasked: bool) -> tuple:
    """``(q.shape, k.shape, v.shape)`` as a plan is kept under them: for an unmasked one-query call without grouped
    heads, the keys' length as :data:`ANY_LENGTH`.

    :func:`plan` decides nothing from that length for such a call (``is_causal`` is False for one query, no
    grouped rows are timed), so a decoding loop's next step, one key longer, runs the plan its last step made
    instead of planning again (5-8 µs at each step of a model's first layer, whose length is new).
    """
    qs, ks, vs = q.shape, k.shape, v.shape
    if unmasked and len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and qs[2] == 1 and qs[1] == ks[1] and ks[2] == vs[2] > 0:
        return qs, (ks[0], ks[1], ANY_LENGTH, ks[3]), (vs[0], vs[1], ANY_LENGTH, vs[3])
    return qs, ks, vs


def _plans_of(mask: object) -> dict | None:
    """Where a call's plans are kept: :data:`_PLANS` unmasked, :data:`_TENSOR_MASK_PLANS` with a bool tensor,
    on a ``qkv.masks`` object, else nowhere."""
    if mask is None:
        return _PLANS
    if type(mask) is Tensor:
        return _TENSOR_MASK_PLANS
    if not isinstance(mask, Mask):
        return None
    plans = getattr(mask, "_lane_plans", None)
    if plans is None:
        try:
            plans = mask._lane_plans = {}
        except AttributeError:  # (a mask class with slots)
            return None
    return plans


def plan(q: Tensor, k: Tensor, v: Tensor, score: object, causal: object, scale: object,
         mask: object = None) -> Plan | None:  # fmt: skip
    """:func:`plain`'s checks and choices for this call, or None when it is not plain."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None  # Parameters, FakeTensors and other subclasses take the full path
    if q.layout != torch.strided or k.layout != torch.strided or v.layout != torch.strided or q.is_nested:
        return None  # sparse or nested: the full path's messages
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or tracing():
        return None  # compile, export and jit.trace take the full path (and may not read a value)
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        return None
    gpu = _on_one_gpu(q, k, v)
    if gpu and dtype not in DEVICE_DTYPES or not gpu and not (q.is_cpu and k.is_cpu and v.is_cpu):
        return None  # (is_cpu: no device object)
    b, h, i, d = q.shape
    kb, g, j, kd = k.shape
    vb, vg, vj, _ = v.shape
    if kb != b or vb != b or vg != g or vj != j or kd != d or i == 0 or j == 0 or g == 0 or h % g:
        return None
    if d == 0:
        return None  # no features: every logit is 0 and 1/√d has no value (the full path, see checks.request)
    if not gpu and (not dtype.is_floating_point or not flash_cpu.works(dtype)):
        return None
    if type(mask) is Window and mask.left is None and mask.right == 0 and causal is False:
        mask, causal = None, True  # qkv.masks.causal() is causal=True (the same window, folded the same way)
    attn_mask = keys = None
    if mask is not None and gpu:
        if type(mask) not in PADDING:
            return None  # a GPU call's other masks: the full path (flex, a lowered BlockMask, its guard)
        padding = device_padding(mask, q, k)
        if padding is None:
            return None
        attn_mask, keys = padding
    elif type(mask) in PADDING:
        padding = None if _records_gradients(q, k, v) else plain_padding(mask, q, k)
        if padding is None:
            return None
        attn_mask, keys = padding
    elif mask is not None:
        if type(mask) is Tensor:  # a caller's bool tensor (SDPA's attn_mask): read afresh at every call, as SDPA does
            if mask.dtype != torch.bool or mask.dim() != 4:
                return None  # (a float mask, or one SDPA broadcasts from fewer dims: the full path, its messages)
            mask = Dense(mask)
        attn_mask = _plain_mask(mask, q, k, v, causal)
        if attn_mask is None:
            return None
    if causal is True:
        is_causal = i == j and i > 1
        if i != 1 and not is_causal:
            if not gpu or not i < j or h != g or attn_mask is not None:
                return None  # a mask tensor, or rows that see no key: the full path
            if autocast_on(q.device.type):
                # causal_lower_right calls its kernels itself, below autocast: float32 inputs would answer float32
                return None  # (the full path casts them first, autocast_inputs)
            attn_mask = (_lower_right(i, j), None)  # on a GPU: the kernel's bottom-right causal, as the full path runs it
    elif causal is False:
        is_causal = False
    else:
        return None
    kind = type(score)
    if kind is str:
        kind = _PLAIN_NAMES.get(score)
    if kind is ScaledDot:
        default = 1.0 / math.sqrt(d)
    elif kind is Dot:
        default = 1.0
    else:
        return None
    if scale is None:
        scale = default
    elif type(scale) is not float or not math.isfinite(scale) or scale <= 0:
        return None  # (a scale that is not positive: the full path, see checks.request)
    tensor = mask_tensor(mask) if mask is not None and attn_mask is not None else None
    attn_mask, live_rows = attn_mask if attn_mask is not None else (None, None)
    read = (k, v) if keys is None else (k[:, :, keys[0]:keys[1]], v[:, :, keys[0]:keys[1]])  # (what the kernel reads)
    way = grouping(q, *read, attn_mask, 0.0, is_causal, scale, h != g)  # a plan's calls share their shapes and mask
    return Plan((q.shape, k.shape, v.shape), dtype, attn_mask, live_rows, is_causal, scale, way, tensor,
                None if tensor is None else version(tensor), gpu, keys)  # fmt: skip


def run(decided: Plan, q: Tensor, k: Tensor, v: Tensor, mask: object = None) -> Tensor | None:
    """The kernel's output for the call :func:`plan` decided, or None where it holds a nan (the full path then
    zeroes the hidden keys); ``mask`` is the call's, which a plan holding :data:`CALLERS_MASK` passes as it is."""
    if decided.keys is not None:  # a padded step: the keys some row sees; on a GPU padding zeroed branch-free, no
        j0, j1, hidden, _ = decided.keys  # scan of the output (a host read stalls the stream)
        if j1 - j0 != k.shape[-2]:
            k, v = k[:, :, j0:j1], v[:, :, j0:j1]
        if hidden is not None:
            k, v = without(k, v, hidden)
    if decided.attn_mask is None:
        return _kernel(q, k, v, None, 0.0, decided.is_causal, decided.scale, decided.grouping)
    if decided.gpu:
        out = _kernel(q, k, v, decided.attn_mask, 0.0, False, decided.scale, decided.grouping)
        return out if decided.live_rows is None else out * decided.live_rows.to(out.dtype)
    attn_mask = mask if decided.attn_mask is CALLERS_MASK else decided.attn_mask
    out = _kernel(q, k, v, attn_mask, 0.0, False, decided.scale, decided.grouping)
    if decided.live_rows is not None:  # (in the kernel's dtype: under autocast its ones must not promote the output)
        out = out * decided.live_rows.to(out.dtype)
    return out if no_nan(out) else None


def fits(decided: Plan, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a kept plan may :func:`run` a call with the arguments it was made for but new tensors (a model's
    next layer in the same forward, a decoding loop's next step).

    The score, scale and mask are the plan's (its key), so what is checked is the tensors: plain CPU
    (or same-GPU, on the device of the plan's tensors) strided ``Tensor``s of the planned shapes and dtype,
    no gradient into a masked CPU call, and the mask's tensor not changed in place since.
    """
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    if _shapes(q, k, v, decided.shapes[1][2] == ANY_LENGTH) != decided.shapes or q.dtype != decided.dtype or (
            k.dtype != q.dtype or v.dtype != q.dtype):  # fmt: skip
        return False
    if q.is_nested or q.layout != torch.strided or k.layout != torch.strided or v.layout != torch.strided:
        return False
    if decided.gpu:
        if not _on_one_gpu(q, k, v):
            return False
        if decided.keys is None:  # unmasked, or the kernel's causal_lower_right: nothing read from a tensor
            return not (decided.attn_mask is not None and autocast_on(q.device.type))
        # a padded step's (padding zeroed, any gradient): planned on this device, its lengths unchanged since, and
        # its tensors not made under inference_mode for a call outside it (they could not be saved for a backward)
        hidden = decided.keys[2]
        if hidden is not None and hidden.is_inference() and not torch.is_inference_mode_enabled():
            return False
        return decided.keys[3] == q.device and _unchanged(decided)
    if not (q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    if decided.attn_mask is not None:
        if decided.mask_tensor is not None and not _unchanged(decided):
            return False
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return False
    return True


def _unchanged(decided: Plan) -> bool:
    """Whether the plan's mask tensor is as planned: kept with a version (none under ``inference_mode``) and not
    changed in place since."""
    return decided.mask_version is not None and version(decided.mask_tensor) == decided.mask_version


def _records_gradients(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether autograd records this call (then a CPU call's hidden keys are guarded first, on the full path)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _plain_mask(mask: object, q: Tensor, k: Tensor, v: Tensor, causal: object) -> tuple[Tensor, Tensor | None] | None:
    """``(attn_mask, live_rows)`` of a mask :func:`plain` may take (see there), as :func:`_mask` gives them; else None."""
    if _records_gradients(q, k, v):
        return None  # a differentiated call guards its hidden keys first: the full path
    if type(mask) is not Dense or causal is not False:
        return None
    allowed = mask.mask
    if type(allowed) is not Tensor or allowed.dtype != torch.bool or allowed.device.type != "cpu" or allowed.dim() != 4:
        return None
    (b, h, i, _), j = q.shape, k.shape[-2]
    mb, mh, mi, mj = allowed.shape
    if mj != j or mi not in (1, i) or mb not in (1, b) or mh not in (1, h):
        return None

    def build():
        if _is_causal(allowed, i, j):
            return None  # the full path runs the kernel's causal flag instead
        # rows that see no key: none to find where the kernel itself gives them 0 (probed once per dtype)
        dead = None if zeroes_dead_rows(q) else _dense_dead_rows(mask, allowed, i, j)
        return _give_dead_rows_every_key(allowed, dead, q.dtype)

    return kept_on_mask(mask, allowed, (i, j, q.dtype), build)


def _lower_right(i: int, j: int) -> object:
    """PyTorch's ``causal_lower_right(i, j)``: a GPU kernel's bottom-right causal flag, no ``(i, j)`` tensor."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(i, j)


#: Dtypes a CUDA call takes the lane in: the ``sdpa`` backend's (flash and the efficient kernel, or
#: PyTorch's math kernel for float64), as the full path would run them.
DEVICE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _on_one_gpu(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """All three on the same CUDA device. There the full path runs an unmasked call on SDPA too (no CPU kernel,
    no hidden key to guard): its Python, 0.1-0.3 ms a call on the H200's host, was most of a small call's time."""
    return q.is_cuda and k.device == q.device and v.device == q.device


#: The scores :func:`plain` takes by name.
_PLAIN_NAMES = {"scaled_dot": ScaledDot, "dot": Dot}
