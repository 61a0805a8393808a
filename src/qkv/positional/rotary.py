"""Rotary position embeddings (RoPE): Su et al. 2021, "RoFormer: Enhanced Transformer with
Rotary Position Embedding", section 3.2.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size, ``r`` the rotated part of ``d`` (``rotary_dim``).

The projected query and key at position ``m`` are rotated pair by pair::

    θ_k = base^(-2k / r),   k = 0 .. r/2 - 1                      (base = 10000)
    [x'_2k  ]   [cos mθ_k  -sin mθ_k] [x_2k  ]
    [x'_2k+1] = [sin mθ_k   cos mθ_k] [x_2k+1]

Read as complex numbers ``z_k = x_2k + i x_2k+1`` this is ``z_k e^{i m θ_k}``, so
``Re Σ_k q_k conj(k_k) e^{i (m - n) θ_k}``: the logit of query ``m`` and key ``n`` depends on
the positions only through ``m - n`` (tested). Only the first ``r`` dims are rotated
(partial rotary, as in GPT-NeoX); the rest pass through. ``interleaved=False`` pairs
dim ``k`` with ``k + r/2`` instead of ``2k`` with ``2k + 1`` — the same rotation on permuted
dims, the layout of GPT-NeoX and LLaMA checkpoints.

Positions follow the bottom-right alignment of ``qkv.masks``: the new keys sit at
``start .. start + j - 1`` (``start`` = the KV-cache length) and the ``i`` queries at the last
``i`` of those positions, so a query and the key at its own position get the same angle.
Checked in the test suite against the complex-number form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._args import finite_number, positive_int
from .base import Positional
from .rope_scaling import DEFAULT, frequencies, scaling_settings


def rotary_angles(positions: Tensor, rotary_dim: int, base: float = 10000.0, theta: Tensor | None = None) -> Tensor:
    """``(n, r/2)`` float64 angles ``m θ_k`` for the positions ``m`` in ``positions (n,)``; ``theta (r/2,)``: other
    frequencies than the paper's (``rope_scaling``)."""
    if theta is None:
        theta = frequencies(rotary_dim, base, DEFAULT)[0]
    return positions.to(torch.float64)[:, None] * theta.to(positions.device)[None, :]


def apply_rotary(x: Tensor, angles: Tensor, *, interleaved: bool = True, factor: float = 1.0) -> Tensor:
    """Rotate the first ``r = 2 · angles.shape[-1]`` dims of ``x (..., n, d)`` by ``angles (n, r/2)``, their length
    scaled by ``factor`` (YaRN's attention factor; 1: a rotation)."""
    # cos/sin in float64, then cast: in float32 the angle m·θ_0 = m is exact but its sine
    # would be rounded differently in the full and the cached pass.
    cos, sin = torch.cos(angles) * factor, torch.sin(angles) * factor
    return rotate_pairs(x, cos.to(x.dtype), sin.to(x.dtype), interleaved=interleaved)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = True) -> Tensor:
    """Rotate the first ``r = 2 · cos.shape[-1]`` dims of ``x (..., d)`` pair by pair by the given ``cos, sin (..., r/2)``,
    which broadcast against ``x``'s leading dims; the other dims pass through."""
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
    a2, b2 = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        rot = torch.stack((a2, b2), dim=-1).flatten(-2)  # re-interleave (.., r/2, 2) -> (.., r)
    else:
        rot = torch.cat((a2, b2), dim=-1)
    return torch.cat((rot, rest), dim=-1)


class Rotary(Positional):
    """RoPE for ``MultiHeadAttention(positional=Rotary(dim_head))``: rotates q and k, adds no bias.

    Args:
        dim_head: the per-head query/key size ``d`` the module will see.
        rotary_dim: how many leading dims of each head to rotate (even, at most ``d``;
            default all of them). GPT-NeoX rotates a quarter.
        base: the wavelength base of the frequencies (10000 in the paper).
        interleaved: pair dims ``(2k, 2k+1)`` as in the paper (True) or ``(k, k + r/2)``.
        scaling: frequencies stretched for longer contexts, as a Hugging Face config's
            ``rope_scaling`` gives them: ``{"rope_type": "linear" | "dynamic" | "yarn" | "llama3",
            "factor": ..., ...}`` (``qkv.positional.rope_scaling``); None: the paper's.
    """

    def __init__(
        self, dim_head: int, *, rotary_dim: int | None = None, base: float = 10000.0, interleaved: bool = True,
        scaling: dict | None = None,
    ):
        super().__init__()
        self.dim_head = positive_int("dim_head", dim_head)
        rotary_dim = dim_head if rotary_dim is None else rotary_dim
        positive_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 or rotary_dim > dim_head:
            raise ValueError(f"rotary_dim: expected an even number at most dim_head={dim_head}, got {rotary_dim}")
        base = finite_number("base", base, above=1)
        self.rotary_dim, self.base, self.interleaved = rotary_dim, base, bool(interleaved)
        self.scaling = scaling_settings(scaling, base, rotary_dim / dim_head)
        # (dynamic NTK's frequencies follow each call's positions; the others are fixed)
        fixed = self.scaling["rope_type"] != "dynamic"
        self._fixed = frequencies(rotary_dim, base, self.scaling) if fixed else None

    def rotate(
        self, q: Tensor, k: Tensor, start: int = 0, positions: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``q (b, h, i, d)``, new keys ``k (b, g, j, d)`` at positions ``start ..``; queries aligned to the last keys.

        ``positions = (q_positions (i,), k_positions (j,))`` rotate rows that stand elsewhere
        (a rank's shard of a longer sequence: ``qkv.distributed.SequenceParallel.positions``).
        """
        for name, x in (("q", q), ("k", k)):
            if x.shape[-1] != self.dim_head:
                raise ValueError(
                    f"{name}: Rotary(dim_head={self.dim_head}) expects head size {self.dim_head}, "
                    f"got shape {tuple(x.shape)}"
                )
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start: expected a non-negative int (the cache length), got {start!r}")
        if positions is not None:
            q_pos, k_pos = positions
            for name, x, pos in (("q", q, q_pos), ("k", k, k_pos)):
                if not isinstance(pos, Tensor) or pos.shape != (x.shape[-2],):
                    got = tuple(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
                    raise ValueError(f"positions: expected ({x.shape[-2]},) positions for {name}, got {got}")
            if self.scaling["rope_type"] == "dynamic":  # a shard's, or several requests' positions
                raise ValueError("positions: dynamic NTK scaling reads its sequence's length, which rows standing "
                                 "elsewhere (a rank's shard, a serving step's requests) do not hold; use linear, yarn "
                                 "or llama3 scaling there")  # fmt: skip
            return self.rotate_at(q, q_pos.to(q.device)), self.rotate_at(k, k_pos.to(k.device))
        i, j = q.shape[-2], k.shape[-2]
        # bottom-right: the last query stands at the last key's position, start + j - 1
        q_pos = torch.arange(start + j - i, start + j, device=q.device)
        k_pos = torch.arange(start, start + j, device=q.device)
        return self.rotate_at(q, q_pos, length=start + j), self.rotate_at(k, k_pos, length=start + j)

    def rotate_at(self, x: Tensor, positions: Tensor, length: int | None = None) -> Tensor:
        """Rotate ``x (..., n, d)`` as if its rows stood at ``positions (n,)`` of one sequence of ``length`` positions
        (read by dynamic NTK scaling only; default ``max(positions) + 1``)."""
        if not isinstance(positions, Tensor) or positions.shape != (x.shape[-2],):
            # a (b, n) tensor (transformers' position_ids) would broadcast along the frequencies, silently wrong
            got = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
            raise ValueError(f"positions: expected one per row of x ({x.shape[-2]},), got {got}; rotary depends on "
                             "distances only, so rows of a batch share their positions")  # fmt: skip
        if self._fixed is None and length is None:
            length = int(positions.max()) + 1 if positions.numel() else None
        theta, factor = self._fixed or frequencies(self.rotary_dim, self.base, self.scaling, length)
        angles = rotary_angles(positions, self.rotary_dim, theta=theta)
        return apply_rotary(x, angles, interleaved=self.interleaved, factor=factor)

    def extra_repr(self) -> str:
        scaled = "" if self.scaling["rope_type"] == "default" else f", scaling={self.scaling}"
        return (
            f"dim_head={self.dim_head}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"interleaved={self.interleaved}{scaled}"
        )
