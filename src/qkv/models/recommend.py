"""Target attention for recommendation: a candidate item attends over a user's history.

Shape legend: ``b`` batch (users), ``j`` history length (keys), ``d`` item embedding size,
``n`` hidden size of the scorer.

In query/key/value terms the query comes from the target item, the keys and values from
the user's profile and history. This is the setup of the Deep Interest Network (Zhou et
al. 2018, "Deep Interest Network for Click-Through Rate Prediction"): instead of pooling
a user's history into one fixed vector, the history is pooled *with respect to the
candidate*, so the same user is represented by their sports purchases when the candidate
is a football and by their books when it is a novel:

    e_c = E[candidate],  e_j = E[history_j]                 item embeddings (shared table)
    α_j = softmax_j score(e_c, e_j)   over real history items (padding masked)
    u   = Σ_j α_j e_j                                        the candidate-specific interest
    p(click) = sigmoid(MLP([u; e_c; u ⊙ e_c]))

DIN scores with an MLP and leaves the weights unnormalised; here the weights are the
usual softmax over qkv's own scores (default ``"concat"``, the additive MLP score), so
they can be read as "which past items explain this prediction". A user with no history
gets ``u = 0`` (a fully masked row gives zero output in qkv). Checked in
the test suite: padding changes nothing, and a trained model puts its
weight on the history items that share the candidate's category.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import positive_int, probability
from ..attention import Attention
from .checks import check_ids, check_rows


class TargetAttention(nn.Module):
    """Click-through model: the candidate item's embedding queries the user's history.

    Args:
        num_items: item ids lie in ``[0, num_items)``; ``pad_id`` marks history padding.
        dim: item embedding size ``d``.
        score: the attention score (``"concat"``, ``"dot"``, ``"scaled_dot"``, ``"general"``
            or a ``qkv.scores.Score`` on ``(d, d)``).
        attention_dim: hidden size of the ``"concat"`` score.
        hidden: hidden size ``n`` of the click scorer.
        pad_id: the padding id of histories (its embedding is kept at zero).
        dropout: in the scorer, in training mode.
    """

    def __init__(
        self,
        num_items: int,
        dim: int = 32,
        *,
        score: str = "concat",
        attention_dim: int = 32,
        hidden: int = 64,
        pad_id: int = 0,
        dropout: float = 0.0,
    ):
        super().__init__()
        sizes = {"num_items": num_items, "dim": dim, "attention_dim": attention_dim, "hidden": hidden}
        for arg, value in sizes.items():
            positive_int(arg, value)
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < num_items:
            raise ValueError(f"pad_id: expected an id in [0, {num_items}), got {pad_id!r}")
        self.num_items, self.pad_id = num_items, pad_id
        self.items = nn.Embedding(num_items, dim, padding_idx=pad_id)
        # reference backend: the (b, 1, j) logits are tiny, and it returns the weights.
        self.attention = Attention(score, query_dim=dim, key_dim=dim, hidden=attention_dim, backend="reference")
        self.scorer = nn.Sequential(
            nn.Linear(3 * dim, hidden),
            nn.ReLU(),
            nn.Dropout(probability("dropout", dropout)),
            nn.Linear(hidden, 1),
        )

    def forward(
        self, candidate: Tensor, history: Tensor, *, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Click logits ``(b,)`` for ``candidate (b,)`` item ids given ``history (b, j)`` item ids.

        Positions of ``history`` equal to ``pad_id`` are padding. With ``return_weights=True``
        also the attention weights over the history ``(b, j)`` (0 at padding).
        """
        check_ids("candidate", candidate, self.num_items, dims=1)
        check_ids("history", history, self.num_items)
        if history.shape[0] != candidate.shape[0]:
            raise ValueError(
                f"history: expected one row per candidate (b={candidate.shape[0]}), got {history.shape[0]} "
                f"(shape {tuple(history.shape)})"
            )
        query = self.items(candidate)  # (b, d)
        keys = self.items(history)  # (b, j, d)
        real = (history != self.pad_id)[:, None, :]  # (b, 1, j), True = may attend
        interest, weights = self.attention(query, keys, mask=real, return_weights=True)  # (b, d), (b, j)
        logits = self.scorer(torch.cat([interest, query, interest * query], dim=-1)).squeeze(-1)
        return (logits, weights) if return_weights else logits

    def loss(self, candidate: Tensor, history: Tensor, clicked: Tensor) -> Tensor:
        """Binary cross-entropy of the click logits against ``clicked (b,)`` (0/1, bool or float).

        A batch of 0 rows is an error, not a NaN mean over nothing.
        """
        if not isinstance(clicked, Tensor) or tuple(clicked.shape) != tuple(candidate.shape):
            got = tuple(clicked.shape) if isinstance(clicked, Tensor) else type(clicked).__name__
            raise ValueError(f"clicked: expected shape {tuple(candidate.shape)} like candidate, got {got}")
        check_rows("clicked", clicked)
        logits = self(candidate, history)
        return F.binary_cross_entropy_with_logits(logits, clicked.to(logits.dtype))

    def extra_repr(self) -> str:
        return f"num_items={self.num_items}, pad_id={self.pad_id}"
