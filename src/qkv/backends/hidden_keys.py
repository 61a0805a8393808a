"""Keys no query sees never reach an output: zero the hidden keys that hold NaN or inf.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` queries, ``j`` keys,
``d`` key size, ``e`` value size.

A key masked for every query row of its batch row and head (padding, a KV cache's unfilled
slots, often made with ``torch.empty``) gets weight 0, but ``0 · NaN = NaN`` in
``weights @ v`` and ``NaN + (-inf) = NaN`` in an additive mask, so on any engine, PyTorch's
SDPA included, one non-finite value there would turn every row of the batch into NaN, and
a non-finite hidden key turns the gradient of the queries into NaN (``dS @ K`` with
``dS = 0`` there). Which keys are hidden: ``Mask.hidden_keys`` names those one part of the
mask hides (lazy padding masks know them without a tensor; a dense mask is reduced over its
rows) or its offset ranges hide together, and a dense float bias's ``-inf`` columns
(:func:`hidden_keys`, no value read); :func:`exact_hidden_keys` evaluates the whole mask a
block of rows at a time and also finds a key hidden only by parts together (a per-row dense
mask and ``causal()``). Then, by what the call is:

* **recording gradients**, **traced** (``torch.compile``, ``torch.export``, meta
  tensors) or **on an accelerator**: :func:`guard`, before the engine, where the backend
  may read a hidden key (:func:`reads`; ``qkv.attention`` asks once the backend is chosen,
  other callers guard every call). A traced call, or
  one on a GPU (where reading a value on the host would stall the stream), zeroes the keys
  :func:`hidden_keys` names in copies of ``k`` and ``v`` unconditionally (the same result,
  branch-free); an eager CPU one reads the hidden keys alone where those names are exact
  (padding, offset ranges), else sums ``k`` and ``v`` (small beside a differentiated
  attention), and zeroes the exact hidden keys only when what it read is not finite;
* **inference** (no gradient): :func:`after`, once the engine ran. A non-finite hidden
  value or key shows in the output (``0 · NaN`` in ``weights @ v``; an engine that adds
  the mask to the logits keeps a NaN logit's row NaN, ``qkv.backends.engines.mod_tiles``
  selecting the masked logits away before it counts a row as empty) as nan, so an output
  without nan is the answer, for the cost of one scan of it (:func:`no_nan`); otherwise the
  call runs again with the exact hidden keys zeroed. A mask of offset ranges alone under which
  some row reaches every key (a causal call, a window) hides none: no scan
  (:func:`ranges_hide_none`), nor where no kernel of the backend reads a hidden key (its
  ``reads_hidden_keys``: a padded batch run a row at a time over each row's real keys). A
  one-token decoding step over a long padded cache thus pays nothing for reading its padding.

Either way a hidden key's gradient is 0 (no output depends on it).

A key hidden from some rows and seen by others (the future under a causal mask) is a real
input of the rows that see it, and a NaN there is theirs; the rows that do not see it may
get it too, through ``0 · NaN`` in ``weights @ v``, on every engine as in PyTorch's SDPA:
such a key is not padding, and its NaN is an error of the model that made it. Masks of
positions (``causal``, ``window``) hide no key from every row of a square call and report
none here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from .._bools import any_along
from .._trace import concrete
from ..masks.base import Tile, conjuncts
from .request import Request
from .tiling.tiles import as_heads

#: Mask elements each step of :func:`exact_hidden_keys` evaluates (rows at a time, every key).
EXACT_ELEMENTS = 2**20


def hidden_keys(req: Request) -> Tensor | None:
    """Bool ``(b|1, g|1, j, 1)``, True where a key is masked for every query row of its KV head; None if none known."""
    found = None if req.mask is None else req.mask.hidden_keys(req.i, req.j)
    bias = req.bias
    if isinstance(bias, Tensor) and bias.dim() == 4 and bias.shape[-1] == req.j:
        # (b|1, h|1, 1, j): a column is -inf in every row where its largest entry is (a nan is not);
        # one pass over the bias, where isneginf + all took two and a slow bool reduction
        if bias.shape[-2]:
            neg_inf = bias.detach().amax(dim=-2, keepdim=True) == float("-inf")
        else:
            neg_inf = torch.isneginf(bias).all(dim=-2, keepdim=True)
        found = neg_inf if found is None else found | neg_inf
    return None if found is None else _per_kv_head(found, req)


def exact_hidden_keys(req: Request) -> Tensor | None:
    """:func:`hidden_keys` exactly: the mask (and a dense bias's ``-inf``) evaluated over every row, a block of rows at a time.

    :meth:`Mask.hidden_keys` names the keys one part of a mask hides, or its offset ranges
    together; a key hidden only by parts together (a per-row dense mask and ``causal()``: the
    only row that reaches key 0 is masked) is found here, in ``O(i·j)`` work and
    ``O(b·h·j)`` memory. For an inference call whose output came out not finite (rare), and
    for a differentiated one whose keys or values hold a nan or inf.
    """
    mask, bias = req.mask, req.bias if isinstance(req.bias, Tensor) and req.bias.dim() == 4 else None
    if mask is None and bias is None:
        return None
    i, j, device = req.i, req.j, req.k.device
    step = max(1, EXACT_ELEMENTS // max(j, 1))
    seen = None
    for r0 in range(0, i, step):
        t = Tile(r0, min(r0 + step, i), 0, j, i, j, device)
        if mask is not None and mask.state(t) == "empty":
            continue
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device) if mask is None else as_heads(mask.tile(t), 4).to(device)
        if bias is not None:
            rows = bias[..., t.i0 : t.i1, :] if bias.shape[-2] != 1 else bias
            allowed = allowed & (rows.detach() != float("-inf"))
        part = any_along(allowed.expand(*allowed.shape[:-1], j), -2, keepdim=True)  # (b|1, h|1, 1, j)
        seen = part if seen is None else seen | part
    if seen is None:  # every row block empty: every key hidden
        return torch.ones(1, 1, j, 1, dtype=torch.bool, device=device)
    hidden = ~seen
    return _per_kv_head(hidden, req) if bool(hidden.any()) else None


def _per_kv_head(found: Tensor, req: Request) -> Tensor:
    """``(b|1, h|1, 1, j)`` keys hidden from rows of query heads -> ``(b|1, g|1, j, 1)``: hidden from every head of a group."""
    found = found.to(req.k.device)  # a mask may live elsewhere (copied per tile by the engines)
    if found.shape[1] not in (1, req.kv_heads):  # (b, h, ...) query heads -> hidden from each head of a group
        found = found.unflatten(1, (req.kv_heads, -1)).all(dim=2)
    return found.transpose(-1, -2)


def zeroed(req: Request, hidden: Tensor) -> Request:
    """``req`` with copies of ``k`` and ``v`` whose hidden keys are 0 (:func:`without`)."""
    k, v = without(req.k, req.v, hidden)
    return replace(req, k=k, v=v)


def without(k: Tensor, v: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of ``k`` and ``v`` whose keys ``hidden (b|1, g|1, j, 1)`` are 0 (a hidden key's gradient then 0 too).

    ``torch.where`` writes each copy in one pass (one kernel on a GPU), where ``masked_fill``
    copies and then fills (two): 21 against 33 µs a call on a 2-core AMD EPYC at 64 keys.
    """
    return torch.where(hidden, 0.0, k), torch.where(hidden, 0.0, v)


def guard(req: Request) -> Request:
    """Before the engine: ``req``, or :func:`zeroed` when a hidden key or value is not finite (or values cannot be read).

    On the CPU, eagerly: where :func:`hidden_keys` names every hidden key (:func:`named_exactly`:
    padding and offset ranges), one gather and sum of those keys alone; otherwise one sum over
    ``k`` and ``v`` (small beside a differentiated attention) and, only when it is not finite,
    the exact hidden keys (:func:`exact_hidden_keys`). Traced or on an accelerator, where no
    value may be read on the host: the keys :meth:`Mask.hidden_keys` names (one part's, or the
    offset ranges' together) are zeroed unconditionally.
    """
    if req.mask is None and not isinstance(req.bias, Tensor):  # nothing can hide a key
        return req
    k, v = req.k, req.v
    if not (concrete(k, v) and k.device.type == "cpu"):
        hidden = hidden_keys(req)
        return req if hidden is None else zeroed(req, hidden)
    if named_exactly(req):  # padding and offset ranges: read the hidden keys alone
        hidden = hidden_keys(req)
        if hidden is None or _finite(*_gather(k, v, hidden)):
            return req
        return zeroed(req, hidden)
    if _finite(k, v):
        return req
    hidden = exact_hidden_keys(req)
    return req if hidden is None else zeroed(req, hidden)


#: Outputs of at most this many elements are scanned by ``torch.equal`` (0.8 µs for a decoding step's), larger ones
#: by a sum (``torch.equal``'s scan is one thread, element by element: 2.6 ms for a 4M-element bfloat16 output, 14%
#: of a padded batch's call on an Intel Xeon; its sum took 0.3).
EQUAL_ELEMENTS = 2**12


def no_nan(out: Tensor) -> bool:
    """Whether an inference call's output holds no nan: a small one scanned by ``torch.equal`` of the tensor with
    itself, which PyTorch's CPU kernel answers by stopping at the first nan (no reduction made and read back: 0.8 µs
    for a decoding step's output, against 3.5 for a sum read on the host); a large one by its sum, nan where any
    entry is (a false alarm where ``+inf`` and ``-inf`` entries meet only reruns the call on zeroed hidden keys, the
    same output).

    Nan is what a hidden key or value that is not finite brings, and the only thing: its weight
    is exactly 0 (its logit is masked to ``-inf``, or a bias's ``-inf`` or lowest float is added),
    so a value of nan or ``±inf`` gives ``0 · nan`` or ``0 · inf``, nan; a key that is not finite
    gives a logit of nan, ``+inf`` or ``-inf``, and masked, nan, nan (``inf - inf``, or a row
    maximum of ``+inf``) or ``-inf``, a weight of 0 that does no harm. An infinite output
    without a nan comes from keys some query sees, as in PyTorch's SDPA.
    """
    if out.numel() <= EQUAL_ELEMENTS:
        return torch.equal(out, out)
    return not bool(out.sum().isnan())


def ranges_hide_none(req: Request) -> bool:
    """Whether the call's mask is offset ranges alone (causal, windows, their ``&``), no tensor bias, and some row
    reaches every key: nothing hidden, known from the sizes (no tensor built, no value read)."""
    if isinstance(req.bias, Tensor) or req.mask is None:
        return False
    return all(p.offset_bounds() is not None for p in conjuncts(req.mask)) and req.mask.hidden_keys(req.i, req.j) is None


def every_hidden_key(req: Request) -> Tensor | None:
    """The exact hidden keys: :func:`hidden_keys` where it names them all (:func:`named_exactly`, no tile
    evaluated), else :func:`exact_hidden_keys`."""
    return hidden_keys(req) if named_exactly(req) else exact_hidden_keys(req)


def named_exactly(req: Request) -> bool:
    """Whether :func:`hidden_keys` names every hidden key: each part of the mask's ``&`` keeps the same keys for
    every row (padding) or is an offset range, and a dense bias (if any) is one row for all.

    A key is then hidden exactly when one padding part hides it or the offset ranges together
    reach it from no row; otherwise parts may hide a key only together (a per-row mask and
    ``causal()``), which only :func:`exact_hidden_keys` finds.
    """
    bias = req.bias
    if isinstance(bias, Tensor) and bias.dim() >= 2 and bias.shape[-2] != 1:
        return False
    return req.mask is None or all(p.offset_bounds() is not None or p.same_for_every_row() for p in conjuncts(req.mask))


def _gather(k: Tensor, v: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """The hidden keys and values alone: ``(n, ·)`` rows gathered by ``hidden (b|1, g|1, j, 1)``."""
    at = hidden.expand(k.shape[0], -1, -1, -1)[..., 0]  # (b, g|1, j)
    if at.shape[1] == 1:  # the same keys hidden in every head (padding): index (b, j) only
        rows = at[:, 0].nonzero(as_tuple=True)
        return k.transpose(1, 2)[rows], v.transpose(1, 2)[rows]  # (n, g, d)
    rows = at.nonzero(as_tuple=True)
    return k[rows], v[rows]


def _finite(*xs: Tensor) -> bool:
    """Whether every value is finite: one sum, read once on the host (a sum is nan or inf when a term is,
    or when it overflows, where zeroing is harmless). ``Tensor.isfinite`` costs ~40 µs on a 0-d tensor."""
    return math.isfinite(float(sum(x.detach().sum() for x in xs)))


def needs_guard_first(req: Request) -> bool:
    """True when :func:`guard` must run before the engine (gradients recorded, or values unreadable)."""
    if not concrete(req.k, req.v) or req.k.device.type != "cpu":
        return True  # traced, or an accelerator, where reading a value on the host is a sync
    return req.differentiated


def after(req: Request, impl, result: tuple) -> tuple:
    """After an inference call on backend ``impl``: ``result`` when its output holds no nan (or no kernel of ``impl``
    read a hidden key: its ``reads_hidden_keys``), else ``impl.run`` again on :func:`zeroed` inputs."""
    if req.mask is None and not isinstance(req.bias, Tensor):  # nothing can hide a key
        return result
    if not reads(impl, req):  # (a padded batch's rows over their real keys alone)
        return result
    if ranges_hide_none(req):  # a causal call, a window, a chunk after its cache: no scan of the output
        return result
    if no_nan(result[0].detach()):
        return result
    hidden = every_hidden_key(req)
    return result if hidden is None else impl.run(zeroed(req, hidden))


def reads(impl, req: Request) -> bool:
    """Whether a kernel of backend ``impl`` may read a key of ``req`` hidden from every query (its
    ``reads_hidden_keys``; a backend without one may): where none does, neither :func:`guard` nor :func:`after` is
    needed."""
    return getattr(impl, "reads_hidden_keys", _always)(req)


def _always(req: Request) -> bool:
    return True
