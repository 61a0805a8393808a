"""How a sequence is split across the ranks of a group: contiguous or zigzag chunks.

Shape legend: ``n`` the sequence length (``i`` for queries, ``j`` for keys), ``P`` ranks,
``c`` rows per chunk (the chunk side), ``s`` chunk slots per rank (1 contiguous, 2 zigzag).

The sequence is cut into equal chunks of side ``c = ceil(n / chunks)``; the last ones are
shorter or empty when ``n`` is not a multiple of ``chunks``::

    contiguous, P = 4:   | 0 | 1 | 2 | 3 |          rank r holds chunk r
    zigzag,     P = 4:   |0|1|2|3|3|2|1|0|          rank r holds chunks r and 2P - 1 - r

Zigzag (Brandon et al. 2023, "Striped Attention", and the load-balanced ring of
Llama 3 / ring-flash-attention) gives every rank one early and one late chunk, so under a
causal mask each rank has the same number of visible query-key pairs up to one chunk's
worth; contiguous leaves rank 0 with one chunk of work and rank P - 1 with P.

Each rank holds only its real rows (different counts on different ranks, possibly none).
Internally a rank's rows are padded to ``s`` slots of ``c`` rows, so that every message
between ranks has the same size; the padding is never attended (blocks are cut to their
real rows and keys before computing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: The layouts ``shard``, ``unshard``, ``positions`` and ``attention`` accept.
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


@dataclass(frozen=True)
class Layout:
    """A sequence of ``length`` rows split over ``ranks`` ranks in the ``kind`` layout."""

    kind: str  # "contiguous" or "zigzag"
    length: int  # rows of the whole sequence
    ranks: int  # P, the group size

    @property
    def chunks(self) -> int:
        return self.ranks if self.kind == "contiguous" else 2 * self.ranks

    @property
    def side(self) -> int:
        """Rows per chunk, ``c`` (the last chunks may hold fewer real rows)."""
        return -(-self.length // self.chunks)

    @property
    def slots(self) -> int:
        """Chunks per rank, ``s``."""
        return 1 if self.kind == "contiguous" else 2

    def owned(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` holds, in the order its rows are stored."""
        return (rank,) if self.kind == "contiguous" else (rank, 2 * self.ranks - 1 - rank)

    def span(self, chunk: int) -> tuple[int, int]:
        """``(start, stop)``: the global rows of chunk ``chunk`` (``start == stop`` if it is empty)."""
        start = min(chunk * self.side, self.length)
        return start, min(start + self.side, self.length)

    def slot_spans(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(start, real rows)`` of each slot of ``rank``."""
        return tuple((a, b - a) for a, b in (self.span(c) for c in self.owned(rank)))

    def rows(self, rank: int) -> int:
        """Real rows rank ``rank`` holds."""
        return sum(n for _, n in self.slot_spans(rank))

    def positions(self, rank: int, device: torch.device | str = "cpu") -> Tensor:
        """``(rows,)`` long: the global positions of rank ``rank``'s rows, in storage order."""
        parts = [torch.arange(a, a + n, device=device) for a, n in self.slot_spans(rank)]
        return torch.cat(parts)

    def take(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """Rank ``rank``'s rows of the whole tensor ``x`` (``x.shape[dim] == length``)."""
        return torch.cat([x.narrow(dim, a, n) for a, n in self.slot_spans(rank)], dim)

    def pad(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """Real rows ``(..., rows, ...)`` -> padded slots ``(..., s·c, ...)`` (zeros after each slot's rows)."""
        dim = dim % x.dim()
        if all(n == self.side for _, n in self.slot_spans(rank)):
            return x  # nothing to pad: the rows already are the slots
        parts, at = [], 0
        for _, n in self.slot_spans(rank):
            part = x.narrow(dim, at, n)
            at += n
            if n < self.side:
                widths = [0, 0] * (x.dim() - 1 - dim) + [0, self.side - n]
                part = F.pad(part, widths)
            parts.append(part)
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def unpad(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """Padded slots ``(..., s·c, ...)`` -> the real rows ``(..., rows, ...)``."""
        if all(n == self.side for _, n in self.slot_spans(rank)):
            return x
        parts = [x.narrow(dim, slot * self.side, n) for slot, (_, n) in enumerate(self.slot_spans(rank))]
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def assemble(self, padded: Tensor, dim: int) -> Tensor:
        """``(P, ..., s·c, ...)`` padded slots of every rank -> the whole ``(..., length, ...)`` in order.

        ``dim`` is the row dim of one rank's part (without the leading ``P``).
        """
        dim = dim % (padded.dim() - 1)
        pieces: list[tuple[int, Tensor]] = []
        for rank in range(self.ranks):
            for slot, (start, n) in enumerate(self.slot_spans(rank)):
                if n:
                    pieces.append((start, padded[rank].narrow(dim, slot * self.side, n)))
        if not pieces:  # an empty sequence: a slice of no rows, still on the autograd graph of ``padded``
            return padded[0].narrow(dim, 0, 0)
        pieces.sort(key=lambda p: p[0])
        return torch.cat([p for _, p in pieces], dim)

    def scatter(self, whole: Tensor, dim: int) -> Tensor:
        """The inverse of :meth:`assemble`: ``(..., length, ...)`` -> ``(P, ..., s·c, ...)`` padded slots."""
        return torch.stack([self.pad(self.take(whole, dim, r), dim, r) for r in range(self.ranks)])
