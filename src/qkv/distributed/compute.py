"""Local attention of some global rows against some global keys, with the call's mask and bias framed.

Shape legend: ``b`` batch, ``h`` query heads (``h0 .. h1`` when a strategy holds only some),
``g`` KV heads, ``it`` rows, ``jt`` keys, ``d`` query/key size, ``e`` value size.

Used by the strategies whose local work is one ordinary attention call (all-gather and
Ulysses): ``qkv.attention`` on the block, so the engine's fast paths (the fused diagonal
kernel for windows and ALiBi, key skipping under causal masks) apply to each block as they
would to an unsharded call. Autograd runs through it.
"""

from __future__ import annotations


from torch import Tensor

from ..backends.engines import key_blocks
from ..functional import attention
from .blocks import Work
from .comm import Group
from ..backends.tiling.framing import Block, frame_bias, frame_mask, frame_score_mod, mask_state
from .ring import attend, plan_for, row_bytes


def attend_rows(q: Tensor, k: Tensor, v: Tensor, call, *, r0: int = 0, c0: int = 0,
                heads: tuple[int, int] | None = None) -> Tensor:  # fmt: skip
    """``q (b, h, it, d)`` at global rows ``r0 ..`` against ``k (b, g, jt, d)``, ``v`` at keys ``c0 ..``.

    A block the mask leaves empty is not computed: its rows are zero (as for any query
    with no visible key), and no gradient flows through them.
    """
    req = call.req
    block = Block(r0, q.shape[-2], c0, k.shape[-2], call.i_len, call.j_len)
    sinks = req.sinks if req.sinks is None or heads is None else req.sinks[heads[0] : heads[1]]
    if mask_state(req.mask, block) == "empty":  # with sinks too: a sink has no value, the rows stay 0
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))
    if req.dropout > 0:  # the dropout mask must be the whole call's at these coordinates
        return _placed(q, k, v, call, block, heads, sinks)
    return attention(
        q, k, v, score=req.score, mask=frame_mask(req.mask, block, heads), bias=frame_bias(req.bias, block, heads),
        scale=req.scale, score_mod=frame_score_mod(req.score_mod, block, heads), sinks=sinks,
    )  # fmt: skip





def _placed(q: Tensor, k: Tensor, v: Tensor, call, block: Block, heads: tuple[int, int] | None,
            sinks: Tensor | None) -> Tensor:  # fmt: skip
    """The block through ``backends.engines.key_blocks``, which places its dropout mask at the block's origin.

    A ring of one rank: the same forward and backward as the ring strategy, no messages.
    """
    req = call.req
    qp, kp = req.score.prepare(q, k)
    work = Work(req, call.i_len, call.j_len, call.seed, heads, call.dims["h"])
    per_row = row_bytes(q.shape[0], q.shape[1], k.shape[1], kp.shape[-1], v.shape[-1], v.dtype)
    plan = plan_for(Group(None, 1, 0), work, [((block.r0, block.it),)], [((block.c0, block.jt),)], block.it, block.jt,
                    per_row)  # fmt: skip
    dense = req.bias if isinstance(req.bias, Tensor) else None
    return attend(qp, kp, v, dense, plan, key_blocks.parameters(req), sinks)
