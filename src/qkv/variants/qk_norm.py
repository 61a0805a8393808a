"""QK-norm: a per-head RMSNorm of the queries and the keys, with a learnable scale.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size.

Each head's query and key vector is divided by its root mean square and multiplied by a
learned per-dimension gain (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")::

    q' = γ_q ⊙ q / sqrt(mean_d(q²) + ε)        k' = γ_k ⊙ k / sqrt(mean_d(k²) + ε)

so a logit ``q'·k' / √d`` is bounded by the gains, whatever the scale of the projections:
the logit growth that destabilises training at scale cannot happen (Dehghani et al. 2023,
"Scaling Vision Transformers to 22 Billion Parameters", section 3.1). Current language
models normalise per head, before the rotary embedding, with one gain vector of size ``d``
shared by the heads: Qwen 3, Gemma 3 (OLMo 2 normalises the whole ``h·d`` projection
instead). Used as ``MultiHeadAttention(..., qk_norm=QKNorm(dim_head))``; checked against
the formula above in the test suite.
"""

from __future__ import annotations

from torch import Tensor, nn

from .._args import positive_int


class QKNorm(nn.Module):
    """RMSNorm of every query and key head, ``q (..., h, i, d)``, ``k (..., g, j, d)``; gains ``(d,)``.

    Args:
        dim_head: the per-head query/key size ``d``.
        eps: added to the mean square (1e-6 as in Qwen 3 and Gemma 3).
    """

    def __init__(self, dim_head: int, *, eps: float = 1e-6):
        super().__init__()
        positive_int("dim_head", dim_head)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise ValueError(f"eps: expected a positive float, got {eps!r}")
        self.q_norm = nn.RMSNorm(dim_head, eps=float(eps))
        self.k_norm = nn.RMSNorm(dim_head, eps=float(eps))

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """``(q', k')``, each normalised over its last dim ``d``."""
        d = self.q_norm.normalized_shape[0]
        for name, x in (("q", q), ("k", k)):
            if x.shape[-1] != d:
                raise ValueError(f"{name}: QKNorm(dim_head={d}) expects head size {d}, got shape {tuple(x.shape)}")
        return self.q_norm(q), self.k_norm(k)
