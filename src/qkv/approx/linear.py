"""Linear attention: softmax replaced by a positive feature map, in O(i + j) memory.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``m`` feature size.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention" (ICML 2020), eqs. 4-6 and 8-12. With a feature map
``φ(x) = elu(x) + 1`` (positive, so every weight is positive and rows normalise)::

    out_p = φ(q_p)ᵀ Σ_t φ(k_t) v_tᵀ  /  φ(q_p)ᵀ Σ_t φ(k_t)              (non-causal)
    out_p = φ(q_p)ᵀ S_p / φ(q_p)ᵀ z_p,  S_p = Σ_{t ≤ p'} φ(k_t) v_tᵀ,  z_p = Σ_{t ≤ p'} φ(k_t)

Associating ``φ(K)ᵀ V`` first costs ``O((i + j) m e)`` instead of ``O(i j)``. The causal
form keeps the prefix sums ``S`` chunk by chunk: each chunk of ``chunk_size`` queries reads
the state left by the earlier keys and adds its own small ``(chunk, chunk)`` masked block,
so memory is ``O(chunk · (chunk + m + e) + m e)`` per head, never the ``O(i m e)`` of a
cumulative sum over all positions. Causal masks are bottom-right aligned like the rest of
qkv, ``p' = p + j - i``; rows that see no key give zeros::

    i=3, j=5   keys 0 1 2 3 4
    query 0         1 1 1 0 0
    query 1         1 1 1 1 0
    query 2         1 1 1 1 1

:func:`kernel_attention` is shared with :mod:`qkv.approx.performer` (FAVOR+ is linear
attention with random features). :func:`kernel_attention_weights` is its slow twin: the
``(i, j)`` matrix ``φ(Q) φ(K)ᵀ ⊙ causal`` normalised by rows, materialised.

Checked against (tests/test_approx_linear.py): the quadratic form ``(φ(Q)φ(K)ᵀ ⊙ causal) V /
rowsum`` computed in the test, to 1e-6 in float64 for causal (chunked, with i < j, i == j,
i > j) and non-causal; key padding equal to dropping the padded keys.

``return_weights=True`` returns ``(out, weights)`` with the implicit ``(b, h, i, j)`` weight
matrix materialised (``out == weights @ v``): ``O(i j)`` memory, for inspection only.
Key padding masks are supported (the padded keys' features are zeroed); masks that vary
with the query are not (use ``causal=True`` for the causal one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum
from torch import Tensor, nn

from .._args import positive_int
from ._common import check_flags, check_qkv, dense_mask, key_padding, repeat_kv, safe_divide


def elu_feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020, eq. 7)."""
    return F.elu(x) + 1


def causal_keep(i: int, j: int, device: torch.device) -> Tensor:
    """Bool ``(i, j)``, True where key ``t`` is at most query ``p``'s bottom-right aligned position."""
    rows = torch.arange(i, device=device)[:, None]
    cols = torch.arange(j, device=device)[None, :]
    return cols <= rows + (j - i)


def kernel_attention(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool = False, chunk_size: int = 128
) -> Tensor:
    """``φ(Q) (φ(K)ᵀ V)`` normalised by ``φ(Q) Σ φ(K)``, without any ``(i, j)`` tensor.

    ``phi_q (b, h, i, m)``, ``phi_k (b, h, j, m)`` (non-negative; padded keys zeroed),
    ``v (b, h, j, e)`` -> ``(b, h, i, e)``. Causal is bottom-right aligned, computed in
    chunks of ``chunk_size`` queries.
    """
    if not causal:
        kv = einsum(phi_k, v, "b h j m, b h j e -> b h m e")
        num = einsum(phi_q, kv, "b h i m, b h m e -> b h i e")
        den = einsum(phi_q, phi_k.sum(-2), "b h i m, b h m -> b h i")
        return safe_divide(num, den)

    i, j = phi_q.shape[-2], phi_k.shape[-2]
    offset = j - i  # query p sees keys t <= p + offset
    state = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], v.shape[-1])  # S: b h m e
    total = phi_k.new_zeros(phi_k.shape[:-2] + phi_k.shape[-1:])  # z: b h m
    absorbed = 0  # keys [0, absorbed) are summed into (state, total)
    outs = []
    for p0 in range(0, i, chunk_size):
        p1 = min(p0 + chunk_size, i)
        lo = min(max(p0 + offset, 0), j)  # keys < lo: seen by every query of the chunk
        hi = min(max(p1 + offset, 0), j)  # keys in [lo, hi): seen by some, a triangle
        if lo > absorbed:
            state = state + einsum(phi_k[..., absorbed:lo, :], v[..., absorbed:lo, :], "b h j m, b h j e -> b h m e")
            total = total + phi_k[..., absorbed:lo, :].sum(-2)
            absorbed = lo
        fq = phi_q[..., p0:p1, :]
        num = einsum(fq, state, "b h i m, b h m e -> b h i e")
        den = einsum(fq, total, "b h i m, b h m -> b h i")
        if hi > lo:
            rows = torch.arange(p0, p1, device=fq.device)[:, None]
            cols = torch.arange(lo, hi, device=fq.device)[None, :]
            block = einsum(fq, phi_k[..., lo:hi, :], "b h i m, b h j m -> b h i j")
            block = block * (cols <= rows + offset)
            num = num + einsum(block, v[..., lo:hi, :], "b h i j, b h j e -> b h i e")
            den = den + block.sum(-1)
        outs.append(safe_divide(num, den))
    return torch.cat(outs, dim=-2)


def kernel_attention_weights(phi_q: Tensor, phi_k: Tensor, *, causal: bool = False) -> Tensor:
    """The slow twin: ``(φ(Q) φ(K)ᵀ ⊙ causal) / rowsum`` as a ``(b, h, i, j)`` tensor.

    ``kernel_attention(...) == kernel_attention_weights(...) @ v``.
    """
    scores = einsum(phi_q, phi_k, "b h i m, b h j m -> b h i j")
    if causal:
        scores = scores * causal_keep(phi_q.shape[-2], phi_k.shape[-2], phi_q.device)
    den = scores.sum(-1, keepdim=True)
    return scores / torch.where(den == 0, torch.ones_like(den), den)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    causal: bool = False,
    chunk_size: int = 128,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Linear attention with ``φ = elu + 1`` on ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``.

    ``keep (b|1, h|1, j)`` is an optional key padding mask (True = real key). Returns
    ``out (b, h, i, e)``, and the implicit ``(b, h, i, j)`` weights if asked.
    """
    h = q.shape[1]
    phi_q = elu_feature_map(q)
    phi_k = repeat_kv(elu_feature_map(k), h)
    v = repeat_kv(v, h)
    if keep is not None:
        phi_k = phi_k.masked_fill(~keep[..., None], 0)
    out = kernel_attention(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size)
    if return_weights:
        return out, kernel_attention_weights(phi_q, phi_k, causal=causal)
    return out


class LinearAttention(nn.Module):
    """Linear attention (Katharopoulos et al. 2020) as a qkv mechanism; no parameters.

    ``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.

    Args:
        chunk_size: queries per chunk of the causal prefix sums; memory grows with it,
            the number of Python steps shrinks with it.

    There is no ``scale``: the feature map replaces the softmax kernel, and ``elu(x) + 1``
    is not scale-invariant, so a scale would be a different model, not a temperature.
    """

    def __init__(self, *, chunk_size: int = 128):
        super().__init__()
        self.chunk_size = positive_int("chunk_size", chunk_size)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: object = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        dims = check_qkv(q, k, v)
        check_flags(causal, return_weights)
        keep = key_padding(
            dense_mask(mask, dims, q.device),
            dims,
            "LinearAttention",
            "use causal=True for the causal mask, or exact attention (qkv.attention) for other masks",
        )
        return linear_attention(
            q, k, v, keep=keep, causal=causal, chunk_size=self.chunk_size, return_weights=return_weights
        )

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"
