"""PyTorch's dialect: ``qkv.scaled_dot_product_attention``, a drop-in for ``F.scaled_dot_product_attention``.

Shape legend: ``N…`` leading (batch) dims, ``Hq`` query heads, ``H`` KV heads, ``L`` query
length, ``S`` key length, ``E`` query/key size, ``Ev`` value size.

Code moves over by changing an import: the same arguments, the same results, on qkv's
backends (a lazy causal mask, the fused kernels where they apply, a fused engine where
SDPA would build the mask). PyTorch's semantics are kept where they differ from
``qkv.attention``'s:

* ``is_causal`` is aligned **top-left** (query ``r`` sees keys ``c <= r``), as
  ``torch.ones(L, S).tril()``; qkv's own ``causal=True`` is bottom-right (a query at the end
  of a cache sees every key). Both agree when ``L == S``. With ``L < S`` no query sees the
  keys from ``L`` on: the call runs on the first ``L`` keys (their gradients are 0), the
  kernel's causal square.
* ``attn_mask`` is a bool mask (True = take part) or a float mask added to the scores, in
  float32 or the query's dtype; ``attn_mask`` with ``is_causal=True`` is an error, as
  PyTorch documents it (torch 2.13's CPU path joins the two instead).
* ``query``, ``key`` and ``value`` broadcast along every batch dim, as PyTorch's products
  do: a dim of 1 or a missing one (a lower rank), the heads too.
* ``enable_gqa=True`` groups the heads instead, as PyTorch repeats them: ``key`` and
  ``value`` may have different head counts ``Hk`` and ``Hv``, each dividing ``Hq``; query
  head ``i`` reads key head ``i // (Hq/Hk)`` and value head ``i // (Hq/Hv)``. Each of the
  three needs a head dim (PyTorch reads ``size(-3)``: an ``IndexError`` for a 2-d one), and
  a count that does not divide ``Hq`` is PyTorch's ``RuntimeError``; so is a count of 0
  under query heads, where PyTorch divides by it (a crash for ``key``, zeros for ``value``).
  Without the flag different counts are PyTorch's broadcast error.
* ``attn_mask`` broadcasts to the scores ``q·kᵀ``, ``(N…, Hq, L, S)``, without growing them (PyTorch
  adds it in place: a mask that would grow them, or that holds a batch only ``value`` has, is its
  ``RuntimeError``), from any rank: a 1-d ``(S,)`` row and a 0-d value included, as PyTorch
  documents it ("broadcastable"), where torch 2.13's kernels raise ``IndexError`` for both.
* PyTorch's input checks, with its exception types and each message naming the argument: one
  dtype and one device for ``query``, ``key``, ``value`` (and the mask's device), each at least
  2-d (``RuntimeError``); an integer or bool dtype ``RuntimeError``, a complex one
  ``NotImplementedError``. ``scale`` and ``enable_gqa`` are keyword-only; ``scale`` and
  ``dropout_p`` are read as PyTorch's parser reads a float: a number, a numpy scalar or a 0-d
  tensor without grad (other tensors: ``TypeError``).
* ``dropout_p`` outside [0, 1] is a ``RuntimeError``, as the documented reference's
  ``torch.dropout`` raises; torch 2.13's CPU kernels skip dropout for a negative (or nan) one.
  A scale that is not finite is refused (``ValueError``), where PyTorch gives nan rows.
* Nested tensors are refused (``NotImplementedError``, pointing to ``qkv.varlen_attention``);
  PyTorch takes jagged ones.
* A query whose keys are all masked gets zeros, as PyTorch's CPU kernels give.
* A key or value that every query is masked from never reaches the output: a nan or inf
  there (a cache's unfilled slots from ``torch.empty``) is not read, where PyTorch's kernels
  give nan for the whole batch row (``0 · nan`` in ``weights @ v``, ``nan + (-inf)`` in a
  float mask). A nan in a key some query sees is that query's, as in PyTorch.
* Head size 0: every logit is 0, whatever the scale; ``dropout_p=1``: zeros; a one-element
  tensor ``scale`` is read as its number.
* A scale ``<= 0`` with ``is_causal`` gives the softmax; PyTorch's CPU kernel gives nan
  rows there (its flag's hidden logits turn to nan; its mask path is right).

Checked against ``F.scaled_dot_product_attention`` over masks, causal, scales, GQA,
broadcasting and dtypes in the test suite.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .backends import sdpa_direct, sdpa_plain
from .checks import one_zero_feature
from .functional import attention
from .masks import Mask, causal, offsets


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s call, on qkv: ``(N…, Hq, L, Ev)``."""
    if is_causal is False and dropout_p == 0.0 and type(dropout_p) is float and type(enable_gqa) is bool and (
            scale is None or type(scale) is float):  # fmt: skip
        if attn_mask is None:
            out = sdpa_direct.unmasked(query, key, value, scale, enable_gqa)
            if out is not None:
                return out
        elif type(attn_mask) is Tensor:
            out = sdpa_direct.decoding_step(query, key, value, attn_mask, scale, enable_gqa)
            if out is None:
                out = _usual(query, key, value, attn_mask, scale, enable_gqa)
            if out is not None and out is not sdpa_direct.NOT_FINITE:
                return out
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be bool, not {type(flag).__name__}")
    scale = None if scale is None else _number("scale", scale)
    dropout_p = _probability(_number("dropout_p", dropout_p))
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    _validate(query, key, value, attn_mask)
    scores = (query.shape, key.shape)  # the caller's: q·kᵀ broadcasts these, not value's batch
    if scores[0][-1] != scores[1][-1]:  # PyTorch's kernels raise RuntimeError here too, in their products' words
        raise RuntimeError(f"key: expected query's size E = {scores[0][-1]} in its last dim (query·keyᵀ needs one "
                           f"size), got {scores[1][-1]} (query {tuple(scores[0])}, key {tuple(scores[1])})")  # fmt: skip
    query, key, value = _broadcast(query, key, value, enable_gqa)
    mask, bias = None, None
    if attn_mask is not None:
        if attn_mask.dim() < 2:  # broadcastable to (L, S), as PyTorch documents: a row (S,) or one value for all
            attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
        _mask_fits(attn_mask, _scores_shape(*scores, enable_gqa))
        mask, bias = (attn_mask, None) if attn_mask.dtype == torch.bool else (None, attn_mask)
    if query.shape[-1] == 0:  # no features: every logit is 0 (the sum of no products), whatever the scale
        query, key, scale = one_zero_feature(query), one_zero_feature(key), 1.0
    if is_causal:
        i, j = query.shape[-2], key.shape[-2]
        if 0 < i < j:  # top-left: no query sees the keys from i on; the kernel's causal square, those never read
            key, value, j = key[..., :i, :], value[..., :i, :], i
        mask = causal() if i == j else offsets(None, i - j)  # top-left: key c <= query r
    if dropout_p == 1:
        # every weight dropped: zeros, and zero gradients (PyTorch's dropout at p = 1)
        out = attention(query, key, value, mask=mask, bias=bias, scale=scale)
        return torch.where(torch.zeros((), dtype=torch.bool, device=out.device), out, 0.0)
    return attention(query, key, value, mask=mask, bias=bias, scale=scale, dropout=dropout_p)


def _usual(query: object, key: object, value: object, attn_mask: Tensor, scale: float | None,
           grouped: bool) -> Tensor | None:  # fmt: skip
    """A masked call (an unmasked one takes ``sdpa_direct``) straight to ``qkv.attention``'s plain lane, or None: the
    checks below then run.

    The lane (:func:`qkv.backends.sdpa_plain.plain`) takes what the full path would hand it
    unchanged, 4-d tensors of one batch with a bool ``(N|1, H|1, L|1, S)`` mask, and
    declines the rest (other ranks, broadcast batches, float masks, a scale that is not positive,
    dtypes that differ, an output a hidden key made non-finite); the full path then answers with
    its checks and messages. What only SDPA's call decides is settled here, so that the lane
    does not plan a call it must decline: batches and heads that the drop-in broadcasts or
    regroups (a batch of one, key and value head counts that differ), query and key head counts
    that differ without ``enable_gqa`` (qkv groups them without a flag), and a masked call
    that records gradients (the lane guards none). A short masked call takes 10-20 µs here:
    the checks this skips cost 2-5 µs of it.
    """
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested or key.is_nested or value.is_nested:
        return None  # (a strided nested tensor has no shape: the full path's message)
    (b, hq, _, _), (kb, hk, _, _), (vb, hv, _, _) = query.shape, key.shape, value.shape
    if kb != b or vb != b or hk != hv or not (hk == hq or grouped):
        return None  # broadcast or regrouped by the drop-in, or PyTorch's broadcast of the heads (or its error)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    return sdpa_plain.plain(query, key, value, "scaled_dot", False, scale, attn_mask)


def _number(name: str, value: object) -> float:
    """``value`` as a float, as PyTorch's argument parser reads a ``float`` argument.

    A Python or numpy number (a bool too) is its value; a tensor only if it is 0-d and
    records no gradient (PyTorch refuses a scale one learns, which reading its number would
    silently stop learning); anything else is PyTorch's ``TypeError``.
    """
    if type(value) is float:  # the usual call (an ABC's isinstance below costs more than the rest of this)
        return value
    if isinstance(value, Tensor):
        if value.dim() == 0 and not value.requires_grad:
            return value.item()
        raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be float, not Tensor (a 0-d tensor "
                        f"without grad is read as its number; got shape {tuple(value.shape)}, "
                        f"requires_grad={value.requires_grad})")  # fmt: skip
    if isinstance(value, numbers.Real):  # int, float, bool and numpy's scalars, which register as Real
        return float(value)
    raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be float, not {type(value).__name__}")


def _probability(p: float) -> float:
    """``dropout_p`` if it lies in [0, 1], else the ``RuntimeError`` of the reference's ``torch.dropout``.

    PyTorch's CPU kernels skip dropout for ``p <= 0`` (a nan too) instead: a negative
    probability is a bug upstream, which qkv reports (the module docstring's difference).
    """
    if not 0.0 <= p <= 1.0:
        raise RuntimeError(f"dropout_p: dropout probability has to be between 0 and 1, but got {p}")
    return p


def _validate(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> None:
    """PyTorch's ``validate_sdpa_input``, in its order, with its exception types; each message names the argument.

    Its kernels add two: an integer or bool tensor is a ``RuntimeError`` ("expected scalar
    type Float"), a complex one ``NotImplementedError`` (no softmax for it).
    """
    if (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor and query.is_cpu and key.is_cpu
            and value.is_cpu and query.dtype == key.dtype == value.dtype and query.dtype.is_floating_point
            and not (query.is_nested or key.is_nested or value.is_nested)
            and query.dim() >= 2 and key.dim() >= 2 and value.dim() >= 2):  # fmt: skip
        # the usual call, every check below passed at once (their device objects and lists cost 3-4 µs a call)
        if attn_mask is not None:
            _mask_kind(attn_mask, query)
        return
    named = (("query", query), ("key", key), ("value", value))
    for name, x in named:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.is_nested:  # before any shape is read: a jagged tensor has no sizes to broadcast
            raise NotImplementedError(f"{name}: a nested tensor; qkv.scaled_dot_product_attention takes dense "
                                      "(N…, H, L, E) tensors: pack the sequences for qkv.varlen_attention, or pad "
                                      "them and pass attn_mask")  # fmt: skip
    got = "query.{0}: {1} key.{0}: {2} and value.{0}: {3} instead"
    for what, attr in (("dtype", "dtype"), ("device type", "device")):
        odd = [name for name, x in named[1:] if getattr(x, attr) != getattr(query, attr)]
        if odd:
            raise RuntimeError(f"{odd[0]}: expected query's {attr}. Expected query, key, and value to have the same "
                               f"{what}, but got " + got.format(attr, *(getattr(x, attr) for _, x in named)))  # fmt: skip
    low = [name for name, x in named if x.dim() < 2]
    if low:
        raise RuntimeError(f"{low[0]}: expected (…, length, size). Expected query, key, and value to all be at least "
                           "2 dimensional, but got " + got.format("dim", *(x.dim() for _, x in named)))  # fmt: skip
    if not query.dtype.is_floating_point:
        error = NotImplementedError if query.dtype.is_complex else RuntimeError
        raise error(f"query: expected a real floating-point dtype, got {query.dtype}")
    if attn_mask is not None:
        _mask_kind(attn_mask, query)


def _mask_kind(attn_mask: Tensor, query: Tensor) -> None:
    """``attn_mask`` is a bool mask or a float one (float32 or the query's dtype) on the query's device."""
    if type(attn_mask) is Tensor and attn_mask.is_cpu and query.is_cpu and attn_mask.dtype in (torch.bool, torch.float32,
                                                                                             query.dtype):  # fmt: skip
        return  # (the usual call: no device objects built)
    if isinstance(attn_mask, Mask):  # qkv's own lazy masks are qkv.attention's, which PyTorch's call has no place for
        raise TypeError(f"attn_mask: expected a bool or float tensor, got {attn_mask!r}, a qkv lazy mask, which "
                        "qkv.attention(q, k, v, mask=...) takes (here, is_causal=True for a causal mask)")  # fmt: skip
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask: expected a bool or float tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {attn_mask.dtype} and query.dtype: {query.dtype} instead.")  # fmt: skip
    if attn_mask.device != query.device:
        raise RuntimeError(f"attn_mask: expected a tensor on query's device {query.device}, got {attn_mask.device}")


def _scores_shape(q: torch.Size, k: torch.Size, grouped: bool) -> tuple[int, ...]:
    """The shape of ``q·kᵀ``, ``(N…, Hq, L, S)``: query's and key's batch dims broadcast, value's not.

    With ``enable_gqa`` key's heads are repeated to query's, so only the dims before them broadcast.
    """
    keep = 3 if grouped else 2
    lead_q, lead_k = q[: max(len(q) - keep, 0)], k[: max(len(k) - keep, 0)]
    lead = lead_q if lead_q == lead_k else torch.broadcast_shapes(lead_q, lead_k)
    return (*lead, *q[-keep:-1], k[-2])


def _mask_fits(attn_mask: Tensor, scores: tuple[int, ...]) -> None:
    """PyTorch adds ``attn_mask`` to ``q·kᵀ`` in place: it must broadcast to the scores without growing them."""
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= len(scores) and all(m in (1, s) for m, s in zip(shape[::-1], scores[::-1]))
    if not fits:
        raise RuntimeError(f"attn_mask: expected a shape broadcastable to the scores q·kᵀ, {scores} "
                           f"(N…, Hq, L, S), without growing them; got {shape}")  # fmt: skip


def _broadcast(query: Tensor, key: Tensor, value: Tensor, grouped: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``query``, ``key``, ``value`` expanded (views) to one batch shape, as PyTorch's products broadcast them.

    Every dim but the last two broadcasts, the heads included; with ``enable_gqa`` the heads
    (dim -3) are grouped instead (:func:`_group_heads`), and only the dims before them
    broadcast.
    """
    given = (query, key, value)  # the caller's, for a message
    if grouped:
        key, value = _group_heads(query, key, value)
    keep = 3 if grouped else 2  # trailing dims that are each tensor's own
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) == len(ks) == len(vs) >= keep and qs[:-keep] == ks[:-keep] == vs[:-keep]:
        return query, key, value  # the usual call: nothing broadcasts (torch.broadcast_shapes costs 10 µs)
    leads = [x.shape[: max(x.dim() - keep, 0)] for x in (query, key, value)]
    try:
        lead = torch.broadcast_shapes(*leads)
    except RuntimeError:
        try:  # PyTorch's own message (its products broadcast these dims): an add of stride-0 views of the shapes
            torch.empty(()).expand(leads[0]) + torch.empty(()).expand(leads[1]) + torch.empty(()).expand(leads[2])
        except RuntimeError as e:
            grouping = not grouped and _groups(query, key, value)
            hint = "; set enable_gqa=True for grouped-query attention" if grouping else ""
            shapes = [tuple(x.shape) for x in given]
            raise RuntimeError(f"query {shapes[0]}, key {shapes[1]}, value {shapes[2]}: "
                               f"{e}{hint}") from None  # fmt: skip
        raise
    return tuple(x.expand(*lead, *x.shape[-keep:]) if x.dim() >= keep and x.shape[:-keep] != lead else x
                 for x in (query, key, value))  # fmt: skip


def _group_heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``key (…, G, S, E)``, ``value (…, G, S, Ev)``: one head count ``G`` dividing ``Hq``, for ``enable_gqa``.

    PyTorch repeats each of ``key`` and ``value`` ``Hq // H`` times along the heads
    (``repeat_interleave``): query head ``i`` reads key head ``i // (Hq/Hk)`` and value head
    ``i // (Hq/Hv)``, the two counts free to differ. qkv's kernels group query heads over
    KV heads themselves, so the two need only meet: at ``G = lcm(Hk, Hv)``, which divides
    ``Hq``, each head of the one with fewer repeated ``G/H`` times in a row (the repeat of
    a repeat is PyTorch's index). Equal counts, the usual GQA, are not copied.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() < 3:  # PyTorch reads each one's size(-3), whatever the counts
            raise IndexError(f"{name}: enable_gqa=True needs a heads dim (…, H, length, size), got shape "
                             f"{tuple(x.shape)}: Dimension out of range (expected to be in range of "
                             f"[{-x.dim()}, {x.dim() - 1}], but got -3)")  # fmt: skip
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk == hv and hq and hk and hq % hk == 0:  # one count dividing query's: nothing to repeat
        return key, value
    bad = [f"{name}: {h} heads" for name, h in (("key", hk), ("value", hv)) if h == 0 or hq % h]
    if bad:  # PyTorch's message, as it reads; a count of 0 it divides by (a crash for key, zeros for value)
        raise RuntimeError(f"{', '.join(bad)} for query's {hq} (enable_gqa=True): Number of heads in key and value "
                           "must divide the number of heads in query")  # fmt: skip
    if hq == 0:  # every count divides 0: PyTorch repeats each 0 times
        return key[..., :0, :, :], value[..., :0, :, :]
    g = math.lcm(hk, hv)
    return _repeat_heads(key, g // hk), _repeat_heads(value, g // hv)


def _repeat_heads(x: Tensor, times: int) -> Tensor:
    """``x (…, H, S, E)`` with each head ``times`` times in a row: ``(…, H·times, S, E)``; a view for one head."""
    if times == 1:
        return x
    if x.shape[-3] == 1:
        return x.expand(*x.shape[:-3], times, *x.shape[-2:])
    return x.repeat_interleave(times, dim=-3)


def _groups(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether ``enable_gqa=True`` would group these heads: each has a head dim, and key's and value's, not both
    query's, divide query's (the hint of a broadcast error)."""
    if min(x.dim() for x in (query, key, value)) < 3:
        return False
    hq, kv = query.shape[-3], (key.shape[-3], value.shape[-3])
    return kv != (hq, hq) and all(h > 0 and hq % h == 0 for h in kv)


