"""The ring strategy: K/V blocks visit the ranks that need them; partial results merge by log-sum-exp.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``d`` prepared query/key size,
``e`` value size, ``P`` ranks, ``S·c`` a rank's padded rows (``S`` slots of ``c``).

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): at step ``s = 0 .. P-1`` rank ``r`` holds the keys and values of
rank ``r - s`` and attends its queries to them; the per-step outputs merge by their
log-sum-exp (``backends.partial.merge``), so the result is the exact softmax over all keys.
The next step's K/V are posted before this step's blocks are computed, so transfer and
compute overlap. The backward walks the same steps with the saved final ``(out, lse)``
(FlashAttention-2's backward needs nothing else, ``partial.backward``): ``dq`` stays, the
``dk, dv`` of a visiting block travel back to the rank that owns it. The forward is not
rerun.

Each step's K/V are sent straight from their owner rank (``r - s -> r``), not forwarded
hop by hop; the schedule of blocks is ring attention's, and the bytes per step the same
(one rank's ``g`` KV heads: ``(P - 1)·2·(n/P)·g·d`` elements per pass without a mask),
but a pair of ranks that the mask leaves without a visible block exchanges nothing: a
sliding window sends only to the ranks its window reaches, and under a causal mask in
the contiguous layout no rank sends to the ranks before it. Every rank derives the same
table of pairs from the same mask, so each send meets its receive
(``comm.Exchange``, ``batch_isend_irecv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends import partial
from ..backends.request import Request
from .blocks import Slots, Work
from .comm import Exchange, Group

#: Message tags: K/V on the way out, their gradients on the way back.
KV_TAG, GRAD_TAG = 1, 2


@dataclass
class RingPlan:
    """Who holds what: the ring's group, every member's query and key slots, and the work."""

    group: Group
    q_slots: list[Slots]  # per ring member
    k_slots: list[Slots]  # per ring member
    work: Work

    def __post_init__(self):
        me, members = self.group.rank, range(self.group.size)
        mine_q, mine_k = self.q_slots[me], self.k_slots[me]
        # recv[o]: my queries see a block of member o's keys; send[a]: member a's queries see mine
        self.recv = [o != me and self.work.needs(mine_q, self.k_slots[o]) for o in members]
        self.send = [a != me and self.work.needs(self.q_slots[a], mine_k) for a in members]

    def peers(self, step: int) -> tuple[int, int]:
        """``(to, source)``: the member this rank sends its K/V to at ``step``, and the one it receives from."""
        me, size = self.group.rank, self.group.size
        return (me + step) % size, (me - step) % size


def _post_kv(plan: RingPlan, step: int, packed: Tensor) -> tuple[Exchange, Tensor | None]:
    to, source = plan.peers(step)
    buf = torch.empty_like(packed) if plan.recv[source] else None
    sends = [(packed, to)] if plan.send[to] else []
    recvs = [(buf, source)] if buf is not None else []
    return Exchange(plan.group, sends, recvs, "kv", tag=KV_TAG), buf


class RingAttention(torch.autograd.Function):
    """``(qp, kp, v, dense, *params) -> out``, all padded to slots; see the module docstring."""

    @staticmethod
    def forward(ctx, plan: RingPlan, qp: Tensor, kp: Tensor, v: Tensor, dense: Tensor | None, *params: Tensor):
        me, size = plan.group.rank, plan.group.size
        acc = torch.promote_types(v.dtype, torch.float32)
        out = torch.zeros((*qp.shape[:-1], v.shape[-1]), dtype=acc, device=qp.device)
        lse = torch.full(qp.shape[:-1], float("-inf"), dtype=acc, device=qp.device)
        d = kp.shape[-1]
        packed = torch.cat((kp, v), -1).contiguous()  # one message per step: [k | v]
        pending = _post_kv(plan, 1, packed) if size > 1 else None
        plan.work.forward(qp, plan.q_slots[me], kp, v, plan.k_slots[me], dense, out, lse)
        for step in range(1, size):
            exchange, buf = pending
            exchange.wait()
            pending = _post_kv(plan, step + 1, packed) if step + 1 < size else None
            source = plan.peers(step)[1]
            if buf is not None:
                plan.work.forward(qp, plan.q_slots[me], buf[..., :d], buf[..., d:], plan.k_slots[source], dense, out, lse)
            del buf
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, v, dense, out, lse, *params)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        plan: RingPlan = ctx.plan
        qp, kp, v, dense, out, lse, *params = ctx.saved_tensors
        me, size = plan.group.rank, plan.group.size
        acc = out.dtype
        d = kp.shape[-1]
        d_out = d_out.to(acc)
        grad_dense = dense is not None and ctx.needs_input_grad[4]
        if dense is not None:
            dense = dense.detach().requires_grad_(grad_dense)
        dq = torch.zeros(qp.shape, dtype=acc, device=qp.device)
        packed = torch.cat((kp, v), -1).contiguous()
        dkv_own = torch.zeros(packed.shape, dtype=acc, device=qp.device)  # [dk | dv] of this rank's keys
        d_dense = torch.zeros(dense.shape, dtype=acc, device=dense.device) if grad_dense else None
        d_params: list[Tensor | None] = [None] * len(params)
        work, q_slots = plan.work, plan.q_slots[me]
        pending = _post_kv(plan, 1, packed) if size > 1 else None
        work.backward(qp, q_slots, kp, v, plan.k_slots[me], dense, out, lse, d_out, dq, dkv_own, d_dense, d_params)
        returning: Exchange | None = None
        returned: Tensor | None = None
        for step in range(1, size):
            exchange, buf = pending
            exchange.wait()
            pending = _post_kv(plan, step + 1, packed) if step + 1 < size else None
            to, source = plan.peers(step)
            dkv = None
            if buf is not None:
                dkv = torch.zeros(buf.shape, dtype=acc, device=buf.device)
                work.backward(qp, q_slots, buf[..., :d], buf[..., d:], plan.k_slots[source], dense, out, lse, d_out,
                              dq, dkv, d_dense, d_params)  # fmt: skip
            del buf
            if returning is not None:  # the previous step's gradients for my keys have arrived
                returning.wait()
                if returned is not None:
                    dkv_own += returned
            # this step's K/V gradients go back to their owner; mine come back from `to`
            returned = torch.empty_like(dkv_own) if plan.send[to] else None
            sends = [(dkv, source)] if dkv is not None else []
            recvs = [(returned, to)] if returned is not None else []
            returning = Exchange(plan.group, sends, recvs, "grad", tag=GRAD_TAG)
            returning.keep = dkv  # the send buffer lives until the exchange is waited for
        if returning is not None:
            returning.wait()
            if returned is not None:
                dkv_own += returned
        dk, dv = dkv_own[..., :d].to(kp.dtype), dkv_own[..., d:].to(v.dtype)
        d_params_out = [None if g is None else g.to(p.dtype) for g, p in zip(d_params, params)]
        d_dense = None if d_dense is None else d_dense.to(dense.dtype)
        return None, dq.to(qp.dtype), dk, dv, d_dense, *d_params_out


def attend(qp: Tensor, kp: Tensor, v: Tensor, dense: Tensor | None, plan: RingPlan, params: list[Tensor]) -> Tensor:
    """Run :class:`RingAttention` (padded slots in, padded slots out)."""
    return RingAttention.apply(plan, qp, kp, v, dense, *params)


def run(q: Tensor, k: Tensor, v: Tensor, call) -> Tensor:
    grp, lay_q, lay_k = call.group, call.q_layout, call.k_layout
    req: Request = call.req
    qp, kp = req.score.prepare(q, k)  # per position, on the local rows; the graph stays outside
    members = range(grp.size)
    q_slots = [Slots(lay_q.slot_spans(r), lay_q.side) for r in members]
    k_slots = [Slots(lay_k.slot_spans(r), lay_k.side) for r in members]
    work = Work(req, call.i_len, call.j_len, call.seed, None, call.dims["h"])
    plan = RingPlan(grp, q_slots, k_slots, work)
    dense = req.bias if isinstance(req.bias, Tensor) else None
    params = partial.parameters(req)
    out = attend(lay_q.pad(qp, -2, grp.rank), lay_k.pad(kp, -2, grp.rank), lay_k.pad(v, -2, grp.rank), dense,
                 plan, params)  # fmt: skip
    return lay_q.unpad(out, -2, grp.rank)
