"""Choosing the next token from a model's logits: greedy, temperature and top-k sampling.

Shape legend: ``b`` batch, ``V`` vocabulary size.

Temperature sampling draws from ``softmax(logits / T)``; top-k keeps only the ``k`` largest
logits before the draw (Fan et al. 2018, "Hierarchical Neural Story Generation").
Temperature 0 is greedy decoding (argmax). Shared by every generating model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._args import positive_int


def sample_next(logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """Next token ids ``(b,)`` from ``logits (b, V)``: argmax if ``temperature == 0``, else a draw."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature: expected a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        positive_int("top_k", top_k)
    if logits.shape[-1] == 0:  # argmax and amax have nothing to reduce: an IndexError from inside torch
        raise ValueError(f"logits: expected at least one token per row (b, V), got shape {tuple(logits.shape)}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    # in float64 (a temperature of 1e-300 is 0 in float32), the row's largest logit subtracted first: a
    # tiny temperature then gives 0 and very negative logits (greedy), never inf - inf
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # the k-th largest logit per row
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
