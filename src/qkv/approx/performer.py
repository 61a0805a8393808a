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
of a (b, h) by ``exp(max over j and m)`` (a constant across keys, it cancels too); padded
keys are left out of that maximum and their features zeroed. A row that sees no key
gives zeros; on the causal and ``return_weights`` paths so does a row whose features all
underflow (the streamed path's query features are a softmax over m and cannot).

Speed: without ``return_weights`` the non-causal form never holds the ``(i, m)`` or
``(j, m)`` features: :func:`qkv.approx.linear.streamed_kernel_attention` makes and uses them
a chunk of rows at a time, the key max is kept as a running max (the state rescaled when it
grows), and factors that cancel in the ratio are not computed (see :func:`_favor_streamed`).
The causal form, and ``return_weights``, materialise the features with
:func:`favor_features`, the literal form of the paper.

Redrawing: ``redraw()`` draws a new ``W`` from the module's generator; with
``redraw_interval=n`` the module does so every ``n`` forward calls in training mode (the
paper redraws periodically during training). ``W`` is a buffer, saved in the state dict.

``return_weights=True`` returns the implicit weights ``φ(Q)φ(K)ᵀ / rowsum`` (masked,
causal), materialised as ``(b, h, i, j)`` from the same features, so ``out == weights @ v``;
``O(i j)`` memory, for inspection only.

Checked against (tests/test_approx_performer.py): averaged over 200 feature draws the
kernel estimate approaches ``exp(qᵀk/√d)`` and the output approaches exact softmax
attention computed in the test; the error falls as ``nb_features`` grows; causal and the
streamed non-causal form (over many chunks, a rising key max, padding that differs between
heads) equal the quadratic masked form with the same features; key padding equals dropping
the keys.
"""

from __future__ import annotations

import math

import torch
from einops import einsum
from torch import Tensor, nn

from .._args import positive_int
from ._common import (
    check_flags,
    check_interval,
    check_qkv,
    check_scale,
    dense_mask,
    key_padding,
    make_generator,
    repeat_kv,
)
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
    phi_q = favor_features(q * root, projection, stabilize="row")
    phi_k = favor_features(k * root, projection, stabilize="all", keep=keep)
    out = kernel_attention(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size)
    if return_weights:
        return out, kernel_attention_weights(phi_q, phi_k, causal=causal)
    return out


def _favor_streamed(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, root: float, keep: Tensor | None) -> Tensor:
    """Non-causal FAVOR+ without materialising the features: :func:`streamed_kernel_attention`
    with the maps of :func:`favor_features` fused per chunk.

    The same estimator as ``favor_features`` + ``kernel_attention``, written so that each
    chunk is a few large ops: ``√scale`` is folded into ``W``, and a key's log-feature minus
    the running max, ``W k − |k|²/2 − c``, is one matmul of ``[k, |k|², c]`` with
    ``[Wᵀ; −1/2; −1]``. Factors that cancel between numerator and denominator are left
    out: ``1/√m`` (every feature), ``exp(−max)`` of the keys (every key of a head), and for a
    query everything common to its ``m`` features, so its features are ``softmax(W q)``,
    which is ``exp(W q − |q|²/2) / √m`` times a per-row constant.
    """
    m, d = projection.shape
    k, v, keep = grouped_keep(k, v, keep, q.shape[1])
    b, g, _, _ = k.shape
    w = projection.to(q).T * root  # d m
    # [Wᵀ; −1/2; −1] with root² folded in: [x, |x|², c] @ it = W(root x) − |root x|²/2 − c.
    w_keys = torch.cat([w, w.new_full((1, m), -root * root / 2), w.new_full((1, m), -1.0)])  # d+2 m
    # [k, |k|², c] for all keys, the last column rewritten with each chunk's c (a few numbers per row).
    rows = torch.cat(
        [k, torch.linalg.vector_norm(k, dim=-1, keepdim=True).square(), k.new_zeros(()).expand(b, g, k.shape[2], 1)],
        dim=-1,
    ).reshape(b * g, k.shape[2], d + 2)

    # bmm saves its inputs for the backward pass only if something needs a gradient.
    differentiable = rows.requires_grad or w_keys.requires_grad

    def key_logits(t0: int, t1: int, shift: Tensor | None) -> Tensor:  # -> (b g, n, m)
        chunk = rows[:, t0:t1]
        if shift is not None and differentiable:
            chunk = torch.cat([chunk[..., : d + 1], shift.expand(b * g, t1 - t0, 1)], dim=-1)
        elif shift is not None:  # nothing to differentiate: overwrite the column in place
            chunk[..., d + 1 :] = shift.expand(b * g, t1 - t0, 1)
        return torch.bmm(chunk, w_keys.expand(b * g, d + 2, m))

    def query_features(x: Tensor) -> Tensor:  # (b h, n, d) -> (b h, n, m)
        return torch.bmm(x, w.expand(x.shape[0], d, m)).softmax(-1)

    return streamed_kernel_attention(q, v, query_features, key_logits, m, keep=keep, log_keys=True)


class Performer(nn.Module):
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
        dims = check_qkv(q, k, v)
        check_flags(causal, return_weights)
        if dims.d != self.dim_head:
            raise ValueError(f"q: Performer(dim_head={self.dim_head}) expects d={self.dim_head}, got d={dims.d}")
        keep = key_padding(
            dense_mask(mask, dims, q.device),
            dims,
            "Performer",
            "use causal=True for the causal mask, or exact attention (qkv.attention) for other masks",
        )
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

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, orthogonal={self.orthogonal}, "
            f"redraw_interval={self.redraw_interval}"
        )
