"""The blocks one rank computes: its query chunks against one rank's key chunks, through ``backends.partial``.

Shape legend: ``b`` batch, ``h`` query heads (this rank's), ``g`` KV heads, ``d`` prepared
query/key size, ``e`` value size, ``c`` rows per chunk (a slot), ``S`` slots;
``it``/``jt`` the real rows/keys of one block.

A rank holds its queries as ``S`` slots of ``c`` rows (``Slots``: the global start and the
real rows of each); keys arrive the same way from another rank. Every pair (query slot,
key slot) is one block at global positions (``framing.Block``): a block that the mask
leaves empty is skipped; the others run ``partial.forward`` with the mask and bias framed,
and merge into the slot's running ``(out, lse)`` (``partial.merge``, float32 or wider,
NaN-free when a row has seen no key yet). The backward runs ``partial.backward`` on the
same blocks with the final ``(out, lse)`` of the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..backends import partial
from ..backends.dropout import Origin
from ..backends.request import Request
from .framing import Block, frame_bias, frame_mask, mask_state


@dataclass(frozen=True)
class Slots:
    """Chunks of a sequence one rank holds: ``(global start, real rows)`` per slot of ``side`` rows."""

    spans: tuple[tuple[int, int], ...]
    side: int

    def rows(self, slot: int) -> slice:
        """Local rows of the real part of ``slot`` in the padded ``(S·c)`` layout."""
        return slice(slot * self.side, slot * self.side + self.spans[slot][1])


@dataclass
class Work:
    """What a rank computes, shared by the forward and the backward."""

    req: Request  # the whole call (score, mask with causal folded, bias, scale, dropout)
    i_len: int  # I
    j_len: int  # J
    seed: int  # dropout seed of the whole call
    heads: tuple[int, int] | None  # this rank's query heads (Ulysses inside hybrid), None = all
    total_heads: int  # h of the whole call
    elements: int = 0  # query-key pairs of the blocks computed so far (per-rank work)

    def blocks(self, q_slots: Slots, k_slots: Slots):
        """``(query slot, key slot, block)`` of every block the mask does not leave empty."""
        for a, (r0, it) in enumerate(q_slots.spans):
            for c, (c0, jt) in enumerate(k_slots.spans):
                block = Block(r0, it, c0, jt, self.i_len, self.j_len)
                if it and jt and mask_state(self.req.mask, block) != "empty":
                    yield a, c, block

    def needs(self, q_slots: Slots, k_slots: Slots) -> bool:
        return next(iter(self.blocks(q_slots, k_slots)), None) is not None

    def request(self, block: Block, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None) -> Request:
        req = self.req
        bias = req.bias if dense is None else dense
        return replace(
            req, q=q, k=k, v=v, mask=frame_mask(req.mask, block), bias=frame_bias(bias, block, self.heads),
            generator=None, return_weights=False, weights_for=None,
        )  # fmt: skip

    def origin(self, block: Block) -> Origin:
        head = 0 if self.heads is None else self.heads[0]
        return Origin(head=head, heads=self.total_heads, row=block.r0, col=block.c0)

    def forward(self, qp: Tensor, q_slots: Slots, kp: Tensor, v: Tensor, k_slots: Slots, dense: Tensor | None,
                out: Tensor, lse: Tensor) -> None:  # fmt: skip
        """Merge the blocks of ``qp`` against these keys into ``out (b, h, S·c, e)``, ``lse (b, h, S·c)``, in place."""
        for a, c, block in self.blocks(q_slots, k_slots):
            rows, cols = q_slots.rows(a), k_slots.rows(c)
            preq = self.request(block, qp[..., rows, :], kp[..., cols, :], v[..., cols, :], dense)
            o, m = partial.forward(preq, self.seed, self.origin(block))
            out[..., rows, :], lse[..., rows] = partial.merge(out[..., rows, :], lse[..., rows], o, m)
            self.elements += block.it * block.jt

    def backward(self, qp: Tensor, q_slots: Slots, kp: Tensor, v: Tensor, k_slots: Slots, dense: Tensor | None,
                 out: Tensor, lse: Tensor, d_out: Tensor, dq: Tensor, dkv: Tensor | None,
                 d_dense: Tensor | None, d_params: list) -> None:  # fmt: skip
        """Add the blocks' gradients: ``dq``, ``dkv = [dk | dv]`` of these keys, a dense bias, the parameters."""
        d = kp.shape[-1]
        for a, c, block in self.blocks(q_slots, k_slots):
            rows, cols = q_slots.rows(a), k_slots.rows(c)
            preq = self.request(block, qp[..., rows, :], kp[..., cols, :], v[..., cols, :], dense)
            grads = partial.backward(
                preq, out[..., rows, :], lse[..., rows], d_out[..., rows, :], self.seed, self.origin(block)
            )
            dq[..., rows, :] += grads.q
            if dkv is not None:
                dkv[..., cols, :d] += grads.k
                dkv[..., cols, d:] += grads.v
            if d_dense is not None and grads.bias is not None:
                _dense_view(d_dense, block, self.heads).add_(grads.bias.to(d_dense.dtype))
            for n, grad in enumerate(grads.params):
                if grad is not None:
                    d_params[n] = grad if d_params[n] is None else d_params[n] + grad


def _dense_view(x: Tensor, block: Block, heads: tuple[int, int] | None) -> Tensor:
    """The block's part of a dense bias (or of its gradient), as a view (size-1 dims kept)."""
    if x.shape[-2] != 1:
        x = x[..., block.r0 : block.r0 + block.it, :]
    if x.shape[-1] != 1:
        x = x[..., block.c0 : block.c0 + block.jt]
    if heads is not None and x.dim() >= 3 and x.shape[-3] != 1:
        x = x[..., heads[0] : heads[1], :, :]
    return x
