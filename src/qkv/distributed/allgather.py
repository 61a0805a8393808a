"""The all-gather strategy: every rank gathers all keys and values, then attends its own rows.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size, ``P`` ranks, ``s·c`` a rank's padded rows.

This is how Llama 3 trained with context parallelism (Llama Team 2024, "The Llama 3 Herd of
Models", section 3.3.2): an all-gather of K and V (only the ``g`` KV heads travel, ``k`` and
``v`` in one message), then each rank computes attention for its query rows against the
whole sequence, one call per query chunk (a zigzag rank has two) with the mask and bias
framed at that chunk's global rows. Memory holds the whole K/V, which is what ring and
Ulysses avoid; its appeal is one collective per pass and no per-step merging. The
backward of the all-gather is a reduce-scatter of the K/V gradients (``comm.AllGather``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .comm import all_gather, attach
from .compute import attend_rows


def run(q: Tensor, k: Tensor, v: Tensor, call) -> Tensor:
    grp, lay_q, lay_k = call.group, call.q_layout, call.k_layout
    d = k.shape[-1]
    # one message: k and v side by side on the last dim, padded to whole slots
    kv = lay_k.pad(torch.cat((k, v), -1), -2, grp.rank)
    whole = lay_k.assemble(all_gather(kv, grp, "kv"), -2)  # (b, g, j, d + e)
    keys, values = whole[..., :d], whole[..., d:]
    parts, at = [], 0
    for start, n in lay_q.slot_spans(grp.rank):
        parts.append(attend_rows(q[..., at : at + n, :], keys, values, call, r0=start))
        at += n
    out = torch.cat(parts, -2) if len(parts) > 1 else parts[0]
    # every rank must run the all-gather's backward, even one that computed nothing
    return out if out.requires_grad else attach(out, whole, q)
