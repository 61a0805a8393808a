"""Structured queries, keys and values for measuring approximation error.

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length (``j = i``: self-attention),
``d`` query/key size, ``e`` value size (``e = d`` here), ``c`` clusters.

Gaussian noise is the easy case for an approximation: with ``q, k ~ N(0, I)`` and the
``1/√d`` scale the logits are about ``N(0, 1)``, every row of the softmax is close to
uniform, and a low-rank or random-feature estimate of a near-uniform matrix is good. Real
attention is not like that (Tay et al. 2021 "Long Range Arena", Xiong et al. 2021 section 5
look at trained models' maps: local bands, a few clusters, peaked rows). So besides
``gaussian`` three structured families are generated, each a known pattern:

- ``local``: ``q_t, k_t`` are random Fourier features of the position ``t``, so
  ``q_s · k_t`` is a smooth bump in ``|s − t|`` (a band around the diagonal, width
  ``bandwidth`` tokens), plus noise.
- ``lowrank_local``: ``local`` plus a cluster term: each token belongs to one of ``c``
  clusters with a shared centroid in ``q`` and ``k``, so tokens of a cluster attend to each
  other wherever they are. The logit matrix is low rank (``c`` + the band) plus noise.
- ``peaked``: each query is a scaled copy of one random key, so each row of the softmax
  puts most of its mass on a single, non-local key (sparse attention, the hard case for
  low-rank methods and the easy one for hashing).

Values are Gaussian in every family. Everything is drawn from a ``torch.Generator`` seeded
by ``seed``: the same call gives the same tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FAMILIES = ("gaussian", "local", "lowrank_local", "peaked")
#: default ``sharpness`` of each structured family (see :func:`make_inputs`)
SHARPNESS = {"local": 3.0, "lowrank_local": 3.0, "peaked": 4.0}


def _randn(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen)


def _position_features(i: int, d: int, bandwidth: float, gen: torch.Generator) -> Tensor:
    """``(i, d)`` random Fourier features of the positions: ``f_s · f_t ≈ exp(−(s−t)²/2σ²)``.

    Rahimi & Recht 2007: with ``ω ~ N(0, 1/σ²)`` and ``φ ~ U(0, 2π)``,
    ``E[2 cos(ωs + φ) cos(ωt + φ)] = exp(−(s−t)²/(2σ²))``; ``d`` features estimate it.
    """
    omega = _randn(gen, d) / bandwidth
    phase = torch.rand(d, generator=gen) * 2 * math.pi
    t = torch.arange(i, dtype=torch.float32)[:, None]
    return torch.cos(t * omega + phase) * math.sqrt(2.0 / d)


def make_inputs(
    family: str,
    i: int,
    *,
    b: int = 1,
    h: int = 8,
    d: int = 64,
    seed: int = 0,
    sharpness: float | None = None,
    bandwidth: float = 8.0,
    clusters: int = 16,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)``, each ``(b, h, i, d)`` float32, of one input ``family`` (see the module).

    ``sharpness`` sets how peaked the structured families are: the largest logits (after
    the ``1/√d`` scale) are about ``sharpness²`` above the typical ones. The default
    (:data:`SHARPNESS`) was chosen so that at ``i = 4096`` a row of ``local`` spreads over
    about 50 keys, ``lowrank_local`` over about 8 and ``peaked`` over about 3 (measured with
    :func:`effective_keys`; the uniform rows of ``gaussian`` spread over about 2500).
    """
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    for name, value in (("i", i), ("b", b), ("h", h), ("d", d), ("clusters", clusters)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    sharpness = SHARPNESS.get(family, 1.0) if sharpness is None else float(sharpness)
    gen = torch.Generator().manual_seed(seed)
    v = _randn(gen, b, h, i, d)
    if family == "gaussian":
        return _randn(gen, b, h, i, d), _randn(gen, b, h, i, d), v
    # Work in units where a logit is q·k/√d: a vector of norm a·d^¼ contributes a²
    # to the logit of its own direction.
    root = d**0.25
    noise = 0.5
    if family == "peaked":
        k = _randn(gen, b, h, i, d)
        target = torch.randint(i, (b, h, i), generator=gen)
        chosen = k.gather(2, target[..., None].expand(b, h, i, d))
        # |k|² ≈ d, so with q = c·k_target the logit q·k_target/√d ≈ c√d = sharpness², while the
        # other keys give c·N(0, 1): one key stands far above the rest.
        q = chosen * (sharpness**2 / math.sqrt(d)) + noise * _randn(gen, b, h, i, d)
        return q, k, v
    band = _position_features(i, d, bandwidth, gen) * sharpness * root  # i d
    q = band.expand(b, h, i, d) + noise * _randn(gen, b, h, i, d)
    k = band.expand(b, h, i, d) + noise * _randn(gen, b, h, i, d)
    if family == "lowrank_local":
        centroids = _randn(gen, b, h, clusters, d)
        centroids = centroids / centroids.norm(dim=-1, keepdim=True) * sharpness * root
        member = torch.randint(clusters, (b, h, i), generator=gen)
        shared = centroids.gather(2, member[..., None].expand(b, h, i, d))  # b h i d
        q, k = q + shared, k + shared
    return q.contiguous(), k.contiguous(), v


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """``‖approx − exact‖_F / ‖exact‖_F`` over the whole tensor, computed in float64."""
    if approx.shape != exact.shape:
        raise ValueError(f"approx: expected the shape of exact {tuple(exact.shape)}, got {tuple(approx.shape)}")
    a, e = approx.double(), exact.double()
    norm = e.norm()
    if norm == 0:
        raise ValueError("exact: the reference output is all zeros, a relative error is undefined")
    return float((a - e).norm() / norm)


def effective_keys(q: Tensor, k: Tensor, *, rows: int = 256) -> float:
    """How spread the exact attention is: ``exp(entropy)`` of a row, averaged over ``rows`` rows.

    ``i`` for uniform rows, 1 for one-hot rows; shared by all heads and batches.
    """
    scale = q.shape[-1] ** -0.5
    sub = q[..., : min(rows, q.shape[-2]), :]
    logp = (sub @ k.transpose(-1, -2) * scale).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return float(entropy.exp().mean())
