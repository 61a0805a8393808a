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
evaluated as flex evaluates it (0-d indices; ``qkv._mods``). ``return_lse`` /
``return_aux=AuxRequest(lse=True)`` give the natural-log log-sum-exp ``(B, Hq, L)``,
differentiable. ``kernel_options`` tune flex's Triton kernels and are accepted and
ignored. Key and value may have batch 1 under a larger query batch only with a block mask
of the query's batch, as in flex (its messages otherwise). Checked against flex's own CPU
forward in ``tests/test_flex.py``, random calls included.

A block mask made with ``B=None`` or ``H=None`` serves every batch row and head: inside its
partial blocks the ``mask_mod`` sees each row's and query head's own ``b`` and ``h``, as in
flex. One difference from flex's *eager* forward, which evaluates the ``mask_mod`` at every
element: a block the block mask leaves out is never computed, as in flex's compiled kernel.
They differ only for a block mask whose lists are wrong for some heads or batch rows (made
with ``B=None`` or ``H=None`` for a ``mask_mod`` that hides whole blocks from ``b = 0`` or
``h = 0`` only), or lists written by hand (``BlockMask.from_kv_blocks``), which qkv follows.
Key and value in another dtype than the query's are computed in the query's, as flex does;
any ``AuxRequest`` is answered with ``(out, AuxOutput(...))``. A key or value every query is
masked from never reaches the output (a nan or inf there is not read, where flex gives nan),
and a block mask made for more batch rows or heads than the call is refused, where flex reads
its first ones.

Under ``torch.compile(fullgraph=True)``, ``torch.export`` and on ``meta`` tensors a call
with a ``score_mod`` works as :func:`qkv.attention`'s does (``qkv.score_mods`` says which
functions fail under export, and why; ``tests/test_score_mods_trace.py``). A ``block_mask``
does not trace: ``qkv.masks.FlexBlocks`` reads the block lists' values on the host to skip
blocks ("could not guard on data-dependent expression" under export); on ``meta`` tensors it
works. A ``mask_mod`` given as ``qkv.masks.from_mask_mod`` traces.
"""

from __future__ import annotations

import math
from typing import Callable

from torch import Tensor

from .functional import attention
from .masks import documents
from .masks.programs import FlexBlocks


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
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a 4-d tensor (B, H, length, size), as flex_attention does, got {got}")
    hq, hkv = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hkv:
        raise ValueError(
            f"key: expected query and key/value to have the same number of heads but got Hq={hq} and Hkv={hkv}; "
            "set enable_gqa=True for grouped-query attention"
        )
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options: expected a dict or None, got {type(kernel_options).__name__}")
    if return_lse and return_aux is not None:
        raise ValueError("return_lse: give return_lse or return_aux=AuxRequest(lse=True), not both")
    want_lse = bool(return_lse) or bool(getattr(return_aux, "lse", False))
    if getattr(return_aux, "max_scores", False):
        raise ValueError("return_aux: qkv computes the log-sum-exp (AuxRequest(lse=True)), not max_scores")
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
            raise ValueError(f"key: expected batch {query.shape[0]} like query, or 1 (shared), got {key.shape[0]}")
        key, value = key.expand(query.shape[0], *key.shape[1:]), value.expand(query.shape[0], *value.shape[1:])
    if key.dtype != query.dtype or value.dtype != query.dtype:  # flex computes in the query's dtype and answers in it
        key, value = key.to(query.dtype), value.to(query.dtype)
    mask = None
    if block_mask is not None:
        if not hasattr(block_mask, "kv_num_blocks") or not hasattr(block_mask, "mask_mod"):
            raise TypeError(f"block_mask: expected torch's BlockMask (create_block_mask), got {type(block_mask).__name__}")
        mask = FlexBlocks(block_mask, batch=query.shape[0], heads=query.shape[1])
        groups = mask.diagonal_groups()
        if groups is not None:  # block-diagonal (packed documents): one ordinary call per group
            mask = documents(groups.to(query.device)) & mask
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    result = attention(query, key, value, mask=mask, scale=scale, score_mod=score_mod, return_lse=want_lse)
    if not want_lse:
        return result if return_aux is None else (result, _aux(None))  # flex answers (out, AuxOutput()) to any AuxRequest
    out, lse = result
    if return_aux is not None:
        return out, _aux(lse)
    return out, lse


def _aux(lse: Tensor | None):
    """flex's ``AuxOutput(lse=...)`` (torch's own named tuple)."""
    from torch.nn.attention.flex_attention import AuxOutput

    return AuxOutput(lse=lse)
