"""Packed sequences in flash-attn's dialect: ``varlen_attention``, ``unpad_input`` and ``pad_input``.

Shape legend: ``t`` packed tokens (``total_q`` / ``total_k``), ``h`` query heads, ``g`` KV
heads, ``d`` query/key size, ``e`` value size, ``b`` sequences; ``sq``/``sk`` one
sequence's query and key lengths.

``varlen_attention`` has ``flash_attn.flash_attn_varlen_func``'s signature and semantics, so
code that imports one can import the other, and it runs forward and backward on a CPU:
``q (total_q, h, d)``, ``k (total_k, g, d)``, ``v (total_k, g, e)`` hold the sequences end to
end, sequence ``s`` in rows ``cu_seqlens[s] : cu_seqlens[s + 1]``. Per sequence, queries are
the last ``sq`` of ``sk`` positions (bottom-right), so with ``causal`` query ``r`` sees keys
``c <= r + sk - sq``; ``window_size = (left, right)`` keeps keys in ``[r + sk - sq - left,
r + sk - sq + right]`` (-1: unbounded; ``causal`` sets ``right = 0``); ``alibi_slopes``
``(h,)`` or ``(b, h)`` add ``-slope · |r + sk - sq - c|``; ``softcap`` caps the scaled
logits (``c · tanh(s / c)``, before ALiBi, as flash-attn does). A query that sees no key
gets zeros and, with ``return_lse``, ``lse = -inf`` (flash-attn 2's kernel writes +inf there,
flash-attn 3's -inf; and under causal ALiBi its kernel adds ``+slope · c``, so its lse exceeds
the documented bias's by ``slope · (r + sk - sq)``: qkv keeps the docstring's). qkv adds
``score_mod`` (its ``b`` the sequence's index, positions inside the sequence), ``sinks`` and
``generator``; it takes more than flash-attn refuses (float32/64, ``e != d``, any head size,
softcap with dropout, int64 offsets) and refuses what flash-attn would read wrongly (a
``max_seqlen`` below the longest sequence, offsets that do not end at the token count) or
reads as "none" (a negative ``softcap``, a window side below -1). Where a window side is at
least the key count and queries outnumber keys, flash-attn 2's kernel reads that side as
unbounded (and an unbounded side next to a bounded one as the key count), which moves the
top rows' keys away from its docstring's formula; qkv keeps the formula, which flash-attn's
tests check (their windows are below the key count). Flags and numbers are read as
flash-attn's bindings read them (``qkv.flash_args``: numpy scalars and 0-d tensors too).

Each sequence runs as an ordinary call of its own (``backends.segments``): the work is
``Σ sq·sk``, a sequence's result does not depend on its neighbours, and every mechanism of
``qkv.attention`` applies to it. Checked against a per-sequence loop of the formula
(``tests/test_varlen.py``) and flash-attn's ``attention_ref`` (``tests/test_varlen_dialect_audit.py``).

The offsets are read on the host, where the calls are sized: ``torch.compile`` breaks the graph
there (``fullgraph=True`` and ``torch.export`` refuse: "could not guard on data-dependent
expression"), and ``torch.jit.trace`` keeps them as constants. A traced packed batch is
``qkv.attention`` with ``mask=qkv.masks.documents(ids) & qkv.masks.causal()``, ``ids`` an input.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import checks
from ._trace import concrete
from .flash_args import as_int, flag, scalars, window
from .backends.segments import Segment, run_segments
from .backends.tiling.framing import Block, frame_score_mod
from .functional import autocast_inputs
from .masks.positions import window_mask
from .positional import ALiBi
from .score_mods import SoftCap
from .varlen_paged import gather_pages, in_place, paged_varlen, plan_of


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
    *,
    score_mod: Callable | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed sequences: ``out (total_q, h, e)``, and ``lse (h, total_q)`` with ``return_lse``.

    Args are ``flash_attn_varlen_func``'s (see the module docstring); ``max_seqlen_q/k``,
    when given, must be at least the longest sequence (flash-attn sizes its grid with
    them): ints, numpy ints or 0-d integer tensors, as flash-attn's C++ int takes them.
    ``window_size`` is any pair of such integers (flash-attn's tests pass a tensor of two).
    ``cu_seqlens_*`` may be any integer dtype (flash-attn requires int32). ``deterministic``
    is always honoured here: a CPU run with a fixed thread count gives the same bits every
    time. ``dropout_p`` drops weights (draw with ``generator`` for reproducible runs); the
    lse is dropout's input's. ``return_attn_probs=True`` returns flash-attn's triple
    ``(out, softmax_lse (h, total_q), S_dmask)``; flash-attn fills ``S_dmask`` only for
    testing with dropout, and qkv never builds it: it is None. Unlike flash-attn's, the
    returned lse carries a gradient (flash-attn's backward drops it). ``block_table (b, n)``:
    ``k`` and ``v`` are pools of pages ``(num_blocks, page_block_size, g, ·)`` and sequence
    ``s``'s keys lie in the pages its row names, read where they lie, or gathered where the
    paged engine has no form for the call (``qkv.varlen_paged``); forward only, no dropout.
    """
    paged = block_table is not None
    cu_q = read_offsets("cu_seqlens_q", cu_seqlens_q, q, "q")
    cu_k = read_offsets("cu_seqlens_k", cu_seqlens_k, None if paged else k, "k")  # (pages: the table says where keys lie)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_k: expected {len(cu_q)} offsets like cu_seqlens_q (b + 1), got {len(cu_k)}")
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        check_max_seqlen(name, given, cu)
    for name, x in (("q", q),) if paged else (("q", q), ("k", k), ("v", v)):  # (pages: plan_of)
        if not isinstance(x, Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected packed tokens (total, heads, size), got {got}")
    left, right = window(window_size, causal)
    causal = flag("causal", causal)
    deterministic, return_attn_probs, softcap, softmax_scale, dropout_p = scalars(
        deterministic, return_attn_probs, softcap, softmax_scale, dropout_p)  # fmt: skip
    if paged:
        _check_paged_call(q, k, v, sinks, dropout_p, score_mod, alibi_slopes)
        out, lse = run_paged(q, k, v, cu_q, cu_k, block_table, causal=causal, window=(left, right),
                             softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, scale=softmax_scale,
                             want_lse=return_lse or return_attn_probs)  # fmt: skip
        return _answer(out, lse, return_lse, return_attn_probs)
    out, lse = packed_spans(q, k, v, spans(cu_q), spans(cu_k), window=(left, right), softcap=float(softcap),
                            alibi_slopes=alibi_slopes, score_mod=score_mod, sinks=sinks, scale=softmax_scale,
                            dropout=dropout_p, generator=generator, return_lse=return_lse or return_attn_probs)  # fmt: skip
    return _answer(out, lse, return_lse, return_attn_probs)


def run_paged(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], block_table: Tensor, *, causal: bool,
              window: tuple[int | None, int | None], softcap: float, alibi_slopes: Tensor | None, sinks: Tensor | None,
              scale: float | None, want_lse: bool = True) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(out (total_q, h, e), lse (h, total_q))`` of packed queries over pools of pages ``k``, ``v`` ``(num_blocks, P,
    g, ·)``: sequence ``s``'s keys are the first ``cu_k[s + 1] - cu_k[s]`` of the pages its ``block_table`` row names.

    The pages are read where they lie where the paged engine has a form for the call
    (``qkv.varlen_paged``), else the keys the table names are gathered and run as packed
    sequences. Without ``want_lse`` the ``lse`` may be None (not computed where that saves
    work). Forward only; the offsets are read and checked by the caller, the pools here.
    """
    plan = plan_of(k, v, block_table, cu_q, cu_k)
    if in_place(k, v, causal=causal, window=window, alibi_slopes=alibi_slopes):
        q, k, v = autocast_inputs(q, k, v)  # as the packed path's (the pools too, where not in its dtype)
        return paged_varlen(q, k, v, plan, causal=causal, window=window, softcap=softcap, scale=scale,
                            alibi_slopes=alibi_slopes, sinks=sinks, want_lse=want_lse)  # fmt: skip
    k, v = (gather_pages(x, block_table, cu_k) for x in (k, v))  # what the engine has no form for: packed
    return packed_spans(q, k, v, spans(cu_q), spans(cu_k), window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        score_mod=None, sinks=sinks, scale=scale, dropout=0.0, generator=None, return_lse=want_lse)  # fmt: skip


def spans(cu: list[int]) -> list[tuple[int, int]]:
    """Offsets ``[0, a, b, …]`` as each sequence's ``(start, length)``."""
    return [(a, b - a) for a, b in zip(cu, cu[1:])]


def packed_spans(q: Tensor, k: Tensor, v: Tensor, spans_q: list[tuple[int, int]], spans_k: list[tuple[int, int]], *,
                 window: tuple[int | None, int | None], softcap: float, alibi_slopes: Tensor | None,
                 score_mod: Callable | None, sinks: Tensor | None, scale: float | None, dropout: float,
                 generator: torch.Generator | None, return_lse: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(out (total_q, h, e), lse (h, total_q) | None)``: sequence ``s``'s queries, rows ``spans_q[s] = (start, n)`` of
    ``q``, against its keys, rows ``spans_k[s]`` of ``k`` and ``v``, with flash-attn's per-sequence semantics.

    Key spans may lie anywhere in ``k`` (a KV cache's rows, flattened, with gaps between them);
    rows of ``q`` no span names get zeros.
    """
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in autocast_inputs(q, k, v))  # (1, h, t, ·): views
    req = checks.request(
        q4, k4, v4, score="scaled_dot", mask=None, bias=None, causal=False, scale=scale, dropout=dropout,
        return_weights=False, generator=generator, sinks=sinks, score_mod=score_mod, return_lse=return_lse,
    )  # fmt: skip
    slopes = _slopes(alibi_slopes, req.heads, len(spans_q), q.device)
    left, right = window
    segments = []
    for s, ((q0, sq), (k0, sk)) in enumerate(zip(spans_q, spans_k)):
        block = Block(q0, sq, k0, sk, req.i, req.j)
        mask = window_mask(left, right, sq, sk)
        row = None if slopes is None else slopes[min(s, len(slopes) - 1)]
        bias, mod = _logit_terms(row, softcap, score_mod, s, block.jt - block.it)
        segments.append(Segment(0, block, mask, bias, mod))
    return run_segments(req, segments, packed=True)  # (total_q, h, e), (h, total_q)


def _answer(out: Tensor, lse: Tensor, return_lse: bool, return_attn_probs: bool):
    """``out``, ``(out, lse)`` with ``return_lse``, or flash-attn's ``(out, softmax_lse, S_dmask)``."""
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def _check_paged_call(q, k, v, sinks, dropout_p: float, score_mod, alibi_slopes) -> None:
    """What ``block_table`` does not take here: dropout (flash-attn's paged kernel silently drops none), gradients
    (flash-attn's backward ignores the table), a ``score_mod``, and slopes that are not a float tensor."""
    if dropout_p:
        raise ValueError(f"dropout_p: with block_table, 0 here (flash-attn's paged kernel applies none), got {dropout_p}")
    if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, sinks)):
        raise ValueError("block_table: forward only here (the paged engine has no backward); call it under "
                         "torch.no_grad(), as serving does, or pass the keys packed, without block_table")  # fmt: skip
    if score_mod is not None:
        raise ValueError("score_mod: not with block_table here (qkv.paged_attention takes one, with positions in "
                         "each request's sequence)")  # fmt: skip
    if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor) or not alibi_slopes.dtype.is_floating_point):
        got = alibi_slopes.dtype if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
        raise TypeError(f"alibi_slopes: expected a float tensor (h,) or (b, h), got {got}")


def read_offsets(name: str, cu: object, x: Tensor | None, of: str) -> list[int]:
    """Check ``cu_seqlens`` (1-d integers from 0, non-decreasing, ending at ``x``'s token count if given) and read it."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1:
        got = tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__
        raise ValueError(f"{name}: expected a 1-d tensor of b + 1 offsets, got {got}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32, as flash-attn's), got {cu.dtype}")
    if cu.device.type == "meta":
        raise ValueError(f"{name}: its offsets are read on the host to cut the sequences, got a meta tensor (a meta "
                         "tensor has a shape but no values)")  # fmt: skip
    values = cu.tolist()
    total = x.shape[0] if isinstance(x, Tensor) and x.dim() == 3 else None
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or (total is not None and values[-1] != total):
        end = "" if total is None else f", ending at {of}'s {total} tokens"
        raise ValueError(f"{name}: expected offsets from 0, non-decreasing{end}, got {values}")
    return values


def check_max_seqlen(name: str, given: object, cu: list[int]) -> None:
    """Check ``max_seqlen_*``: None, or any integer (``flash_args.as_int``) at least the longest sequence."""
    if given is None:
        return
    value = as_int(given)
    if value is None:
        got = f"a tensor of shape {tuple(given.shape)}, {given.dtype}" if isinstance(given, Tensor) else type(given).__name__
        raise TypeError(f"{name}: expected an int (or a 0-d integer tensor), got {got}")
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if value < longest:
        raise ValueError(f"{name}: expected an int at least the longest sequence, {longest}, got {value}")


def _slopes(alibi_slopes: Tensor | None, heads: int, sequences: int, device) -> Tensor | None:
    """``(1 | b, h)`` float64 slopes, or None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor) or not alibi_slopes.dtype.is_floating_point:
        got = alibi_slopes.dtype if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
        raise TypeError(f"alibi_slopes: expected a float tensor (h,) or (b, h), got {got}")
    slopes = alibi_slopes.detach().to(device=device, dtype=torch.float64)
    if tuple(slopes.shape) not in ((heads,), (sequences, heads)):
        raise ValueError(f"alibi_slopes: expected shape ({heads},) or ({sequences}, {heads}), got {tuple(slopes.shape)}")
    return slopes.reshape(-1, heads)


def _logit_terms(slopes: Tensor | None, softcap: float, score_mod: Callable | None, s: int, shift: int):
    """``(bias, score_mod)`` of sequence ``s`` (``shift = sk - sq``): flash-attn's order, soft cap, then ALiBi, then ``score_mod``.

    Alone, each keeps its fast path: ALiBi as a lazy bias (the fused diagonal profile), the
    soft cap as ``SoftCap``. Together, one modifier applies them in flash-attn's order.
    """
    user = frame_score_mod(score_mod, None, row=s)  # b = the sequence's index, positions inside it
    if softcap == 0.0 and user is None:
        return (None if slopes is None else ALiBi(len(slopes), slopes=slopes)), None
    if slopes is None and user is None:
        return None, SoftCap(softcap)
    return None, _Composed(softcap, slopes, user, shift)


class _Composed:
    """Soft cap, then ALiBi (``-slope_h · |r + sk - sq - c|``), then a ``score_mod``, on one sequence's logits."""

    def __init__(self, softcap: float, slopes: Tensor | None, user: Callable | None, shift: int):
        self.softcap, self.slopes, self.user, self.shift = softcap, slopes, user, shift
        # its own arithmetic is elementwise: evaluated the way the user's function is (qkv._mods)
        self.__wrapped_mod__ = user
        self.broadcasts = user is None

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if self.softcap > 0:
            score = torch.tanh(score / self.softcap) * self.softcap
        if self.slopes is not None:
            distance = (q_idx + self.shift - kv_idx).abs()
            score = score - self.slopes.to(score.device)[h].to(score.dtype) * distance.to(score.dtype)
        return score if self.user is None else self.user(score, b, h, q_idx, kv_idx)


def unpad_input(hidden_states: Tensor, attention_mask: Tensor,
                unused_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:  # fmt: skip
    """A padded batch as packed tokens, as ``flash_attn.bert_padding.unpad_input`` (same arguments).

    ``hidden_states (b, s, ...)``, ``attention_mask (b, s)`` (nonzero: a real token) and
    ``unused_mask (b, s)`` (nonzero: allocated but unused, packed too) ->
    ``(packed (t, ...), indices (t,), cu_seqlens (b + 1,) int32, max_seqlen, seqused (b,) int32)``:
    the kept tokens in order, their flat positions in ``(b·s)``, the offsets for
    :func:`varlen_attention` and the longest sequence (both counting used and unused tokens),
    and each sequence's used tokens. These five are flash-attn 2.7's and later's; 2.6 and earlier
    returned the first four (code written for those reads ``unpad_input(...)[:4]``).
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__
        raise TypeError(f"hidden_states: expected a tensor (b, s, ...), got {got}")
    for name, mask in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if mask is None and name == "unused_mask":
            continue
        if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(hidden_states.shape[:2]) != tuple(mask.shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{name}: expected shape {tuple(hidden_states.shape[:2])} (b, s) like hidden_states, got {got}")
    used = attention_mask.bool()
    keep = used if unused_mask is None else used | unused_mask.bool()
    seqlens = keep.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:]).index_select(0, indices)
    longest = int(seqlens.max()) if seqlens.numel() else 0
    return packed, indices, cu_seqlens, longest, used.sum(-1, dtype=torch.int32)


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Packed tokens back to a padded ``(batch, seqlen, ...)`` batch (zeros at padding), as ``flash_attn``'s ``pad_input``.

    ``hidden_states (t, ...)`` are the packed rows, ``indices (t,)`` their flat positions in
    ``(batch·seqlen)`` (what :func:`unpad_input` returned). The arguments are checked, the
    positions too where their values can be read: an index past ``batch·seqlen`` is an
    ``IndexError`` deep in ``index_copy`` on a CPU and a device-side assert on a GPU.
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 1:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__
        raise TypeError(f"hidden_states: expected a tensor (t, ...), got {got}")
    sizes = (as_int(batch), as_int(seqlen))  # (numpy ints and 0-d tensors too, as flash-attn's rearrange takes)
    for name, size, given in (("batch", sizes[0], batch), ("seqlen", sizes[1], seqlen)):
        if size is None:
            raise TypeError(f"{name}: expected an int, got {type(given).__name__}")
        if size < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {size}")
    batch, seqlen = sizes
    if not isinstance(indices, Tensor) or indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        got = indices.dtype if isinstance(indices, Tensor) else type(indices).__name__
        raise TypeError(f"indices: expected an integer tensor, got {got}")
    if indices.shape != hidden_states.shape[:1]:
        raise ValueError(
            f"indices: expected one flat position per packed row ({hidden_states.shape[0]},), got {tuple(indices.shape)}"
        )
    if indices.numel() and concrete(indices):  # one read of two numbers (a sync on a GPU), not under tracing
        low, high = (int(x) for x in torch.aminmax(indices))
        if low < 0:
            raise ValueError(f"indices: expected flat positions >= 0, got {low}")
        if high >= batch * seqlen:
            raise ValueError(
                f"seqlen: batch * seqlen = {batch} * {seqlen} = {batch * seqlen} positions, but indices reach flat "
                f"position {high}; pass the (b, s) of the batch unpad_input packed"
            )
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    # int32 positions too (flash-attn's ``output[indices] = values`` takes any integer dtype; index_copy only int64)
    return out.index_copy(0, indices.long(), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])
