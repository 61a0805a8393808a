"""Differential attention: the difference of two softmax maps, so common-mode noise cancels.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` size of each query/key half, ``2d`` the per-head query/key size the
projections give, ``e`` per-head value size.

Ye et al. 2024, "Differential Transformer" (arXiv 2410.05258), section 2.1. Each head's
query and key are split into halves, ``[Q1; Q2] = q``, ``[K1; K2] = k``::

    DiffAttn(X) = (softmax(Q1 K1ᵀ / √d) − λ softmax(Q2 K2ᵀ / √d)) V
    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init,     λ_init = 0.8 − 0.6 exp(−0.3 (l − 1))
    head' = (1 − λ_init) · RMSNorm(head)               per head (GroupNorm), before W^O

with learnable ``λ_q1, λ_k1, λ_q2, λ_k2 ∈ R^d`` shared by the heads of a layer and ``l`` the
layer's index (1-based). The two maps are two calls of :func:`qkv.attention` (so every
backend, mask and bias works, memory-bounded and with a backward), combined linearly:
``(A1 − λ A2) V = A1 V − λ A2 V``; no ``(i, j)`` map is built unless weights are asked
for. In the paper a head has ``2d`` query/key and ``2d`` value channels, so
``MultiHeadAttention(dim, heads, dim_head=2 * d, attention=DifferentialAttention(2 * d))``
with ``heads = dim / (2 d)`` is its layout. A ``Rotary`` on such heads rotates pairs of channels
within each half only where it is ``interleaved`` (the default; the module refuses the
half-split layout, and an odd half, whose pairs cross the halves): each half then keeps relative positions, the
first half taking the higher frequencies and the second the lower, where the paper's code
rotates each half with all of them. Checked against the formula written with
materialised softmaxes in float64 in the test suite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._args import finite_number, positive_int
from ..functional import attention
from ..masks import Mask
from ..positional import LazyBias


def lambda_init(layer: int) -> float:
    """``0.8 − 0.6 exp(−0.3 (layer − 1))`` for the 1-based ``layer`` (the paper's schedule)."""
    positive_int("layer", layer)
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def differential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    *,
    mask: Mask | Tensor | None = None,
    causal: bool = False,
    bias: Tensor | LazyBias | None = None,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """``(A1 − λ A2) V``: ``q (..., h, i, 2d)``, ``k (..., g, j, 2d)``, ``v (..., g, j, e)`` -> ``(..., h, i, e)``.

    ``A_n = softmax(Q_n K_nᵀ / √d + bias, masked)`` with ``Q_1, Q_2`` the first and second
    halves of ``q`` (likewise ``k``); ``lam`` a scalar (tensor or float). With
    ``return_weights=True`` also ``A1 − λ A2 (..., h, i, j)``. No norm and no scale: those
    belong to :class:`DifferentialAttention`.
    """
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, Tensor) or x.shape[-1] % 2:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected an even last dim (two halves Q1, Q2), got {got}")
    d = q.shape[-1] // 2
    common = dict(mask=mask, causal=causal, bias=bias, return_weights=return_weights, backend=backend)
    one = attention(q[..., :d], k[..., :d], v, **common)
    two = attention(q[..., d:], k[..., d:], v, **common)
    if not return_weights:
        return one - lam * two
    return one[0] - lam * two[0], one[1] - lam * two[1]


class DifferentialAttention(nn.Module):
    """Differential attention as a ``MultiHeadAttention`` mechanism, with its λ and per-head norm.

    ``forward(q (b, h, i, 2d), k (b, g, j, 2d), v (b, g, j, e), *, mask, causal, bias,
    return_weights) -> (1 − λ_init) RMSNorm((A1 − λ A2) V)`` of shape ``(b, h, i, e)``
    (and ``A1 − λ A2`` with ``return_weights=True``).

    Args:
        dim_head: the per-head query/key size ``2d`` (even); each half has ``d``.
        dim_value_head: the per-head value size ``e`` (default ``dim_head``), normalised per head.
        layer: the layer's 1-based index ``l`` in the stack, for ``λ_init``.
        eps: of the RMSNorm (1e-5 as in the paper's code).
        backend: passed to ``qkv.attention``.
    """

    accepts_bias = True  # positional biases (ALiBi, T5) are added to both maps
    head_parts = 2  # q and k of a head are [Q1; Q2] (MultiHeadAttention refuses a Rotary whose pairs cross them)

    def __init__(self, dim_head: int, *, dim_value_head: int | None = None, layer: int = 1, eps: float = 1e-5,
                 backend: str = "auto"):  # fmt: skip
        super().__init__()
        positive_int("dim_head", dim_head)
        if dim_head % 2:
            raise ValueError(f"dim_head: expected an even size (two halves of d each), got {dim_head}")
        e = dim_head if dim_value_head is None else positive_int("dim_value_head", dim_value_head)
        eps = finite_number("eps", eps, above=0)  # (the RMSNorm's: a negative one gave nan)
        self.dim_head, self.layer, self.backend = dim_head, layer, backend
        self.lambda_init = lambda_init(layer)
        d = dim_head // 2
        # N(0, 0.1²) as in the paper's code: λ starts near λ_init
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(d) * 0.1) for _ in range(4)
        )
        self.norm = nn.RMSNorm(e, eps=eps)

    def lam(self) -> Tensor:
        """The scalar ``λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init`` (a 0-d tensor)."""
        one = torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
        two = torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
        return one - two + self.lambda_init

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                bias: Tensor | LazyBias | None = None, return_weights: bool = False):  # fmt: skip
        if q.shape[-1] != self.dim_head:
            raise ValueError(
                f"q: DifferentialAttention(dim_head={self.dim_head}) expects head size {self.dim_head}, "
                f"got shape {tuple(q.shape)}"
            )
        if v.shape[-1] != self.norm.normalized_shape[0]:
            raise ValueError(
                f"v: expected value head size {self.norm.normalized_shape[0]} (dim_value_head), got shape {tuple(v.shape)}"
            )
        lam = self.lam().to(q.dtype)
        result = differential_attention(q, k, v, lam, mask=mask, causal=causal, bias=bias,
                                        return_weights=return_weights, backend=self.backend)  # fmt: skip
        out, weights = result if return_weights else (result, None)
        out = self.norm(out) * (1.0 - self.lambda_init)
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        return f"dim_head={self.dim_head}, layer={self.layer}, lambda_init={self.lambda_init:.4f}"
