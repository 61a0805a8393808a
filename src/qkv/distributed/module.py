"""``SequenceParallel``: the mechanism that makes ``qkv.MultiHeadAttention`` sequence-parallel.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` this rank's query/key
rows, ``d`` query/key size, ``e`` value size, ``dim`` model size.

    mha = qkv.MultiHeadAttention(dim, heads, positional=qkv.Rotary(dim // heads),
                                 attention=qkv.distributed.SequenceParallel("ring"))
    y_local = mha(x_local, causal=True)            # x_local (b, i/P, dim): this rank's rows

The projections act on each rank's rows alone; only attention needs the other ranks, and
this mechanism runs ``qkv.distributed.attention`` there. Positional modules see global
positions: RoPE rotates each row by its global position (:meth:`SequenceParallel.positions`,
which ``MultiHeadAttention`` asks for), ALiBi and T5 buckets are evaluated at global
offsets by the distributed call. The mechanism has no parameters of its own (a learned
score is kept as ``score``, the name exact attention uses), so the state dict of an
unsharded model loads as it is, and the same weights give the same result sharded.
"""

from __future__ import annotations

import copy
from typing import Callable

from torch import Tensor, nn

from .. import score_mods
from .._args import probability
from ..masks import Mask
from ..positional import LazyBias
from ..scores import Score, make
from .comm import all_gather_ints, resolve
from .functional import STRATEGIES, attention
from .layout import Layout, check_layout


class SequenceParallel(nn.Module):
    """A mechanism for ``MultiHeadAttention(attention=...)`` whose inputs are this rank's rows.

    Args:
        strategy: ``"ring"``, ``"ulysses"``, ``"hybrid"`` or ``"allgather"`` (see
            ``qkv.distributed.attention``).
        layout: how the sequence is split: ``"zigzag"`` or ``"contiguous"``; shard the
            model's inputs the same way (``qkv.distributed.shard(x, dim=1, layout=...)``).
        group, ring_group, ulysses_group: process groups (default: all ranks).
        score: a name or a ``qkv.scores.Score`` (a learned one as a module, like exact attention's).
        dropout: on the attention weights, in training mode; the mask is the one the whole
            unsharded call would draw.
        score_mod: ``fn(score, b, h, q_idx, kv_idx)`` on the logits, with the whole
            sequence's indices (as ``Attention(score_mod=...)`` in the unsharded model).
    """

    #: ``MultiHeadAttention`` passes its positional bias (ALiBi, T5 buckets) as ``bias=``.
    accepts_bias = True

    def __init__(self, strategy: str = "ring", layout: str = "zigzag", group=None, *, ring_group=None,
                 ulysses_group=None, score: str | Score = "scaled_dot", dropout: float = 0.0,
                 score_mod: Callable | None = None):  # fmt: skip
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
        self.strategy, self.layout = strategy, check_layout(layout)
        self.score = make(score)
        self.dropout = probability("dropout", dropout)
        self.score_mod = score_mods.check(score_mod)  # global q_idx, kv_idx (as the unsharded call's)
        # process groups are handles, not state: shared by copies (Encoder copies a mechanism per layer)
        self._groups = {"group": group, "ring_group": ring_group, "ulysses_group": ulysses_group}

    def __deepcopy__(self, memo):
        memo[id(self._groups)] = self._groups  # process-group handles are shared, never copied
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__.copy(), memo))
        return clone

    def positions(self, q: Tensor, k: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """``(q_positions (i,), k_positions (j,))``: the global positions of this rank's rows.

        Queries are aligned bottom-right to the keys, as everywhere in qkv (the last query
        stands at the last key's position). One small all-gather of the row counts.
        """
        if start:
            raise ValueError(
                f"cache: sequence-parallel attention runs whole sequences, not incremental decoding "
                f"(got a cache of {start} positions)"
            )
        grp = resolve(self._groups["group"])
        rows = all_gather_ints([q.shape[-2], k.shape[-2]], grp)
        i_len, j_len = int(rows[:, 0].sum()), int(rows[:, 1].sum())
        q_pos = Layout(self.layout, i_len, grp.size).positions(grp.rank, q.device) + (j_len - i_len)
        return q_pos, Layout(self.layout, j_len, grp.size).positions(grp.rank, k.device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                return_weights: bool = False, bias: Tensor | LazyBias | None = None) -> Tensor:  # fmt: skip
        """``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``: this rank's rows -> ``(b, h, i, e)``.

        ``mask`` and ``bias`` are the whole sequence's (global positions), as in
        ``qkv.distributed.attention``.
        """
        if return_weights:
            raise ValueError(
                "return_weights: sequence-parallel attention does not return the weights; each rank would "
                "need (b, h, i, j) of the whole sequence, which is what splitting it avoids"
            )
        return attention(
            q, k, v, strategy=self.strategy, layout=self.layout, **self._groups, score=self.score, mask=mask,
            bias=bias, causal=causal, dropout=self.dropout if self.training else 0.0, score_mod=self.score_mod,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"strategy={self.strategy!r}, layout={self.layout!r}, dropout={self.dropout}"


