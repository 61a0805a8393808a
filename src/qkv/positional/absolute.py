"""Absolute position encodings added to token embeddings: sinusoidal and learned.

Shape legend: ``b`` batch, ``i`` sequence length, ``dim`` model size (the embedding size).

* Sinusoidal — Vaswani et al. 2017, "Attention Is All You Need", section 3.5::

      PE[pos, 2k]     = sin(pos / base^(2k / dim))
      PE[pos, 2k + 1] = cos(pos / base^(2k / dim))          base = 10000

  Sine on even dimensions, cosine on odd ones, one frequency per pair. No parameters and
  no maximum length. (An odd ``dim`` keeps the last sine and drops its cosine.)
* Learned — one trained vector per position (Vaswani et al. report it matches the
  sinusoid; BERT and GPT-2 use it), so the length is capped at ``max_len``.

Both are added to the token embeddings by the models (``x + encoding``); they do not enter
attention, unlike RoPE (``rotary.py``) and the lazy biases (``bias.py``). ``start`` offsets
the positions for incremental decoding with a KV cache: the new tokens sit at
``start, start + 1, ...``. Checked against the formula written out per element in
the test suite.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._args import finite_number, positive_int


def sinusoidal(
    length: int,
    dim: int,
    *,
    start: int = 0,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The ``(length, dim)`` table of Vaswani et al.: positions ``start .. start + length - 1``."""
    positive_int("dim", dim)
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"length: expected a non-negative int, got {length!r}")
    _check_start(start)
    # Angles in float64 whatever the output dtype: pos / base^(2k/dim) loses digits in
    # float32 once positions reach the thousands, and the cache tests compare at 1e-10.
    pos = torch.arange(start, start + length, dtype=torch.float64, device=device)
    two_k = torch.arange(0, dim, 2, dtype=torch.float64, device=device)  # 2k for each pair
    angle = pos[:, None] / base ** (two_k / dim)  # (length, ceil(dim / 2))
    table = torch.empty(length, dim, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return table.to(dtype)


class SinusoidalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to ``x (b, i, dim)``; no parameters, any length.

    Args:
        dim: the model size.
        base: the wavelength base (10000 in the paper).
    """

    def __init__(self, dim: int, *, base: float = 10000.0):
        super().__init__()
        self.dim = positive_int("dim", dim)
        self.base = finite_number("base", base, above=1)

    def encoding(self, length: int, start: int = 0, *, dtype=torch.float32, device="cpu") -> Tensor:
        """The ``(length, dim)`` encodings of positions ``start .. start + length - 1``."""
        return sinusoidal(length, self.dim, start=start, base=self.base, dtype=dtype, device=device)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """``x (b, i, dim)`` whose first token is at position ``start`` -> ``x + PE`` of the same shape."""
        _check_input(x, self.dim)
        return x + self.encoding(x.shape[-2], start, dtype=x.dtype, device=x.device)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}"


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained vector per position to ``x (b, i, dim)``; positions ``0 .. max_len - 1``.

    Args:
        max_len: the number of positions; a longer input raises ``ValueError``.
        dim: the model size.
    """

    def __init__(self, max_len: int, dim: int):
        super().__init__()
        self.max_len = positive_int("max_len", max_len)
        self.dim = positive_int("dim", dim)
        self.embedding = nn.Embedding(max_len, dim)
        # small start (GPT-2 uses 0.01-0.02): the token embeddings, not the positions,
        # should dominate the first steps of training.
        nn.init.normal_(self.embedding.weight, std=0.02)

    def encoding(self, length: int, start: int = 0) -> Tensor:
        """The ``(length, dim)`` learned vectors of positions ``start .. start + length - 1``."""
        _check_start(start)
        if start + length > self.max_len:
            raise ValueError(
                f"length: learned positions cover at most max_len={self.max_len} tokens, "
                f"got positions {start}..{start + length - 1} (start={start}, length={length})"
            )
        return self.embedding.weight[start : start + length]  # rows = positions: a slice, no lookup

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """``x (b, i, dim)`` whose first token is at position ``start`` -> ``x + P`` of the same shape."""
        _check_input(x, self.dim)
        return x + self.encoding(x.shape[-2], start).to(x.dtype)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"


def _check_start(start: object) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start: expected a non-negative int (the first position), got {start!r}")


def _check_input(x: object, dim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a tensor (b, i, {dim}), got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"x: expected shape (b, i, {dim}), got {tuple(x.shape)}")
