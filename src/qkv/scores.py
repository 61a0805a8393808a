"""Score functions: how similar is a query to a key.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length,
``j`` key length, ``d`` query/key size (``dq``, ``dk`` where they may differ), ``n``
the hidden size of the additive score, ``L`` the location score's maximum key length.

Every score is split in two so that any backend can run it tile by tile:

* ``prepare(q, k) -> (qp, kp)`` does all per-position work once, O(i + j);
* ``pairwise(qp, kp, tile) -> (..., it, jt)`` combines a query tile with a key tile.

The logits are then ``scale * pairwise + bias``. Scores whose pairwise step is a plain dot
product (``dot_form = True``) can be handed to PyTorch's fused kernel as ``(qp, kp)``.

The classic scores (Luong et al. 2015, "Effective Approaches to Attention-based
Neural Machine Translation", section 3.1; Bahdanau et al. 2015; Vaswani et al. 2017):

=============  ==================================  ===========================
name           score(q, k)                         class
=============  ==================================  ===========================
dot            qᵀk                                 :class:`Dot`
scaled_dot     qᵀk / √d                            :class:`ScaledDot`
general        qᵀ W k   (bilinear)                 :class:`Bilinear`
concat         vᵀ tanh(W_q q + W_k k)  (additive)  :class:`Additive`
location       (W_a q + b)_j   (query alone)       :class:`Location`
=============  ==================================  ===========================

Two learned offsets go beyond the papers: :class:`Location` adds ``b (L,)`` by default
(``bias=False`` is Luong's ``softmax(W_a h_t)``), :class:`Additive` adds one to ``W_q q``
only when asked (``bias=True``; the default is Bahdanau's and Luong's formula).

Keras' layers add two without projections (``qkv.interop_keras`` copies them):
:class:`LearnedScaleDot` (``s·qᵀk``, a learned scalar ``s``: ``Attention(use_scale=True)``) and
:class:`TanhSum` (``Σ_c w_c tanh(s·(q_c + k_c))``: ``AdditiveAttention`` and
``Attention(score_mode="concat")``).

``vᵀ tanh(W[q; k]) = vᵀ tanh(W_q q + W_k k)`` with ``W = [W_q  W_k]``, so Bahdanau's MLP
score and Luong's "concat" are the same class. Checked against the literal formulas in
the test suite, and by gradcheck through the modules.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ._args import positive_int as _positive
from .masks import Tile


class Score(nn.Module):
    """Base class. Subclasses set :attr:`dot_form` and implement :meth:`prepare` / :meth:`pairwise`."""

    #: True when ``pairwise(qp, kp) == qp @ kp.mT``, so a fused dot-product kernel can run it.
    dot_form: bool = False
    #: Short name used in messages and ``qkv.explain``.
    name: str = "score"
    #: Numbers :meth:`pairwise` builds per logit (the additive score's hidden size): what
    #: materialising all logits costs, per logit.
    pair_width: int = 1
    #: True when :meth:`pairwise` reads the tile's key positions (a call cut into pieces
    #: renumbers them, so such a score runs whole).
    reads_positions: bool = False

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Per-position transforms: ``q (..., i, dq) -> qp (..., i, *)``, ``k (..., j, dk) -> kp (..., j, *)``."""
        return q, k

    def pairwise(self, qp: Tensor, kp: Tensor, tile: Tile) -> Tensor:
        """Unscaled logits of one tile, ``(..., it, jt)``; ``qp``/``kp`` are already sliced to the tile."""
        return qp @ kp.transpose(-1, -2)

    def default_scale(self, d: int) -> float:
        """The factor applied to :meth:`pairwise` when the caller gives no ``scale``."""
        return 1.0

    def check(self, q: Tensor, k: Tensor) -> None:
        """Raise ``ValueError`` if this score cannot compare these sizes."""

    def logits(self, q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
        """All logits at once, ``(..., i, j)`` (for introspection and the reference backend)."""
        self.check(q, k)
        qp, kp = self.prepare(q, k)
        tile = Tile.whole(q.shape[-2], k.shape[-2], q.device)
        return (self.default_scale(q.shape[-1]) if scale is None else scale) * self.pairwise(qp, kp, tile)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.logits(q, k)


class Dot(Score):
    """``score(q, k) = qᵀk``. Without projections this is basic self-attention, ``softmax(X Xᵀ) X``."""

    dot_form = True
    name = "dot"

    def check(self, q: Tensor, k: Tensor) -> None:
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"k: the {self.name} score needs the same size for q and k, "
                f"expected last dim {q.shape[-1]}, got {k.shape[-1]} (use qkv.scores.Bilinear or Additive)"
            )


class ScaledDot(Dot):
    """``score(q, k) = qᵀk / √d`` (Vaswani et al. 2017): keeps the logits' variance near 1 as d grows."""

    name = "scaled_dot"

    def default_scale(self, d: int) -> float:
        # d = 0: every logit is an empty sum, 0, whatever the factor (PyTorch's answer: the mean of the values)
        return 1.0 / math.sqrt(d) if d > 0 else 1.0


class Bilinear(Score):
    """Luong's "general" score ``qᵀ W k`` with a learned ``W (dq, dk)``; q and k sizes may differ.

    It is a dot product after ``q ↦ qW``, so fused kernels run it (``dot_form``).
    """

    dot_form = True
    name = "general"

    def __init__(self, query_dim: int, key_dim: int | None = None):
        super().__init__()
        key_dim = query_dim if key_dim is None else key_dim
        _positive("query_dim", query_dim)
        _positive("key_dim", key_dim)
        self.weight = nn.Parameter(torch.empty(query_dim, key_dim))
        # Glorot-style init keeps qᵀWk at the scale of a dot product of unit vectors.
        nn.init.xavier_uniform_(self.weight)

    def check(self, q: Tensor, k: Tensor) -> None:
        _last_dim("q", q, self.weight.shape[0])
        _last_dim("k", k, self.weight.shape[1])

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q @ self.weight, k

    def extra_repr(self) -> str:
        return f"query_dim={self.weight.shape[0]}, key_dim={self.weight.shape[1]}"


class Additive(Score):
    """Bahdanau's MLP score / Luong's "concat": ``vᵀ tanh(W_q q + W_k k)``.

    ``W_q (n, dq)``, ``W_k (n, dk)`` and ``v (n,)`` are learned; q and k sizes may differ.
    ``prepare`` projects every query and key once (O((i + j)·n)); ``pairwise`` builds the
    ``(it, jt, n)`` sum only for one tile. The chunked backend evaluates the same formula in
    cache-sized pieces of that tile, with a hand-written backward
    (``qkv.backends.tiling.additive_tiles``), so its memory does not grow with ``n·i·j``.
    """

    name = "concat"

    def __init__(self, query_dim: int, key_dim: int | None = None, hidden: int = 64, *, bias: bool = False):
        super().__init__()
        key_dim = query_dim if key_dim is None else key_dim
        for arg, value in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden", hidden)):
            _positive(arg, value)
        self.query_proj = nn.Linear(query_dim, hidden, bias=bias)
        self.key_proj = nn.Linear(key_dim, hidden, bias=False)
        self.v = nn.Parameter(torch.empty(hidden))
        nn.init.uniform_(self.v, -1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
        self.pair_width = hidden  # pairwise builds (it, jt, hidden)

    def check(self, q: Tensor, k: Tensor) -> None:
        _last_dim("q", q, self.query_proj.in_features)
        _last_dim("k", k, self.key_proj.in_features)

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.query_proj(q), self.key_proj(k)

    def pairwise(self, qp: Tensor, kp: Tensor, tile: Tile) -> Tensor:
        # (..., it, 1, n) + (..., 1, jt, n) -> tanh -> · v -> (..., it, jt)
        # v follows qp's dtype: the reference backend combines half-precision inputs in float32.
        return torch.tanh(qp.unsqueeze(-2) + kp.unsqueeze(-3)) @ self.v.to(qp.dtype)

    def extra_repr(self) -> str:
        return (
            f"query_dim={self.query_proj.in_features}, key_dim={self.key_proj.in_features}, "
            f"hidden={self.v.shape[0]}"
        )


class Location(Score):
    """Luong's location score: ``a = softmax(W_a q)``, from the query alone, over at most ``max_len`` keys.

    ``W_a (L, dq)``; the logit for key ``j`` is the ``j``-th output. Keys' contents are not
    looked at, only their positions, so ``j`` may not exceed ``max_len``; a call with
    ``j < L`` keys is the length-``L`` softmax with positions ``j ..`` masked. With
    ``bias=True`` (the default) a learned ``b (L,)`` is added, ``softmax(W_a q + b)``: a
    prior over positions that Luong's formula does not have; ``bias=False`` is the paper's.
    """

    name = "location"
    reads_positions = True  # the logit of key c is the query's c-th output

    def __init__(self, query_dim: int, max_len: int, *, bias: bool = True):
        super().__init__()
        _positive("query_dim", query_dim)
        _positive("max_len", max_len)
        self.proj = nn.Linear(query_dim, max_len, bias=bias)

    @property
    def max_len(self) -> int:
        return self.proj.out_features

    def check(self, q: Tensor, k: Tensor) -> None:
        _last_dim("q", q, self.proj.in_features)
        if k.shape[-2] > self.max_len:
            raise ValueError(
                f"k: the location score was built for at most max_len={self.max_len} keys, got j={k.shape[-2]}"
            )

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # kp carries nothing but the key count; positions come from the tile.
        return self.proj(q)[..., : k.shape[-2]], k[..., :0]

    def pairwise(self, qp: Tensor, kp: Tensor, tile: Tile) -> Tensor:
        # qp holds all j key columns (it is per query); pick this tile's.
        return qp[..., tile.j0 : tile.j1]

    def extra_repr(self) -> str:
        return f"query_dim={self.proj.in_features}, max_len={self.max_len}"


class LearnedScaleDot(Dot):
    """``score(q, k) = s · qᵀk`` with a learned scalar ``s`` (Keras' ``Attention(use_scale=True)``).

    ``prepare`` scales ``q``, so the score stays a dot product that fused kernels run.
    """

    name = "learned_scale_dot"

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(scale)))

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q * self.scale.to(q.dtype), k


class TanhSum(Score):
    """``score(q, k) = Σ_c w_c · tanh(s · (q_c + k_c))`` over the channels ``c`` of ``q`` and ``k``.

    Keras' additive scores, with no projection: ``AdditiveAttention`` has a learned
    ``w (d,)`` (``use_scale``, else ``w = 1``); ``Attention(score_mode="concat")`` a learned
    scalar ``w`` and, with ``use_scale``, a learned scalar ``s`` (else ``s = 1``).
    ``qkv.scores.Additive`` with ``W_q = W_k = s·I`` and ``v = w`` computes the same with
    ``d × d`` matrices where these are scalars.

    Args:
        size: the channels ``d`` of ``q`` and ``k``.
        weight: ``"vector"`` (a learned ``w (d,)``), ``"scalar"`` (one learned ``w``) or
            None (``w = 1``).
        scale: a learned scalar ``s`` (else ``s = 1``).
    """

    name = "tanh_sum"

    def __init__(self, size: int, *, weight: str | None = "vector", scale: bool = False):
        super().__init__()
        if weight not in ("vector", "scalar", None):
            raise ValueError(f"weight: expected 'vector', 'scalar' or None, got {weight!r}")
        self.size = _positive("size", size)
        self.weight = None if weight is None else nn.Parameter(torch.ones(size if weight == "vector" else ()))
        self.scale = nn.Parameter(torch.tensor(1.0)) if scale else None
        self.pair_width = size  # pairwise builds (it, jt, d)

    def check(self, q: Tensor, k: Tensor) -> None:
        for arg, x in (("q", q), ("k", k)):
            if x.shape[-1] != self.size:
                raise ValueError(f"{arg}: expected last dim {self.size} for this score, got {x.shape[-1]}")

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.scale is None:
            return q, k
        s = self.scale.to(q.dtype)
        return q * s, k * s

    def pairwise(self, qp: Tensor, kp: Tensor, tile: Tile) -> Tensor:
        t = torch.tanh(qp.unsqueeze(-2) + kp.unsqueeze(-3))  # (..., it, jt, d)
        if self.weight is None:
            return t.sum(-1)
        w = self.weight.to(qp.dtype)
        return t @ w if w.dim() else w * t.sum(-1)  # Keras: the scalar multiplies the sum

    def extra_repr(self) -> str:
        weight = None if self.weight is None else ("vector" if self.weight.dim() else "scalar")
        return f"size={self.size}, weight={weight!r}, scale={self.scale is not None}"


# Names users may pass as score="..."; the learned ones need sizes, see ``make``.
ALIASES = {
    "dot": "dot",
    "scaled_dot": "scaled_dot",
    "general": "general",
    "bilinear": "general",
    "concat": "concat",
    "additive": "concat",
    "mlp": "concat",
    "location": "location",
}


def make(
    score: str | Score,
    query_dim: int | None = None,
    key_dim: int | None = None,
    *,
    hidden: int = 64,
    max_len: int | None = None,
) -> Score:
    """Build a score from its name (learned ones need their sizes), or return a ``Score`` as is."""
    if isinstance(score, Score):
        return score
    if not isinstance(score, str):
        raise TypeError(f"score: expected a name or a qkv.scores.Score, got {type(score).__name__}")
    canonical = ALIASES.get(score)
    if canonical is None:
        raise ValueError(f"score: expected one of {sorted(ALIASES)} or a qkv.scores.Score, got {score!r}")
    if canonical == "dot":
        return Dot()
    if canonical == "scaled_dot":
        return ScaledDot()
    if query_dim is None:
        raise ValueError(
            f"score: {score!r} has learned parameters, so it needs the query size; "
            f"build it as a module (qkv.scores.{_CLASS[canonical]}(...)) and pass the object"
        )
    if canonical == "general":
        return Bilinear(query_dim, key_dim)
    if canonical == "concat":
        return Additive(query_dim, key_dim, hidden)
    if max_len is None:
        raise ValueError("max_len: the location score needs the maximum number of keys, got None")
    return Location(query_dim, max_len)


_CLASS = {"general": "Bilinear", "concat": "Additive", "location": "Location"}


def _last_dim(name: str, x: Tensor, expected: int) -> None:
    if x.shape[-1] != expected:
        raise ValueError(f"{name}: expected last dim {expected} for this score, got {x.shape[-1]}")
