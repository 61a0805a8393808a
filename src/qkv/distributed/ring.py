"""The ring strategy: K/V blocks visit the ranks that need them; partial results merge by log-sum-exp.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``d`` prepared query/key size,
``e`` value size, ``P`` ranks, ``S·c`` a rank's padded rows (``S`` slots of ``c``).

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): at step ``s = 0 .. P-1`` rank ``r`` holds the keys and values of
rank ``r - s`` and attends its queries to them; the per-step outputs merge by their
log-sum-exp (``backends.engines.key_blocks.merge``), so the result is the exact softmax over all keys.
The next step's K/V are posted before this step's blocks are computed, so transfer and
compute overlap. The backward walks the same steps with the saved final ``(out, lse)``
(FlashAttention-2's backward needs nothing else, ``key_blocks.backward``): ``dq`` stays, the
``dk, dv`` of a visiting block travel back to the rank that owns it. The forward is not
rerun. Attention sinks (``sinks (h,)``, GPT-OSS) join each row's denominator once, after
the last block (``key_blocks.with_sinks``).

Each step's K/V are sent straight from their owner rank (``r - s -> r``), not forwarded
hop by hop; the schedule of blocks is ring attention's, and the bytes per step the same
(one rank's ``g`` KV heads: ``(P - 1)·2·(n/P)·g·d`` elements per pass without a mask),
but a piece of keys that the mask hides from all of a rank's queries is not sent to it:
a sliding window sends only to the ranks its window reaches, and under a causal mask in
the contiguous layout no rank sends to the ranks before it.

K/V travel in pieces (``blocks.Pieces``), one piece per round: round ``(s, n)`` carries piece
``n`` of every rank to the rank ``s`` places ahead, the pieces of a step taken slot by slot in
turn (``Pieces.interleaved``: under a causal mask the zigzag layout's two slots are work for
the receiver in full and not at all, so in turn every round carries about the same work on
every rank, and no rank waits on a peer that has twice its share; 17% faster at P = 2). Every rank walks the same rounds, posts
round ``t + 1``'s sends and receives (``batch_isend_irecv``) before waiting for round ``t``'s,
and derives who sends what from the same mask, so each send meets its receive and no
rank waits for a round its peer has not posted: by induction on ``t``, nothing deadlocks.
Two pieces are in flight at a time, whatever the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.engines import key_blocks
from ..backends.request import Request
from .blocks import Pieces, Work, piece_rows
from .comm import Exchange, Group

#: Rows of a query piece, in key pieces (a multiple keeps the causal diagonal on piece edges).
QUERY_PIECES = 1
#: Message tags: K/V on the way out, their gradients on the way back.
KV_TAG, GRAD_TAG = 1, 2


@dataclass
class RingPlan:
    """Who holds what: the ring's group, every member's query and key pieces, and the work."""

    group: Group
    q_pieces: list[Pieces]  # per ring member
    k_pieces: list[Pieces]  # per ring member
    work: Work

    def __post_init__(self):
        size, me = self.group.size, self.group.rank
        mine_q, mine_k = self.q_pieces[me], self.k_pieces[me]
        self.count = mine_k.count  # pieces per rank: the same on every rank
        # the pieces slot by slot in turn (Pieces.interleaved): each round's work is about the same on every rank
        self.rounds = [(s, n) for s in range(1, size) for n in mine_k.interleaved()]
        # recv[s][n]: my queries see piece n of the rank s behind; send[s][n]: the rank s ahead sees my piece n
        self.recv, self.send = {}, {}
        for s in range(1, size):
            to, source = self.peers(s)
            self.recv[s] = [self.work.needs(mine_q, self.k_pieces[source], n) for n in range(self.count)]
            self.send[s] = [self.work.needs(self.q_pieces[to], mine_k, n) for n in range(self.count)]

    def peers(self, step: int) -> tuple[int, int]:
        """``(to, source)``: the member this rank sends its K/V to at ``step``, and the one it receives from."""
        me, size = self.group.rank, self.group.size
        return (me + step) % size, (me - step) % size


class _Round:
    """One round's K/V transfer: this rank's piece out, the source's piece in (either may be absent)."""

    def __init__(self, plan: RingPlan, t: int, kp: Tensor, v: Tensor):
        step, n = plan.rounds[t]
        self.step, self.piece = step, n
        to, self.source = plan.peers(step)
        sends, recvs, self.buf = [], [], None
        if plan.send[step][n]:
            rows = plan.k_pieces[plan.group.rank].rows(n)
            sends.append((torch.cat((kp[..., rows, :], v[..., rows, :]), -1), to))  # one contiguous message
        if plan.recv[step][n]:
            real = plan.k_pieces[self.source].spans[n][1]
            self.buf = kp.new_empty((*kp.shape[:-2], real, kp.shape[-1] + v.shape[-1]))
            recvs.append((self.buf, self.source))
        self.exchange = Exchange(plan.group, sends, recvs, "kv", tag=KV_TAG)
        self.exchange.keep = sends  # the send buffers live until the exchange is waited for

    def wait(self) -> Tensor | None:
        self.exchange.wait()
        return self.buf


class RingAttention(torch.autograd.Function):
    """``(qp, kp, v, dense, *params) -> out``, all padded to slots; see the module docstring."""

    @staticmethod
    def forward(ctx, plan: RingPlan, qp: Tensor, kp: Tensor, v: Tensor, dense: Tensor | None, sinks: Tensor | None,
                *params: Tensor):  # fmt: skip
        me, work = plan.group.rank, plan.work
        acc = torch.promote_types(v.dtype, torch.float32)
        out = torch.zeros((*qp.shape[:-1], v.shape[-1]), dtype=acc, device=qp.device)
        lse = torch.full(qp.shape[:-1], float("-inf"), dtype=acc, device=qp.device)
        q_pieces, d = plan.q_pieces[me], kp.shape[-1]
        rounds = len(plan.rounds)
        pending = _Round(plan, 0, kp, v) if rounds else None
        work.forward(qp, q_pieces, kp, v, plan.k_pieces[me], None, dense, out, lse)
        for t in range(rounds):
            following = _Round(plan, t + 1, kp, v) if t + 1 < rounds else None
            buf = pending.wait()
            if buf is not None:
                work.forward(qp, q_pieces, buf[..., :d], buf[..., d:], plan.k_pieces[pending.source], pending.piece,
                             dense, out, lse)  # fmt: skip
            pending, buf = following, None
        if sinks is not None:  # each row's denominator gains exp(sink) once, after every block
            out, lse = key_blocks.with_sinks(out, lse, sinks.detach())
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, v, dense, sinks, out, lse, *params)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        plan: RingPlan = ctx.plan
        qp, kp, v, dense, sinks, out, lse, *params = ctx.saved_tensors
        me, work = plan.group.rank, plan.work
        acc, d = out.dtype, kp.shape[-1]
        d_out = d_out.to(acc)
        grad_dense = dense is not None and ctx.needs_input_grad[4]
        if dense is not None:
            dense = dense.detach().requires_grad_(grad_dense)
        dq = torch.zeros(qp.shape, dtype=acc, device=qp.device)
        # this rank's dk, dv: separate (contiguous, as autograd stores them), [dk | dv] only in messages
        dk_own = torch.zeros(kp.shape, dtype=acc, device=kp.device)
        dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)
        d_dense = torch.zeros(dense.shape, dtype=acc, device=dense.device) if grad_dense else None
        d_params: list[Tensor | None] = [None] * len(params)
        q_pieces, my_pieces = plan.q_pieces[me], plan.k_pieces[me]
        rounds = len(plan.rounds)
        pending = _Round(plan, 0, kp, v) if rounds else None
        work.backward(qp, q_pieces, kp, v, my_pieces, None, dense, out, lse, d_out, dq, dk_own, dv_own, d_dense,
                      d_params)  # fmt: skip
        returning = None  # (exchange, buffer for my piece's gradient, piece)
        for t in range(rounds):
            following = _Round(plan, t + 1, kp, v) if t + 1 < rounds else None
            buf = pending.wait()
            dkv = None
            if buf is not None:
                dkv = torch.zeros(buf.shape, dtype=acc, device=buf.device)  # [dk | dv] of the visiting piece
                work.backward(qp, q_pieces, buf[..., :d], buf[..., d:], plan.k_pieces[pending.source], pending.piece,
                              dense, out, lse, d_out, dq, dkv[..., :d], dkv[..., d:], d_dense, d_params)  # fmt: skip
            buf = None
            if returning is not None:  # the previous round's gradient of my piece has arrived
                _collect(returning, dk_own, dv_own, my_pieces)
            # this round's K/V gradient goes back to its owner; mine comes back from the rank I sent to
            step, n = pending.step, pending.piece
            to = plan.peers(step)[0]
            back = None
            if plan.send[step][n]:
                back = torch.empty((*kp.shape[:-2], my_pieces.spans[n][1], d + v.shape[-1]), dtype=acc,
                                   device=kp.device)  # fmt: skip
            sends = [] if dkv is None else [(dkv, pending.source)]
            exchange = Exchange(plan.group, sends, [] if back is None else [(back, to)], "grad", tag=GRAD_TAG)
            exchange.keep = dkv
            returning = (exchange, back, n)
            pending = following
        if returning is not None:
            _collect(returning, dk_own, dv_own, my_pieces)
        dk, dv = dk_own.to(kp.dtype), dv_own.to(v.dtype)
        d_params_out = [None if g is None else g.to(p.dtype) for g, p in zip(d_params, params)]
        d_dense = None if d_dense is None else d_dense.to(dense.dtype)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            # d s_h = -Σ_rows exp(s_h - lse) · rowsum(dO ∘ O) (rows without keys have O = 0)
            share = torch.exp(sinks.to(acc)[:, None] - lse) * (d_out * out).sum(-1)
            per_head = share.sum(-1)  # (..., h): summed over the leading dims (no reshape: 0 rows leave -1 ambiguous)
            d_sinks = -per_head.sum(tuple(range(per_head.dim() - 1))).to(sinks.dtype)
        return None, dq.to(qp.dtype), dk, dv, d_dense, d_sinks, *d_params_out


def _collect(returning, dk: Tensor, dv: Tensor, pieces: Pieces) -> None:
    """Wait for a returned ``[dk | dv]`` of one of this rank's pieces and add it in."""
    exchange, back, n = returning
    exchange.wait()
    if back is not None:
        rows, d = pieces.rows(n), dk.shape[-1]
        dk[..., rows, :] += back[..., :d]
        dv[..., rows, :] += back[..., d:]


def plan_for(group: Group, work: Work, q_slots: list, k_slots: list, q_side: int, k_side: int,
             bytes_per_row: int) -> RingPlan:  # fmt: skip
    """A :class:`RingPlan` from every member's slots ``(global start, real rows)`` and the slot sides."""
    rows = piece_rows(bytes_per_row)
    q_rows = rows * QUERY_PIECES  # query pieces only bound a block's transient output: larger, fewer calls
    q_pieces = [Pieces.cut(spans, q_side, q_rows) for spans in q_slots]
    k_pieces = [Pieces.cut(spans, k_side, rows) for spans in k_slots]
    return RingPlan(group, q_pieces, k_pieces, work)


def row_bytes(b: int, h: int, g: int, d: int, e: int, dtype: torch.dtype) -> int:
    """Bytes of one row of what a piece carries: ``[k | v]`` of ``g`` heads, or ``h`` heads of float32 output."""
    acc = torch.promote_types(dtype, torch.float32)
    return max(b * g * (d + e) * torch.empty((), dtype=dtype).element_size(),
               b * h * e * torch.empty((), dtype=acc).element_size())  # fmt: skip


def attend(qp: Tensor, kp: Tensor, v: Tensor, dense: Tensor | None, plan: RingPlan, params: list[Tensor],
           sinks: Tensor | None = None) -> Tensor:  # fmt: skip
    """Run :class:`RingAttention` (padded slots in, padded slots out); ``sinks`` of this rank's heads."""
    return RingAttention.apply(plan, qp, kp, v, dense, sinks, *params)


def run(q: Tensor, k: Tensor, v: Tensor, call) -> Tensor:
    grp, lay_q, lay_k = call.group, call.q_layout, call.k_layout
    req: Request = call.req
    qp, kp = req.score.prepare(q, k)  # per position, on the local rows; the graph stays outside
    members = range(grp.size)
    work = Work(req, call.i_len, call.j_len, call.seed, None, call.dims["h"])
    per_row = row_bytes(q.shape[0], q.shape[1], k.shape[1], kp.shape[-1], v.shape[-1], v.dtype)
    plan = plan_for(grp, work, [lay_q.slot_spans(r) for r in members], [lay_k.slot_spans(r) for r in members],
                    lay_q.side, lay_k.side, per_row)  # fmt: skip
    dense = req.bias if isinstance(req.bias, Tensor) else None
    out = attend(lay_q.pad(qp, -2, grp.rank), lay_k.pad(kp, -2, grp.rank), lay_k.pad(v, -2, grp.rank), dense,
                 plan, key_blocks.parameters(req), req.sinks)  # fmt: skip
    return lay_q.unpad(out, -2, grp.rank)
