"""PyTorch's fused kernel, ``F.scaled_dot_product_attention``, for the dot family of scores.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

A dot-form score (dot, scaled dot, bilinear) is ``scale · qp kpᵀ`` after its ``prepare``
step, which is exactly what the kernel computes. Three things are adapted to qkv's contract:

* PyTorch's ``is_causal`` is aligned top-left; qkv's causal mask is bottom-right. The flag
  runs qkv's causal mask where ``i == j`` (where the two agree), and the top-left offset
  range ``offsets(None, i - j)`` (query ``r`` sees keys ``c <= r``, what
  ``qkv.scaled_dot_product_attention`` makes of ``is_causal``) at any ``i, j``; otherwise the
  mask is built.
* Lazy biases are left to the chunked backend, which builds them one query block at a
  time (here they would be one ``(…, h, i, j)`` tensor). Lazy masks other than the plain
  causal one are materialised as an ``(i, j)`` bool mask (or ``(b, 1, i, j)`` for lengths),
  so only where that is small (:data:`MASK_ELEMENTS`, a decoding step's); a larger call is
  left to the chunked backend, which builds its mask a tile at a time.
* A fully masked row would be NaN in the kernel; it is unmasked for the kernel and its
  output multiplied by zero afterwards, which also zeroes its gradients.

On CUDA the same function runs PyTorch's flash or efficient kernel (its choice); nothing
here calls a CPU-only op there: the fused CPU kernel's probe (``tiling.flash_cpu.works``)
is asked for CPU calls only. One more case runs without a mask tensor on CUDA: the plain
causal mask with fewer queries than keys (a chunk of a prompt after a KV cache) is
PyTorch's ``torch.nn.attention.bias.causal_lower_right``, the flash kernel's own causal
alignment (:func:`_lower_right`). :data:`MASK_ELEMENTS` holds on CUDA too where the
``flex`` backend takes the call: a larger lazy mask goes there, built by blocks; where it
cannot (no Triton, an older GPU, dropout), up to :data:`DEVICE_MASK_ELEMENTS` are
materialised, faster on a GPU than the chunked engines' tile loops (:func:`_mask_limit`).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F
from torch import Tensor

from .._bools import any_along
from .._trace import concrete, tracing, version
from ..masks import And, Dense, Lengths, Offsets, Starts, Tile
from ..masks.base import conjuncts
from .grouped_rows import grouping
from .request import Request
from .tiling import flash_cpu
from .tiling.tiles import NEG_INF, offset_live_rows

name = "sdpa"
selects_weights = False

#: Largest lazy mask (elements of its ``(b, i, j)`` tensor) materialised for the kernel: 1 MiB
#: of bool, what a decoding step over a padded cache needs; beyond it the mask is built lazily.
MASK_ELEMENTS = 2**20
#: The same limit on CUDA when the ``flex`` backend cannot take the call (no flex_attention or
#: Triton, a GPU older than Ampere, dropout): 256 MiB of bool (and SDPA's additive copy in the
#: inputs' dtype), far faster there than the chunked engines' public-op tile loops.
DEVICE_MASK_ELEMENTS = 2**28
#: Devices whose SDPA runs ``causal_lower_right`` in a kernel (elsewhere it is materialised).
LOWER_RIGHT_DEVICES = ("cuda",)


def supports(req: Request) -> str | None:
    if req.q.device.type == "cpu" and not tracing() and not flash_cpu.works(req.q.dtype):
        # on CPU, F.scaled_dot_product_attention runs this same kernel
        return f"this torch's fused CPU kernel is missing or failed its check for {req.q.dtype}"
    if not req.score.dot_form:
        return f"the {req.score.name} score is not a dot product"
    if req.return_weights:
        return "the fused kernel does not return weights"
    if req.return_lse:
        return "the fused kernel does not return the log-sum-exp"
    if req.bias is not None and not isinstance(req.bias, Tensor) and not tracing():
        # while tracing, the bias is materialised: public ops only (see backends.tiling.flash_cpu)
        return "a lazy bias would be materialised as an (h, i, j) tensor"
    if req.dropout > 0 and req.generator is not None:
        return "the fused kernel's dropout cannot take a generator"
    if req.sinks is not None:
        return "sinks need each row's log-sum-exp, which the kernel does not return"
    if req.score_mod is not None:
        return "a score_mod needs each tile's logits, which the fused kernel never exposes"
    if req.mask is not None and not isinstance(req.mask, Dense) and not _by_flag(req):
        rows = req.q.shape[0] if req.mask.batch_shape() else 1
        elements = rows * req.i * req.j
        limit, by_blocks = _mask_limit(req)
        if elements > limit:
            return f"the lazy mask would be materialised as a ({rows}, {req.i}, {req.j}) tensor, more than {limit} elements{by_blocks}"
    return None


def _mask_limit(req: Request) -> tuple[int, str]:
    """``(elements, why)``: the largest lazy mask materialised for this call, and what builds a larger one.

    :data:`MASK_ELEMENTS`, except on CUDA where the ``flex`` backend cannot take the call:
    there :data:`DEVICE_MASK_ELEMENTS`, as the alternative is the chunked engines' tile loops.
    """
    if req.q.device.type != "cuda":
        return MASK_ELEMENTS, ""
    from . import flex_gpu  # (flex_gpu does not import this module)

    if flex_gpu.supports(req) is None:
        return MASK_ELEMENTS, "; flex_attention builds it by blocks"
    return DEVICE_MASK_ELEMENTS, ""


def _by_flag(req: Request) -> bool:
    """True when the kernel needs no mask tensor: an offset range that hides nothing, causal top-left
    (causal on a square among them), or lower-right."""
    mask = req.mask
    if not isinstance(mask, Offsets):
        return False
    if mask.state(Tile.whole(req.i, req.j, req.q.device)) == "full":
        return True
    return _top_left(req) or _lower_right(req)


def _top_left(req: Request) -> bool:
    """True when the mask is PyTorch's ``is_causal``: query ``r`` sees keys ``c <= r``, and nothing else hides or adds.

    That is the offset range ``offsets(None, i - j)`` (an offset is ``c - r - (j - i)``), and
    qkv's bottom-right ``causal()`` where ``i == j``. Every query sees key 0, so no row is
    dead. With ``i != j`` the chunked engines would otherwise run it (the mask tensor is
    ``i·j`` elements): measured on the Intel Xeon, ``i = 1024, j = 2048``, 1.23-1.28x the
    flag's time.
    """
    return req.bias is None and isinstance(req.mask, Offsets) and _top_left_range(req.mask, req.i, req.j)


def _top_left_range(mask: Offsets, i: int, j: int) -> bool:
    """True when the offset range keeps exactly the keys ``c <= r``: its upper bound ``i - j``, and a lower bound, if
    any, that reaches key 0 from the last query (``lo <= 1 - j``: a sliding window at least the call's length)."""
    return mask.hi == i - j and (mask.lo is None or mask.lo <= 1 - j)


def _lower_right(req: Request) -> bool:
    """True when the mask is plain causal with ``i < j`` on a device whose SDPA aligns it bottom-right in a kernel.

    ``causal_lower_right(i, j)`` as the ``attn_mask`` runs PyTorch's flash kernel with its
    causal flag, which is bottom-right aligned (else the efficient kernel's lower-right mask
    type), with no ``(i, j)`` tensor. With ``i < j`` every query sees a key, so no row is
    dead. Grouped KV heads are left to the mask tensor: that dispatch passes no
    ``enable_gqa``. Not while tracing: the traced graph keeps plain tensors.
    """
    return (
        req.q.device.type in LOWER_RIGHT_DEVICES and req.bias is None and req.is_causal_only
        and req.i < req.j and int(req.heads) == int(req.kv_heads) and not tracing()
    )  # fmt: skip


def kernel(req: Request) -> str | None:
    """What runs, in words, for ``qkv.explain`` on CUDA (None elsewhere: one kernel, the CPU's).

    PyTorch picks the kernel at run time; a mask tensor rules out flash (it takes none), so
    such a call runs the memory-efficient kernel (or cuDNN's, where PyTorch prefers it).
    """
    if req.q.device.type != "cuda":
        return None
    if req.q.dtype == torch.float64:  # flash and the efficient kernel take half and single precision only
        return "math kernel (float64), chosen by PyTorch"
    if req.bias is not None or (req.mask is not None and not _by_flag(req)):
        return "efficient kernel with a mask tensor, chosen by PyTorch"
    if _lower_right(req) and req.mask.state(Tile.whole(req.i, req.j, req.q.device)) != "full":
        return "flash or efficient kernel, causal_lower_right, chosen by PyTorch"
    return "flash or efficient kernel, chosen by PyTorch"


def run(req: Request) -> tuple[Tensor, None, None]:
    # No short-sequence switch to the math path: with b·i = 4096 tokens, 8 heads, d = 64, one
    # thread, forward + backward, PyTorch's flash kernel beat bmm + softmax + bmm (its MATH
    # backend and a hand-written one) at every length tried, i = 64 to 512 (i = 64: 175 ms
    # against 259 and 216; i = 128: 240 against 329 and 288), medians of 7 interleaved rounds.
    qp, kp = req.score.prepare(req.q, req.k)
    attn_mask, is_causal, live_rows = _mask(req)
    way = grouping(qp, kp, req.v, attn_mask, req.dropout, is_causal, req.scale, _grouped(req))
    out = _kernel(qp, kp, req.v, attn_mask, req.dropout, is_causal, req.scale, way)
    if live_rows is not None:
        out = out * live_rows
    return out, None, None


def _kernel(q: Tensor, k: Tensor, v: Tensor, attn_mask, dropout: float, is_causal: bool, scale: float,
            way: str | None) -> Tensor:  # fmt: skip
    """``F.scaled_dot_product_attention`` in the ``way`` :func:`~.grouped_rows.grouping` chose: ``"rows"`` runs grouped
    heads as query rows of their KV head, ``"gqa"`` is ``enable_gqa``, None no grouped heads."""
    if way == "rows":
        b, h, _, d = q.shape
        g = k.shape[1]
        out = F.scaled_dot_product_attention(q.view(b, g, h // g, d), k, v, attn_mask=attn_mask, scale=scale)
        return out.reshape(b, h, 1, out.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale, enable_gqa=way == "gqa")  # fmt: skip


def _grouped(req: Request) -> bool:
    """True when the query heads share KV heads (``h > g``): the kernel's ``enable_gqa``, a Python bool.

    Under ``torch.jit.trace`` a size read from a traced input is a 0-d tensor, so ``h // g > 1``
    would be one too, which the kernel refuses ("enable_gqa must be bool, not Tensor"). The
    sizes are read as ints here: the flag becomes a constant of the trace, right for every
    input of the traced shapes (a trace is specialised to its heads anyway: the projections'
    reshapes are).
    """
    return int(req.heads) != int(req.kv_heads)


def _mask(req: Request) -> tuple[Tensor | object | None, bool, Tensor | None]:
    """``(attn_mask, is_causal, live_rows)`` for the kernel; live_rows is None when every row sees a key.

    An offset mask (causal, windows) that hides nothing from any query, such as the causal
    mask of a one-token query after a cache, is dropped: the kernel then runs unmasked, its
    fastest path (a bool mask cost 2x the unmasked call for a 1 x 512 decoding step).
    """
    tile = Tile.whole(req.i, req.j, req.q.device)
    mask = _without_full_offsets(req.mask, tile)  # (causal() & a window wider than the call: causal())
    if isinstance(mask, Offsets):
        if mask.state(tile) == "full":
            mask = None
        elif req.bias is None and _top_left_range(mask, req.i, req.j):
            return None, True, None
        elif _lower_right(req):
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(req.i, req.j), False, None
    if mask is None and req.bias is None:
        return None, False, None
    allowed = None if mask is None else mask.tile(tile)
    # a program that computed the causal mask (a packed document's block mask); an offset range is known from its
    # bounds above, without comparing its tile (a varlen call's sequences each have their own size)
    if req.bias is None and not isinstance(mask, Offsets) and _is_causal(allowed, req.i, req.j):
        return None, True, None
    live_rows = None
    if allowed is not None and not zeroes_dead_rows(req.q):
        allowed, live_rows = _give_dead_rows_every_key(allowed, _dead_rows(mask, allowed, req), req.v.dtype)
    if req.bias is None:
        return allowed, False, live_rows
    bias = req.bias if isinstance(req.bias, Tensor) else req.bias.tile(tile)
    bias = bias.to(torch.promote_types(req.q.dtype, torch.float32))  # half-precision calls add a float32 bias
    if allowed is not None:
        bias = bias.masked_fill(~allowed, NEG_INF)  # no row is all -inf: dead rows were given every key
    return bias, False, live_rows


def _without_full_offsets(mask, whole: Tile):
    """``mask`` without the parts of its top-level ``&`` that are offset ranges hiding nothing in this call (the
    causal mask of a one-query step after a cache), or None: no tile is built for them (a GPU launches a kernel
    for each of a tile's operations: the causal part of a padded decoding step was 6 of its 31)."""
    if not isinstance(mask, And):
        return mask
    parts = conjuncts(mask)
    kept = [p for p in parts if not (isinstance(p, Offsets) and p.state(whole) == "full")]
    if len(kept) == len(parts):
        return mask
    return functools.reduce(operator.and_, kept) if kept else None


def _sees_first_key(mask, req: Request) -> bool:
    """True when every row sees key 0, known without a tensor: every part of the top-level ``&`` an offset range
    or padding (states from host numbers) that allows the whole first column."""
    column = Tile(0, req.i, 0, 1, req.i, req.j, req.q.device)
    parts = conjuncts(mask)
    return all(isinstance(p, (Offsets, Lengths, Starts)) for p in parts) and all(p.state(column) == "full" for p in parts)


_ZERO_ROWS: dict[torch.dtype, bool] = {}


def zeroes_dead_rows(q: Tensor) -> bool:
    """True where ``F.scaled_dot_product_attention`` itself gives a row with no allowed key 0 and no gradient.

    PyTorch's CPU kernels do (2.13: its flash kernel and the math path's safe softmax), so the
    dead rows need neither finding nor mending: two passes over the mask and one over the
    output saved (8% of a call of 16 left-padded rows of 256 on the Intel Xeon). Probed once
    per dtype on a tiny call, forward and backward, bool and ``-inf`` masks; elsewhere (CUDA,
    a torch that answers NaN, tracing) the rows are mended (:func:`_give_dead_rows_every_key`).
    """
    if q.device.type != "cpu" or tracing():
        return False
    if q.dtype not in _ZERO_ROWS:
        _ZERO_ROWS[q.dtype] = _probe_zero_rows(q.dtype)
    return _ZERO_ROWS[q.dtype]


def _probe_zero_rows(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    keep = torch.ones(70, 70, dtype=torch.bool).tril()  # more rows than one block of the kernel
    keep[1] = keep[66] = False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for mask in (keep, torch.zeros(70, 70, dtype=dtype).masked_fill(~keep, NEG_INF)):
                q, k, v = (torch.randn(1, 2, 70, 8, generator=gen).to(dtype).requires_grad_() for _ in range(3))
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out.sum().backward()
                dead = [1, 66]
                if not (bool(out.isfinite().all()) and bool((out[..., dead, :] == 0).all())):
                    return False
                if not (bool((q.grad[..., dead, :] == 0).all()) and all(bool(x.grad.isfinite().all()) for x in (q, k, v))):
                    return False
    except (RuntimeError, NotImplementedError):
        return False
    return True


_TRIL: dict = {}  # (i, device) -> (i, i) bool: the last causal square compared against


def _is_causal(allowed: Tensor, i: int, j: int) -> bool:
    """True when a materialised mask is exactly the causal square (then ``is_causal`` runs: it skips
    the blocks above the diagonal, where a mask tensor costs about 1.5x on a CPU).

    Checked on CPU tensors with values (one comparison, ``i²`` bools) and one mask for every
    batch row and head; a mask tensor is kept otherwise.
    """
    if i != j or allowed.device.type != "cpu" or not concrete(allowed):
        return False
    while allowed.dim() > 2 and (allowed.shape[0] == 1 or allowed.stride(0) == 0):
        allowed = allowed[0]  # a leading dim of one, or broadcast (the same mask for every row)
    if allowed.dim() != 2:
        return False
    key = (i, allowed.device)
    if key not in _TRIL:
        _TRIL.clear()
        _TRIL[key] = torch.ones(i, i, dtype=torch.bool).tril()
    return torch.equal(allowed, _TRIL[key])


def _give_dead_rows_every_key(allowed: Tensor, dead: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``(attn_mask, live_rows)``: rows that see no key (``dead``) given every key, and ``(..., i, 1)``
    ones in ``dtype`` that zero their output after the kernel (None when no row is dead).

    A row with no allowed key would be NaN in the kernel; its output is 0 instead.
    """
    if dead is None:
        return allowed, None
    return allowed | dead, (~dead).to(dtype)


def _dead_rows(mask, allowed: Tensor, req: Request) -> Tensor | None:
    """Bool ``(..., i, 1)``: rows that see no key; None when there are none.

    An offset mask's rows with keys are one range, found by arithmetic; for other masks the
    rows are found from ``allowed``, and whether any is dead is read on the host only where
    values can be read (``qkv._trace``) and cheaply (a CPU tensor: on a GPU the read would wait
    for the device): elsewhere every row is treated as possibly dead (the same result, one
    more multiplication).
    """
    if req.j > 0 and _sees_first_key(mask, req):  # (a padded decoding step's: no pass over the mask on a GPU)
        return None
    if isinstance(mask, Offsets):
        first, stop = offset_live_rows(mask, req.i, req.j)
        if first == 0 and stop == req.i:
            return None
        rows = torch.arange(req.i, device=allowed.device)[:, None]
        return (rows < first) | (rows >= stop)
    if not concrete(allowed) or allowed.device.type != "cpu":  # on a GPU the read is a sync
        return ~any_along(allowed, -1, keepdim=True)
    if isinstance(mask, Dense):
        return _dense_dead_rows(mask, allowed, req.i, req.j)
    dead = ~any_along(allowed, -1, keepdim=True)
    return dead if bool(dead.any()) else None


def _dense_dead_rows(mask: Dense, allowed: Tensor, i: int, j: int) -> Tensor | None:
    """:func:`_dead_rows` of a Dense CPU mask whose values can be read, ``allowed`` its ``(i, j)`` tile.

    One Dense mask reused call after call (a model's layers share a decoding step's mask):
    the answer is kept on it, for its tensor's version (an in-place change shows; a tensor
    without a version, made under ``torch.inference_mode``, is read every call).
    """
    changes = version(mask.mask)
    key = (i, j, changes)
    kept = getattr(mask, "_dead_rows", None)
    if changes is not None and kept is not None and kept[0] == key:
        return kept[1]
    dead = ~any_along(allowed, -1, keepdim=True)
    found = dead if bool(dead.any()) else None
    if changes is not None:
        mask._dead_rows = (key, found)
    return found

