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

A **padded batch**, ``lengths(n) & rest`` or ``starts(n) & rest`` (right or left padding,
``qkv.masks``; or a dense key-padding prefix or suffix per row), whose mask is too large
for SDPA to be given it built, is one call per batch row over its real keys alone (and,
when ``rest`` is an offset range such as ``causal()``, only the rows that see one of
them): a padded causal batch becomes one ``is_causal`` kernel call per row, the
right-padded one top-left aligned on its shorter keys, where the engines would cut every
row's keys into full and partial runs merged by their log-sum-exp (on the Intel Xeon, 4
rows of 1024 holding 1024 to 300 tokens, h = 8: 0.40-0.69x the engines' time, forward and
forward + backward, float32 and bfloat16). Short rows, whose calls each pay the kernel's
fixed cost, may go in groups of rows instead, each group's mask small enough for SDPA:
which is faster is timed once per size class (``backends.padded_rows``). CPU only.

``qkv.varlen_attention`` (``flash_attn_varlen_func``'s semantics, where each sequence's
causal mask, window and ALiBi are its own) builds its segments with those local masks and
runs them through :func:`run_segments` too. A document's result depends only on its own
tokens and on its own shape, so it is the same, bit for bit, whatever its neighbours are
(on a CPU with a fixed thread count). Checked against the reference backend in
the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from .._trace import concrete, tracing
from ..masks import Lengths, Mask, Offsets
from ..masks.documents import documents_of
from ..masks.padding import may_be_padded, padding_ends, padding_of
from . import padded_rows
from .request import Request
from .sdpa import _top_left, _top_left_range
from .tiling.framing import Block, frame_bias, frame_mask, frame_row, frame_score_mod, row_slice
from .tiling.tiles import offset_live_rows

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


def supports(req: Request) -> str | None:
    docs, _ = documents_of(req.mask)
    if docs is None:
        return _padded(req)
    why = _refused(req, "a document's own call", "the documents' boundaries")
    if why is not None:
        return why
    if docs.runs() is None:
        return "a document's tokens are not contiguous (or the ids cannot be read here)"
    return None


def _refused(req: Request, call: str, read: str) -> str | None:
    """What no call of its own can take: weights, a score reading key positions, a traced call."""
    if req.return_weights:
        return "it does not return weights (the chunked backend builds them lazily)"
    if getattr(req.score, "reads_positions", False):
        return f"the {req.score.name} score reads key positions, which {call} renumbers"
    if tracing():
        return f"{read} are read on the host, which a traced call cannot do"
    return None


def _padded(req: Request) -> str | None:
    """Why a padded batch is not split into its rows here (None: it is)."""
    if not may_be_padded(req.mask):
        return "the mask has no lazy documents (qkv.masks.documents) or padding (lengths, starts)"
    if req.q.device.type != "cpu":
        return "a padded batch is split by rows on the CPU only"
    if req.q.shape[0] * req.i * req.j <= padded_rows.PADDING_ELEMENTS:
        limit = padded_rows.PADDING_ELEMENTS
        return f"a padded batch's mask is small here (at most {limit} elements): SDPA takes it whole"
    why = _refused(req, "a row's own call", "the rows' lengths")
    if why is not None:
        return why
    pad, rest = padding_of(req.mask)  # the cheap refusals first: a dense mask's values are read here
    if pad is None:
        return "the dense mask keeps neither a prefix nor a suffix of each row's keys"
    if not concrete(padding_ends(pad)):
        return "the rows' lengths are read on the host, which a call on meta tensors cannot do"
    if documents_of(rest)[0] is not None:
        return "documents and padding together go to the engines"
    if req.score_mod is not None and padded_rows.in_groups(req, pad, rest, _one_by_one):
        return "short rows go in groups, whose calls renumber the batch rows a score_mod reads"
    return None


def _padded_segments(req: Request, pad: Mask, rest: Mask | None) -> list[Segment]:
    """One segment per batch row: its real keys, and the rows that see one of them (all, unless ``rest`` is an offset range).

    ``pad, rest``: ``padding_of(req.mask)``.
    """
    ends = padding_ends(pad).tolist()
    found = []
    for n in range(req.q.shape[0]):
        end = ends[n if len(ends) > 1 else 0]
        k0, k1 = (0, min(end, req.j)) if isinstance(pad, Lengths) else (min(max(end, 0), req.j), req.j)
        block = Block(0, req.i, k0, k1 - k0, req.i, req.j)
        mask_n = frame_row(rest, n)
        framed = frame_mask(mask_n, block)
        if isinstance(framed, Offsets):  # rows that see none of the row's keys are left out (zeros)
            first, stop = offset_live_rows(framed, block.it, block.jt)
            block = Block(first, stop - first, k0, k1 - k0, req.i, req.j)
            framed = frame_mask(mask_n, block)
        bias_n = row_slice(req.bias, n) if isinstance(req.bias, Tensor) else req.bias
        found.append(Segment(n, block, framed, frame_bias(bias_n, block), frame_score_mod(req.score_mod, block, row=n)))
    return found


def segments(req: Request) -> list[Segment]:
    """The documents of ``req`` as segments: the rest of the mask, the bias and the score_mod framed at each."""
    docs, rest = documents_of(req.mask)
    if docs is None:
        return _padded_segments(req, *padding_of(req.mask))
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


def _one_by_one(req: Request) -> tuple[Tensor, Tensor | None]:
    """A padded batch as one call per row over its real keys."""
    return run_segments(req, _padded_segments(req, *padding_of(req.mask)))


def run(req: Request) -> tuple[Tensor, None, Tensor | None]:
    if documents_of(req.mask)[0] is not None:
        out, lse = run_segments(req, segments(req))
    else:  # a padded batch: short rows in groups (``backends.padded_rows``: timed once per size class) or a call per row
        pad, rest = padding_of(req.mask)
        if padded_rows.in_groups(req, pad, rest, _one_by_one):
            out, lse = padded_rows.run_row_groups(req)
        else:
            out, lse = run_segments(req, _padded_segments(req, pad, rest))
    return out, None, lse


def reads_hidden_keys(req: Request) -> bool:
    """Whether a kernel of this call may read a key hidden from every query (checked for nan only where one may).

    A padded batch run a row at a time reads each row's real keys alone, packed documents (one set of ids for
    queries and keys) each document's own; under no other mask, or a causal square's, each is seen by some
    query. Groups of padded rows are given their padding; a dense bias may hide keys itself (a ``-inf`` column).
    """
    if isinstance(req.bias, Tensor):
        return True
    docs, rest = documents_of(req.mask)
    if docs is not None:
        return not (docs.ids_k is docs.ids_q and req.i == req.j and _every_key_seen(rest, req))
    pad, rest = padding_of(req.mask)
    if pad is None or padded_rows.in_groups(req, pad, rest, _one_by_one):
        return True
    return not _every_key_seen(rest, req)


def _every_key_seen(rest: Mask | None, req: Request) -> bool:
    """Whether ``rest`` leaves every key of a call seen by some query: no mask, or the causal square's."""
    return rest is None or (req.i == req.j and isinstance(rest, Offsets) and _top_left_range(rest, req.i, req.j))


def _plain_chooser(choose: Callable) -> Callable[[Request], object]:
    """``choose`` for each segment's call, asked once for all the plain ones on the CPU: no mask or PyTorch's
    top-left ``is_causal`` (and no bias or score_mod), which differ only in their sizes, and no CPU backend's
    answer for such a call reads them (32 padded rows of 256: one walk of the backends a call, not 32). On CUDA
    ``flex`` keeps what inductor failed to compile per kind of call, short queries apart: asked each time."""
    chosen = []

    def pick(sub: Request):
        plain = sub.q.device.type == "cpu" and sub.score_mod is None and (
            sub.mask is None and sub.bias is None or _top_left(sub))
        if not plain:
            return choose(sub)[0]
        if not chosen:
            chosen.append(choose(sub)[0])
        return chosen[0]

    return pick


def run_segments(req: Request, parts: list[Segment], packed: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(out (b, h, i, e), lse (b, h, i) | None)``: each segment run as its own call, put back in place.

    Rows no segment covers get ``out = 0`` and ``lse = -inf``; ``lse`` only when
    ``req.return_lse``. Autograd runs through every piece (one ``cat`` per batch row).
    ``packed``: one batch row, returned as ``out (i, h, e)`` and ``lse (h, i)``, the
    tokens-first layout of flash-attn's varlen calls, put together by the same one copy.
    """
    from . import choose  # the dispatcher, for each segment's own call

    pick = _plain_chooser(choose)
    if not torch.is_grad_enabled():
        return _run_into(req, parts, packed, pick)
    # With gradients, one cat per row: copying the pieces into one buffer instead (autograd through
    # the copies) made varlen's forward + backward 1.25-1.3x the per-document loop, against 1.0 here.
    b, h, i_len = req.q.shape[0], req.heads, req.i
    e = req.v.shape[-1]
    rows: list[list[tuple[int, Tensor, Tensor | None]]] = [[] for _ in range(b)]
    views = _cut(req, parts)
    for part, part_views in zip(parts, views):
        if part.block.it == 0 or part.block.jt == 0:  # no rows, or rows that see no key: left as gaps
            continue
        sub = _call(req, part, part_views)
        out, _, lse = pick(sub).run(sub)
        rows[part.row].append((part.block.r0, out, lse))
    outs, lses = [], []
    for pieces in rows:
        row_out, row_lse = _assemble(pieces, req, h, i_len, e, packed)
        outs.append(row_out)
        lses.append(row_lse)
    if packed:
        return _joined(outs[0], req), lses[0]
    out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    lse = None if not req.return_lse else torch.cat(lses, dim=0) if len(lses) > 1 else lses[0]
    return _joined(out, req), lse


def _joined(out: Tensor, req: Request) -> Tensor:
    """``out`` in the graph of the differentiated inputs even where no segment ran (no row sees a key).

    Its rows are zeros made here then, which autograd knows nothing of: a loss of them would
    not reach ``q``, ``k``, ``v`` (``backward`` fails on an output that needs no gradient),
    where every other engine gives zero gradients. Joined through ``where`` with a sum of the
    inputs, never a product: a nan in a hidden key cannot reach the output or the gradients.
    """
    inputs = [x for x in (req.q, req.k, req.v) if x.requires_grad]
    if out.requires_grad or not inputs or not torch.is_grad_enabled():
        return out
    anchor = sum(x.sum() for x in inputs).to(out.dtype)
    return torch.where(torch.zeros((), dtype=torch.bool, device=out.device), anchor, out)


def _run_into(req: Request, parts: list[Segment], packed: bool, pick) -> tuple[Tensor, Tensor | None]:
    """:func:`run_segments` with no gradients recorded: each piece copied into the output as it is made
    and freed, so the peak holds the output and one piece, not every piece and their ``cat``."""
    b, h, i_len, e = req.q.shape[0], req.heads, req.i, req.v.shape[-1]
    acc = torch.promote_types(req.v.dtype, torch.float32)
    # left uninitialised and each row's gaps zeroed at the end: zeroing the whole output first
    # faulted in every page once more (11 ms of a 105 ms call of 64 padded rows of 256)
    out = req.v.new_empty((i_len, h, e) if packed else (b, h, i_len, e))
    covered: list[list[tuple[int, int]]] = [[] for _ in range(b)]
    lse = None
    if req.return_lse:  # rows no segment covers: no mass but a sink's
        lse = torch.full((b, h, i_len), float("-inf"), dtype=acc, device=req.v.device)
        if req.sinks is not None:
            lse.copy_(req.sinks.to(acc).reshape(1, h, 1).expand_as(lse))
    for part in parts:
        if part.block.it == 0 or part.block.jt == 0:
            continue
        sub = _call(req, part)
        piece, _, piece_lse = pick(sub).run(sub)
        rows = slice(part.block.r0, part.block.r0 + piece.shape[2])
        covered[part.row].append((rows.start, rows.stop))
        if packed:
            out[rows].copy_(piece[0].transpose(0, 1))
        else:
            out[part.row, :, rows].copy_(piece[0])
        if lse is not None:
            lse[part.row, :, rows].copy_(piece_lse[0])
        del piece, piece_lse
    for n, spans in enumerate(covered):  # rows no segment covers: zeros
        at = 0
        for r0, r1 in sorted(spans) + [(i_len, i_len)]:
            if r0 > at:
                (out[at:r0] if packed else out[n, :, at:r0]).zero_()
            at = max(at, r1)
    if packed:
        return out, (None if lse is None else lse[0])
    return out, lse


def _cut(req: Request, parts: list[Segment]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Each segment's ``(q, k, v)`` as pieces of one split per input and batch row, where gradients are recorded.

    A slice's backward fills a zero tensor of its source's shape and adds the slice's gradient
    into it, so slicing every segment out of its inputs cost one full-size fill and add per
    segment and input (64 padded rows of 256 tokens: 10x SDPA's step; 16 packed documents
    of 512, forward + backward: 1.34x the per-document loop on an AMD EPYC). Cut once (the
    batch into its rows, each row's positions at every segment's edges, gaps included), the
    backward of each cut is one ``cat``. Where two segments' rows (or keys) overlap, that
    input is sliced per segment as before.
    """
    b = req.q.shape[0]
    rows = [x.split(1) if b > 1 and x.shape[0] == b else (x,) * b for x in (req.q, req.k, req.v)]
    live = [p for p in parts if p.block.it and p.block.jt]
    queries, keys = [set() for _ in range(b)], [set() for _ in range(b)]
    for p in live:
        queries[p.row].add((p.block.r0, p.block.r0 + p.block.it))
        keys[p.row].add((p.block.c0, p.block.c0 + p.block.jt))
    cut = [[_pieces(rows[w][n], sorted((queries if w == 0 else keys)[n])) for n in range(b)] for w in range(3)]
    found = []
    for p in parts:
        blk, n = p.block, p.row
        spans = (blk.r0, blk.r0 + blk.it), (blk.c0, blk.c0 + blk.jt), (blk.c0, blk.c0 + blk.jt)
        found.append(tuple(cut[w][n][span] if span in cut[w][n] else rows[w][n][:, :, span[0] : span[1]]
                           for w, span in enumerate(spans)))  # fmt: skip
    return found


def _pieces(x: Tensor, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], Tensor]:
    """``x`` split along its positions (dim 2) at the edges of ``ranges`` (sorted): ``{range: piece}``; ``{}`` on overlap."""
    sizes, names, at = [], [], 0
    for a, z in ranges:
        if a < at:
            return {}
        if a > at:
            sizes.append(a - at)
            names.append(None)
        sizes.append(z - a)
        names.append((a, z))
        at = z
    if at < x.shape[2]:
        sizes.append(x.shape[2] - at)
        names.append(None)
    if len(sizes) == 1:
        return {names[0]: x} if names[0] is not None else {}
    return {name: piece for name, piece in zip(names, x.split(sizes, dim=2)) if name is not None}


def _call(req: Request, part: Segment, views: tuple[Tensor, Tensor, Tensor] | None = None) -> Request:
    """The segment as a call of its own: views of its batch row's rows, keys and values (``views``: cut already)."""
    blk, n = part.block, part.row
    if views is None:
        rows, cols = slice(blk.r0, blk.r0 + blk.it), slice(blk.c0, blk.c0 + blk.jt)
        views = req.q[n : n + 1, :, rows], req.k[n : n + 1, :, cols], req.v[n : n + 1, :, cols]
    q, k, v = views
    return replace(
        req, q=q, k=k, v=v,
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
    if at < i_len or not outs:  # (no query rows at all: an empty row)
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
