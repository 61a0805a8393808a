"""flash-attn's decoding call: ``flash_attn_with_kvcache``, new keys written into the cache and attended in one call.

Shape legend: ``b`` batch, ``sq`` queries a sequence, ``sn`` new keys a sequence, ``h`` query
heads, ``g`` KV heads, ``d`` query/key size, ``e`` value size, ``S`` the cache's capacity a
sequence, ``P`` page size, ``r`` the rotated dims (``rotary_dim``).

Sequence ``n``'s keys are cache row ``cache_batch_idx[n]`` (default ``n``) of ``k_cache (B, S, g,
d)`` and ``v_cache (B, S, g, e)``, or, with ``block_table (b, m)``, the pages its row names in
pools ``(num_blocks, P, g, ·)`` (key ``c`` in page ``block_table[n, c // P]``, slot ``c % P``).
Its first ``cache_seqlens[n]`` keys are filled (all ``S``, or ``m · P``, without it). The call::

    positions  p = cache_seqlens[n] + t,  t < sn
    k_cache[n, p] = rotate(k[n, t], p),  v_cache[n, p] = v[n, t]           (in place, when k, v are given)
    q'[n, t] = rotate(q[n, t], cache_seqlens[n] + t)   if causal or window_size != (-1, -1)
               rotate(q[n, t], cache_seqlens[n])       otherwise (flash-attn's docstring)
    out[n] = attention(q'[n], keys cache_leftpad[n] .. cache_seqlens[n] + sn - 1)

with flash-attn's per-sequence semantics (``qkv.varlen_attention``): bottom-right ``causal`` and
``window_size``, ``softcap`` then ALiBi ``-slope · |r + sk - sq - c|``, a row that sees no key
gives 0. ``rotate`` is RoPE with the given tables, ``cos, sin (seqlen_ro, r/2)`` read at the
position: pairs ``(2i, 2i + 1)`` (``rotary_interleaved=True``) or ``(i, i + r/2)`` (GPT-NeoX's),
the dims past ``r`` unchanged, computed in float32 (float64 for float64) and rounded to the
input's dtype, as flash-attn's kernel does. Returns ``out (b, sq, h, e)`` and, with
``return_softmax_lse``, ``lse (b, h, sq)`` (float32, float64 for float64 inputs; -inf for a
row that sees no key, where flash-attn 2 writes +inf).

flash-attn's kernel reads a window side at least the key count (here: the cache's capacity)
as unbounded, and then the other side's unbounded one as the key count: with more queries
than keys the top rows then see keys (or none) the docstring's formula does not give them,
and a query is rotated at the cache's length. qkv keeps the docstring's formula and rule,
which flash-attn's tests check (their windows are below the key count).

As flash-attn's: forward only (computed without recording gradients: the output needs none);
``block_table`` takes no ``cache_batch_idx`` and no ``cache_leftpad``; rotary tables need new
keys; ``k`` needs ``v`` and ``cache_seqlens``. Where flash-attn reads or writes past what it was
given (new keys past the cache's capacity, a position past the rotary table, a page or cache row
out of range, a left padding past the cache's length) this raises, naming the argument. Wider
than flash-attn: float32 and float64, any head size, any page size (flash-attn: a multiple of
256), any even ``r`` (flash-attn: a multiple of 16), any integer dtype for the index tensors.
``num_splits`` is a GPU kernel's knob: checked, not used. When ``cache_batch_idx`` names a row
twice and new keys are given, the row keeps one of the writes, as flash-attn's (which one is not
promised).

Sequences run as flash-attn's varlen call: paged caches as ``varlen_attention(...,
block_table=...)``, which reads the pages where they lie (``qkv.varlen_paged``). A contiguous
cache whose capacity :data:`PAGE_KEYS` divides is read as pages too: views of its rows and a
page table made here, run by the same paged engine (a ``qkv.paged.PagedPlan``, kept for the
step's other layers), so that every sequence's keys are read where they lie, a kernel call a row with nothing to merge
(a step of 32 requests of 146 to 2047 keys in a cache of 2048, from cold caches on an AMD EPYC
Zen 5: 0.78x a Python loop of SDPA over the filled keys and 0.55x SDPA over the padded cache,
where one call a sequence through the varlen path took 1.5x the loop). Left padding,
or a window or bias the paged engine has no form for, runs one call a sequence over views of
its rows (``varlen.packed_spans``). Checked against the formula written per sequence in
float64 in the test suite.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from ..positional.rotary import rotate_pairs
from ..flash_args import as_int, flag, scalars, window
from ..varlen import _slopes, packed_spans, varlen_attention
from ..paged.plan import PagedPlan
from ..paged.recent import plan_keyed
from ..varlen_paged import in_place, page_counts, run_options


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """``out (b, sq, h, e)``, or ``(out, lse (b, h, sq))`` with ``return_softmax_lse``: see the module docstring."""
    b, sq, h, d = _shape4("q", q, "(batch, seqlen, heads, size)")
    paged = block_table is not None
    caches = _caches(q, k_cache, v_cache, paged)
    rows, capacity = _rows(b, k_cache, block_table, cache_batch_idx, cache_leftpad)
    new = _new_keys(b, k, v, caches)
    lens = _lengths(cache_seqlens, b, capacity, new)
    ends = [n + new for n in lens]
    if any(end > capacity for end in ends):
        raise ValueError(f"cache_seqlens: a sequence's {max(lens)} keys and {new} new ones do not fit the cache's "
                         f"{capacity} a sequence" + (" (block_table's pages)" if paged else ""))  # fmt: skip
    pads = _leftpad(cache_leftpad, lens)
    left, right = window(window_size, causal)
    causal = flag("causal", causal)
    _, _, softcap, softmax_scale, _ = scalars(False, False, softcap, softmax_scale, 0.0)
    rotary_interleaved, return_softmax_lse = (flag(name, x) for name, x in (
        ("rotary_interleaved", rotary_interleaved), ("return_softmax_lse", return_softmax_lse)))  # fmt: skip
    splits = as_int(num_splits)
    if splits is None or splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: the kernel's choice), got {num_splits!r}")
    # flash-attn's docstring: each query at its own position "if causal or local (i.e., window_size != (-1, -1))",
    # else every query at the cache's length
    per_row = left is not None or right is not None
    turns = _rotary(rotary_cos, rotary_sin, q, k, d)
    with torch.no_grad():
        if turns is not None:
            q = _rotated(q, turns, lens, sq if per_row else 1, rotary_interleaved)
        if k is not None:
            k = k if turns is None else _rotated(k, turns, lens, new, rotary_interleaved)
            _write(k_cache, v_cache, k, v, rows, block_table, lens)
        q_packed = q.reshape(b * sq, h, d)
        cu_q, cu_k = [n * sq for n in range(b + 1)], [0, *accumulate(ends)]
        _slopes(alibi_slopes, h, b, q.device)  # (checked here: the paged engine is handed them as they are)
        # a contiguous cache's rows read as pages by the paged engine where it has a form for the call
        pages = None
        if not paged and in_place(k_cache, v_cache, causal=causal, window=(left, right), alibi_slopes=alibi_slopes):
            pages = _as_pages(k_cache, v_cache, rows, pads, ends, sq)
        if paged:  # the caller's table: the varlen call checks it
            out, lse = varlen_attention(q_packed, k_cache, v_cache, torch.tensor(cu_q), torch.tensor(cu_k), None, None,
                                        0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        block_table=block_table, return_lse=True)  # fmt: skip
        elif pages is not None:  # a plan of the rows' pages, made here (or kept from the step's first layer)
            k_pages, v_pages, plan = pages
            out, lse = plan.run(q_packed, (k_pages, v_pages), **run_options(
                causal, (left, right), softcap, softmax_scale, None, alibi_slopes))  # fmt: skip
            lse = lse.transpose(0, 1)
        else:
            spans_q = [(n * sq, sq) for n in range(b)]
            spans_k = [(row * capacity + pad, end - pad) for row, pad, end in zip(rows, pads, ends)]
            out, lse = packed_spans(q_packed, k_cache.flatten(0, 1), v_cache.flatten(0, 1), spans_q, spans_k,
                                    window=(left, right), softcap=softcap, alibi_slopes=alibi_slopes,
                                    score_mod=None, sinks=None, scale=softmax_scale, dropout=0.0, generator=None,
                                    return_lse=True)  # fmt: skip
    out = out.reshape(b, sq, h, out.shape[-1])
    if not return_softmax_lse:
        return out
    return out, lse.reshape(h, b, sq).transpose(0, 1).contiguous()


#: Page sizes a contiguous cache's rows are read as, the first that divides its capacity: a page of 256 keys is one
#: item of the paged engine's decoding step (``qkv.paged.items``), and the fewest entries for its table.
PAGE_KEYS = (256, 16)


def _as_pages(k_cache: Tensor, v_cache: Tensor, rows: list[int], pads: list[int], ends: list[int], sq: int):
    """A contiguous cache ``(B, S, g, ·)`` as pools of pages ``(B·S/P, P, g, ·)`` (views) and the plan of a table that
    names each sequence's row (its first ``⌈end / P⌉`` pages, ``sq`` queries each), so that the paged engine reads
    every sequence's keys in one pass; None where the rows are not pages (left padding, a capacity no page size
    divides, rows that are not one block of memory).

    The plan is a function of the rows, their key counts and the geometry alone: it is kept under those host values
    (``qkv.paged.recent.plan_keyed``), so a model's layers, each with its own cache and the step's lengths, plan
    once a step (the table's tensors are neither built nor compared again)."""
    B, S = k_cache.shape[:2]
    P = next((p for p in PAGE_KEYS if S % p == 0), None)
    if P is None or any(pads) or not ends:
        return None
    try:
        pools = tuple(x.view(B * S // P, P, *x.shape[2:]) for x in (k_cache, v_cache))
    except RuntimeError:  # (strides that do not merge: the rows are read as views, one call a sequence)
        return None
    device = k_cache.device

    def make() -> PagedPlan:
        counts, kv_indptr, last = page_counts(ends, P)
        first = torch.tensor(rows, dtype=torch.long) * (S // P)  # each row's first page
        # entry t of row r's pages: first[r] + (t - kv_indptr[r])
        shift = torch.repeat_interleave(first - kv_indptr[:-1], torch.tensor(counts, dtype=torch.long))
        kv_indices = torch.arange(int(kv_indptr[-1])) + shift
        qo_indptr = torch.arange(len(ends) + 1) * sq
        return PagedPlan(qo_indptr, kv_indptr, kv_indices.to(device), last, num_pages=B * S // P, page_size=P,
                         device=device, total_q=len(ends) * sq)  # fmt: skip

    return (*pools, plan_keyed(("cache rows", B, S, P, sq, tuple(rows), tuple(ends), str(device)), make, device))


def _shape4(name: str, x: object, shape: str) -> tuple[int, int, int, int]:
    if not isinstance(x, Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected {shape}, got {got}")
    return tuple(x.shape)


def _caches(q: Tensor, k_cache: object, v_cache: object, paged: bool) -> tuple[int, int]:
    """Check the caches against ``q``: ``(g, e)``."""
    form = "(num_blocks, page_block_size, heads_k, size)" if paged else "(batch_cache, seqlen_cache, heads_k, size)"
    _shape4("k_cache", k_cache, form)
    _shape4("v_cache", v_cache, form)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"v_cache: expected {tuple(k_cache.shape[:3])} + (size,) like k_cache, got {tuple(v_cache.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q: expected a floating-point dtype, got {q.dtype}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype} (flash-attn: query and key must have the same "
                            f"dtype), got {x.dtype}")  # fmt: skip
        if x.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {x.device}")
    g, h = k_cache.shape[2], q.shape[2]
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache: expected q's size {q.shape[3]} in its last dim, got {tuple(k_cache.shape)}")
    if g == 0 or h % g:
        raise ValueError(f"k_cache: {g} key/value heads must divide q's {h}")
    return g, v_cache.shape[3]


def _ints(name: str, x: object, n: int) -> list[int]:
    """A 1-d integer tensor of ``n`` numbers, read on the host."""
    if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or (
            x.dtype == torch.bool):  # fmt: skip
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a 1-d integer tensor (batch,), got {got}")
    if x.numel() != n:
        raise ValueError(f"{name}: expected {n} numbers (one a sequence), got {x.numel()}")
    return x.tolist()


def _rows(b: int, k_cache: Tensor, block_table: object, cache_batch_idx: object, cache_leftpad: object):
    """``(rows, S)``: each sequence's cache row (None with pages) and the keys a sequence may hold."""
    if block_table is None:
        B, S = k_cache.shape[:2]
        rows = list(range(b)) if cache_batch_idx is None else _ints("cache_batch_idx", cache_batch_idx, b)
        if any(not 0 <= r < B for r in rows):
            what = "cache_batch_idx: rows" if cache_batch_idx is not None else "q: a batch of"
            raise ValueError(f"{what} {min(rows)} .. {max(rows)} of a cache of {B} rows (k_cache's first dim)")
        return rows, S
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not with block_table (flash-attn: paged KV cache does not support it)")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: not with block_table (flash-attn supports no paged KV cache with leftpad_k)")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.dtype.is_floating_point or (
            block_table.dtype == torch.bool):  # fmt: skip
        got = f"{tuple(block_table.shape)} {block_table.dtype}" if isinstance(block_table, Tensor) else type(block_table).__name__
        raise TypeError(f"block_table: expected an integer tensor (batch, max_num_blocks_per_seq), got {got}")
    if block_table.shape[0] != b:
        raise ValueError(f"block_table: expected a row per sequence ({b}), got {block_table.shape[0]}")
    return None, block_table.shape[1] * k_cache.shape[1]


def _new_keys(b: int, k: object, v: object, caches: tuple[int, int]) -> int:
    """Check ``k (b, sn, g, d)`` and ``v (b, sn, g, e)`` against the caches: ``sn`` (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and new values, or neither")
    if k is None:
        return 0
    g, e = caches
    for name, x, size in (("k", k, None), ("v", v, e)):
        shape = _shape4(name, x, "(batch, seqlen_new, heads_k, size)")
        if shape[0] != b or shape[2] != g or (size is not None and shape[3] != size) or shape[1] != k.shape[1]:
            raise ValueError(f"{name}: expected ({b}, seqlen_new, {g}, size) matching the caches and q, got {shape}")
    return k.shape[1]


def _lengths(cache_seqlens: object, b: int, capacity: int, new: int) -> list[int]:
    """Each sequence's filled keys before the call: ``cache_seqlens`` (an int or ``(b,)``), or the capacity."""
    if cache_seqlens is None:
        if new:
            raise ValueError("cache_seqlens: needed with new keys k, v (where in the cache they go)")
        return [capacity] * b
    if isinstance(cache_seqlens, Tensor):
        lens = _ints("cache_seqlens", cache_seqlens, b)
    else:
        one = as_int(cache_seqlens)
        if one is None:
            raise TypeError(f"cache_seqlens: expected an int or a (batch,) integer tensor, got {cache_seqlens!r}")
        lens = [one] * b
    if any(n < 0 for n in lens):
        raise ValueError(f"cache_seqlens: expected lengths >= 0, got {min(lens)}")
    return lens


def _leftpad(cache_leftpad: object, lens: list[int]) -> list[int]:
    """Each sequence's first key: ``cache_leftpad``, at most its cache's length (flash-attn's kernel, whose cache then
    starts after the new keys' first positions, writes only the new keys past the padding: refused here)."""
    if cache_leftpad is None:
        return [0] * len(lens)
    pads = _ints("cache_leftpad", cache_leftpad, len(lens))
    if any(not 0 <= p <= n for p, n in zip(pads, lens)):
        raise ValueError(f"cache_leftpad: expected 0 .. each sequence's cache_seqlens ({lens}), got {pads}")
    return pads


def _rotary(cos: object, sin: object, q: Tensor, k: object, d: int) -> tuple[Tensor, Tensor] | None:
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos, rotary_sin: give both tables, or neither")
    if k is None:
        raise ValueError("rotary_cos: needs new keys k, v (flash-attn rotates the keys it appends)")
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a float tensor (seqlen_ro, rotary_dim / 2), got {got}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_sin: expected rotary_cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(f"rotary_cos: rotary_dim = 2 · {cos.shape[1]} must lie in 1 .. q's size {d}")
    return cos.to(q.device), sin.to(q.device)


def _rotated(x: Tensor, table: tuple[Tensor, Tensor], lens: list[int], steps: int, interleaved: bool) -> Tensor:
    """``x (b, s, heads, d)`` rotated at positions ``lens[n] + min(t, steps - 1)``: each row its own, or all at ``lens``."""
    cos, sin = table
    b, s = x.shape[:2]
    pos = torch.tensor(lens, dtype=torch.long, device=x.device)[:, None] + torch.arange(s, device=x.device).clamp(
        max=max(steps - 1, 0))  # fmt: skip
    if s and int(pos.max()) >= cos.shape[0]:
        raise ValueError(f"rotary_cos: position {int(pos.max())} read, but the tables hold {cos.shape[0]} "
                         "(seqlen_ro: at least the cache's length with the new keys)")  # fmt: skip
    acc = torch.promote_types(x.dtype, torch.float32)
    turn_cos, turn_sin = (t[pos].to(acc)[:, :, None, :] for t in (cos, sin))  # (b, s, 1, r/2)
    return rotate_pairs(x.to(acc), turn_cos, turn_sin, interleaved=interleaved).to(x.dtype)


def _write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, rows: list[int] | None, block_table: Tensor | None,
           lens: list[int]) -> None:  # fmt: skip
    """The new keys and values into the caches, in place, at positions ``lens[n] + t``."""
    b, new = k.shape[:2]
    if new == 0:
        return
    pos = torch.tensor(lens, dtype=torch.long)[:, None] + torch.arange(new)  # (b, sn)
    if block_table is None and k_cache.is_contiguous() and v_cache.is_contiguous():
        # rows of one flat view, an index_copy_: 0.10 ms for a 32-request step against index_put_'s 0.15 (cold caches)
        at = (torch.tensor(rows, dtype=torch.long)[:, None] * k_cache.shape[1] + pos).flatten().to(k_cache.device)
        for cache, x in ((k_cache, k), (v_cache, v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, at, x.reshape(-1, *x.shape[2:]).to(cache.dtype))
        return
    if block_table is None:
        where = (torch.tensor(rows, dtype=torch.long)[:, None].expand(b, new), pos)
    else:
        P = k_cache.shape[1]
        pages = block_table.to(device="cpu", dtype=torch.long).gather(1, pos // P)
        if int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]:
            raise ValueError(f"block_table: page ids must lie in 0 .. {k_cache.shape[0] - 1} (k_cache's num_blocks), "
                             f"got {int(pages.min())} .. {int(pages.max())}")  # fmt: skip
        where = (pages, pos % P)
    where = tuple(w.to(k_cache.device) for w in where)
    k_cache.index_put_(where, k.to(k_cache.dtype))
    v_cache.index_put_(where, v.to(v_cache.dtype))
