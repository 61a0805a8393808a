"""Luong et al.'s global and local alignment: which source positions a decoder step attends to.

Shape legend: ``b`` batch, ``i`` decoder steps (queries), ``j`` source length (keys),
``dq`` decoder state size, ``d`` annotation size, ``n`` hidden size of the position
predictor.

Luong, Pham and Manning 2015, "Effective Approaches to Attention-based Neural Machine
Translation", section 3. The decoder state ``h_t`` is the query, the source states
``h̄_s`` the keys and values, ``score`` one of ``qkv.scores`` (dot, general, concat,
location), and ``align(h_t, h̄_s) = softmax_s score(h_t, h̄_s)``:

* **global** (3.1): ``a_t(s) = align(h_t, h̄_s)`` over every real source position.
* **local-m** (3.2, monotonic): the aligned position is ``p_t = t``; ``align`` is a softmax
  over the window ``[p_t − D, p_t + D]`` only, so every weight outside it is exactly 0.
* **local-p** (3.2, predictive): ``p_t = S · sigmoid(v_pᵀ tanh(W_p h_t))`` with ``S`` the
  row's own source length, and

      a_t(s) = align(h_t, h̄_s) · exp(−(s − p_t)² / (2σ²)),   σ = D / 2,

  the global weights times a Gaussian centred on ``p_t``, kept inside the window
  ``|s − p_t| ≤ D`` (0 elsewhere). As in the paper the weights are not renormalised, so
  a row sums to at most 1. ``p_t`` is real, so the window need not hold ``2D + 1`` positions.

Positions count from 0. The context is ``c_t = Σ_s a_t(s) h̄_s``. Padding is masked with a
bool mask (True = may attend). Checked against these formulas, computed by hand from the
module's parameters, in the test suite.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._args import positive_int
from ..functional import attention, attention_weights
from ..scores import Score

ALIGNMENTS = ("global", "local-m", "local-p")


def padding_mask(src_lengths: Tensor, j: int) -> Tensor:
    """Bool ``(b, 1, j)``: True at the first ``src_lengths[n]`` positions of row ``n``."""
    positions = torch.arange(j, device=src_lengths.device)
    return (positions[None, :] < src_lengths[:, None])[:, None, :]


def monotonic_mask(steps: Tensor, j: int, window: int) -> Tensor:
    """Bool ``(i, j)``: local-m's window, ``|s − t| ≤ window`` for decoder step ``t = steps[i]``."""
    positions = torch.arange(j, device=steps.device)
    return (positions[None, :] - steps[:, None]).abs() <= window


def gaussian_window(centres: Tensor, j: int, window: int) -> Tensor:
    """``(b, i, j)``: ``exp(−(s − p)² / (2σ²))`` with ``σ = window / 2`` where ``|s − p| ≤ window``, else 0.

    ``centres (b, i)`` holds the predicted positions ``p_t``.
    """
    positions = torch.arange(j, device=centres.device, dtype=centres.dtype)
    distance = positions - centres[..., None]  # (b, i, j)
    sigma = window / 2.0
    gauss = torch.exp(-(distance**2) / (2.0 * sigma**2))
    return gauss * (distance.abs() <= window)


class PositionPredictor(nn.Module):
    """Local-p's aligned position ``p_t = S · sigmoid(v_pᵀ tanh(W_p h_t))``, per row's source length ``S``."""

    def __init__(self, query_dim: int, hidden: int):
        super().__init__()
        positive_int("query_dim", query_dim)
        positive_int("hidden", hidden)
        self.proj = nn.Linear(query_dim, hidden, bias=False)  # W_p
        self.v = nn.Linear(hidden, 1, bias=False)  # v_p

    def forward(self, query: Tensor, src_lengths: Tensor) -> Tensor:
        """``query (b, i, dq)``, ``src_lengths (b,)`` -> ``p (b, i)`` in ``[0, S]``."""
        unit = torch.sigmoid(self.v(torch.tanh(self.proj(query)))).squeeze(-1)  # (b, i) in (0, 1)
        return src_lengths.to(unit.dtype)[:, None] * unit


class LuongAlignment(nn.Module):
    """Global, local-m or local-p attention of decoder states over source states, with any qkv score.

    Args:
        score: a ``qkv.scores.Score`` comparing decoder states ``(dq)`` with annotations ``(d)``.
        alignment: ``"global"``, ``"local-m"`` or ``"local-p"``.
        window: ``D``, the half-width of the local window (ignored by global).
        query_dim: decoder state size, needed by local-p's position predictor.
        predictor_hidden: hidden size of ``W_p`` (local-p).
        backend: the ``qkv.attention`` backend for global and local-m.
    """

    def __init__(
        self,
        score: Score,
        alignment: str = "global",
        *,
        window: int = 10,
        query_dim: int | None = None,
        predictor_hidden: int = 64,
        backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(score, Score):
            raise TypeError(f"score: expected a qkv.scores.Score, got {type(score).__name__}")
        if alignment not in ALIGNMENTS:
            raise ValueError(f"alignment: expected one of {ALIGNMENTS}, got {alignment!r}")
        positive_int("window", window)
        self.score, self.alignment, self.window, self.backend = score, alignment, window, backend
        self.predictor = None
        if alignment == "local-p":
            if query_dim is None:
                raise ValueError(
                    "query_dim: local-p predicts positions from the decoder state, so it needs its size, got None"
                )
            self.predictor = PositionPredictor(query_dim, predictor_hidden)

    def forward(
        self, query: Tensor, keys: Tensor, src_lengths: Tensor, *, first_step: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Contexts ``(b, i, d)`` and weights ``(b, i, j)``.

        ``query (b, i, dq)`` holds decoder steps ``first_step, first_step + 1, ...`` (the
        step number is local-m's position); ``keys (b, j, d)`` the annotations, which are
        also the values; ``src_lengths (b,)`` the real source length of each row.
        """
        b, i, _ = query.shape
        j = keys.shape[1]
        keep = padding_mask(src_lengths, j)  # (b, 1, j)
        if self.alignment == "global":
            return attention(query, keys, keys, score=self.score, mask=keep, return_weights=True, backend=self.backend)
        if self.alignment == "local-m":
            steps = torch.arange(first_step, first_step + i, device=query.device)
            mask = keep & monotonic_mask(steps, j, self.window)[None]  # (b, i, j)
            # A step past the end of a short source has no key in its window: zero context.
            return attention(query, keys, keys, score=self.score, mask=mask, return_weights=True, backend=self.backend)
        global_weights = attention_weights(query, keys, score=self.score, mask=keep)  # (b, i, j)
        centres = self.predictor(query, src_lengths)  # (b, i)
        weights = global_weights * gaussian_window(centres, j, self.window)
        return weights @ keys, weights

    def extra_repr(self) -> str:
        return f"alignment={self.alignment!r}, window={self.window}"
