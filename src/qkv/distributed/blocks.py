"""The blocks one rank computes: its query pieces against one key piece, through ``backends.engines.key_blocks``.

Shape legend: ``b`` batch, ``h`` query heads (this rank's), ``g`` KV heads, ``d`` prepared
query/key size, ``e`` value size, ``S·c`` a rank's padded rows (``S`` slots of ``c``);
``it``/``jt`` the real rows/keys of one block.

A rank's rows are ``S`` slots of ``c`` padded rows (``layout``), each slot a contiguous
range of global positions. For computing and for sending, slots are cut into *pieces* of
at most :data:`PIECE_BYTES` (of the keys and values a piece carries, or of the output rows
a query piece produces), so that memory in flight stays a few pieces whatever the
sequence length: K/V move piece by piece, and the transient output of one block is one
query piece. Every rank cuts every rank's slots the same way (:class:`Pieces`), so both
ends of a transfer agree on it.

A block is a query piece against a key piece at global positions (``framing.Block``): a
block the mask leaves empty is skipped; the others run ``key_blocks.forward`` with the mask
and bias framed, and merge into the rows' running ``(out, lse)`` in place (in float32 or
wider; a row that has seen no key yet has ``lse = -inf`` and takes the new block's values,
never NaN). The backward runs ``key_blocks.backward`` on the same blocks with the rows' final
``(out, lse)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ..backends.engines import key_blocks
from ..backends.tiling.dropout import Origin
from ..backends.tiling.lse import merge_into
from ..backends.request import Request
from ..backends.tiling.framing import Block, block_slice, frame_bias, frame_mask, frame_score_mod, mask_state

#: Largest piece (1 MiB), in bytes of what it carries ([k | v] of a key piece; the float32 output
#: rows of a query piece). Small enough that a few in flight are a fraction of a rank's
#: shard at long lengths; large enough that each block is a large kernel call.
PIECE_BYTES = 2**20
#: Fewest rows in a piece (below this, messages and kernel calls are too small to pay off).
MIN_ROWS = 128


@dataclass(frozen=True)
class Pieces:
    """One rank's rows cut into pieces: ``(global start, real rows, local start)`` each, in slot order.

    Every slot is cut into ``per_slot`` pieces of ``rows`` (the last ones shorter or empty),
    so every rank has the same number of pieces, :attr:`count`, and piece ``n`` of one rank
    meets piece ``n`` of another in the same round of the ring.
    """

    spans: tuple[tuple[int, int, int], ...]
    slots: int = 1  # the rank's slots, each cut into count / slots pieces

    @classmethod
    def cut(cls, slots: tuple[tuple[int, int], ...], side: int, rows: int) -> Pieces:
        """``slots`` ``(global start, real rows)`` of ``side`` padded rows each, in pieces of ``rows``."""
        rows = max(1, min(rows, side)) if side else 1
        per_slot = -(-side // rows) if side else 0
        spans = []
        for slot, (start, real) in enumerate(slots):
            for n in range(per_slot):
                a = min(n * rows, real)
                spans.append((start + a, min(real, (n + 1) * rows) - a, slot * side + a))
        return cls(tuple(spans), max(1, len(slots)))

    @property
    def count(self) -> int:
        return len(self.spans)

    def interleaved(self) -> list[int]:
        """The pieces slot by slot in turn: piece 0 of every slot, then piece 1 of every slot, and so on.

        The ring sends a rank's pieces in this order. Under a causal mask the zigzag layout's two
        slots are an early and a late stretch of the sequence, which the receiving rank's queries
        see in full and not at all (or the reverse): sent slot after slot, one rank computed
        twice its share for half the rounds while the other waited on it (P = 2, n = 16384: 1.3-1.7 s
        of a 9 s step waiting). In turn, each two rounds carry about the same work on every rank.
        """
        per_slot, rest = divmod(self.count, self.slots)
        if rest:  # (cut() gives every slot as many pieces; a hand-made one might not, and none may be dropped)
            raise ValueError(f"Pieces: {self.count} pieces do not split into {self.slots} slots")
        return [slot * per_slot + n for n in range(per_slot) for slot in range(self.slots)]

    def rows(self, n: int) -> slice:
        """Local rows of piece ``n`` in the padded ``(S·c)`` layout."""
        _, real, local = self.spans[n]
        return slice(local, local + real)


def piece_rows(bytes_per_row: int) -> int:
    """Rows per piece for rows of ``bytes_per_row`` bytes."""
    return max(MIN_ROWS, PIECE_BYTES // max(1, bytes_per_row))


#: Query-key pairs this process has computed (the benchmark's per-rank work), by strategy.
computed = {"elements": 0}


@dataclass
class Work:
    """What a rank computes, shared by the forward and the backward."""

    req: Request  # the whole call (score, mask with causal folded, bias, scale, dropout)
    i_len: int  # I
    j_len: int  # J
    seed: int  # dropout seed of the whole call
    heads: tuple[int, int] | None  # this rank's query heads (Ulysses inside hybrid), None = all
    total_heads: int  # h of the whole call

    def blocks(self, q: Pieces, k: Pieces, key: int | None = None):
        """``(query piece, key piece, block)`` of every non-empty block (of key piece ``key`` only, if given)."""
        keys = range(k.count) if key is None else (key,)
        for c in keys:
            c0, jt, _ = k.spans[c]
            for a, (r0, it, _) in enumerate(q.spans):
                block = Block(r0, it, c0, jt, self.i_len, self.j_len)
                if mask_state(self.req.mask, block) != "empty":
                    yield a, c, block

    def needs(self, q: Pieces, k: Pieces, key: int | None = None) -> bool:
        """Whether any query piece sees anything of these keys."""
        return next(iter(self.blocks(q, k, key)), None) is not None

    def request(self, block: Block, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None) -> Request:
        req = self.req
        bias = req.bias if dense is None else dense
        return replace(
            req, q=q, k=k, v=v, mask=frame_mask(req.mask, block, self.heads), bias=frame_bias(bias, block, self.heads),
            score_mod=frame_score_mod(req.score_mod, block, self.heads), sinks=None, generator=None,
            return_weights=False, weights_for=None,  # sinks join the merged rows once (ring.RingAttention)
        )  # fmt: skip

    def origin(self, block: Block) -> Origin:
        head = 0 if self.heads is None else self.heads[0]
        return Origin(head=head, heads=self.total_heads, row=block.r0, col=block.c0)

    def forward(self, qp: Tensor, q: Pieces, kp: Tensor, v: Tensor, k: Pieces, key: int | None,
                dense: Tensor | None, out: Tensor, lse: Tensor) -> None:  # fmt: skip
        """Merge the blocks against key piece ``key`` into ``out``, ``lse`` in place.

        With ``key=None``, ``kp``, ``v`` are a rank's padded keys and every piece is used;
        otherwise they are piece ``key`` alone (a received buffer).
        """
        for a, c, block in self.blocks(q, k, key):
            rows, cols = q.rows(a), _cols(k, c, key)
            preq = self.request(block, qp[..., rows, :], kp[..., cols, :], v[..., cols, :], dense)
            o, m = key_blocks.forward(preq, self.seed, self.origin(block))
            merge_into(out[..., rows, :], lse[..., rows], o, m)
            computed["elements"] += block.it * block.jt

    def backward(self, qp: Tensor, q: Pieces, kp: Tensor, v: Tensor, k: Pieces, key: int | None,
                 dense: Tensor | None, out: Tensor, lse: Tensor, d_out: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                 d_dense: Tensor | None, d_params: list) -> None:  # fmt: skip
        """Add the blocks' gradients into ``dq``, ``dk``, ``dv`` (shaped like ``kp``, ``v``), a dense bias, the parameters."""
        for a, c, block in self.blocks(q, k, key):
            rows, cols = q.rows(a), _cols(k, c, key)
            preq = self.request(block, qp[..., rows, :], kp[..., cols, :], v[..., cols, :], dense)
            grads = key_blocks.backward(
                preq, out[..., rows, :], lse[..., rows], d_out[..., rows, :], self.seed, self.origin(block)
            )
            dq[..., rows, :] += grads.q
            dk[..., cols, :] += grads.k
            dv[..., cols, :] += grads.v
            if d_dense is not None and grads.bias is not None:
                block_slice(d_dense, block, self.heads).add_(grads.bias.to(d_dense.dtype))
            for n, grad in enumerate(grads.params):
                if grad is not None:
                    d_params[n] = grad if d_params[n] is None else d_params[n] + grad
            del grads


def _cols(k: Pieces, c: int, key: int | None) -> slice:
    """Where key piece ``c`` sits: at its rows of the rank's keys (``key`` None), or alone in a buffer."""
    return k.rows(c) if key is None else slice(0, k.spans[c][1])
