"""The segments backend: a packed batch, run as one ordinary call per document.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; a segment is rows ``r0 .. r0 + it`` against
keys ``c0 .. c0 + jt`` of one batch row.

A mask ``documents(ids) & rest`` (``qkv.masks.documents``) lets no query see outside its
own document, so when each document's tokens are contiguous the call is block-diagonal:
one independent attention per document, ``Σ lenᵢ²`` work in all instead of ``T²``, and no
``(i, j)`` mask. Each document becomes a call of its own: its rows, keys and values are
views of the caller's, the rest of the mask and the bias are framed at its position
(``tiling.framing``), and ``backends.choose`` picks that call's own backend (a causal
document of a packed causal batch is a plain causal square: ``F.scaled_dot_product_attention``
with ``is_causal``, the fastest path there is). The outputs (and log-sum-exps) are put back
in place; rows whose document has no key get zeros (and ``-inf``).

``qkv.varlen_attention`` (``flash_attn_varlen_func``'s semantics, where each sequence's
causal mask, window and ALiBi are its own) builds its segments with those local masks and
runs them through :func:`run_segments` too. A document's result depends only on its own
tokens and on its own shape, so it is the same, bit for bit, whatever its neighbours are
(on a CPU with a fixed thread count). Checked against the reference backend in
``tests/test_backends_segments.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from .._trace import tracing
from ..masks import And, Documents, Mask
from .request import Request
from .tiling.framing import Block, frame_bias, frame_mask, frame_row, frame_score_mod, row_slice

name = "segments"
selects_weights = False


@dataclass(frozen=True)
class Segment:
    """One document: batch row ``row``, global rows and keys ``block``, and its own call's options."""

    row: int
    block: Block
    mask: Mask | None  # in the segment's own coordinates
    bias: object  # a dense tensor sliced to the segment, a lazy bias framed at it, or None
    score_mod: Callable | None  # reading the caller's indices (batch row, global positions)


def split(mask: Mask | None) -> tuple[Documents | None, Mask | None]:
    """``(documents, rest)`` of a mask ``documents & rest`` (either side of a top-level ``&``), else ``(None, mask)``."""
    if isinstance(mask, Documents):
        return mask, None
    if isinstance(mask, And):
        docs, rest = split(mask.a)
        if docs is not None:
            return docs, (mask.b if rest is None else And(rest, mask.b))
        docs, rest = split(mask.b)
        if docs is not None:
            return docs, (mask.a if rest is None else And(mask.a, rest))
    return None, mask


def supports(req: Request) -> str | None:
    docs, _ = split(req.mask)
    if docs is None:
        return "the mask has no lazy documents (qkv.masks.documents)"
    if req.return_weights:
        return "it does not return weights (the chunked backend builds them lazily)"
    if getattr(req.score, "reads_positions", False):
        return f"the {req.score.name} score reads key positions, which a document's own call renumbers"
    if tracing():
        return "the documents' boundaries are read on the host, which a traced call cannot do"
    if docs.runs() is None:
        return "a document's tokens are not contiguous (or the ids cannot be read here)"
    return None


def segments(req: Request) -> list[Segment]:
    """The documents of ``req`` as segments: the rest of the mask, the bias and the score_mod framed at each."""
    docs, rest = split(req.mask)
    runs = docs.runs()
    found = []
    for n in range(req.q.shape[0]):
        mask_n = frame_row(rest, n)
        bias_n = row_slice(req.bias, n) if isinstance(req.bias, Tensor) else req.bias
        for q0, q1, k0, k1 in runs[n if len(runs) > 1 else 0]:  # ids of one row serve every row
            block = Block(q0, q1 - q0, k0, k1 - k0, req.i, req.j)
            found.append(Segment(n, block, frame_mask(mask_n, block), frame_bias(bias_n, block),
                                 frame_score_mod(req.score_mod, block, row=n)))  # fmt: skip
    return found


def run(req: Request) -> tuple[Tensor, None, Tensor | None]:
    out, lse = run_segments(req, segments(req))
    return out, None, lse


def run_segments(req: Request, parts: list[Segment], packed: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(out (b, h, i, e), lse (b, h, i) | None)``: each segment run as its own call, put back in place.

    Rows no segment covers get ``out = 0`` and ``lse = -inf``; ``lse`` only when
    ``req.return_lse``. Autograd runs through every piece (one ``cat`` per batch row).
    ``packed``: one batch row, returned as ``out (i, h, e)`` and ``lse (h, i)``, the
    tokens-first layout of flash-attn's varlen calls, put together by the same one copy.
    """
    from . import choose  # the dispatcher, for each segment's own call

    if not torch.is_grad_enabled():
        return _run_into(req, parts, packed, choose)
    # With gradients, one cat per row: copying the pieces into one buffer instead (autograd through
    # the copies) made varlen's forward + backward 1.25-1.3x the per-document loop, against 1.0 here.
    b, h, i_len = req.q.shape[0], req.heads, req.i
    e = req.v.shape[-1]
    rows: list[list[tuple[int, Tensor, Tensor | None]]] = [[] for _ in range(b)]
    for part in parts:
        if part.block.it == 0 or part.block.jt == 0:  # no rows, or rows that see no key: left as gaps
            continue
        sub = _call(req, part)
        impl, _ = choose(sub)
        out, _, lse = impl.run(sub)
        rows[part.row].append((part.block.r0, out, lse))
    outs, lses = [], []
    for pieces in rows:
        row_out, row_lse = _assemble(pieces, req, h, i_len, e, packed)
        outs.append(row_out)
        lses.append(row_lse)
    if packed:
        return outs[0], lses[0]
    out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    lse = None if not req.return_lse else torch.cat(lses, dim=0) if len(lses) > 1 else lses[0]
    return out, lse


def _run_into(req: Request, parts: list[Segment], packed: bool, choose) -> tuple[Tensor, Tensor | None]:
    """:func:`run_segments` with no gradients recorded: each piece copied into the output as it is made
    and freed, so the peak holds the output and one piece, not every piece and their ``cat``."""
    b, h, i_len, e = req.q.shape[0], req.heads, req.i, req.v.shape[-1]
    acc = torch.promote_types(req.v.dtype, torch.float32)
    out = req.v.new_zeros((i_len, h, e) if packed else (b, h, i_len, e))
    lse = None
    if req.return_lse:  # rows no segment covers: no mass but a sink's
        lse = torch.full((b, h, i_len), float("-inf"), dtype=acc, device=req.v.device)
        if req.sinks is not None:
            lse.copy_(req.sinks.to(acc).reshape(1, h, 1).expand_as(lse))
    for part in parts:
        if part.block.it == 0 or part.block.jt == 0:
            continue
        sub = _call(req, part)
        impl, _ = choose(sub)
        piece, _, piece_lse = impl.run(sub)
        rows = slice(part.block.r0, part.block.r0 + piece.shape[2])
        if packed:
            out[rows].copy_(piece[0].transpose(0, 1))
        else:
            out[part.row, :, rows].copy_(piece[0])
        if lse is not None:
            lse[part.row, :, rows].copy_(piece_lse[0])
        del piece, piece_lse
    if packed:
        return out, (None if lse is None else lse[0])
    return out, lse


def _call(req: Request, part: Segment) -> Request:
    """The segment as a call of its own: views of its batch row's rows, keys and values."""
    blk, n = part.block, part.row
    rows, cols = slice(blk.r0, blk.r0 + blk.it), slice(blk.c0, blk.c0 + blk.jt)
    return replace(
        req, q=req.q[n : n + 1, :, rows], k=req.k[n : n + 1, :, cols], v=req.v[n : n + 1, :, cols],
        mask=part.mask, bias=part.bias, score_mod=part.score_mod, layout=None, weights_for=None,
    )  # fmt: skip


def _assemble(pieces: list, req: Request, h: int, i_len: int, e: int, packed: bool = False) -> tuple[Tensor, Tensor | None]:
    """One batch row's ``(1, h, i, e)`` output (and ``(1, h, i)`` lse) from its pieces, zeros between them.

    ``packed``: ``(i, h, e)`` and ``(h, i)`` instead (each piece transposed as it is copied in).
    """
    pieces = sorted(pieces, key=lambda p: p[0])
    acc = torch.promote_types(req.v.dtype, torch.float32)

    def gap(rows: int) -> tuple[Tensor, Tensor]:
        """Rows that see no key: zeros, and no mass but a sink's."""
        lse = torch.full((1, h, rows), float("-inf"), dtype=acc, device=req.v.device)
        if req.sinks is not None:
            lse = req.sinks.to(acc).reshape(1, h, 1).expand(1, h, rows)
        return req.v.new_zeros((1, h, rows, e)), lse

    outs, lses, at = [], [], 0
    for r0, out, lse in pieces:
        if r0 > at:
            for xs, x in zip((outs, lses), gap(r0 - at)):
                xs.append(x)
        outs.append(out)
        lses.append(lse)
        at = r0 + out.shape[2]
    if at < i_len:
        for xs, x in zip((outs, lses), gap(i_len - at)):
            xs.append(x)
    if packed:
        outs = [x[0].transpose(0, 1) for x in outs]
    out = torch.cat(outs, dim=0 if packed else 2)
    if not req.return_lse:
        return out, None
    if packed:
        lses = [x[0] for x in lses]
    return out, torch.cat([x.to(acc) for x in lses], dim=1 if packed else 2)
