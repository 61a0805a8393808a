"""FlashInfer's kernels' formulas, written out per request in float64: the oracle of ``qkv.flashinfer``'s tests.

Shape legend: ``n`` one request's queries, ``j`` its keys, ``h`` query heads, ``g`` KV heads,
``d`` key size, ``e`` value size.

Written from ``include/flashinfer/attention/variants.cuh`` (the logits transform and mask),
``pos_enc.cuh`` / ``prefill.cuh`` (Llama's RoPE at ``p = j - n + t`` for query ``t``, at ``k`` for a
key) and the flashinfer-bench references (``lse`` in base 2, ``-inf`` and zeros for a row
that sees nothing), not from qkv's code.
"""

import math

import torch


def request(q, k, v, *, causal=False, mode="NONE", window_left=-1, cap=0.0, sm_scale=None, rope_scale=1.0,
            rope_theta=1e4, mask=None, sinks=None):  # fmt: skip
    """``(out (n, h, e), lse (n, h))`` of one request, ``q (n, h, d)``, ``k (j, g, d)``, ``v (j, g, e)``, float64.

    ``mask (n, j)`` bool replaces ``causal``; ``sinks (h,)``: one more logit per row, no value.
    """
    q, k, v = q.double(), k.double(), v.double()
    n, h, d = q.shape
    j, g = k.shape[:2]
    sm = d**-0.5 if sm_scale is None else sm_scale
    t = torch.arange(n)[:, None]
    p = t + j - n
    kp = torch.arange(j)[None, :]
    if mode == "ROPE_LLAMA":
        q = llama_rope(q, (torch.arange(n) + j - n), rope_scale, rope_theta)
        k = llama_rope(k, torch.arange(j), rope_scale, rope_theta)
    ks = k.transpose(0, 1).repeat_interleave(h // g, 0)  # (h, j, d)
    vs = v.transpose(0, 1).repeat_interleave(h // g, 0)
    raw = q.transpose(0, 1) @ ks.transpose(-1, -2)  # (h, n, j)
    if mode == "ALIBI":
        slopes = alibi_slopes(h)[:, None, None]
        s = raw * sm + slopes * (kp - t)
        if cap:
            s = cap * torch.tanh(s * sm / cap)
    else:
        s = raw * sm
        if cap:
            s = cap * torch.tanh(s / cap)
    seen = torch.ones(n, j, dtype=torch.bool)
    if mask is not None:
        seen &= mask.reshape(n, j).bool()
    elif causal:
        seen &= kp <= p
    if window_left >= 0:
        seen &= kp >= p - window_left
    s = s.masked_fill(~seen, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(h, n, 1)], -1)
        vs = torch.cat([vs, vs.new_zeros(h, 1, vs.shape[-1])], 1)
    lse = torch.logsumexp(s, -1)  # (h, n)
    live = torch.isfinite(lse)[..., None]
    w = torch.where(live, torch.exp(s - torch.where(live, lse[..., None], 0.0)), 0.0)
    return (w @ vs).transpose(0, 1), (lse / math.log(2.0)).T


def alibi_slopes(h):
    """Press et al.'s slopes as FlashInfer's ``get_alibi_slopes`` computes them (``torch.pow`` in float32), in float64."""
    n = 2 ** math.floor(math.log2(h))
    m = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n))
    if n < h:
        m = torch.cat([m, torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (h - n), 2))])
    return m.float().double()


def llama_rope(x, positions, scale, theta):
    """``x (s, heads, d)`` rotated as Llama: halves ``(i, i + d/2)`` turned by ``positions / scale · theta^(-2i/d)``."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) / scale
    angle = positions.double()[:, None, None] * freq  # (s, 1, d/2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


def paged_requests(rng, *, requests, page_size, g, d, e, dtype=torch.float64, max_kv=40, max_q=6, spare=3):
    """A random paged cache and table: ``(kv_cache (N, 2, P, g, d), (qo_indptr, kv_indptr, kv_indices, last), keys)``.

    ``keys[r] = (K (j, g, d), V (j, g, e))``, each request's own contiguous keys; pages permuted, ``spare``
    unused pages; ``qo`` lengths 0 .. ``max_q`` (at most the keys under ``causal``, as callers choose).
    """
    lens = [int(rng.integers(1, max_kv + 1)) for _ in range(requests)]
    counts = [-(-n // page_size) for n in lens]
    total = sum(counts) + spare
    order = torch.from_numpy(rng.permutation(total)).long()
    K = torch.randn(total, page_size, g, d, dtype=dtype)
    V = torch.randn(total, page_size, g, e, dtype=dtype)
    kv_indptr, indices, last, keys, at = [0], [], [], [], 0
    for n, c in zip(lens, counts):
        ids = order[at : at + c]
        at += c
        indices += ids.tolist()
        kv_indptr.append(kv_indptr[-1] + c)
        last.append(n - (c - 1) * page_size)
        keys.append((K[ids].reshape(-1, g, d)[:n], V[ids].reshape(-1, g, e)[:n]))
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return (K, V), (ints(kv_indptr), ints(indices), ints(last)), keys, lens
