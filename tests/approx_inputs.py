"""Inputs shared by the qkv.approx tests: distinct odd sizes, so a swapped axis fails.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.
"""

import torch

B, H, G, D, E = 2, 6, 3, 11, 13


def inputs(i, j=None, dtype=torch.float64, seed=0, size=1.0):
    """Seeded ``q (B, H, i, D)``, ``k (B, G, j, D)``, ``v (B, G, j, E)``; ``size`` scales q and k."""
    j = i if j is None else j
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, i, D, generator=gen, dtype=dtype) * size
    k = torch.randn(B, G, j, D, generator=gen, dtype=dtype) * size
    v = torch.randn(B, G, j, E, generator=gen, dtype=dtype)
    return q, k, v
