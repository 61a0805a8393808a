"""The approx suite's configuration: methods, sizes, inputs and how one call is timed.

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length (self-attention, ``j = i``),
``d`` query/key size (``e = d``).

Shared by :mod:`qkv.bench.approx` (the main table) and :mod:`qkv.bench.peers` (the same
calls against the peer packages), so both measure the same mechanisms on the same inputs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import approx
from ..functional import attention
from .inputs import FAMILIES, make_inputs

LABELS = {
    "exact": "exact (`qkv.attention`, SDPA)",
    "linformer": "Linformer",
    "performer": "Performer",
    "linear": "linear (elu+1)",
    "nystrom": "Nyström",
}

@dataclass(frozen=True)
class ApproxSetup:
    sizes: tuple[int, ...] = (1024, 4096, 16384, 32768)  # sequence lengths i
    batch: int = 1  # b
    heads: int = 8  # h
    dim_head: int = 64  # d (= e)
    family: str = "lowrank_local"  # input family of the main table (qkv.bench.inputs)
    repeats: int = 9  # timed calls per method at i <= big
    large_repeats: tuple[int, ...] = (7, 5)  # approximate methods at the sizes above big, in order
    exact_large_repeats: tuple[int, ...] = (3, 2)  # exact at the sizes above big, in order (last one repeats)
    big: int = 4096  # where "large" starts
    fit_range: tuple[int, int] = (4096, 32768)  # sizes the scaling exponent is fitted over
    error_size: int = 4096  # i of the error-by-family table
    lsh_error_max: int = 4096  # largest i with an LSH error (dense i² mask for its reference)
    memory: bool = True  # measure peak RSS in subprocesses
    steady_heap: bool = True  # time with freed memory kept in the process (qkv.bench.measure.steady_heap)
    peer_sizes: tuple[int, ...] = (4096, 16384)  # i of the peer comparison; () skips it
    peer_repeats: int = 3  # timed calls of each side of a peer pair
    reformer_peer_max: int = 4096  # largest i of the Reformer pair (both take about a minute a call at 16K)
    linformer_k: int = 256  # projected length k
    nb_features: int = 256  # Performer random features m
    landmarks: int = 64  # Nyström landmarks
    lsh_rounds: tuple[int, ...] = (1, 2, 4)  # Reformer hash rounds, one row each ("reformer_lsh_<r>")
    peer_lsh_rounds: int = 2  # the rounds of the reformer-pytorch comparison
    lsh_chunk: int = 64  # Reformer chunk (bucket) size; n_buckets = i / chunk
    lsh_factorise_above: int = 128  # more buckets than this are hashed as two factors (lsh_bucket_count)
    lsh_norm: float = 10.0  # Reformer's queries rescaled to norm lsh_norm·√d (see lsh_queries)
    seed: int = 0  # inputs and module parameters

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"sizes: expected positive lengths, got {self.sizes}")
        if not self.lsh_rounds or any(r < 1 for r in self.lsh_rounds) or len(set(self.lsh_rounds)) != len(self.lsh_rounds):
            raise ValueError(f"lsh_rounds: expected distinct positive round counts, got {self.lsh_rounds}")

    def repeats_for(self, method: str, i: int) -> int:
        """Timed calls of ``method`` at length ``i``."""
        if i <= self.big:
            return self.repeats
        counts = self.exact_large_repeats if method == "exact" else self.large_repeats
        rank = sorted(s for s in self.sizes if s > self.big).index(i)
        return counts[min(rank, len(counts) - 1)]


def mechanism(method: str, i: int, setup: ApproxSetup) -> Callable[..., Tensor]:
    """The mechanism of ``method`` for length ``i``, with parameters seeded by ``setup.seed``."""
    torch.manual_seed(setup.seed)
    d = setup.dim_head
    if method == "exact":
        return attention
    if method == "linformer":
        return approx.Linformer(i, setup.linformer_k).eval()
    if is_lsh(method):
        return approx.LSHAttention(d, n_buckets=lsh_bucket_count(i, setup), n_hashes=lsh_rounds(method),
                                   chunk_size=setup.lsh_chunk, seed=setup.seed).eval()  # fmt: skip
    if method == "performer":
        return approx.Performer(d, nb_features=setup.nb_features, seed=setup.seed).eval()
    if method == "linear":
        return approx.LinearAttention().eval()
    if method == "nystrom":
        return approx.NystromAttention(setup.landmarks).eval()
    raise ValueError(f"method: expected one of {methods(setup)}, got {method!r}")


def methods(setup: ApproxSetup) -> tuple[str, ...]:
    """The suite's methods in table order, exact first; Reformer once per entry of ``lsh_rounds``."""
    return ("exact", "linformer", *(f"reformer_lsh_{r}" for r in setup.lsh_rounds), "performer", "linear", "nystrom")


def is_lsh(method: str) -> bool:
    """Whether ``method`` is one of the Reformer rows (shared QK: they get :func:`lsh_queries`)."""
    return method.startswith("reformer_lsh_")


def lsh_rounds(method: str) -> int:
    """The hash rounds of a Reformer row, ``"reformer_lsh_4" -> 4``."""
    return int(method.rsplit("_", 1)[1])


def label(method: str) -> str:
    """The table's name of ``method`` (Reformer's rows with their rounds)."""
    if is_lsh(method):
        rounds = lsh_rounds(method)
        return f"Reformer LSH, {rounds} round{'s' if rounds > 1 else ''}"
    return LABELS[method]


def lsh_bucket_count(i: int, setup: ApproxSetup) -> int | tuple[int, int]:
    """Reformer's buckets at length ``i``: about ``i / chunk`` (even), as the paper sets them.

    Above ``lsh_factorise_above`` buckets they are two even factors as close to ``√n`` as
    divide it (HF's Reformer factorises the same way for long inputs), so hashing costs
    ``O(i √i)`` rather than ``O(i²)``; with no such factors the count stays one number.
    """
    buckets = max(2, 2 * (i // setup.lsh_chunk // 2))
    if buckets <= setup.lsh_factorise_above:
        return buckets
    for low in range(int(math.isqrt(buckets)) // 2 * 2, 1, -2):
        if buckets % low == 0 and (buckets // low) % 2 == 0:
            return low, buckets // low
    return buckets


def inputs(i: int, setup: ApproxSetup, family: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return make_inputs(family or setup.family, i, b=setup.batch, h=setup.heads, d=setup.dim_head, seed=setup.seed)


def lsh_queries(q: Tensor, setup: ApproxSetup) -> Tensor:
    """The queries given to Reformer: ``q`` rescaled to norm ``lsh_norm · √d``.

    Shared QK normalises the keys, so a logit is ``|q| cos θ / √d``: with the inputs' own
    norms (about 1.5 √d) every row of the shared-QK softmax is nearly uniform whatever the
    structure. Fixing the norm makes the logits ``lsh_norm · cos θ``, so the directions'
    structure shows in the attention (same time: hashing does not depend on norms).
    """
    return F.normalize(q, dim=-1) * (setup.lsh_norm * q.shape[-1] ** 0.5)


def lsh_spread(q: Tensor, rows: int = 256) -> float:
    """:func:`effective_keys` of the shared-QK reference (keys ``q/|q|``, self excluded)."""
    sub = q[..., :rows, :]
    logits = sub @ F.normalize(q, dim=-1).transpose(-1, -2) * q.shape[-1] ** -0.5
    itself = torch.arange(sub.shape[-2])[:, None] == torch.arange(q.shape[-2])[None, :]
    logp = logits.masked_fill(itself, float("-inf")).log_softmax(-1)
    entropy = -(logp.exp() * logp.masked_fill(itself, 0)).sum(-1)
    return float(entropy.exp().mean())


def lsh_reference(q: Tensor, v: Tensor) -> Tensor:
    """Exact shared-QK attention (keys ``q/|q|``), a token never attending to itself."""
    i = q.shape[-2]
    keep = ~torch.eye(i, dtype=torch.bool, device=q.device)
    return attention(q, F.normalize(q, dim=-1), v, mask=keep, backend="reference" if i <= 512 else "auto")


def timed(fn: Callable[[], Tensor]) -> tuple[float, Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def size_label(i: int) -> str:
    """``4096 -> '4K'``: lengths as the tables print them."""
    return f"{i // 1024}K" if i % 1024 == 0 else str(i)
