"""Linformer: keys and values projected along the sequence to a fixed length ``k``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``k`` projected length.

Wang, Li, Khabsa, Fang, Ma, "Linformer: Self-Attention with Linear Complexity" (2020),
eq. 7. Learned projections ``E, F (k, seq_len)`` shorten the key and value sequences::

    out = softmax(scale · Q (E K)ᵀ) (F V)        Q (i, d), E K (k, d), F V (k, e)

so the weights are ``(i, k)``, linear in the sequence length. A call with ``j < seq_len``
keys uses the first ``j`` columns of ``E`` and ``F`` (as if the rest were zero padding);
``j > seq_len`` is an error. The paper's parameter sharing (section 4) maps to ``share``:

- ``"none"``: one ``E_n, F_n`` per query head (needs ``heads``);
- ``"headwise"``: one ``E`` and one ``F`` for all heads of the layer (the default);
- ``"kv"``: a single ``E = F`` for keys and values of all heads;
- layerwise sharing: build one ``Linformer(share="kv")`` and give the same instance to
  every layer, since the projection is this module's only parameter.

Entries are initialised ``N(0, 1/k)``, the random projection of the paper's Theorem 1.

Masks: a key padding mask is honoured by zeroing the padded keys and values before the
projection, so padding at the end gives exactly the output of the shorter sequence. The
projection mixes all positions, so a mask that varies with the query, and ``causal=True``,
cannot be honoured and raise ``ValueError``.

``return_weights=True`` returns ``(out, weights (b, h, i, j))`` with the *effective* weights
``softmax(scale · Q (E K)ᵀ) F``, the exact linear map from values to outputs
(``out == weights @ v``); they need not be positive nor sum to one. The probabilities over
the ``k`` projected positions are :func:`linformer_weights`.

Speed: ``E K`` and ``F V`` are plain batched matmuls over the keys' memory (one per batch
row when the heads are interleaved, as :class:`qkv.MultiHeadAttention` lays them out), the
scale is folded into ``E K``, and without ``return_weights`` the softmax runs over a chunk
of query rows at a time, so the ``(i, k)`` weights are never held whole. Logits more than
about 80 below their row's max are raised to that floor: their weights would be subnormal
numbers, which some CPUs process a hundred times slower, and Linformer's logits spread with √j.

Checked in the test suite against: ``softmax(q (E k)ᵀ · scale) (F v)``
computed directly in the test (also in chunks of two query rows, and with heads interleaved
in memory); with ``k == seq_len`` and ``E = F = I`` it equals exact attention.
"""

from __future__ import annotations

import torch
from einops import einsum
from torch import Tensor, nn

from .._args import positive_int
from ._common import CHUNK_ELEMENTS, Dims, check_scale, floor_logits, needs_grad, repeat_kv
from .base import ApproxAttention

SHARES = ("none", "headwise", "kv")


def _project(x: Tensor, proj: Tensor) -> Tensor:
    """``(b, h, j, c)`` projected along ``j`` by ``proj (k, j)`` or per head ``(h, k, j)`` -> ``(b, h, k, c)``.

    Batched matmuls straight over ``x``'s memory (an einsum would first permute ``x`` into
    a ``(j, b h c)`` copy). When the heads of ``x`` are interleaved in memory, ``(b, j, h,
    c)`` as :class:`qkv.MultiHeadAttention` splits them, a shared ``proj`` is one matmul
    per batch row with all heads side by side.
    """
    b, h, j, c = x.shape
    if proj.dim() == 2 and x.transpose(1, 2).is_contiguous():
        return (proj @ x.transpose(1, 2).reshape(b, j, h * c)).unflatten(-1, (h, c)).transpose(1, 2)
    return torch.matmul(proj, x)


def linformer_weights(q: Tensor, k: Tensor, e_proj: Tensor, *, scale: float | None = None) -> Tensor:
    """Softmax over the projected keys: ``softmax(scale · Q (E K)ᵀ)``, ``(b, h, i, k)``.

    ``q (b, h, i, d)``, ``k (b, h, j, d)`` (already one KV head per query head),
    ``e_proj (k, j)`` or ``(h, k, j)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = einsum(q, _project(k, e_proj), "b h i d, b h k d -> b h i k") * scale
    return logits.softmax(-1)


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e_proj: Tensor,
    f_proj: Tensor,
    *,
    keep: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Linformer attention on ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)`` -> ``(b, h, i, e)``.

    ``e_proj, f_proj``: ``(k, j)`` shared across heads or ``(h, k, j)`` per head, already cut
    to ``j`` columns. ``keep (b|1, h|1, j)``: optional key padding mask.
    """
    h, d = q.shape[1], q.shape[-1]
    if (keep is not None and keep.shape[1] != 1) or e_proj.dim() == 3 or f_proj.dim() == 3:
        k, v = repeat_kv(k, h), repeat_kv(v, h)  # a per-head mask or projection: one copy per query head
    if keep is not None:
        # Zero the padded keys and values before the projection (a copy, only when masked).
        k, v = k.masked_fill(~keep[..., None], 0), v.masked_fill(~keep[..., None], 0)
    # Shared projections commute with the head repeat: project the g KV heads, then repeat.
    scale = d**-0.5 if scale is None else scale
    k_proj = repeat_kv(_project(k, e_proj) * scale, h)  # b h k d, the scale folded in
    v_proj = repeat_kv(_project(v, f_proj), h)  # b h k e
    if not return_weights:
        return _chunked_softmax_attention(q, k_proj, v_proj)
    probs = floor_logits(q @ k_proj.transpose(-1, -2)).softmax(-1)
    out = probs @ v_proj
    effective = einsum(probs, f_proj, "b h i k, k j -> b h i j" if f_proj.dim() == 2 else "b h i k, h k j -> b h i j")
    if keep is not None:
        effective = effective.masked_fill(~keep[:, :, None, :], 0)
    return out, effective


def _chunked_softmax_attention(q: Tensor, k_proj: Tensor, v_proj: Tensor) -> Tensor:
    """``softmax(q k_projᵀ) v_proj`` for ``q (b, h, i, d)``, ``k_proj (b, h, k, d)``, ``v_proj
    (b, h, k, e)``, a chunk of query rows at a time, so the ``(i, k)`` logits are never held
    whole (no large buffer is allocated and each block stays in cache).

    Without autograd each head's chunks go straight into the output through one reused
    logits buffer: no list of chunk outputs and no concatenation, whose fresh memory (64 MiB
    at i = 32K) is faulted in page by page on every call.
    """
    b, h, i, d = q.shape
    n_proj, e = k_proj.shape[2], v_proj.shape[-1]
    if i == 0:
        return q.new_zeros(b, h, 0, e)
    keys_t = k_proj.reshape(b * h, n_proj, d).transpose(1, 2)
    values = v_proj.reshape(b * h, n_proj, e)
    if needs_grad(q, k_proj, v_proj):
        rows = max(1, CHUNK_ELEMENTS // (b * h * n_proj))
        outs = [
            torch.bmm(floor_logits(torch.bmm(q[:, :, p0 : p0 + rows].reshape(b * h, -1, d), keys_t)).softmax(-1), values)
            for p0 in range(0, i, rows)
        ]
        return torch.cat(outs, dim=1).unflatten(0, (b, h))
    rows = max(1, CHUNK_ELEMENTS // n_proj)
    queries = q.reshape(b * h, i, d)
    out = q.new_empty(b * h, i, e)
    logits = q.new_empty(min(rows, i), n_proj)
    for row in range(b * h):
        for p0 in range(0, i, rows):
            block = torch.mm(queries[row, p0 : p0 + rows], keys_t[row], out=logits[: min(rows, i - p0)])
            floor_logits(block, inplace=True)
            torch.mm(torch.softmax(block, -1, out=block), values[row], out=out[row, p0 : p0 + rows])
    return out.unflatten(0, (b, h))


class Linformer(ApproxAttention):
    """Linformer attention (Wang et al. 2020) as a qkv mechanism.

    ``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.

    Args:
        seq_len: the longest key sequence the projections cover.
        k: the projected length.
        heads: number of query heads ``h``; required for ``share="none"``.
        share: ``"none"``, ``"headwise"`` or ``"kv"`` (see the module docstring; layerwise
            sharing is one instance used by every layer).
        scale: logits are ``scale · qᵀ(Ek)``; default ``1/sqrt(d)``.
    """

    method = "Linformer"
    why_not_causal = "Linformer projects keys along the sequence"
    mask_hint = "the projection mixes all positions; use exact attention (qkv.attention) for such masks"

    def __init__(
        self,
        seq_len: int,
        k: int = 256,
        *,
        heads: int | None = None,
        share: str = "headwise",
        scale: float | None = None,
    ):
        super().__init__()
        self.seq_len = positive_int("seq_len", seq_len)
        self.k = positive_int("k", k)
        if share not in SHARES:
            raise ValueError(f"share: expected one of {SHARES}, got {share!r}")
        if share == "none":
            if heads is None:
                raise ValueError("heads: share='none' keeps one projection per head, so heads is required, got None")
            heads = positive_int("heads", heads)
        self.heads = heads
        self.share = share
        self.scale = check_scale(scale)
        shape = (k, seq_len) if share != "none" else (heads, k, seq_len)
        self.e_proj = nn.Parameter(torch.randn(shape) * k**-0.5)
        # kv sharing: no F of its own, the forward pass uses E for the values too.
        self.f_proj = None if share == "kv" else nn.Parameter(torch.randn(shape) * k**-0.5)

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
        if (empty := self.empty_result(q, k, v, dims, return_weights)) is not None:
            return empty
        f_full = self.e_proj if self.f_proj is None else self.f_proj
        e_proj, f_proj = self.e_proj[..., : dims.j], f_full[..., : dims.j]
        return linformer_attention(
            q, k, v, e_proj.to(q.dtype), f_proj.to(q.dtype), keep=keep, scale=self.scale, return_weights=return_weights
        )

    def check_sizes(self, dims: Dims, k: Tensor) -> None:
        if dims.j > self.seq_len:
            raise ValueError(
                f"k: Linformer(seq_len={self.seq_len}) projects at most {self.seq_len} keys, "
                f"got j={dims.j} (shape {tuple(k.shape)})"
            )
        if self.share == "none" and dims.h != self.heads:
            raise ValueError(
                f"q: Linformer(heads={self.heads}, share='none') has projections for {self.heads} heads, got h={dims.h}"
            )

    def extra_repr(self) -> str:
        return f"seq_len={self.seq_len}, k={self.k}, heads={self.heads}, share={self.share!r}"
