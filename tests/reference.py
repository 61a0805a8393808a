"""Oracles for the tests: attention written out element by element, independent of qkv.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

:func:`literal_attention` is the definition with Python loops and Python floats (double
precision), for tiny inputs only:

    e[r, c] = scale · score(q_r, k_c) + bias[r, c]       for allowed (r, c)
    α[r, c] = exp(e[r, c] - max) / Σ_allowed exp(...)    (0 for a row with no allowed key)
    out[r]  = Σ_c α[r, c] v_c

It shares no code with ``qkv.backends.reference``: the score functions below are the
formulas of Luong et al. (2015, section 3.1) and Bahdanau et al. (2015) as sums over
indices. :func:`plain_attention` is the usual few-line PyTorch version, used as the
"same precision" baseline of the flash-attention error rule (:func:`assert_flash_rule`,
Dao et al. 2022: a low-precision kernel may err at most twice as much as plain PyTorch in
the same precision, against a float64 oracle).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

ScoreFn = Callable[[list[float], list[float], int], float]  # (q_r, k_c, c) -> score


def dot(qr: list[float], kc: list[float], c: int) -> float:
    """``qᵀk`` as a sum."""
    return sum(a * b for a, b in zip(qr, kc, strict=True))


def bilinear(weight: Tensor) -> ScoreFn:
    """Luong's "general" score ``Σ_a Σ_b q_a W_ab k_b``."""
    w = weight.double().tolist()

    def score(qr: list[float], kc: list[float], c: int) -> float:
        return sum(qr[a] * w[a][b] * kc[b] for a in range(len(qr)) for b in range(len(kc)))

    return score


def additive(w_q: Tensor, w_k: Tensor, v: Tensor, b_q: Tensor | None = None) -> ScoreFn:
    """Bahdanau's score ``Σ_n v_n tanh(Σ_a Wq_na q_a + bq_n + Σ_b Wk_nb k_b)``."""
    wq, wk, vv = w_q.double().tolist(), w_k.double().tolist(), v.double().tolist()
    bq = [0.0] * len(vv) if b_q is None else b_q.double().tolist()

    def score(qr: list[float], kc: list[float], c: int) -> float:
        total = 0.0
        for n in range(len(vv)):
            pre = bq[n] + sum(wq[n][a] * qr[a] for a in range(len(qr))) + sum(wk[n][b] * kc[b] for b in range(len(kc)))
            total += vv[n] * math.tanh(pre)
        return total

    return score


def location(weight: Tensor, bias: Tensor | None) -> ScoreFn:
    """Luong's location score: the ``c``-th entry of ``W_a q + b``; the key's content is unused."""
    w = weight.double().tolist()
    bb = [0.0] * len(w) if bias is None else bias.double().tolist()

    def score(qr: list[float], kc: list[float], c: int) -> float:
        return bb[c] + sum(w[c][a] * qr[a] for a in range(len(qr)))

    return score


def bottom_right_causal(i: int, j: int) -> Tensor:
    """``(i, j)`` bool, True where key ``c <= r + (j - i)`` (qkv's causal convention)."""
    return torch.tensor([[c <= r + (j - i) for c in range(j)] for r in range(i)])


def band(i: int, j: int, left: int, right: int) -> Tensor:
    """``(i, j)`` bool, True where ``-left <= c - r - (j - i) <= right``."""
    return torch.tensor([[-left <= c - r - (j - i) <= right for c in range(j)] for r in range(i)])


def literal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score: ScoreFn = dot,
    scale: float = 1.0,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)`` -> float64 ``out (b, h, i, e)``, ``α (b, h, i, j)``.

    ``mask`` (bool, True = may attend) and ``bias`` broadcast to ``(b, h, i, j)``. Query head
    ``n`` reads KV head ``n // (h // g)``.
    """
    b, h, i, _ = q.shape
    g, j, e = k.shape[1], k.shape[2], v.shape[3]
    allowed = torch.ones(b, h, i, j, dtype=torch.bool) if mask is None else mask.expand(b, h, i, j)
    add = torch.zeros(b, h, i, j, dtype=torch.float64) if bias is None else bias.double().expand(b, h, i, j)
    qq, kk, vv = q.double().tolist(), k.double().tolist(), v.double().tolist()
    allowed, add = allowed.tolist(), add.tolist()
    out = [[[[0.0] * e for _ in range(i)] for _ in range(h)] for _ in range(b)]
    alpha = [[[[0.0] * j for _ in range(i)] for _ in range(h)] for _ in range(b)]
    for n in range(b):
        for hd in range(h):
            kv = hd // (h // g)
            for r in range(i):
                cols = [c for c in range(j) if allowed[n][hd][r][c]]
                if not cols:
                    continue  # a query that may see nothing: zero output and weights
                logit = {c: scale * score(qq[n][hd][r], kk[n][kv][c], c) + add[n][hd][r][c] for c in cols}
                top = max(logit.values())
                total = sum(math.exp(x - top) for x in logit.values())
                for c in cols:
                    alpha[n][hd][r][c] = math.exp(logit[c] - top) / total
                for f in range(e):
                    out[n][hd][r][f] = sum(alpha[n][hd][r][c] * vv[n][kv][c][f] for c in cols)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(alpha, dtype=torch.float64)


def plain_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, mask: Tensor | None = None
) -> Tensor:
    """The few-line PyTorch attention, computed entirely in the inputs' dtype (the baseline of the error rule).

    Rows with no allowed key are zero, as in qkv.
    """
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    w = torch.softmax(logits, dim=-1)
    if mask is not None:
        w = w * mask.any(dim=-1, keepdim=True)
    return w @ v


def assert_flash_rule(low: Tensor, baseline: Tensor, oracle: Tensor, *, floor: float = 1e-5) -> None:
    """``max|low - oracle| <= 2 · max|baseline - oracle| + floor`` (all compared in float64)."""
    err = (low.double() - oracle.double()).abs().max().item()
    base = (baseline.double() - oracle.double()).abs().max().item()
    if not err <= 2 * base + floor:
        raise AssertionError(f"low-precision error {err:.3g} exceeds 2 × baseline error {base:.3g} + {floor:g}")


#: Names of the mask cases of :func:`mask_case`, for parametrising parity tests.
MASK_CASES = ("none", "dense", "lengths", "window", "dense&lengths", "window|dense")


def mask_case(name: str, b: int, i: int, j: int, *, causal: bool, seed: int = 0):
    """``(qkv_mask, allowed)``: a mask as given to qkv, and the same mask as an explicit bool tensor.

    ``allowed`` is built here from the definitions (bottom-right causal, band, key lengths),
    broadcastable to ``(b, 1, i, j)``, including the causal flag. Every row keeps at least
    one key (key 0 or its own diagonal), so PyTorch's kernel, which returns NaN for a fully
    masked row, can be compared.
    """
    from qkv import masks  # the object under test only supplies the lazy twin

    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(b, 1, i, j, generator=gen) > 0.4
    dense[..., 0] = True
    key_lengths = torch.tensor([max(1, j - 2 - n) for n in range(b)])
    by_length = (torch.arange(j)[None, :] < key_lengths[:, None])[:, None, None, :]
    lazy, allowed = {
        "none": (None, torch.ones(1, 1, i, j, dtype=torch.bool)),
        "dense": (dense, dense),
        "lengths": (masks.lengths(key_lengths), by_length),
        "window": (masks.window(2), band(i, j, 2, 0)[None, None]),
        "dense&lengths": (masks.lengths(key_lengths) & dense, dense & by_length),
        "window|dense": (masks.window(1, 1) | dense, band(i, j, 1, 1)[None, None] | dense),
    }[name]
    if causal:
        allowed = allowed & bottom_right_causal(i, j)
    return lazy, allowed


def tile_masks(b: int, i: int, j: int) -> dict:
    """Masks that cut tiles every way: none, causal, a window, lengths & causal, and a dense
    mask with one dead row (query 2 of batch row 1 sees nothing)."""
    import qkv

    dead = torch.ones(b, 1, i, j, dtype=torch.bool)
    dead[1, 0, 2] = False
    return {
        "none": None,
        "causal": qkv.masks.causal(),
        "window": qkv.masks.window(3, 1),
        "lengths&causal": qkv.masks.lengths(torch.tensor([j, max(1, j // 2)])) & qkv.masks.causal(),
        "dense_dead_row": dead,
    }


def random_qkv(b: int, h: int, g: int, i: int, j: int, d: int, e: int, *, dtype=torch.float64, seed: int = 0,
               spread: float = 1.0) -> list[Tensor]:  # fmt: skip
    """``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``, normal (q and k times ``spread``), requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=gen, dtype=dtype) * spread
    k = torch.randn(b, g, j, d, generator=gen, dtype=dtype) * spread
    v = torch.randn(b, g, j, e, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def assert_same_output_and_grads(got, expected, tol: float = 1e-10) -> None:
    """``(out, grads)`` pairs equal: the output within ``tol``, each gradient within ``10 · tol``."""
    (out, grads), (out_ref, grads_ref) = got, expected
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    for a, b_ in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=10 * tol, atol=10 * tol)


def alibi_slopes(heads: int) -> list[float]:
    """Press et al. 2022's slopes with Python floats: ``2^(-8k/n)`` for the largest power of two
    ``n <= heads``, then every other slope of ``2n``."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    return slopes + [2.0 ** (-8.0 * k / (2 * n)) for k in range(1, 2 * n + 1, 2)][: heads - n]


def t5_bucket(relative: int, buckets: int, max_distance: int, bidirectional: bool) -> int:
    """Raffel et al. 2020's bucket of ``key - query``, written out with Python numbers."""
    offset = 0
    if bidirectional:
        buckets //= 2
        offset = buckets if relative > 0 else 0
        distance = abs(relative)
    else:
        distance = max(-relative, 0)
    exact = buckets // 2
    if distance < exact:
        return offset + distance
    log_part = math.log(distance / exact) / math.log(max_distance / exact) * (buckets - exact)
    return offset + min(buckets - 1, exact + int(log_part))


def run_with_grads(fn, leaves: list[Tensor], seed: int = 1) -> list[Tensor]:
    """``fn()``'s outputs and the gradients of ``leaves`` under seeded random cotangents (finite entries only)."""
    outs = fn()
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((torch.where(torch.isfinite(o), o, 0.0) * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [*outs, *(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))]
