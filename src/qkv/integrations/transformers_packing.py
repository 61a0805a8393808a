"""Packed batches in transformers, as qkv's lazy document masks: no ``(T, T)`` mask, one call per document.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length, ``T`` packed tokens.

transformers says that a batch row holds several sequences end to end in three ways
(``DataCollatorWithFlattening``, TRL's ``padding_free``):

* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (and ``max_length_q`` / ``max_length_k``): the
  sequences' offsets in the flattened tokens, flash-attn's ``cu_seqlens`` (the collator's
  ``return_flash_attn_kwargs=True``); the maximum lengths only size flash's grid;
* ``seq_idx``: a sequence index per token ``(b, T)``;
* packed ``position_ids`` of one row, read as transformers' ``flash_attention_2`` reads them
  (``prepare_fa_kwargs_from_position_ids``): a sequence starts at each token holding the
  row's smallest position, the first token included; positions that only jump (``0, 1, 2,
  10, 11``) are one sequence. Where transformers' ``sdpa`` and ``eager`` see packing (no
  cache and no ``attention_mask``: a training forward) the mask function they compose
  already holds their sequences (a position that does not follow its predecessor starts
  one, ``find_packed_sequence_indices``), and that mask is kept; with a cache (an eval
  forward's default) or an all-ones ``attention_mask`` they read restarting positions as one
  sequence, where qkv, like ``flash_attention_2``, reads documents.

:func:`documents_for` turns whichever the layer was given into ``qkv.masks.documents``,
combined with the layer's own mask by the integration, so the ``segments`` backend runs
each sequence as its own call. :func:`packed_parts` reads the mask function transformers
composes for position-id packing (its causal or sliding pattern on per-sequence
positions, and'ed with the sequence ids), so that mask, too, is built lazily.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from .._trace import concrete
from ..masks import And, Documents, Mask
from .transformers_closures import closure


def documents_for(query: Tensor, key: Tensor, kwargs: dict, mask: Mask | None = None) -> Documents | None:
    """The documents of a packed layer call, from its keywords; None when it is not packed.

    ``mask`` is the layer's own mask: where it pads some keys (a padded batch, whose
    ``generate`` gives the padding one repeated position id), ``position_ids`` say nothing of
    packing, as in transformers, which looks for packed positions only without a padding mask;
    nor do they in a batch of several rows (``flash_attention_2``'s rule, see the module).
    """
    b, i, j = query.shape[0], query.shape[-2], key.shape[-2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        return Documents(_ids("cu_seq_lens_q", cu_q, b, i), _ids("cu_seq_lens_k", cu_k, b, j))
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        if not isinstance(seq_idx, Tensor) or seq_idx.shape[-1] != i or i != j:
            got = tuple(seq_idx.shape) if isinstance(seq_idx, Tensor) else type(seq_idx).__name__
            raise ValueError(f"seq_idx: expected a sequence index per token (b, {i}) of a self-attention layer, got {got}")
        return Documents(seq_idx.expand(b, -1))
    positions = kwargs.get("position_ids")
    if not (isinstance(positions, Tensor) and positions.dim() == 2 and positions.shape[-1] == i == j and i > 1):
        return None
    docs = _packed_positions(positions, b)  # read once per forward; the padding is asked only when they restart
    if docs is None or mask is None or mask.hidden_keys(i, j) is None:  # no padding: restarting positions are packing
        return docs
    return None


#: The last position_ids read, as ``(weak reference, version, b, documents or None)``: every layer
#: of a forward gets the same tensor, and reading it (a difference and a read on the host)
#: cost each layer more than its attention call at prefill lengths.
_last_positions: tuple | None = None


def _packed_positions(positions: Tensor, b: int) -> Documents | None:
    """The documents that restarting ``positions (b or 1, T)`` mark; None when they run on by one."""
    global _last_positions
    if not concrete(positions):  # traced: no host state kept
        return _restarts(positions, b)
    last = _last_positions
    # a live weak reference to this very tensor, unchanged since (its version counts in-place writes)
    if last is not None and last[0]() is positions and last[1] == positions._version and last[2] == b:
        return last[3]
    docs = _restarts(positions, b)
    try:
        _last_positions = (weakref.ref(positions), positions._version, b, docs)
    except (TypeError, RuntimeError):  # a tensor subclass or a traced value without weak references or versions
        _last_positions = None
    return docs


def _restarts(positions: Tensor, b: int) -> Documents | None:
    """The sequences of one row's positions: one starts at each token holding the row's smallest position (the first
    must); None when only the first does, or for a batch of several rows."""
    if b != 1 or positions.shape[0] != 1:
        return None
    starts = positions == positions.min()
    if not bool(starts[0, 0]) or not bool(starts[0, 1:].any()):
        return None
    return Documents(starts.cumsum(-1) - 1)


def _ids(name: str, cu: object, b: int, n: int) -> Tensor:
    """Sequence ids ``(b, n)`` from offsets over the ``b·n`` flattened tokens."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point:
        got = tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__
        raise ValueError(f"{name}: expected 1-d integer offsets (sequences + 1,), got {got}")
    counts = torch.diff(cu.long())
    if int(cu[0]) != 0 or bool((counts < 0).any()) or int(cu[-1]) != b * n:
        raise ValueError(f"{name}: expected offsets from 0, non-decreasing, ending at the {b * n} packed tokens, got {cu.tolist()}")
    return torch.repeat_interleave(torch.arange(len(counts), device=cu.device), counts.to(cu.device)).reshape(b, n)


def packed_parts(mask_function: Callable) -> tuple[Callable, Tensor] | None:
    """``(base, ids)`` of transformers' mask for position-id packing, ``and_masks(remap(base, positions), packed(ids))``.

    Within a sequence the positions run on by one, so ``base`` on them is ``base`` on the
    tokens' own indices: the mask is ``documents(ids) & base``.
    """
    parts = closure(mask_function, "and_masks.<locals>.and_mask").get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remapped, packed = parts
    base = closure(remapped, "remap_positions_for_packed_sequence.<locals>.inner_mask").get("mask_function")
    ids = closure(packed, "packed_sequence_mask_function.<locals>.inner_mask").get("packed_sequence_mask")
    if base is None or not isinstance(ids, Tensor):
        return None
    return base, ids


def with_documents(mask: Mask | None, docs: Documents | None) -> Mask | None:
    """``mask & docs``; the mask as it is when it already holds documents."""
    if docs is None:
        return mask
    if mask is None:
        return docs
    if has_documents(mask):
        return mask
    return And(docs, mask)


def has_documents(mask: Mask) -> bool:
    """True when ``mask`` is, or and's in, a ``qkv.masks.documents`` mask (a packed batch)."""
    if isinstance(mask, Documents):
        return True
    return isinstance(mask, And) and (has_documents(mask.a) or has_documents(mask.b))
