"""Nyström attention: the softmax matrix rebuilt from a few landmark rows and columns.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``m`` landmarks.

Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention"
(AAAI 2021), eqs. 13-16. Landmarks ``Q̃ (m, d)`` and ``K̃ (m, d)`` are segment means of the
queries and keys, and with ``s = scale``::

    F̃ = softmax(s Q K̃ᵀ) (i, m),   Ã = softmax(s Q̃ K̃ᵀ) (m, m),   B̃ = softmax(s Q̃ Kᵀ) (m, j)
    out = F̃ Ã⁺ (B̃ V)

so nothing of size ``(i, j)`` is built. Without a mask (and without ``return_weights``) the
two products with ``V`` are fused attention calls, ``B̃ V = softmax(s Q̃ Kᵀ) V`` and
``F̃ W = softmax(s Q K̃ᵀ) W`` with ``W = Ã⁺ B̃ V``, so neither ``(m, j)`` nor ``(i, m)`` is
stored; landmarks are a reshape-mean (or one ``index_add``), ``O(n d)``.

``Ã⁺`` is the iterative Moore-Penrose inverse of the paper (eq. 16, after Razavi et al.
2014), started from ``Z₀ = Ãᵀ / (‖Ã‖₁ ‖Ã‖∞)``::

    Z ← ¼ Z (13 I − ÃZ (15 I − ÃZ (7 I − ÃZ)))        ``pinv_iterations`` times (paper: 6)

Landmarks when ``m`` does not divide the length: position ``t`` of ``n`` belongs to segment
``⌊t m / n⌋``, so segments hold ``⌊n/m⌋`` or ``⌈n/m⌉`` consecutive tokens and none is empty.
This is the paper's "pad to a multiple of m" with the padding left out of the means
(zero padding would pull the last landmark towards zero). With ``m >= n`` every token is
its own landmark, ``Ã = F̃ = B̃`` is the exact softmax matrix ``A`` and ``A A⁺ A = A``: the
method is exact up to the convergence of the pseudo-inverse.

Masks: key padding is honoured by leaving padded keys out of the key landmarks (a landmark
whose segment is all padding is dropped from ``F̃`` and ``Ã``) and out of ``B̃``. With as many
queries as keys the call is self-attention's, and its padded positions are left out of the query
landmarks too (the paper's code masks ``Q``), so what padding holds (a nan included) reaches no
real row; a cross-attention of equal lengths then takes its query landmarks over the positions
whose keys are kept. Landmarks
average over the whole sequence, so ``causal=True`` and masks that vary with the query
raise ``ValueError``.

``conv_kernel``: the paper's optional skip connection, a depthwise convolution of the
values along the sequence added to the output (self-attention only, ``i == j``).

``return_weights=True`` returns ``(out, weights (b, h, i, j))`` with the approximate matrix
``F̃ Ã⁺ B̃`` materialised (``out == weights @ v`` without the convolution); it is not
guaranteed non-negative. ``O(i j)`` memory, for inspection only.

Checked in the test suite against: exact softmax attention computed in the test
when ``num_landmarks >= i, j``; ``torch.linalg.pinv`` for the iteration; the formula above
computed directly with explicit landmark segments; the fused path against the materialised
``F̃ Ã⁺ B̃``. nystrom-attention (the peer package) agrees to float32 rounding (``qkv bench``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import positive_int
from ._common import check_scale, masked_softmax, repeat_kv
from .base import ApproxAttention, unseen_zeroed


def segment_ids(n: int, m: int, device: torch.device | None = None) -> Tensor:
    """Landmark segment of each of ``n`` positions, ``⌊t m / n⌋`` in ``[0, m)``, shape ``(n,)``."""
    return torch.arange(n, device=device) * m // n


def segment_means(x: Tensor, m: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Landmarks of ``x (b, h, n, c)``: the means of ``m`` consecutive segments, ``(b, h, m, c)``.

    With ``keep (b, h, n)`` padded positions are left out of the means, and the second
    result ``valid (b, h, m)`` says which segments had any real position. ``O(n c)`` work:
    a reshape when ``m`` divides ``n``, else one ``index_add`` over the segment ids (a
    one-hot ``(m, n)`` product would cost ``O(m n c)``, more than the attention itself).
    """
    b, h, n, c = x.shape
    if keep is None and n % m == 0:
        return x.reshape(b, h, m, n // m, c).mean(3), None
    ids = segment_ids(n, m, x.device)
    if keep is None:
        counts = torch.bincount(ids, minlength=m).to(x.dtype)
        return x.new_zeros(b, h, m, c).index_add(2, ids, x) / counts[:, None], None
    weight = keep.to(x.dtype)  # b h n
    counts = weight.new_zeros(keep.shape[:2] + (m,)).index_add(2, ids, weight)
    sums = x.new_zeros(b, h, m, c).index_add(2, ids, x.masked_fill(~keep[..., None], 0))
    return sums / counts.clamp_min(1)[..., None], counts > 0


def iterative_pinv(a: Tensor, iterations: int = 6) -> Tensor:
    """Moore-Penrose pseudo-inverse of ``a (..., r, c)`` by the paper's iteration -> ``(..., c, r)``.

    The start ``Z₀ = aᵀ / (‖a‖₁ ‖a‖∞)`` (max column sum times max row sum, per matrix)
    keeps every eigenvalue of ``a Z₀`` in (0, 1], from where the iteration converges to
    ``a⁺``. A zero matrix stays at ``Z = 0``, its pseudo-inverse.
    """
    mags = a.abs()
    norm = mags.sum(-2).amax(-1) * mags.sum(-1).amax(-1)
    z = a.transpose(-1, -2) / norm.clamp_min(torch.finfo(a.dtype).tiny)[..., None, None]
    eye = torch.eye(a.shape[-2], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _landmarks(q: Tensor, k: Tensor, num_landmarks: int, pinv_iterations: int, keep: Tensor | None, scale: float):
    """``(Q̃ (b, h, m, d), K̃ (b, h, m, d), valid (b, h, m) | None, Ã⁺ (b, h, m, m))``: the
    segment-mean landmarks (keys' means over kept keys only) and the pseudo-inverse of
    ``Ã = softmax(s Q̃ K̃ᵀ)`` over the valid key landmarks."""
    # as many queries as keys: self-attention, whose padded positions are no queries either (the paper's code masks Q)
    q_marks, q_valid = segment_means(q, min(num_landmarks, q.shape[-2]), keep if q.shape[-2] == k.shape[-2] else None)
    k_marks, valid = segment_means(k, min(num_landmarks, k.shape[-2]), keep)
    a = masked_softmax(q_marks @ k_marks.transpose(-1, -2) * scale, None if valid is None else valid[:, :, None, :])
    if q_valid is not None:  # a landmark of padding alone: its row of Ã zero (its column already is), so Ã⁺'s too
        a = a.masked_fill(~q_valid[..., None], 0)
    # The iteration multiplies m x m matrices 3 * pinv_iterations times: run it in at least float32.
    a_pinv = iterative_pinv(a.to(torch.promote_types(a.dtype, torch.float32)), pinv_iterations).to(a.dtype)
    return q_marks, k_marks, valid, a_pinv


def nystrom_parts(
    q: Tensor,
    k: Tensor,
    *,
    num_landmarks: int,
    pinv_iterations: int = 6,
    keep: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(F̃ (b, h, i, m), Ã⁺ (b, h, m, m), B̃ (b, h, m, j))`` for ``q (b, h, i, d)``, ``k (b, h, j, d)``.

    ``keep (b, h, j)``: optional key padding mask.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_marks, k_marks, valid, a_pinv = _landmarks(q, k, num_landmarks, pinv_iterations, keep, scale)
    # The scale goes on the (m, d) landmarks, not on the (i, d) queries: every logit is
    # linear in one landmark, and the means of scaled queries are the scaled means.
    marks_kept = None if valid is None else valid[:, :, None, :]
    keys_kept = None if keep is None else keep[:, :, None, :]
    f = masked_softmax(q @ (k_marks * scale).transpose(-1, -2), marks_kept)  # b h i m
    bt = masked_softmax(q_marks * scale @ k.transpose(-1, -2), keys_kept)  # b h m j
    return f, a_pinv, bt  # (a query landmark of padding alone: Ã⁺'s column zero, its row of B̃ never read)


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    num_landmarks: int,
    pinv_iterations: int = 6,
    keep: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Nyström attention of ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)`` -> ``(b, h, i, e)``.

    ``keep (b|1, h|1, j)``: optional key padding mask. No convolution here (see the module).
    """
    b, h = q.shape[:2]
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    if keep is None and not return_weights:
        return _fused(q, k, v, num_landmarks=num_landmarks, pinv_iterations=pinv_iterations, scale=scale)
    if keep is not None:
        keep = keep.expand(b, h, k.shape[-2])
    f, a_pinv, bt = nystrom_parts(
        q, k, num_landmarks=num_landmarks, pinv_iterations=pinv_iterations, keep=keep, scale=scale
    )
    # Right to left: (m, j)(j, e) then (m, m)(m, e) then (i, m)(m, e), all linear in i and j.
    out = f @ (a_pinv @ (bt @ v))
    if return_weights:
        return out, f @ (a_pinv @ bt)
    return out


def _fused(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int, pinv_iterations: int, scale: float | None) -> Tensor:
    """:func:`nystrom_attention` without masks: ``F̃ (Ã⁺ (B̃ V))`` as two fused attention calls.

    ``B̃ V = softmax(s Q̃ Kᵀ) V`` is attention of the landmark queries over all keys, and
    ``F̃ W = softmax(s Q K̃ᵀ) W`` attention of all queries over the landmark keys with values
    ``W = Ã⁺ B̃ V (m, e)``; ``scaled_dot_product_attention`` computes each without storing the
    ``(m, j)`` and ``(i, m)`` weights (at long lengths those tensors, not the arithmetic, were
    the cost).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_marks, k_marks, _, a_pinv = _landmarks(q, k, num_landmarks, pinv_iterations, None, scale)
    values = a_pinv @ F.scaled_dot_product_attention(q_marks, k, v, scale=scale)  # b h m e
    return F.scaled_dot_product_attention(q, k_marks, values, scale=scale)


class NystromAttention(ApproxAttention):
    """Nyström attention (Xiong et al. 2021) as a qkv mechanism.

    ``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.

    Args:
        num_landmarks: ``m``, landmarks for queries and for keys (capped at ``i`` and ``j``).
        pinv_iterations: steps of the iterative pseudo-inverse (paper: 6).
        scale: logits are ``scale · qᵀk``; default ``1/sqrt(d)``.
        conv_kernel: odd kernel size of the depthwise value convolution added to the output
            (the paper's skip connection); None (default) leaves it out.
        heads: ``h``, required with ``conv_kernel`` (one filter per head).
    """

    method = "NystromAttention"
    why_not_causal = "Nyström landmarks average over the whole sequence"
    mask_hint = "landmarks mix all positions; use exact attention (qkv.attention) for such masks"

    def __init__(
        self,
        num_landmarks: int = 64,
        *,
        pinv_iterations: int = 6,
        scale: float | None = None,
        conv_kernel: int | None = None,
        heads: int | None = None,
    ):
        super().__init__()
        self.num_landmarks = positive_int("num_landmarks", num_landmarks)
        self.pinv_iterations = positive_int("pinv_iterations", pinv_iterations)
        self.scale = check_scale(scale)
        self.heads = None if heads is None else positive_int("heads", heads)
        self.conv = None
        if conv_kernel is not None:
            positive_int("conv_kernel", conv_kernel)
            if conv_kernel % 2 == 0:
                raise ValueError(f"conv_kernel: expected an odd size (the output keeps the length), got {conv_kernel}")
            if heads is None:
                raise ValueError("heads: conv_kernel needs one filter per head, so heads is required, got None")
            self.conv = nn.Conv2d(
                heads, heads, (conv_kernel, 1), padding=(conv_kernel // 2, 0), groups=heads, bias=False
            )

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
        dims, keep = self.check_call(q, k, v, mask=mask, causal=causal, return_weights=return_weights)
        # Checked here, after the mask, rather than in check_sizes: a call with a bad mask and
        # a bad size for the convolution keeps getting the mask's error, as it always has.
        if self.conv is not None:
            if dims.h != self.heads:
                raise ValueError(
                    f"q: NystromAttention(heads={self.heads}) has conv filters for {self.heads} heads, got h={dims.h}"
                )
            if dims.i != dims.j:
                raise ValueError(
                    f"k: the value convolution adds v to the output, so it needs j == i={dims.i}, got j={dims.j}"
                )
        if (empty := self.empty_result(q, k, v, dims, return_weights)) is not None:
            return empty
        k, v = unseen_zeroed(k, keep), unseen_zeroed(v, keep)
        result = nystrom_attention(
            q,
            k,
            v,
            num_landmarks=self.num_landmarks,
            pinv_iterations=self.pinv_iterations,
            keep=keep,
            scale=self.scale,
            return_weights=return_weights,
        )
        if self.conv is None:
            return result
        out, weights = result if return_weights else (result, None)
        values = repeat_kv(v, dims.h)
        if keep is not None:
            values = values.masked_fill(~keep[..., None], 0)
        out = out + self.conv(values)
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        return f"num_landmarks={self.num_landmarks}, pinv_iterations={self.pinv_iterations}"
