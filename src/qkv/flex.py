"""FlexAttention's dialect: ``qkv.flex_attention``, a drop-in with a backward on the CPU.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``L`` query length, ``S``
key length, ``E`` query/key size, ``Ev`` value size.

``torch.nn.attention.flex_attention.flex_attention(query, key, value, score_mod, block_mask,
scale, enable_gqa, return_lse, kernel_options, *, return_aux)`` runs a ``score_mod`` and a
``BlockMask`` as a compiled kernel, on CPU forward only ("FlexAttention does not support
backward on CPU"). :func:`flex_attention` takes the same arguments, torch's own
``BlockMask`` included (``create_block_mask(..., device="cpu")``), and runs them on qkv's
engines, forward and backward: the block mask's lists skip the blocks it leaves out and
drop the ``mask_mod`` on its full blocks (``qkv.masks.FlexBlocks``); a block mask whose
lists fall into independent runs along the diagonal (packed documents) runs as one ordinary
call per run (``FlexBlocks.diagonal_groups``, the segments backend); and ``score_mod`` is
evaluated as flex evaluates it (0-d indices). ``return_lse`` /
``return_aux=AuxRequest(lse=True)`` give the natural-log log-sum-exp ``(B, Hq, L)``,
differentiable (None where it has no element, as flex answers); ``scale`` may be a 0-d tensor
without grad, read as its number. ``kernel_options`` tune flex's Triton kernels and are accepted and
ignored, but those flex refuses are refused (a ``BACKEND`` outside its list, ``BACKEND`` with
``FORCE_USE_FLEX_ATTENTION``, ``OUTPUT_LOGSUMEXP`` / ``OUTPUT_MAX``). Key and value may have
batch 1 under a larger query batch only with a block mask of the query's batch, as in flex
(its messages otherwise); a value of batch 1 under a key of the query's batch is broadcast, as
flex's ``expand`` does. flex's no-op block mask (``BLOCK_SIZE`` 2^30 on both sides, as its
``_create_empty_block_mask``) takes any lengths, its ``mask_mod`` decides every element; a
sliced block mask (``bm[0]``, its ``mask_mod`` a stub) and one on another device than the
query's are refused up front, as flex refuses them. What flex refuses as not implemented (a
rank other than 4, nested tensors, ``AuxRequest(max_scores=True)``, which flex computes on
CUDA only) raises ``NotImplementedError`` here too (:class:`FlexNotImplemented`, a ``ValueError``
as well), and what it refuses as ``RuntimeError`` (K/V batches that do not broadcast, value heads
other than key's, ``BACKEND`` with ``FORCE_USE_FLEX_ATTENTION``) a ``RuntimeError``
(:class:`FlexRuntimeError`, also a ``ValueError``). The output is laid out in the query's stride order, as flex's is (a query made by
``transpose(1, 2)`` gives an output whose ``transpose(1, 2)`` is contiguous). A block mask's
lists of fewer leading dims than ``(B, H)`` (``BlockMask.from_kv_blocks`` takes ``(nq,)``)
broadcast from the right. Checked against flex's own CPU forward in the test suite, random
calls included.

A block mask made with ``B=None`` or ``H=None`` serves every batch row and head: inside its
partial blocks the ``mask_mod`` sees each row's and query head's own ``b`` and ``h``, as in
flex. One difference from flex's *eager* forward, which evaluates the ``mask_mod`` at every
element: a block the block mask leaves out is never computed, as in flex's compiled kernel.
They differ only for a block mask whose lists are wrong for some heads or batch rows (made
with ``B=None`` or ``H=None`` for a ``mask_mod`` that hides whole blocks from ``b = 0`` or
``h = 0`` only), or lists written by hand (``BlockMask.from_kv_blocks``), which qkv follows.
Key and value in another dtype than the query's are read as flex reads them: the scores from
the key as given in float32 (float64 for a float64 query), the value in the query's dtype, the
output in the query's dtype;
any ``AuxRequest`` is answered with ``(out, AuxOutput(...))``. A key or value every query is
masked from never reaches the output (a nan or inf there is not read, where flex gives nan).
A ``score_mod`` that returns ``+inf`` makes the row's output nan in both; its lse is nan here,
``+inf`` in flex's eager forward.

A block mask of any ``(B, H)`` is taken, as flex takes it (it checks ``B`` only under K/V of
batch 1, above): of the call's batch and query heads, or of 1 (broadcast), as it is; made for
more rows or heads, at its first ones (the call's rows' own lists where they came from the
``mask_mod``); made for fewer, but more than one, as its ``mask_mod`` alone, every block
partial, as flex's eager forward reads any block mask (its compiled kernels read other rows'
lists there, the CPU's and CUDA's not the same ones; the CPU's crashes for more, dividing by
zero, and reads past the lists for a count that does not divide the call's).

Under ``torch.compile(fullgraph=True)``, ``torch.export`` and on ``meta`` tensors a call
with a ``score_mod`` works as :func:`qkv.attention`'s does (``qkv.score_mods`` says which
functions fail under export, and why). A ``block_mask``
does not trace: ``qkv.masks.FlexBlocks`` reads the block lists' values on the host to skip
blocks ("could not guard on data-dependent expression" under export and ``fullgraph=True``; a
plain ``torch.compile`` breaks the graph there); on ``meta`` tensors it works, and ``torch.jit.trace``
keeps its lists as constants. A ``mask_mod`` given as ``qkv.masks.from_mask_mod`` traces.
"""

from __future__ import annotations

import math
import typing
import weakref
from typing import Callable

import torch
from torch import Tensor

from .functional import attention
from .masks import documents, from_mask_mod
from .masks.programs import FlexBlocks

#: Stands in for flex's stub of a sliced block mask where a torch lacks it (made once: dynamo cannot trace ``object()``).
_NO_STUB = object()


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable | None = None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux=None,
):
    """``out (B, Hq, L, Ev)``; ``(out, lse)`` with ``return_lse``; ``(out, AuxOutput(lse=...))`` with ``return_aux``.

    Traceable by ``torch.compile(fullgraph=True)`` and ``torch.export`` with a ``score_mod``,
    not with a ``block_mask`` (the module docstring says why).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if isinstance(x, Tensor) and x.is_nested:  # before any shape is read: a nested tensor has none to give
            raise NotImplementedError(f"{name}: flex_attention takes no nested tensors; pass dense (B, H, length, size) ones")
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise FlexNotImplemented(f"{name}: expected a 4-d tensor (B, H, length, size), as flex_attention does, got {got}")
    hq, hkv = query.shape[1], key.shape[1]
    if value.shape[1] != hkv:  # flex's product of the weights and the value: a broadcast error
        raise FlexRuntimeError(f"value: expected {hkv} heads like key, got {value.shape[1]}")
    if not enable_gqa and hq != hkv:
        raise ValueError(
            f"key: expected query and key/value to have the same number of heads but got Hq={hq} and Hkv={hkv}; "
            "set enable_gqa=True for grouped-query attention"
        )
    _check_kernel_options(kernel_options)
    if return_aux is not None and not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
        raise TypeError(f"return_aux: expected an AuxRequest or None, got {type(return_aux).__name__}")
    if return_lse and return_aux is not None:
        raise ValueError("return_lse: give return_lse or return_aux=AuxRequest(lse=True), not both")
    want_lse = bool(return_lse) or bool(getattr(return_aux, "lse", False))
    if getattr(return_aux, "max_scores", False):  # flex on the CPU: NotImplementedError
        raise FlexNotImplemented("return_aux: max_scores are not supported (nor by flex_attention on the CPU); "
                                 "qkv computes the log-sum-exp (AuxRequest(lse=True))")  # fmt: skip
    if query.shape[0] != key.shape[0]:  # flex's rule: K/V batches differ only under a block mask of the query's
        bq, bkv = query.shape[0], key.shape[0]
        if block_mask is None:
            raise ValueError(
                "Expect query and key/value to have the same batch size, or non-none block_mask, but got "
                f"block_mask=None, Bq={bq}, and Bkv={bkv}."
            )
        if getattr(block_mask, "kv_num_blocks", None) is not None and block_mask.kv_num_blocks.shape[0] != bq:
            raise ValueError(
                "Expect query and key/value to have the same batch size, or block_mask and query to have the same "
                f"batch size, but got Bq={bq}, Bkv={bkv}, B_block_mask={block_mask.kv_num_blocks.shape[0]}."
            )
        if key.shape[0] != 1:
            raise FlexRuntimeError(f"key: Bq and Bkv must broadcast: expected batch {query.shape[0]} like query, or 1 "
                                   f"(shared), got {key.shape[0]}")  # fmt: skip
        key, value = key.expand(query.shape[0], *key.shape[1:]), value.expand(query.shape[0], *value.shape[1:])
    elif value.shape[0] == 1 != query.shape[0]:  # flex broadcasts a value of batch 1 under key's (its ``expand``)
        value = value.expand(query.shape[0], *value.shape[1:])
    answer_dtype = None  # the output's dtype where the call runs in another (autocast's answer is left as it is)
    if value.dtype != query.dtype:  # flex weighs the value in the query's dtype (``value.to(query.dtype)``)
        value = value.to(query.dtype)
    if key.dtype != query.dtype:
        # flex's scores are ``query.to(w) @ key.to(w)ᵀ`` in its working precision w (float64 for a float64 query, else
        # float32): a key wider than the query is not rounded to the query's dtype first. So the call runs in w, the
        # value as flex rounds it, and the output is given in the query's dtype (rounding the key to a bfloat16 query's
        # dtype moved the lse by 3e-3)
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        answer_dtype, query, key, value = query.dtype, query.to(work), key.to(work), value.to(work)
    mask = None
    if block_mask is not None:
        if not hasattr(block_mask, "kv_num_blocks") or not hasattr(block_mask, "mask_mod"):
            raise TypeError(f"block_mask: expected torch's BlockMask (create_block_mask), got {type(block_mask).__name__}")
        from torch.nn.attention import flex_attention as torch_flex

        # a sliced BlockMask (``bm[0]``) carries a stub for its mask_mod: flex refuses it before reading any
        # list, so here too, even where every listed block is full and the stub would never run
        if block_mask.mask_mod is getattr(torch_flex, "_sliced_mask_mod_error", _NO_STUB):
            raise RuntimeError("block_mask: cannot use mask_mod from a sliced BlockMask; set its mask_mod to the "
                               "original BlockMask's (bm[0].mask_mod = bm.mask_mod)")  # fmt: skip
        # flex's rule; a meta query (shape inference, qkv.explain) may take a block mask of any device
        if query.device != block_mask.kv_num_blocks.device and query.device.type != "meta":
            raise RuntimeError(f"block_mask: expected it on the query's device {query.device}, got it on "
                               f"{block_mask.kv_num_blocks.device}")  # fmt: skip
        batch, heads = (int(n) for n in query.shape[:2])  # (jit.trace reads a size as a 0-d tensor)
        large = getattr(torch_flex, "_LARGE_SPARSE_BLOCK_SIZE", None)
        if large is not None and tuple(block_mask.BLOCK_SIZE) == (large, large):
            # flex's "no-op" block mask (``_create_empty_block_mask``): one block of 2^30 on each side,
            # of any lengths (flex skips its length check), partial: the mask_mod decides every element
            noop = block_mask.mask_mod is torch_flex.noop_mask
            mask = None if noop else from_mask_mod(block_mask.mask_mod, batch, heads)
        else:
            block_mask = _with_batch_and_heads(block_mask)  # lists of (nq,) or (H, nq): as (1, 1, nq), (1, H, nq)
            mask = FlexBlocks(_fitted(block_mask, batch, heads), batch=batch, heads=heads)  # any (B, H), as flex takes
            groups = mask.diagonal_groups()
            if groups is not None:  # block-diagonal (packed documents): one ordinary call per group
                mask = documents(groups.to(query.device)) & mask
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else _scale(scale)
    result = attention(query, key, value, mask=mask, scale=scale, score_mod=score_mod, return_lse=want_lse)
    out, lse = result if want_lse else (result, None)
    out = _in_query_layout(out if answer_dtype is None else out.to(answer_dtype), query)
    if lse is not None and lse.numel() == 0:
        lse = None  # no query row (L, B or Hq of 0): flex answers None for an empty lse (its ``_finalize_outputs``)
    if not want_lse:
        return out if return_aux is None else (out, _aux(None))  # flex answers (out, AuxOutput()) to any AuxRequest
    if return_aux is not None:
        return out, _aux(lse)
    return out, lse


def _scale(scale: object) -> object:
    """``scale`` as flex reads it: a 0-d tensor that records no gradient is its number (flex's eager forward multiplies
    by it); anything else goes to :func:`qkv.attention`, which checks it."""
    if isinstance(scale, Tensor) and scale.dim() == 0 and not scale.requires_grad:
        return scale.item()
    return scale


class FlexRuntimeError(RuntimeError, ValueError):
    """What flex refuses as ``RuntimeError`` (K/V batches that do not broadcast to the query's, value heads other
    than key's, ``BACKEND`` with ``FORCE_USE_FLEX_ATTENTION``); a ``ValueError`` too, as qkv's argument errors are."""


class FlexNotImplemented(NotImplementedError, ValueError):
    """What flex refuses as ``NotImplementedError`` (a rank other than 4, ``max_scores`` on the CPU).

    A ``ValueError`` too: qkv's own shape and argument errors are, and code written for qkv
    catches those.
    """


def _in_query_layout(out: Tensor, query: Tensor) -> Tensor:
    """``out`` laid out in ``query``'s stride order, as flex lays out its output (``_permute_strides``).

    flex allocates ``out (B, Hq, L, Ev)`` with the query's fill order (dims sorted by stride,
    ties kept outer-first, as inductor's ``get_fill_order``), ``Ev`` moved innermost when it is
    not: a query made as ``(B, L, H, E).transpose(1, 2)`` answers an output whose
    ``transpose(1, 2)`` is contiguous, and model code ``view``s it so. For the usual contiguous
    query this is the identity (no copy).
    """
    strides = query.stride()
    order = sorted(range(4), key=lambda d: strides[d], reverse=True)  # outermost first; stable: ties outer-first
    if order[-1] != 3 and math.prod(out.shape[d] for d in order[order.index(3) + 1 :]) != 1:
        order.remove(3)  # flex's kernels need the unit stride on Ev (unless what follows it has size 1)
        order.append(3)
    if order == [0, 1, 2, 3]:
        return out.contiguous()  # qkv's engines answer contiguous: no copy
    inverse = [order.index(d) for d in range(4)]
    return out.permute(order).contiguous().permute(inverse)


def _with_batch_and_heads(block_mask):
    """``block_mask`` with lists of ``(B, H, nq)``: itself, or one made from it (kept, as :func:`_fitted`'s).

    ``BlockMask.from_kv_blocks`` takes lists of any leading dims, ``(nq,)`` and ``(nq, nk)`` at
    the least, and flex's eager forward takes them (it evaluates the ``mask_mod`` at every
    element). Fewer than two broadcast from the right, as tensors do: ``(nq,)`` is ``(1, 1, nq)``,
    ``(H, nq)`` is ``(1, H, nq)``. More than two have no ``(b, h)`` of a call to name: refused.
    """
    lead = block_mask.kv_num_blocks.dim() - 1
    if lead == 2:
        return block_mask
    if lead > 2:
        raise ValueError(f"block_mask: expected lists of (B, H, q blocks), got {tuple(block_mask.kv_num_blocks.shape)}")
    # views: in-place changes of the lists are seen
    return _kept(block_mask, "dims", lambda lists: tuple(None if x is None else x[(None,) * (2 - lead)] for x in lists))


#: flex's ``_Backend`` in torch 2.13, the values ``kernel_options["BACKEND"]`` may take (torch's own list where it has one).
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")


def _check_kernel_options(kernel_options) -> None:
    """Refuse the ``kernel_options`` flex refuses; qkv reads none of them (they tune flex's Triton kernels).

    flex reads them as ``dict(kernel_options)`` (a mapping or ``(name, value)`` pairs), refuses
    a ``BACKEND`` outside its ``_Backend``, ``BACKEND`` with the legacy
    ``FORCE_USE_FLEX_ATTENTION``, and the two options it sets itself, ``OUTPUT_LOGSUMEXP`` and
    ``OUTPUT_MAX`` (those follow ``return_lse`` / ``return_aux``).
    """
    if kernel_options is None:
        return
    try:
        options = dict(kernel_options)
    except (TypeError, ValueError) as e:
        raise TypeError(f"kernel_options: expected a dict or None, got {type(kernel_options).__name__} ({e})") from e
    if "BACKEND" in options:
        if options.get("FORCE_USE_FLEX_ATTENTION", False):
            raise FlexRuntimeError("kernel_options: BACKEND cannot be combined with the legacy FORCE_USE_FLEX_ATTENTION; "
                                   "drop FORCE_USE_FLEX_ATTENTION")  # fmt: skip
        from torch.nn.attention import flex_attention as torch_flex

        backends = typing.get_args(getattr(torch_flex, "_Backend", None)) or _BACKENDS
        if options["BACKEND"] not in backends:
            raise ValueError(f"kernel_options: BACKEND must be one of {backends}, got {options['BACKEND']!r}")
    for name in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if name in options:
            raise ValueError(f"kernel_options: {name} must not be given (return_lse / return_aux decide it)")


def _fitted(block_mask, batch: int, heads: int):
    """``block_mask`` for a call of ``batch`` rows and ``heads`` query heads: itself, or one made from it and kept.

    flex takes a block mask of any ``(B, H)`` (it checks ``B`` only where K/V's batch is not
    the query's); its eager forward evaluates the ``mask_mod`` at every element with each
    row's and head's own ``b`` and ``h`` and reads no list. qkv follows the lists, as flex's
    kernels do. A block mask of the call's counts, or of 1 (broadcast), is taken as it is.
    One made for more rows or heads is read at its first ones: the call's rows' own lists
    where they came from the ``mask_mod`` (flex's CUDA kernel reads the same; its CPU kernel
    divides by zero). One with fewer rows or heads, but more than one, has no lists for some
    of the call's: it is read as its ``mask_mod`` alone, every block partial, as the eager
    forward reads it (flex's kernels read other rows' lists there, CPU ``b // (Bq/B)``, CUDA
    ``b % B``). The one made is kept with ``block_mask`` while its lists and ``mask_mod`` are
    the same objects, so that a block mask reused by many calls (a model's layers) keeps
    what ``FlexBlocks`` evaluated for it.
    """
    B, H = block_mask.kv_num_blocks.shape[:2]
    fewer = 1 < B < batch or 1 < H < heads
    if not fewer and B <= batch and H <= heads:
        return block_mask
    if fewer:
        return _kept(block_mask, "mask_mod", lambda lists: _every_block_partial(block_mask))
    rows, cols = min(B, batch), min(H, heads)  # the first rows and heads (views: an in-place change is seen)
    return _kept(block_mask, (rows, cols), lambda lists: tuple(None if x is None else x[:rows, :cols] for x in lists))


def _every_block_partial(block_mask):
    """Lists of one ``(1, 1)`` row of every block of ``block_mask``'s lengths, partial: the ``mask_mod`` decides each element."""
    nq, nk = (-(-n // size) for n, size in zip(block_mask.seq_lengths, block_mask.BLOCK_SIZE))
    device = block_mask.kv_num_blocks.device
    counts = torch.full((1, 1, nq), nk, dtype=torch.int32, device=device)
    indices = torch.arange(nk, dtype=torch.int32, device=device).expand(1, 1, nq, nk).contiguous()
    return counts, indices, None, None


def _kept(block_mask, key, make_lists):
    """torch's ``BlockMask`` of ``make_lists(block_mask's four lists)``, with ``block_mask``'s ``mask_mod``, sizes
    and lengths; made once per ``key`` and kept with ``block_mask`` while its lists and ``mask_mod`` are the same
    objects (a block mask reused by a model's layers keeps what ``FlexBlocks`` evaluated for it)."""
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    sources = (block_mask.mask_mod, block_mask.BLOCK_SIZE, block_mask.seq_lengths, *lists)
    try:
        made = _FITTED.setdefault(block_mask, {})
    except TypeError:  # not weakly referable: made afresh at each call
        made = {}
    kept = made.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], sources)):
        return kept[1]
    from torch.nn.attention.flex_attention import BlockMask

    shaped = BlockMask.from_kv_blocks(*make_lists(lists), BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                      mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)  # fmt: skip
    made[key] = (sources, shaped)
    return shaped


#: Block masks made by :func:`_kept`, per block mask given: {key: (what it was made from, the one made)}.
_FITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _aux(lse: Tensor | None):
    """flex's ``AuxOutput(lse=...)`` (torch's own named tuple)."""
    from torch.nn.attention.flex_attention import AuxOutput

    return AuxOutput(lse=lse)
