"""Performer: softmax attention estimated with positive orthogonal random features (FAVOR+).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size, ``m`` random features (``nb_features``).

Choromanski et al., "Rethinking Attention with Performers" (ICLR 2021), Lemma 1 and
section 2.4. The softmax kernel has the positive random-feature form

    exp(xᵀy) = E_w[φ(x)ᵀφ(y)],   φ(x) = exp(Wx − |x|²/2) / √m,   rows w ~ N(0, I_d),

so with ``x = q·√scale`` and ``y = k·√scale`` (``scale = 1/√d`` by default)
``exp(scale · qᵀk)`` is estimated without bias, and attention becomes linear attention
(:func:`qkv.approx.linear.kernel_attention`) with features ``φ``::

    out = φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)        causal: prefix sums, chunked

The rows of ``W`` are drawn in blocks of ``d`` exactly orthogonal directions (QR of a
Gaussian matrix with the signs fixed, i.e. Haar), each row rescaled by the norm of an
independent ``N(0, I_d)`` vector so it is marginally Gaussian: the estimate stays unbiased
and its variance drops (section 2.4, "orthogonal random features").

Numerics: ``exp`` overflows for large logits, so each query's features are divided by
``exp(max over m)`` (a per-row constant, it cancels in the row normalisation) and all keys
of a (b, h) by a constant across keys (it cancels too): on the materialised paths
``exp(max over j and m)`` of the log-features, on the streamed path ``exp(max over j)`` of
each key's log-sum of its features (see :func:`_favor_streamed`). Padded keys are left out
of that maximum and their features zeroed. A row that sees no key gives zeros; on the
causal and ``return_weights`` paths so does a row whose features all underflow (the
streamed path's query features are a softmax over m and cannot).

Speed: without ``return_weights`` the non-causal form never holds the ``(i, m)`` or
``(j, m)`` features: :func:`qkv.approx.linear.streamed_kernel_attention` makes and uses them
a block of rows at a time, the key stabiliser is a running max (the state rescaled when it
grows), and factors that cancel in the ratio are not computed. For float32 on the CPU, once
a head's block holds 1024 rows or more, its four large products (``W x`` for keys and
queries, ``φ(K)ᵀ V``, ``φ(Q) S``) run in oneDNN (:func:`qkv.projection.linear`'s
convolution, written into reused buffers, and a batched product run as the same kind of
convolution), 1.5-2× MKL's rate on the benchmark machine.
The causal form, and ``return_weights``, materialise the features with
:func:`favor_features`, the literal form of the paper.

Redrawing: ``redraw()`` draws a new ``W`` from the module's generator; with
``redraw_interval=n`` the module does so every ``n`` forward calls in training mode (the
paper redraws periodically during training). ``W`` is a buffer, saved in the state dict.

``return_weights=True`` returns the implicit weights ``φ(Q)φ(K)ᵀ / rowsum`` (masked,
causal), materialised as ``(b, h, i, j)`` from the same features, so ``out == weights @ v``;
``O(i j)`` memory, for inspection only.

Checked in the test suite against: averaged over 200 feature draws the
kernel estimate approaches ``exp(qᵀk/√d)`` and the output approaches exact softmax
attention computed in the test; the error falls as ``nb_features`` grows; causal and the
streamed non-causal form (over many blocks, a rising key max, padding that differs between
heads; in float64 and on the float32 oneDNN route) equal the quadratic masked form with the
same features; key padding equals dropping the keys.
"""

from __future__ import annotations

import math

import torch
from einops import einsum
from torch import Tensor

from .._args import positive_int
from ._common import Dims, Scratch, check_interval, check_scale, make_generator, needs_grad, project_into, repeat_kv
from .base import CAUSAL_INSTEAD, ApproxAttention, unseen_zeroed
from .linear import grouped_keep, kernel_attention, kernel_attention_weights, streamed_kernel_attention


def gaussian_features(
    m: int, d: int, *, orthogonal: bool = True, generator: torch.Generator | None = None
) -> Tensor:
    """Random feature matrix ``W (m, d)`` with rows marginally ``N(0, I_d)``, float32.

    ``orthogonal=True`` makes each block of ``d`` rows exactly orthogonal (FAVOR+).
    """
    device = generator.device if generator is not None else None
    if not orthogonal:
        return torch.randn(m, d, generator=generator, device=device)
    blocks = []
    for _ in range(math.ceil(m / d)):
        gauss = torch.randn(d, d, generator=generator, device=device)
        qm, r = torch.linalg.qr(gauss)
        # QR is unique only up to column signs; fixing sign(diag R) > 0 makes qm Haar-distributed.
        blocks.append((qm * torch.sign(torch.diagonal(r))[None, :]).T)
    directions = torch.cat(blocks)[:m]
    lengths = torch.randn(m, d, generator=generator, device=device).norm(dim=1)  # chi with d dof
    return directions * lengths[:, None]


def favor_features(
    x: Tensor, projection: Tensor, *, stabilize: str | None = None, keep: Tensor | None = None
) -> Tensor:
    """Positive random features ``φ(x) = exp(Wx − |x|²/2) / √m`` of ``x (..., n, d)`` -> ``(..., n, m)``.

    ``x`` is already multiplied by ``√scale``. ``stabilize``: None (the plain estimator),
    ``"row"`` (divide each row by its max, for queries) or ``"all"`` (divide by the max over
    ``n`` and ``m``, for keys). ``keep (..., n)`` zeroes padded rows and leaves them out of
    the max.
    """
    m = projection.shape[0]
    logits = einsum(x, projection.to(x), "... n d, m d -> ... n m") - (x * x).sum(-1, keepdim=True) / 2
    lowest = torch.finfo(logits.dtype).min
    if keep is not None:
        logits = logits.masked_fill(~keep[..., None], lowest)  # exp gives exactly 0, never inf * 0
    if stabilize is not None:
        if stabilize == "row":
            top = logits.amax(-1, keepdim=True)
        elif stabilize == "all":
            top = logits.amax((-2, -1), keepdim=True)
        else:
            raise ValueError(f"stabilize: expected None, 'row' or 'all', got {stabilize!r}")
        # The max only rescales numerator and denominator alike, so no gradient flows through
        # it; with every row padded there is nothing to rescale.
        logits = logits - top.masked_fill(top == lowest, 0).detach()
    return torch.exp(logits) / math.sqrt(m)


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    keep: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 128,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FAVOR+ attention of ``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)`` -> ``(b, h, i, e)``.

    ``projection (m, d)`` is the random feature matrix, ``keep (b|1, h|1, j)`` an optional
    key padding mask.
    """
    h, d = q.shape[1], q.shape[-1]
    root = (d**-0.5 if scale is None else scale) ** 0.5
    if not causal and not return_weights:
        return _favor_streamed(q, k, v, projection, root, keep)
    k = repeat_kv(k, h)
    v = repeat_kv(v, h)
    if keep is not None:
        keep = keep.expand(k.shape[0], h, k.shape[2])
    # features in float32 at least: float16's exp flushed 60% of the key features to zero below the keys' max
    # (e^-16.6), 0.49 off in a causal call (bfloat16 has float32's range, its features are rounded instead)
    acc = torch.promote_types(q.dtype, torch.float32)
    phi_q = favor_features(q.to(acc) * root, projection, stabilize="row")
    phi_k = favor_features(k.to(acc) * root, projection, stabilize="all", keep=keep)
    out = kernel_attention(phi_q, phi_k, v.to(acc), causal=causal, chunk_size=chunk_size).to(q.dtype)
    if return_weights:
        return out, kernel_attention_weights(phi_q, phi_k, causal=causal).to(q.dtype)
    return out


def _favor_streamed(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, root: float, keep: Tensor | None) -> Tensor:
    """Non-causal FAVOR+ without materialising the features: :func:`streamed_kernel_attention`
    with the maps of :func:`favor_features` written as softmaxes.

    The same estimator as ``favor_features`` + ``kernel_attention``, with ``√scale`` folded
    into ``W`` and factors that cancel between numerator and denominator left out (``1/√m``
    of every feature, anything common to a query's ``m`` features). With ``x`` scaled by
    ``√scale`` and ``ℓ = W x`` (one matmul per block, :func:`qkv.approx._common.project_into`),

        φ(x) ∝ exp(ℓ − |x|²/2) = softmax(ℓ) · exp(logsumexp(ℓ) − |x|²/2),

    so a query's features are ``softmax(ℓ)`` and a key's are ``softmax(ℓ)`` with the
    log-weight ``logsumexp(ℓ) − |k|²/2``, which :func:`streamed_kernel_attention` applies on
    the ``[V | 1]`` side of the product, after subtracting the running max over keys (the
    paper's stabiliser, a constant that cancels). The log-sum-exp is read off the softmax:
    its largest entry is ``exp(0) / Σ exp(ℓ − max ℓ)``, so ``logsumexp(ℓ) = max ℓ − log max
    softmax(ℓ)``; torch's softmax is one fused pass, cheaper on the benchmark machine than
    ``exp`` alone (0.7 against 1.0 ns an element, one core).
    """
    m, d = projection.shape
    k, v, keep = grouped_keep(k, v, keep, q.shape[1])
    b, g, j, _ = k.shape
    kf = k.reshape(b * g, j, d)
    w = projection.to(q) * root  # m d: ℓ = W (root x)
    # The per-key log-weights are a few numbers per key, kept in at least float32: in bfloat16
    # |k|²/2 ~ 5 would be off by ~0.03, an error of 3% in every key's weight.
    acc = torch.promote_types(k.dtype, torch.float32)
    # |root k|² / 2 (b g, j), without a (b g, j, d) temporary
    halves = torch.linalg.vector_norm(kf, dim=-1, dtype=acc).square() * (root * root / 2)
    scratch = Scratch(not needs_grad(q, k, v, w))

    def softmax_of_projection(x: Tensor) -> tuple[Tensor, Tensor]:  # -> (ℓ, softmax(ℓ))
        # One pair of buffers for key and query blocks: a block's features are used up
        # before the next block is made.
        shape = (*x.shape[:-1], m)
        logits = project_into(x, w, scratch.get("logits", shape, x))
        buffer = scratch.get("features", shape, x)
        return logits, logits.softmax(-1) if buffer is None else torch.softmax(logits, -1, out=buffer)

    def key_features(s0: int, s1: int, t0: int, t1: int) -> tuple[Tensor, Tensor]:  # -> (n_h, n, m), (n_h, n)
        logits, features = softmax_of_projection(kf[s0:s1, t0:t1])
        lse = logits.amax(-1).to(acc) - torch.log(features.amax(-1).to(acc))
        return features, lse - halves[s0:s1, t0:t1]

    def query_features(x: Tensor) -> Tensor:  # (n_h, n, d) -> (n_h, n, m)
        return softmax_of_projection(x)[1]

    return streamed_kernel_attention(q, v, query_features, key_features, m, keep=keep, scratch=scratch)


class Performer(ApproxAttention):
    """FAVOR+ attention (Choromanski et al. 2021) as a qkv mechanism.

    ``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.

    Args:
        dim_head: ``d``, the query/key size the features are drawn for.
        nb_features: ``m``, the number of random features; default ``round(d ln d)``, the
            paper's choice.
        scale: logits are ``scale · qᵀk``; default ``1/sqrt(d)``.
        orthogonal: draw blocks of orthogonal rows (FAVOR+); False draws iid rows.
        redraw_interval: redraw the features every this many training-mode forward calls;
            None never redraws on its own (call :meth:`redraw`).
        chunk_size: queries per chunk of the causal prefix sums.
        seed, generator: the random stream of the features (one of them, or neither to seed
            from torch's global RNG).
    """

    method = "Performer"
    mask_hint = CAUSAL_INSTEAD

    def __init__(
        self,
        dim_head: int,
        *,
        nb_features: int | None = None,
        scale: float | None = None,
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        chunk_size: int = 128,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.dim_head = positive_int("dim_head", dim_head)
        if nb_features is None:
            nb_features = max(1, round(dim_head * math.log(dim_head)))
        self.nb_features = positive_int("nb_features", nb_features)
        self.scale = check_scale(scale)
        self.orthogonal = bool(orthogonal)
        self.redraw_interval = check_interval(redraw_interval)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self.generator = make_generator(seed, generator)
        self._steps = 0
        self.register_buffer("projection", self._draw())

    def _draw(self) -> Tensor:
        return gaussian_features(self.nb_features, self.dim_head, orthogonal=self.orthogonal, generator=self.generator)

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw a new random feature matrix from the module's generator (in place)."""
        self.projection.copy_(self._draw())

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
        if self.training and self.redraw_interval is not None:
            self._steps += 1
            if self._steps % self.redraw_interval == 0:
                self.redraw()
        return favor_attention(
            q,
            k,
            v,
            self.projection,
            keep=keep,
            causal=causal,
            scale=self.scale,
            chunk_size=self.chunk_size,
            return_weights=return_weights,
        )

    def check_sizes(self, dims: Dims, k: Tensor) -> None:
        if dims.d != self.dim_head:
            raise ValueError(f"q: Performer(dim_head={self.dim_head}) expects d={self.dim_head}, got d={dims.d}")

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, orthogonal={self.orthogonal}, "
            f"redraw_interval={self.redraw_interval}"
        )
