"""Sequence classifiers: a transformer encoder with mean, CLS or attention pooling, and a
bag-of-words baseline that cannot see word order.

Shape legend: ``b`` batch, ``i`` sequence length, ``h`` heads, ``dim`` model size, ``C``
classes. Token ids are ``(b, i)`` int64; ``lengths (b,)`` marks right padding.

* :class:`EncoderClassifier` — ``logits = W_c pool(Encoder(Embed(ids)))``. Pooling:
  ``"mean"`` over real tokens; ``"cls"`` reads a learned vector prepended to the sequence
  (BERT, Devlin et al. 2019); ``"attention"`` lets a learned query attend over the tokens
  (:class:`AttentionPooling`; Lin et al. 2017, "A Structured Self-Attentive Sentence
  Embedding"), whose weights say which tokens decided the class. ``reach = (lo, hi)``
  limits which keys each token's self-attention sees: those whose offset ``key − query``
  lies in ``lo..hi`` (None = unbounded on that side; the default, no limit, is the usual
  all-to-all encoder). ``(0, None)`` is a token and everything after it; ``(1, 2)`` the
  next two tokens only (its own content still reaches the output through the residual;
  with CLS pooling the CLS vector is position 0 and gets the same reach)::

      reach=(0, None)        reach=(1, 2)
          k0 k1 k2 k3            k0 k1 k2 k3
      q0   1  1  1  1        q0   .  1  1  .
      q1   .  1  1  1        q1   .  .  1  1
      q2   .  .  1  1        q2   .  .  .  1
      q3   .  .  .  1        q3   .  .  .  .     (no key: the row's output is 0)
* :class:`BagOfWords` — ``logits = MLP(mean_t E[ids_t])``: a permutation of the tokens
  leaves it unchanged, so on tasks where order matters (*the shark bit the person* against
  *the person bit the shark*) it stays near chance while the transformer learns them. Its
  mean is attention with fixed uniform weights, returned as such for side-by-side plots.

Tested in the test suite (each overfits a small batch; bag of words is
permutation invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._args import positive_int
from ..attention import MultiHeadAttention
from ..blocks import Encoder
from ..masks import Offsets
from .checks import check_batch, check_ids, check_tokens
from .transformer import TokenEmbedding, attention_positional, check_common, lengths_for

POOLINGS = ("mean", "cls", "attention")
#: Why a row needs a token. An empty row had logits from nothing (the head's bias, a mean of no
#: embedding taken as 0) where ``lengths`` of 0 are refused: it is refused the same way.
_WHY = "a class is read from its tokens"


@dataclass(frozen=True)
class ClassifierConfig:
    vocab: int  # token ids are 0 .. vocab - 1
    classes: int  # number of output classes
    dim: int = 64  # model size
    heads: int = 4  # attention heads per layer
    layers: int = 2  # encoder depth
    hidden: int | None = None  # feed-forward width (None = 4 · dim)
    activation: str = "gelu"  # feed-forward activation: relu, gelu or swiglu
    dropout: float = 0.0  # residual, feed-forward and attention-weight dropout
    norm_first: bool = True  # pre-norm or post-norm
    positional: str = "sinusoidal"  # sinusoidal, learned, rotary, alibi, relative or none
    max_len: int = 512  # longest input (enforced for learned positions; CLS takes one)
    pooling: str = "mean"  # mean, cls or attention
    pool_heads: int = 1  # heads of the attention pooling's learned query
    kv_heads: int | None = None  # grouped K/V heads (None = heads)
    reach: tuple[int | None, int | None] | None = None  # keys at offsets key - query in lo..hi (None = all)

    def __post_init__(self):
        check_common(self)
        if self.reach is not None:
            try:  # the pair is an Offsets mask's (lo, hi): its own checks decide
                if not (isinstance(self.reach, tuple) and len(self.reach) == 2):
                    raise ValueError
                Offsets(*self.reach)
            except (TypeError, ValueError):
                raise ValueError(
                    f"reach: expected None or a pair (lo, hi) of ints or None with lo <= hi, got {self.reach!r}"
                ) from None
        positive_int("vocab", self.vocab)
        positive_int("classes", self.classes)
        positive_int("layers", self.layers)
        positive_int("pool_heads", self.pool_heads)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {POOLINGS}, got {self.pooling!r}")
        if self.pooling == "attention" and self.dim % self.pool_heads:
            raise ValueError(f"pool_heads: expected a divisor of dim={self.dim}, got {self.pool_heads}")


class AttentionPooling(nn.Module):
    """A learned query ``w`` attends over the tokens: ``pooled = Σ_t α_t W_V x_t`` (then ``W^O``).

    ``forward(x (b, i, dim), *, lengths=None, return_weights=False) -> (b, dim)`` and the
    weights ``(b, h, i)`` (one distribution over the tokens per head).
    """

    def __init__(self, dim: int, heads: int = 1):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, dim) * dim**-0.5)
        self.attn = MultiHeadAttention(dim, heads)

    def forward(self, x: Tensor, *, lengths: Tensor | None = None, return_weights: bool = False):
        mask = None if lengths is None else _keep(lengths, x.shape[1])[:, None, None, :]  # (b, 1, 1, i)
        query = self.query.expand(x.shape[0], 1, -1).to(x.dtype)
        pooled, w = self.attn(query, x, mask=mask, return_weights=True)
        pooled, w = pooled.squeeze(1), w.squeeze(2)  # (b, dim), (b, h, i)
        return (pooled, w) if return_weights else pooled


class EncoderClassifier(nn.Module):
    """Transformer encoder + pooling + linear classifier; see the module docstring."""

    def __init__(self, config: ClassifierConfig):
        super().__init__()
        if not isinstance(config, ClassifierConfig):
            raise TypeError(f"config: expected a ClassifierConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = TokenEmbedding(c.vocab, c.dim, positional=c.positional, max_len=c.max_len, dropout=c.dropout)
        positional = attention_positional(c.positional, c.heads, c.dim // c.heads, causal=False)
        self.encoder = Encoder(c.layers, c.dim, c.heads, hidden=c.hidden, activation=c.activation, dropout=c.dropout,
                               norm_first=c.norm_first, kv_heads=c.kv_heads, positional=positional)  # fmt: skip
        self.cls = nn.Parameter(torch.randn(1, 1, c.dim) * c.dim**-0.5) if c.pooling == "cls" else None
        self.pool = AttentionPooling(c.dim, c.pool_heads) if c.pooling == "attention" else None
        self.head = nn.Linear(c.dim, c.classes)
        # Chosen once: no reach limit keeps the plain padding mask.
        self.reach = None if c.reach is None or c.reach == (None, None) else Offsets(*c.reach)

    def forward(self, ids: Tensor, *, lengths: Tensor | None = None, return_weights: bool = False):
        """``ids (b, i)`` -> logits ``(b, C)``.

        With ``return_weights=True`` also ``{"layers": [(b, h, i', i')] per layer, "pooling":
        (b, h, i) or None}``: ``i' = i + 1`` with CLS pooling (the CLS vector is position 0);
        pooling weights are the learned query's (attention), uniform over real tokens
        (mean), or None (CLS, whose pooling is the last layer's row 0).
        """
        cls = self.cls is not None
        check_tokens("ids", check_ids("ids", ids, self.config.vocab), _WHY)
        if cls and ids.shape[1] + 1 > self.config.max_len and self.config.positional == "learned":
            raise ValueError(
                f"ids: expected at most max_len - 1 = {self.config.max_len - 1} tokens (CLS takes a position), "
                f"got {ids.shape[1]}"
            )
        lengths = lengths_for("lengths", lengths, ids)
        check_batch(ids=ids, lengths=lengths)
        x = self.embed(ids, start=1 if cls else 0)  # with CLS the tokens sit at positions 1..i
        if cls:
            first = self.cls.expand(ids.shape[0], 1, -1).to(x.dtype)
            if self.embed.position is not None:
                first = self.embed.position(first, 0)
            x = torch.cat((first, x), dim=1)
        seq_lengths = None if lengths is None else lengths + int(cls)
        n = x.shape[1]
        mask = None if seq_lengths is None else _keep(seq_lengths, n)[:, None, None, :]
        if self.reach is not None:
            mask = self.reach if mask is None else self.reach & mask
        y = self.encoder(x, mask=mask, return_weights=return_weights)
        y, layer_weights = y if return_weights else (y, None)
        pool_weights = None
        if cls:
            pooled = y[:, 0]
        elif self.pool is not None:
            pooled, pool_weights = self.pool(y, lengths=seq_lengths, return_weights=True)
        else:
            pooled, pool_weights = _mean(y, seq_lengths)
        logits = self.head(pooled)
        return (logits, {"layers": layer_weights, "pooling": pool_weights}) if return_weights else logits


@dataclass(frozen=True)
class BagOfWordsConfig:
    vocab: int  # token ids are 0 .. vocab - 1
    classes: int  # number of output classes
    dim: int = 64  # embedding size
    hidden: int = 64  # width of the MLP's hidden layer

    def __post_init__(self):
        for name in ("vocab", "classes", "dim", "hidden"):
            positive_int(name, getattr(self, name))


class BagOfWords(nn.Module):
    """``logits = W_2 ReLU(W_1 mean_t E[ids_t])``: the order-blind baseline; see the module docstring."""

    def __init__(self, config: BagOfWordsConfig):
        super().__init__()
        if not isinstance(config, BagOfWordsConfig):
            raise TypeError(f"config: expected a BagOfWordsConfig, got {type(config).__name__}")
        self.config = c = config
        self.embedding = nn.Embedding(c.vocab, c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.classes))

    def forward(self, ids: Tensor, *, lengths: Tensor | None = None, return_weights: bool = False):
        """``ids (b, i)`` -> logits ``(b, C)``; with ``return_weights=True`` also ``{"pooling": (b, 1, i)}``,
        the uniform weights ``1/length`` of the mean."""
        check_tokens("ids", check_ids("ids", ids, self.config.vocab), _WHY)
        lengths = lengths_for("lengths", lengths, ids)
        check_batch(ids=ids, lengths=lengths)
        pooled, w = _mean(self.embedding(ids), lengths)
        logits = self.mlp(pooled)
        return (logits, {"pooling": w}) if return_weights else logits


def _keep(lengths: Tensor, n: int) -> Tensor:
    """``(b, n)`` bool, True for the first ``lengths[b]`` positions."""
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]


def _mean(x: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mean of ``x (b, i, dim)`` over real positions, and its uniform weights ``(b, 1, i)``."""
    b, n, _ = x.shape
    keep = torch.ones(b, n, dtype=torch.bool, device=x.device) if lengths is None else _keep(lengths, n)
    w = keep.to(x.dtype) / keep.sum(dim=1, keepdim=True).to(x.dtype)  # (b, i)
    return torch.einsum("bi,bid->bd", w, x), w[:, None, :]

