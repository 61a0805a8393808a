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
features are made and used a block of rows at a time (never ``(i, m)`` at once), the KV
heads of a group are not repeated for its query heads, and the output is written in place.

:func:`kernel_attention` is shared with :mod:`qkv.approx.performer` (FAVOR+ is linear
attention with random features). :func:`kernel_attention_weights` is its slow twin: the
``(i, j)`` matrix ``φ(Q) φ(K)ᵀ ⊙ causal`` normalised by rows, materialised.

Checked in the test suite against: the quadratic form ``(φ(Q)φ(K)ᵀ ⊙ causal) V /
rowsum`` computed in the test, to 1e-6 in float64 for causal (chunked, with i < j, i == j,
i > j) and non-causal (also streamed over many blocks, with padding that differs between
heads; in float32 as accurate as the quadratic form in float32); key padding equal to
dropping the padded keys, whatever the padded keys hold (inf, NaN).

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
from torch import Tensor

from .._args import positive_int
from ._common import (
    CHUNK_ELEMENTS,
    GROUPED_MIN_PIXELS,
    Scratch,
    grouped_matmul,
    grouped_prefers_onednn,
    project_into,
    repeat_kv,
    safe_divide,
)
from .base import CAUSAL_INSTEAD, ApproxAttention, unseen_zeroed


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
    # The prefix sums grow over all i / chunk_size chunks: in bfloat16 their rounding would
    # add up, so they are kept in float32 (at least) and rounded once per chunk for its products.
    acc = torch.promote_types(phi_k.dtype, torch.float32)
    state = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], v.shape[-1], dtype=acc)  # S: b h m e
    total = phi_k.new_zeros(phi_k.shape[:-2] + phi_k.shape[-1:], dtype=acc)  # z: b h m
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
        num = einsum(fq, state.to(fq.dtype), "b h i m, b h m e -> b h i e")
        den = einsum(fq, total.to(fq.dtype), "b h i m, b h m -> b h i")
        if hi > lo:
            rows = torch.arange(p0, p1, device=fq.device)[:, None]
            cols = torch.arange(lo, hi, device=fq.device)[None, :]
            block = einsum(fq, phi_k[..., lo:hi, :], "b h i m, b h j m -> b h i j")
            block = block * (cols <= rows + offset)
            num = num + einsum(block, v[..., lo:hi, :], "b h i j, b h j e -> b h i e")
            den = den + block.sum(-1)
        outs.append(safe_divide(num, den))
    return torch.cat(outs, dim=-2)


def blocks(heads: int, length: int, m: int, chunk_elements: int, *, per_head: bool = True) -> tuple[int, int]:
    """``(heads per block, rows per block)`` of a ``(heads, length, m)`` tensor made a block
    of about ``chunk_elements`` at a time.

    With ``m >= GROUPED_MIN_PIXELS`` (the products go to oneDNN, per head) rows of one head
    come first, several heads only when a whole head fits: long sequences give one-head
    blocks, whose query product is one :func:`qkv.projection.linear`. With fewer features,
    or ``per_head=False`` (this CPU's BLAS beats oneDNN at these products), the products
    stay batched ``bmm`` over all heads, and fewer, wider blocks mean fewer ops (2 threads,
    m = 64: one-head blocks were 10-20% slower at 4K and 16K).
    """
    if m < GROUPED_MIN_PIXELS or not per_head:
        return heads, max(1, min(length, chunk_elements // (heads * m)))
    rows = max(1, min(length, chunk_elements // m))
    return max(1, min(heads, chunk_elements // (rows * m))), rows


def streamed_kernel_attention(
    q: Tensor,
    v: Tensor,
    query_map: Callable[[Tensor], Tensor],
    key_map: Callable[[int, int, int, int], tuple[Tensor, Tensor | None]],
    m: int,
    *,
    keep: Tensor | None = None,
    chunk_elements: int | None = None,
    scratch: Scratch | None = None,
) -> Tensor:
    """Non-causal ``φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)``, the features made and used block by block.

    ``q (b, h, i, d)``, ``v (b, g, j, e)`` -> ``(b, h, i, e)``. Heads are flattened into one
    axis (``b h`` for queries, ``b g`` for keys) and the maps make ``m`` features of a block
    of heads and rows: ``query_map(x (n_h, n, d)) -> (n_h, n, m)`` for queries ``x``, and
    ``key_map(s0, s1, t0, t1) -> (f (n_h, n, m), log_w (n_h, n) or None)`` for keys ``t0 <=
    t < t1`` of KV heads ``s0 <= s < s1``, where ``φ(k_t) = f_t · exp(log_w_t)`` (None: ``φ
    = f``). A query's features may be off by a positive factor common to the whole row (it
    cancels in the row's ratio); a key's may not, which is what ``log_w`` carries.
    ``keep (b|1, g|1, j)`` drops padded keys. ``chunk_elements``: size of a block's ``(n_h,
    n, m)`` features, default :data:`CHUNK_ELEMENTS` (see :func:`blocks`). ``scratch``: the
    call's reusable buffers (:class:`Scratch`, the maps may use it too), None for none;
    with buffers on, the key features a map returns are overwritten here (padding zeroed).

    The per-key factor goes on the small side of the products: the state is ``[V | 1]ᵀ
    diag(w) F`` (``(b g, e + 1, m)``; ``(w V)ᵀ F`` and ``wᵀ F`` computed apart and stacked),
    with ``w_t = exp(log_w_t − c)``, 0 for a padded key. ``c`` is the largest ``log_w`` seen
    so far in the head; when a block holds a larger one the state is rescaled by ``exp(old −
    new)``, so at the end every key carries the factor ``exp(−max log_w)``, a constant that
    cancels between numerator and denominator and keeps every ``w_t <= 1``. Grouped heads
    are not repeated: the state is built once per KV head and read by the ``h / g`` query
    heads of its group.

    Equal to :func:`kernel_attention` on the materialised features up to rounding, but no
    ``(i, m)`` or ``(j, m)`` tensor is held: each block stays in cache between the op that
    makes it and the one that reads it. Speed (float32, CPU): with ``m >= 256`` features
    (Performer) the keys' product runs through :func:`grouped_matmul` and, in one-head
    blocks, the queries' through :func:`qkv.projection.linear`, both oneDNN (about twice
    MKL's rate on the benchmark machine); with fewer (linear attention, ``m = d``) both stay
    ``bmm``. Without autograd the output is written in place, block by block, into one
    tensor (no list of parts and no concatenation), and ``scratch`` buffers are reused.
    """
    b, h, i, d = q.shape
    g, j, e = v.shape[1], v.shape[2], v.shape[3]
    if j == 0 or i == 0:
        return q.new_zeros(b, h, i, e)
    scratch = Scratch(False) if scratch is None else scratch
    tiny = torch.finfo(q.dtype).tiny
    acc = torch.promote_types(q.dtype, torch.float32)  # the key state's sums
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    kept = None if keep is None else keep.expand(b, g, j).reshape(b * g, j)
    vf = v.reshape(b * g, j, e)
    states = []  # per block of KV heads: (n_h, e + 1, m) = [Σ w φ(k) vᵀ ; Σ w φ(k)]ᵀ
    # One-head blocks feed oneDNN; if this CPU's BLAS is faster at the keys' product, all
    # heads go through bmm together instead.
    per_head = not (
        q.dtype == torch.float32 and q.device.type == "cpu" and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled and m >= GROUPED_MIN_PIXELS
        and not grouped_prefers_onednn(e, max(1, min(j, chunk_elements // m)), m)
    )  # fmt: skip
    per, rows = blocks(b * g, j, m, chunk_elements, per_head=per_head)
    for s0 in range(0, b * g, per):
        s1 = min(s0 + per, b * g)
        num = den = None  # (n_h, e, m), (n_h, 1, m): the state [Σ w v φ(k)ᵀ ; Σ w φ(k)ᵀ]
        seen = None  # (n_h, 1): largest log_w so far, lowest while every key was padded
        for t0 in range(0, j, rows):
            t1 = min(t0 + rows, j)
            fk, log_w = key_map(s0, s1, t0, t1)  # (n_h, n, m), (n_h, n) or None
            if kept is not None:
                # A padded key weighs 0, but 0 · inf is NaN: its features are zeroed too, so
                # whatever a padded key holds (inf, NaN) it adds exactly nothing.
                padded = ~kept[s0:s1, t0:t1, None]
                fk = fk.masked_fill_(padded, 0) if scratch.enabled else fk.masked_fill(padded, 0)
            weight = None
            if log_w is not None:
                lowest = torch.finfo(log_w.dtype).min  # log_w may be wider than q (see the key map)
                if kept is not None:
                    log_w = log_w.masked_fill(~kept[s0:s1, t0:t1], lowest)  # exp(lowest − c) is exactly 0
                top = log_w.detach().amax(-1, keepdim=True)
                if seen is None or bool((top > seen).any()):
                    new = top if seen is None else torch.maximum(seen, top)
                    if num is not None:
                        # Rescale what was summed with the old max: a factor in [0, 1] (0 for
                        # a state that is still empty, whose seen is lowest).
                        factor = torch.exp(seen - new)[..., None].to(num.dtype)
                        num, den = num * factor, den * factor
                    seen = new
                # The max only rescales numerator and denominator alike (no gradient flows
                # through it); a head with every key so far padded subtracts 0.
                weight = torch.exp(log_w - seen.masked_fill(seen == lowest, 0)).to(vf.dtype)
            elif kept is not None:
                weight = kept[s0:s1, t0:t1].to(vf.dtype)
            values = vf[s0:s1, t0:t1].transpose(1, 2)  # n_h, e, n
            # (w v)ᵀ laid out (e, n) in a reused buffer for oneDNN's product, which reads it 25%
            # faster than the transposed view (one core, 0.46 against 0.60 ms); bmm takes the view.
            onednn = s1 - s0 == 1 and m >= GROUPED_MIN_PIXELS  # grouped_matmul's own test, roughly
            scaled = scratch.get("values", tuple(values.shape), vf) if onednn else None
            if scaled is None:
                scaled = values if weight is None else values * weight[:, None, :]
            elif weight is None:
                scaled.copy_(values)
            else:
                torch.mul(values, weight[:, None, :], out=scaled)
            # Numerator and denominator apart: e = 64 rows suit oneDNN's blocks of 16, e + 1 not.
            part = grouped_matmul(scaled, fk)  # n_h, e, m: Σ w v φ(k)ᵀ
            total = fk.sum(1, keepdim=True) if weight is None else torch.bmm(weight.unsqueeze(1), fk)  # n_h, 1, m
            # In place when possible: nothing saves the state for its backward until the queries
            # read it. The sums run over every key block, so half-precision parts are summed
            # in float32 (each block's product is rounded once, as in one matmul).
            if num is None:
                num, den = part.to(acc), total.to(acc)
            else:
                num, den = num.add_(part), den.add_(total)
        states.append(torch.cat([num, den], dim=1))
    state = states[0] if len(states) == 1 else torch.cat(states)
    state = state.to(q.dtype)  # rounded once for the queries' products
    # Every query head reads its group's state: (b g, e + 1, m) -> (b h, e + 1, m).
    r = h // g
    state = state.unflatten(0, (b, g)).unsqueeze(2).expand(b, g, r, e + 1, m).reshape(b * h, e + 1, m)
    qf = q.reshape(b * h, i, d)
    out = None  # (b h, i, e), written block by block when nothing needs a gradient
    parts = []  # per block of heads, the list of its row blocks (autograd only)
    per, rows = blocks(b * h, i, m, chunk_elements, per_head=per_head)
    for s0 in range(0, b * h, per):
        s1 = min(s0 + per, b * h)
        parts.append([])
        for p0 in range(0, i, rows):
            fq = query_map(qf[s0:s1, p0 : p0 + rows])  # n_h, n, m
            if s1 - s0 == 1:  # one head: its state is the weight of a projection of the rows
                numerators = scratch.get("numerators", (fq.shape[1], e), fq)
                num = project_into(fq[0], state[s0, :e], numerators).unsqueeze(0)  # e rows again, not e + 1
                den = (fq[0] @ state[s0, e]).view(1, -1, 1)
            else:
                nd = torch.bmm(fq, state[s0:s1].transpose(1, 2))  # n_h, n, e + 1
                num, den = nd[..., :e], nd[..., e:]
            # Features are non-negative, so den = 0 means num = 0 (no key seen): 0 / tiny = 0.
            den = den.clamp_min(tiny)
            if num.requires_grad:
                parts[-1].append(num / den)
                continue
            if out is None:
                out = q.new_empty(b * h, i, e)
            torch.div(num, den, out=out[s0:s1, p0 : p0 + rows])
    if out is None:
        out = torch.cat([torch.cat(row_parts, dim=1) for row_parts in parts])
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
        b, g, j, d = k.shape
        kf = k.reshape(b * g, j, d)

        def key_features(s0: int, s1: int, t0: int, t1: int) -> tuple[Tensor, None]:
            return elu_feature_map(kf[s0:s1, t0:t1]), None

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


class LinearAttention(ApproxAttention):
    """Linear attention (Katharopoulos et al. 2020) as a qkv mechanism; no parameters.

    ``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.

    Args:
        chunk_size: queries per chunk of the causal prefix sums; memory grows with it,
            the number of Python steps shrinks with it.

    There is no ``scale``: the feature map replaces the softmax kernel, and ``elu(x) + 1``
    is not scale-invariant, so a scale would be a different model, not a temperature.
    """

    method = "LinearAttention"
    mask_hint = CAUSAL_INSTEAD

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
        dims, keep = self.check_call(q, k, v, mask=mask, causal=causal, return_weights=return_weights)
        if (empty := self.empty_result(q, k, v, dims, return_weights)) is not None:
            return empty
        k, v = unseen_zeroed(k, keep), unseen_zeroed(v, keep)
        return linear_attention(
            q, k, v, keep=keep, causal=causal, chunk_size=self.chunk_size, return_weights=return_weights
        )

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"
