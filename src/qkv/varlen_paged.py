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
``(k, v)``: pages are read where they lie. ``causal`` (or a window whose right side is 0)
with ``window_size = (left, ·)`` is its ``window_left``; softcap and ALiBi ``(h,)`` its own
(the cap first, then ``-slope · (r + sk - sq - c)``, which is flash-attn's ``-slope · |·|``
on the keys a causal query sees). What flash-attn computes and the paged engine has no form
for (:func:`in_place` is False) -- a window reaching right of the query, ALiBi where keys
after the query are seen (flash-attn's ``|·|``), per-sequence slopes ``(b, h)``, ``e != d`` --
runs on the packed path over the keys gathered out of their pages (:func:`gather_pages`,
one copy of the ``Σ sk`` keys the table names), with the same results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import PagedPlan
from .paged.recent import plan_keyed


def plan_of(k: Tensor, v: Tensor, block_table: object, cu_q: list[int], cu_k: list[int]) -> PagedPlan:
    """Check the pools ``(num_blocks, P, g, ·)`` and ``block_table (b, n)`` (a row a sequence, wide enough, ids in
    range) and plan the call's table, FlashInfer's form of it (``qkv.paged.PagedPlan``).

    A model's layers run one step's table each: the plan is kept under the offsets, the pools'
    geometry and the table's entries (``qkv.paged.recent.plan_keyed``, compared element by
    element), so a step reads and checks its table once (0.18 ms of a 32-request step's 2.6 ms
    when read at every layer, on an AMD EPYC Zen 5 between kernel calls).
    """
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: with block_table, expected pages (num_blocks, page_block_size, kv_heads, size), "
                             f"got {got}")  # fmt: skip
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"v: with block_table, expected pages {tuple(k.shape[:3])} + (size,) like k, got {tuple(v.shape)}")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.dtype.is_floating_point or (
            block_table.dtype == torch.bool):  # fmt: skip
        got = tuple(block_table.shape) if isinstance(block_table, Tensor) else type(block_table).__name__
        raise TypeError(f"block_table: expected an integer tensor (b, max_num_blocks_per_seq), got {got}")
    if block_table.shape[0] != len(cu_k) - 1:
        raise ValueError(f"block_table: expected a row per sequence ({len(cu_k) - 1}), got {block_table.shape[0]}")
    num_pages, P = k.shape[:2]

    def make() -> PagedPlan:
        lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
        counts, kv_indptr, last = page_counts(lengths, P)
        if max(counts, default=0) > block_table.shape[1]:
            raise ValueError(f"block_table: {block_table.shape[1]} blocks a row, but a sequence of {max(lengths)} keys "
                             f"needs {max(counts)} pages of {P}")  # fmt: skip
        named = _named_pages(block_table, counts)
        low, high = (int(x) for x in torch.aminmax(named)) if named.numel() else (0, -1)  # (one read of both)
        if named.numel() and not 0 <= low <= high < num_pages:  # (a gather would be an IndexError)
            raise ValueError(f"block_table: page ids must lie in 0 .. {num_pages - 1} (k's num_blocks), got "
                             f"{low} .. {high}")  # fmt: skip
        return PagedPlan(torch.tensor(cu_q), kv_indptr, named.to(k.device), last, num_pages=num_pages, page_size=P,
                         device=k.device, total_q=cu_q[-1])  # fmt: skip

    return plan_keyed(("block table", tuple(cu_q), tuple(cu_k), num_pages, P), make, k.device, values=block_table)


def in_place(k: Tensor, v: Tensor, *, causal: bool, window: tuple[int | None, int | None],
             alibi_slopes: Tensor | None) -> bool:  # fmt: skip
    """Whether the paged engine has a form for the call: keys stop at the query or run to the sequence's end,
    ALiBi ``(h,)`` only where they stop at the query, ``e == d``. (More queries than keys it takes as flash-attn
    does: under ``causal`` the queries before the first key see none.)"""
    to_query = causal or window[1] == 0  # (a window whose right side is 0 is causal)
    fits = to_query or window[1] is None
    fits = fits and (alibi_slopes is None or (to_query and alibi_slopes.dim() == 1))
    return fits and k.shape[-1] == v.shape[-1]


def gather_pages(pool: Tensor, block_table: Tensor, cu_k: list[int]) -> Tensor:
    """``pool (num_blocks, P, g, ·)`` -> packed ``(Σ sk, g, ·)``: sequence ``s``'s key ``c`` from page
    ``block_table[s, c // P]``, slot ``c % P``, in sequence order (what ``cu_seqlens_k`` indexes)."""
    lengths = torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])], dtype=torch.long)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (Σ sk,)
    position = torch.arange(len(sequence)) - torch.tensor(cu_k[:-1], dtype=torch.long)[sequence]
    P = pool.shape[1]
    pages = block_table.to(dtype=torch.long)[sequence, position // P].to(pool.device)
    return pool[pages, (position % P).to(pool.device)]


def paged_varlen(q: Tensor, k: Tensor, v: Tensor, plan: PagedPlan, *, causal: bool,
                 window: tuple[int | None, int | None], softcap: float, scale: float | None,
                 alibi_slopes: Tensor | None, sinks: Tensor | None, want_lse: bool = True) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(out (t, h, e), lse (h, t))``: sequence ``s``'s queries ``q[cu_q[s] : cu_q[s + 1]]`` over its pages, read in place.

    Runs the plan :func:`plan_of` made, for a call :func:`in_place` accepted. Without ``want_lse`` the ``lse`` is None.
    """
    options = {**run_options(causal, window, softcap, scale, sinks, alibi_slopes), "return_lse": want_lse}
    answer = plan.run(q, (k, v), **options)
    return (answer[0], answer[1].transpose(0, 1)) if want_lse else (answer, None)


def page_counts(lengths: list[int], P: int) -> tuple[list[int], Tensor, Tensor]:
    """Sequences of ``lengths`` keys in pages of ``P``: each one's page count, and FlashInfer's ``kv_indptr (b + 1,)``
    and ``kv_last_page_len (b,)`` (1 for a sequence of no key, whose table names no page)."""
    counts = [-(-n // P) for n in lengths]
    kv_indptr = torch.tensor([0, *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)
    last = torch.tensor([n - (c - 1) * P if c else 1 for n, c in zip(lengths, counts)], dtype=torch.long)  # (b = 0: long)
    return counts, kv_indptr, last


def run_options(causal: bool, window: tuple[int | None, int | None], softcap: float, scale: float | None,
                sinks: Tensor | None, alibi_slopes: Tensor | None) -> dict:  # fmt: skip
    """flash-attn's options as ``qkv.paged_attention``'s (and ``PagedPlan.run``'s) keywords, with the ``lse``: a
    window whose right side is 0 is causal, its left side ``window_left`` (None: -1, unbounded)."""
    return dict(causal=causal or window[1] == 0, window_left=-1 if window[0] is None else window[0],
                logits_soft_cap=softcap, sm_scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True)


def _named_pages(block_table: Tensor, counts: list[int]) -> Tensor:
    """The page ids the sequences use, end to end: ``block_table[s, :counts[s]]`` for each ``s`` (long)."""
    width = max(counts, default=0)
    if not width:
        return torch.zeros(0, dtype=torch.long, device=block_table.device)
    # one masked read of the table's used columns, row after row (a slice a sequence cost ~4 µs each)
    used = torch.arange(width, device=block_table.device)[None, :] < torch.tensor(counts, device=block_table.device)[:, None]
    return block_table[:, :width].to(dtype=torch.long)[used]
