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

Without ``return_weights`` the non-causal form is :func:`streamed_kernel_attention`: the
features are made and used a chunk of rows at a time (never ``(i, m)`` at once) and the KV
heads of a group are not repeated for its query heads.

:func:`kernel_attention` is shared with :mod:`qkv.approx.performer` (FAVOR+ is linear
attention with random features). :func:`kernel_attention_weights` is its slow twin: the
``(i, j)`` matrix ``φ(Q) φ(K)ᵀ ⊙ causal`` normalised by rows, materialised.

Checked against (tests/test_approx_linear.py): the quadratic form ``(φ(Q)φ(K)ᵀ ⊙ causal) V /
rowsum`` computed in the test, to 1e-6 in float64 for causal (chunked, with i < j, i == j,
i > j) and non-causal (also streamed over many chunks, with padding that differs between
heads); key padding equal to dropping the padded keys.

``return_weights=True`` returns ``(out, weights)`` with the implicit ``(b, h, i, j)`` weight
matrix materialised (``out == weights @ v``): ``O(i j)`` memory, for inspection only.
Key padding masks are supported (the padded keys' features are zeroed); masks that vary
with the query are not (use ``causal=True`` for the causal one).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from einops import einsum
from torch import Tensor, nn

from .._args import positive_int
from ._common import CHUNK_ELEMENTS, check_flags, check_qkv, dense_mask, key_padding, repeat_kv, safe_divide


def elu_feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020, eq. 7).

    The 1 is added in place, one buffer instead of two: ``F.elu``'s backward reads its
    input, not its output, so the in-place add is safe under autograd.
    """
    return F.elu(x).add_(1)


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


def streamed_kernel_attention(
    q: Tensor,
    v: Tensor,
    query_map: Callable[[Tensor], Tensor],
    key_map: Callable[[int, int, Tensor | None], Tensor],
    m: int,
    *,
    keep: Tensor | None = None,
    log_keys: bool = False,
    chunk_elements: int | None = None,
) -> Tensor:
    """Non-causal ``φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)``, the features made and used chunk by chunk.

    ``q (b, h, i, d)``, ``v (b, g, j, e)`` -> ``(b, h, i, e)``. The maps make ``m`` features
    of a chunk of rows, heads flattened into the batch: ``query_map(x (b h, n, d)) -> (b h,
    n, m)`` for queries ``x``, and ``key_map(t0, t1, shift) -> (b g, t1 − t0, m)`` for keys
    ``t0 <= t < t1``. A query's features may be off by a positive factor common to the whole
    row (it cancels in the row's ratio); a key's may not. ``keep (b|1, g|1, j)`` zeroes
    padded keys. ``chunk_elements``: size of a chunk's ``(b g, n, m)`` block, default
    :data:`CHUNK_ELEMENTS`. Grouped heads are not repeated: the state ``[φ(K)ᵀ V | φ(K)ᵀ 1]
    (b g, m, e + 1)`` is built once per KV head and read by the ``h / g`` query heads of its
    group.

    With ``log_keys`` the key map returns *log*-features minus ``shift (b g, 1, 1)`` (None:
    minus nothing) and ``exp`` is taken here. ``shift`` is the largest log-feature seen so
    far (per ``(b, g)``, padded keys left out); when a chunk holds a larger one, the chunk
    and the state are rescaled by ``exp(old − new)``. At the end every key carries the
    factor ``exp(−max)``, as if the max over all keys had been subtracted first (the
    paper's stabiliser), and that factor cancels between numerator and denominator.

    Equal to :func:`kernel_attention` on the materialised features up to rounding, but no
    ``(i, m)`` or ``(j, m)`` tensor is held: each chunk's block stays in cache between the
    matmul that makes it and the one that reads it, and nothing larger than ``[V | 1]`` and
    ``[num | den]`` of the output is allocated.
    """
    b, h, i, d = q.shape
    g, j, e = v.shape[1], v.shape[2], v.shape[3]
    if j == 0 or i == 0:
        return q.new_zeros(b, h, i, e)
    lowest = torch.finfo(q.dtype).min
    padded = None if keep is None else ~keep.expand(b, g, j).reshape(b * g, j, 1)
    vf = v.reshape(b * g, j, e)
    state = None  # (b g, m, e): Σ φ(k) vᵀ over the keys so far
    norm = None  # (b g, 1, m): Σ φ(k) over the keys so far
    seen = None  # (b g, 1, 1): largest key log-feature so far, lowest if none (log_keys only)
    shift = None  # what the key map subtracts: seen, or 0 where seen is lowest
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    step = max(1, chunk_elements // (b * g * m))
    for t0 in range(0, j, step):
        t1 = min(t0 + step, j)
        fk = key_map(t0, t1, shift)  # b g, n, m
        if padded is not None:
            fk = fk.masked_fill_(padded[:, t0:t1], lowest if log_keys else 0)  # exp(lowest) is exactly 0
        if log_keys:
            top = fk.detach().amax((-2, -1), keepdim=True)
            if shift is not None:
                top = top + shift
            if seen is None or bool((top > seen).any()):
                new = top if seen is None else torch.maximum(seen, top)
                new_shift = new.masked_fill(new == lowest, 0)  # an all-padded (b, g) subtracts 0
                fk = fk.sub_(new_shift if shift is None else new_shift - shift)
                if state is not None:
                    # Rescale what was summed with the old max: a factor in [0, 1] (0 for a
                    # state that is still empty, whose seen is lowest).
                    factor = torch.exp(seen - new)
                    state, norm = state.mul_(factor), norm.mul_(factor)
                seen, shift = new, new_shift
            fk = fk.exp_()
        fk_t = fk.transpose(1, 2)
        # In place: no op saves the state for its backward until the queries read it.
        if state is None:
            state, norm = torch.bmm(fk_t, vf[:, t0:t1]), fk.sum(1, keepdim=True)
        else:
            state, norm = state.baddbmm_(fk_t, vf[:, t0:t1]), norm.add_(fk.sum(1, keepdim=True))
    # [Σ φ(k) vᵀ | Σ φ(k)] (b g, m, e + 1): one matmul per query chunk gives numerator and
    # denominator. Joined here, on the small state, not as a column of ones on all of V.
    both = torch.cat([state, norm.transpose(1, 2)], dim=-1)
    # Every query head reads its group's state: (b g, m, e + 1) -> (b h, m, e + 1).
    r = h // g
    both = both.unflatten(0, (b, g)).unsqueeze(2).expand(b, g, r, m, e + 1).reshape(b * h, m, e + 1)
    rows = max(1, chunk_elements // (b * h * m))
    tiny = torch.finfo(q.dtype).tiny
    parts = []
    for p0 in range(0, i, rows):
        fq = query_map(q[:, :, p0 : p0 + rows].reshape(b * h, -1, d))  # b h, n, m
        nd = torch.bmm(fq, both)  # b h, n, e + 1
        # Features are non-negative, so den = 0 means num = 0 (no key seen): 0 / tiny = 0.
        parts.append(nd[..., :e] / nd[..., e:].clamp_min(tiny))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.unflatten(0, (b, h))


def grouped_keep(k: Tensor, v: Tensor, keep: Tensor | None, h: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(k, v, keep)`` ready for :func:`streamed_kernel_attention`: ``keep (b|1, h|1, j)`` as
    ``(b|1, g|1, j)``; a mask that differs between the query heads of a group needs one state
    per query head, so then ``k`` and ``v`` are repeated to ``h`` heads."""
    if keep is None or keep.shape[1] == 1 or k.shape[1] == h:
        return k, v, keep
    return repeat_kv(k, h), repeat_kv(v, h), keep


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
    if not causal and not return_weights:
        k, v, keep = grouped_keep(k, v, keep, q.shape[1])
        b, g, _, d = k.shape

        def key_features(t0: int, t1: int, _shift: None) -> Tensor:
            return elu_feature_map(k[:, :, t0:t1].reshape(b * g, t1 - t0, d))

        return streamed_kernel_attention(q, v, elu_feature_map, key_features, d, keep=keep)
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
