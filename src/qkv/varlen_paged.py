"""flash-attn's varlen call over a paged KV cache (``block_table``), run as ``qkv.paged_attention``.

Shape legend: ``t`` packed query tokens (``total_q``), ``h`` query heads, ``g`` KV heads,
``d`` query/key size, ``e`` value size, ``b`` sequences, ``P`` page size (flash-attn's
``page_block_size``), ``n`` blocks a sequence may name.

``flash_attn_varlen_func(..., block_table=...)``: ``k (num_blocks, P, g, d)`` and ``v
(num_blocks, P, g, e)`` are pools of pages, sequence ``s``'s key ``c`` lies in page
``block_table[s, c // P]`` at slot ``c % P``, and ``cu_seqlens_k`` still counts each
sequence's keys (its pages are the first ``⌈sk / P⌉`` entries of its row). That is
FlashInfer's page table with other names (``qkv.paged.table``)::

    qo_indptr = cu_seqlens_q,   kv_indices = block_table[s, :⌈sk / P⌉] end to end,
    kv_indptr = their offsets,  kv_last_page_len = sk - (⌈sk / P⌉ - 1) · P

and the same bottom-right alignment, so the call is ``qkv.paged_attention`` over the tuple
``(k, v)``: pages are read where they lie. ``causal`` with ``window_size = (left, ·)`` is
its ``window_left``; softcap and ALiBi ``(h,)`` its own (the cap first, then
``-slope · (r + sk - sq - c)``, which is flash-attn's ``-slope · |·|`` on the keys a causal
query sees). What the paged engine has no form for is refused with its reason: a window
to the right without ``causal``, ALiBi without ``causal`` (flash-attn's ``|·|`` reaches keys
after the query), per-sequence slopes ``(b, h)``, dropout, a ``score_mod``, and more queries
than keys in a sequence (a query is one of its sequence's cached positions).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import paged_attention


def paged_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], block_table: Tensor, *,
                 causal: bool, window: tuple[int | None, int | None], softcap: float, scale: float | None,
                 alibi_slopes: Tensor | None, sinks: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (t, h, e), lse (h, t))``: sequence ``s``'s queries ``q[cu_q[s] : cu_q[s + 1]]`` over its pages."""
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: with block_table, expected pages (num_blocks, page_block_size, kv_heads, size), "
                             f"got {tuple(x.shape)}")  # fmt: skip
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.dtype.is_floating_point or (
            block_table.dtype == torch.bool):  # fmt: skip
        got = tuple(block_table.shape) if isinstance(block_table, Tensor) else type(block_table).__name__
        raise TypeError(f"block_table: expected an integer tensor (b, max_num_blocks_per_seq), got {got}")
    sequences, P = len(cu_q) - 1, k.shape[1]
    if block_table.shape[0] != sequences:
        raise ValueError(f"block_table: expected a row per sequence ({sequences}), got {block_table.shape[0]}")
    left, right = window
    if right is not None and not causal:
        raise ValueError("window_size: a window to the right of the query with block_table is not supported here "
                         "(the paged engine keeps keys up to the query); use causal=True or (left, -1)")  # fmt: skip
    if alibi_slopes is not None and (not causal or alibi_slopes.dim() != 1):
        raise ValueError("alibi_slopes: with block_table, one slope per head (h,) and causal=True (flash-attn's "
                         "|distance| reaches keys after the query, which the paged engine's slope · (kv - q) does not)")  # fmt: skip
    lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
    for s, (sq, sk) in enumerate(zip((b - a for a, b in zip(cu_q, cu_q[1:])), lengths)):
        if sq > sk:  # (FlashInfer's table: a request's queries are the last of its keys' positions)
            raise ValueError(f"cu_seqlens_q: sequence {s} has {sq} queries but {sk} keys; with block_table, each "
                             "sequence's queries are the last of its keys' positions (append them to the pages first)")  # fmt: skip
    counts = [-(-n // P) for n in lengths]
    if max(counts, default=0) > block_table.shape[1]:
        raise ValueError(f"block_table: {block_table.shape[1]} blocks a row, but a sequence of {max(lengths)} keys needs "
                         f"{max(counts)} pages of {P}")  # fmt: skip
    rows = block_table.to(device=k.device, dtype=torch.long)
    indices = torch.cat([rows[s, :c] for s, c in enumerate(counts)]) if sequences else rows.new_zeros(0)
    kv_indptr = torch.tensor([0, *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()])
    last = torch.tensor([n - (c - 1) * P if c else 1 for n, c in zip(lengths, counts)])
    out, lse = paged_attention(
        q, (k, v), torch.tensor(cu_q), kv_indptr, indices, last, causal=causal,
        window_left=-1 if left is None else left, logits_soft_cap=softcap, sm_scale=scale,
        sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True,
    )  # fmt: skip
    return out, lse.transpose(0, 1)
