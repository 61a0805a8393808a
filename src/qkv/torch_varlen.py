"""PyTorch's varlen dialect: ``varlen_attn`` and ``varlen_attn_out``, drop-ins for ``torch.nn.attention.varlen``'s.

Shape legend: ``T_q``/``T_k`` packed query/key tokens, ``H_q`` query heads, ``H_kv`` KV heads,
``D`` query/key size, ``D_v`` value size, ``N`` sequences, ``sq``/``sk`` one sequence's query and
key counts; with ``block_table``, pools of pages ``(num_pages, page_size, H_kv, ·)``.

PyTorch's ``varlen_attn`` runs flash attention's CUDA kernel and nothing else (on a CPU it raises
``NotImplementedError``). These take its arguments and give its results on a CPU, forward and
backward, so code moves over by changing an import::

    from torch.nn.attention.varlen import varlen_attn, AuxRequest
    from qkv.torch_varlen import varlen_attn, AuxRequest      # (PyTorch's AuxRequest is taken too)

Sequence ``s`` is query rows ``cu_seq_q[s] : cu_seq_q[s + 1]`` and key rows from ``cu_seq_k[s]``:
``sk = seqused_k[s]`` of them where ``seqused_k`` is given (a cache slot larger than its sequence),
else to ``cu_seq_k[s + 1]``. Its queries are the last ``sq`` of ``sk`` positions (bottom-right), so
``window_size = (left, right)`` keeps keys ``c`` with
``r + sk - sq - left <= c <= r + sk - sq + right`` (-1: unbounded); ``(-1, 0)`` is causal, ``(W, 0)``
causal with a sliding window of ``W`` keys before the query's own. ``scale`` defaults to ``1/√D``.
Without ``enable_gqa`` query and key head counts must be equal, with it ``H_kv`` must divide
``H_q`` (PyTorch's ``ValueError`` and message). ``block_table (N, max_pages)`` makes ``key`` and
``value`` pools of pages: sequence ``s``'s keys are the first ``seqused_k[s]`` tokens of the pages
its row names, in any order (``cu_seq_k`` may be None); it requires ``seqused_k``, as PyTorch's
docs say. ``seqused_k`` and ``block_table`` are inference-only: with a tensor that records
gradients, PyTorch's ``RuntimeError`` ("seqused_k is an inference-only parameter."); pages are
read where they lie (``qkv.varlen.run_paged``). ``return_aux=AuxRequest(lse=True)`` returns
``(out, lse)`` with ``lse (H_q, T_q)`` in float32 (float64 for float64 inputs): what the kernel
returns and PyTorch's fake op describes (its docstring says ``(T_q, H_q)``). ``num_splits`` (an
int or None) picks how the CUDA kernel splits keys, and ``num_splits=1`` promises batch invariance:
a sequence's bits do not depend on the others in the batch. Packed keys always give that here
(each sequence runs as its own call, ``qkv.varlen.packed_spans``); a ``block_table`` call reads
its decoding steps together (one pass over their pages, whose float32 results may move in the
last bit with the batch), and with ``num_splits=1`` runs each sequence alone instead, on a copy of
its queries (the kernel's sums moved with where a query row began in memory).
``cu_seq_k`` may end before ``key``'s last row (a buffer with room to spare, as the kernel reads
it); ``cu_seq_q`` must end at ``query``'s (the kernel leaves later rows unwritten).
``varlen_attn_out`` writes into ``out`` and returns it, with no gradient, as PyTorch's (its out
variant has no autograd formula).

Where this differs from PyTorch's CUDA kernel: it takes more (float32 and float64, ``D_v != D``,
any head size); a query that sees no key gets zeros and ``lse = -inf`` (the kernel writes +inf);
the returned ``lse`` carries a gradient (PyTorch's backward drops it); ``max_q`` below the longest
sequence is refused (the kernel sizes its grid with it, leaving rows unwritten), and so is such a
``max_k`` (the kernel's key splits and window bounds read it); a
window side below -1 is refused (the kernel reads it as -1); and a window side at least the key
count where queries outnumber keys keeps the formula above, as ``qkv.varlen_attention`` does and
says why. On CUDA a float16 or bfloat16 call is PyTorch's own ``varlen_attn``, the fastest exact
kernel there. Checked against a per-sequence float64 reference and PyTorch's tests' cases in
``tests/test_torch_varlen.py``.
"""

from __future__ import annotations

import math
import numbers
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from .flash_args import as_int, flag, real, window
from .varlen import check_max_seqlen, packed_spans, read_offsets, run_paged, spans



class AuxRequest(NamedTuple):
    """Which auxiliary outputs :func:`varlen_attn` returns: ``lse``, the log-sum-exp ``(H_q, T_q)``.

    PyTorch's own ``AuxRequest`` (the same one field) is taken as well. It is not imported here:
    ``torch.nn.attention.varlen`` imports ``torch._dynamo`` (a second to ``import qkv``, and
    inductor's settings read before a program sets them).
    """

    lse: bool = False


def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None, max_q: int,
                max_k: int, *, return_aux: AuxRequest | None = None, scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False, seqused_k: Tensor | None = None,
                block_table: Tensor | None = None, num_splits: int | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """``out (T_q, H_q, D_v)``, or ``(out, lse (H_q, T_q))`` with ``return_aux=AuxRequest(lse=True)``: each
    sequence's queries over its keys (the module docstring's semantics)."""
    kernel = _torch_kernel(query)
    if kernel is not None:
        return kernel.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                                  scale=scale, window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                                  block_table=block_table, num_splits=num_splits)  # fmt: skip
    want = _wants_lse(return_aux)
    out, lse = _run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, want, scale, window_size, enable_gqa,
                    seqused_k, block_table, num_splits)  # fmt: skip
    return (out, lse) if want else out


def varlen_attn_out(out: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None,
                    max_q: int, max_k: int, *, return_aux: AuxRequest | None = None, scale: float | None = None,
                    window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                    seqused_k: Tensor | None = None, block_table: Tensor | None = None,
                    num_splits: int | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`varlen_attn` written into ``out (T_q, H_q, D_v)`` (the query's dtype and device), which is returned
    (with ``lse`` where asked); forward only, as PyTorch's."""
    kernel = _torch_kernel(query, "varlen_attn_out")
    if kernel is not None:
        return kernel.varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                                      scale=scale, window_size=window_size, enable_gqa=enable_gqa,
                                      seqused_k=seqused_k, block_table=block_table, num_splits=num_splits)  # fmt: skip
    want = _wants_lse(return_aux)
    with torch.no_grad():
        result, lse = _run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, want, scale, window_size, enable_gqa,
                           seqused_k, block_table, num_splits)  # fmt: skip
        if not isinstance(out, Tensor) or out.shape != result.shape or out.dtype != result.dtype or (
                out.device != result.device):  # fmt: skip
            got = f"{tuple(out.shape)}, {out.dtype}, {out.device}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"out: expected a tensor {tuple(result.shape)} (T_q, H_q, D_v), {result.dtype}, "
                             f"{result.device} like the query's, got {got}")  # fmt: skip
        out.copy_(result)
    return (out, lse) if want else out


def _run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, want_lse: bool, scale, window_size, enable_gqa,
         seqused_k, block_table, num_splits) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(out, lse or None)`` of a call on qkv's engines, its arguments checked in PyTorch's order and words."""
    paged = block_table is not None
    _check_heads(query, key, value, enable_gqa, paged)
    left, right = _window(window_size)
    if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in (query, key, value)):
        for name, given in (("seqused_k", seqused_k), ("block_table", block_table)):  # PyTorch's order and message
            if given is not None:
                raise RuntimeError(f"{name} is an inference-only parameter.")
    if num_splits is not None and as_int(num_splits) is None:
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if scale is not None:
        scale = real("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
    cu_q = read_offsets("cu_seq_q", cu_seq_q, query, "query")
    used = None if seqused_k is None else _seqused(seqused_k, len(cu_q) - 1)
    if paged and used is None:
        raise ValueError("block_table: requires seqused_k, each sequence's key count in its pages (PyTorch's docs: "
                         "'Requires seqused_k')")  # fmt: skip
    if cu_seq_k is None and not paged:
        raise ValueError("cu_seq_k: expected the offsets of each sequence's keys (b + 1,); only with block_table may "
                         "it be None")  # fmt: skip
    starts = None
    if cu_seq_k is not None:  # (with block_table, read and checked, not used: the table says where the keys lie)
        cu_k = read_offsets("cu_seq_k", cu_seq_k, None, "key")
        if len(cu_k) != len(cu_q):
            raise ValueError(f"cu_seq_k: expected {len(cu_q)} offsets like cu_seq_q (b + 1), got {len(cu_k)}")
        if not paged and cu_k[-1] > key.shape[0]:  # (rows past the last offset are room the kernel never reads)
            raise ValueError(f"cu_seq_k: offsets reach row {cu_k[-1]}, past key's {key.shape[0]} rows")
        starts = spans(cu_k)
    lengths = [n for _, n in starts] if used is None else used
    for name, given, counts in (("max_q", max_q, [n for _, n in spans(cu_q)]), ("max_k", max_k, lengths)):
        if as_int(given) is None:
            raise TypeError(f"{name}: expected an int, the longest sequence's length, got {type(given).__name__}")
        check_max_seqlen(name, given, list(accumulate(counts, initial=0)))  # (host ints: no tensor a call)
    causal = left is None and right == 0
    if paged:
        options = dict(causal=causal, window=(left, right), softcap=0.0, alibi_slopes=None, sinks=None, scale=scale,
                       want_lse=want_lse)  # fmt: skip
        if as_int(num_splits) == 1 and used and isinstance(block_table, Tensor) and block_table.dim() == 2:
            if block_table.shape[0] != len(used):  # (plan_of's check, before the table is cut into rows)
                raise ValueError(f"block_table: expected a row per sequence ({len(used)}), got {block_table.shape[0]}")
            return _one_at_a_time(query, key, value, cu_q, used, block_table, options)  # batch invariance: each alone
        return run_paged(query, key, value, cu_q, list(accumulate(used, initial=0)), block_table, **options)
    if used is not None:  # each count within its sequence's span
        for s, ((start, room), n) in enumerate(zip(starts, used)):
            if n > room:
                raise ValueError(f"seqused_k: sequence {s} uses {n} keys, more than its {room} in cu_seq_k (rows "
                                 f"{start} to {start + room}): its keys would be the next sequence's")  # fmt: skip
        starts = [(start, n) for (start, _), n in zip(starts, used)]
    return packed_spans(query, key, value, spans(cu_q), starts, window=(left, right), softcap=0.0, alibi_slopes=None,
                        score_mod=None, sinks=None, scale=scale, dropout=0.0, generator=None, return_lse=want_lse)  # fmt: skip


def _one_at_a_time(query: Tensor, key: Tensor, value: Tensor, cu_q: list[int], used: list[int], block_table: Tensor,
                   options: dict) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """A paged call as one call a sequence (``num_splits=1``): each sequence's result is its own, whatever the batch.

    Each sequence's queries are copied first: the CPU kernel's float32 sums moved in the last bit with where in memory
    a query row began (its row in a batch), 1.8e-7 between the same request alone and third in a batch.
    """
    outs, lses = [], []
    for s, n in enumerate(used):
        rows = query[cu_q[s] : cu_q[s + 1]].clone()
        out, lse = run_paged(rows, key, value, [0, rows.shape[0]], [0, n], block_table[s : s + 1], **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), (torch.cat(lses, 1) if options["want_lse"] else None)


def _torch_kernel(query: object, name: str = "varlen_attn"):
    """PyTorch's own varlen module where its kernel runs the call (a CUDA tensor in float16 or bfloat16, a build with
    flash attention, a PyTorch that has the function ``name``), else None: qkv's engines run it."""
    if not (isinstance(query, Tensor) and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    if not torch.backends.cuda.is_flash_attention_available():
        return None
    try:
        from torch.nn.attention import varlen
    except ImportError:  # pragma: no cover - PyTorch before 2.9
        return None
    return varlen if hasattr(varlen, name) else None


def _wants_lse(return_aux: object) -> bool:
    """Whether ``return_aux`` asks for the log-sum-exp: None, or an ``AuxRequest`` (PyTorch's or this module's)."""
    if return_aux is None:
        return False
    lse = getattr(return_aux, "lse", None)
    if not isinstance(lse, bool):
        raise TypeError(f"return_aux: expected None or AuxRequest(lse=...), got {return_aux!r}")
    return lse


def _check_heads(query: object, key: object, value: object, grouped: object, paged: bool) -> None:
    """PyTorch's head checks, its ``ValueError`` and words: one count, or with ``enable_gqa`` one dividing ``H_q``."""
    rank = 4 if paged else 3
    for name, x, want in (("query", query, 3), ("key", key, rank), ("value", value, rank)):
        if not isinstance(x, Tensor) or x.dim() != want:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            shape = "(num_pages, page_size, H_kv, size) pages, with block_table" if want == 4 else "(T, heads, size)"
            raise ValueError(f"{name}: expected {shape}, got {got}")
    # as PyTorch's Python check and its op's bool argument read it: any number (numpy's too) or 0-d tensor by its truth
    if isinstance(grouped, numbers.Number) or (isinstance(grouped, Tensor) and grouped.dim() == 0):
        grouped = bool(grouped)
    grouped = flag("enable_gqa", grouped)  # (numpy's bool_ too; anything else is a TypeError naming the argument)
    hq, hk = query.shape[1], key.shape[2 if paged else 1]
    if value.shape[:-1] != key.shape[:-1]:  # (PyTorch's kernel asks it too, in its own words)
        raise ValueError(f"value: expected {tuple(key.shape[:-1])} + (size,) like key, got {tuple(value.shape)}")
    if not grouped and hq != hk:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={hq} and Hkv={hk}. "
                         "Try setting enable_gqa=True for GQA.")  # fmt: skip
    if grouped and (hk == 0 or hq % hk != 0):  # (PyTorch divides by a count of 0)
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={hq} and "
                         f"Hkv={hk}.")  # fmt: skip


def _window(window_size: object) -> tuple[int | None, int | None]:
    """``(left, right)``, None unbounded: PyTorch's length check and message first, then the pair's values."""
    try:
        length = len(window_size)
    except TypeError:
        length = None
    if length is not None and length != 2:
        raise ValueError(f"window_size must have length 2, got {length}")
    return window(window_size, False)


def _seqused(seqused_k: object, sequences: int) -> list[int]:
    """``seqused_k``: a 1-d integer tensor ``(N,)`` of key counts, each >= 0, read on the host."""
    if not isinstance(seqused_k, Tensor) or seqused_k.dim() != 1 or seqused_k.dtype.is_floating_point or (
            seqused_k.dtype.is_complex or seqused_k.dtype == torch.bool):  # fmt: skip
        got = f"{tuple(seqused_k.shape)}, {seqused_k.dtype}" if isinstance(seqused_k, Tensor) else type(seqused_k).__name__
        raise TypeError(f"seqused_k: expected a 1-d integer tensor (N,) of key counts, got {got}")
    if seqused_k.shape[0] != sequences:
        raise ValueError(f"seqused_k: expected one count a sequence ({sequences},), got {tuple(seqused_k.shape)}")
    used = seqused_k.tolist()
    if any(n < 0 for n in used):
        raise ValueError(f"seqused_k: expected counts >= 0, got {used}")
    return used
