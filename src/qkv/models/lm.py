"""A decoder-only causal language model (GPT-style) with greedy, temperature and top-k sampling.

Shape legend: ``b`` batch, ``i`` sequence length (new tokens when a cache is used), ``j``
keys (cached + new), ``h`` heads, ``dim`` model size, ``V`` vocabulary size.

    logits = W_out Encoder_causal(Embed(ids))                       (b, i, V)

Position ``t``'s logits predict token ``t + 1`` (Radford et al. 2018). The stack is
``qkv.blocks.Encoder`` with causal self-attention, so a ``qkv.cache.DecoderCache`` makes
generation incremental: the prompt is run once, then each new token attends to the cached
keys and values, O(n) work per token instead of recomputing the O(n) prefix through every
projection. ``generate(..., use_cache=False)`` is the recomputing twin used by the tests and
by the generation benchmark (``qkv bench --suite generation``).

Sampling (:func:`sample_next`): ``temperature = 0`` takes the argmax (greedy); otherwise
the next token is drawn from ``softmax(logits / temperature)``, restricted to the ``top_k``
most likely tokens when ``top_k`` is given (Fan et al. 2018, "Hierarchical Neural Story
Generation"). Tested in the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._args import positive_int
from ..blocks import Encoder
from ..cache import DecoderCache, LatentCache
from ..latent import MultiHeadLatentAttention
from .checks import check_batch, check_rows
from .sampling import sample_next
from .transformer import TokenEmbedding, attention_positional, check_common, inference, key_padding, lengths_for


@dataclass(frozen=True)
class LMConfig:
    vocab: int  # token ids are 0 .. vocab - 1
    dim: int = 64  # model size
    heads: int = 4  # attention heads per layer
    kv_heads: int | None = None  # grouped K/V heads (None = heads; the cache stores only these)
    layers: int = 2  # depth
    hidden: int | None = None  # feed-forward width (None = 4 · dim)
    activation: str = "gelu"  # feed-forward activation: relu, gelu or swiglu
    dropout: float = 0.0  # residual, feed-forward and attention-weight dropout
    norm_first: bool = True  # pre-norm (GPT-2) or post-norm
    positional: str = "learned"  # sinusoidal, learned (GPT-2), rotary, alibi, relative or none
    max_len: int = 256  # context length (enforced for learned positions)
    tie_embeddings: bool = True  # output layer shares the input embedding matrix (Press & Wolf 2017)
    attention: str = "multi_head"  # or "latent": DeepSeek-V2's multi-head latent attention (its own rotary part)
    kv_rank: int | None = None  # latent: the KV latent size c (None = 4 · dim / heads)
    rope_dim: int | None = None  # latent: the rotary size r (None = half the head size, even)

    def __post_init__(self):
        check_common(self)
        positive_int("vocab", self.vocab)
        positive_int("layers", self.layers)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {self.attention!r}")
        if self.attention == "latent":
            if self.positional not in ("none", "learned", "sinusoidal"):
                raise ValueError(
                    f"positional: latent attention rotates its own rotary part; expected none, learned or sinusoidal "
                    f"positions added to the embeddings, got {self.positional!r}"
                )
            if self.kv_heads is not None:
                raise ValueError(f"kv_heads: latent attention shares one latent across its heads, got kv_heads={self.kv_heads}")
        elif self.kv_rank is not None or self.rope_dim is not None:
            raise ValueError('kv_rank, rope_dim: they size latent attention; set attention="latent"')


#: The self-attention of each layer: ``MultiHeadAttention``, or ``MultiHeadLatentAttention``.
ATTENTIONS = ("multi_head", "latent")


class CausalLM(nn.Module):
    """Decoder-only transformer language model; see the module docstring."""

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config: expected an LMConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = TokenEmbedding(c.vocab, c.dim, positional=c.positional, max_len=c.max_len, dropout=c.dropout)
        if c.attention == "latent":  # positions: MLA's own rotary part (and any absolute ones of the embedding)
            latent = lambda: MultiHeadLatentAttention(c.dim, c.heads, kv_rank=c.kv_rank, rope_dim=c.rope_dim,  # noqa: E731
                                                      dropout=c.dropout)  # fmt: skip
            self.blocks = Encoder(c.layers, c.dim, c.heads, hidden=c.hidden, activation=c.activation, dropout=c.dropout,
                                  norm_first=c.norm_first, self_attention=latent)  # fmt: skip
        else:
            positional = attention_positional(c.positional, c.heads, c.dim // c.heads, causal=True)
            self.blocks = Encoder(c.layers, c.dim, c.heads, hidden=c.hidden, activation=c.activation, dropout=c.dropout,
                                  norm_first=c.norm_first, kv_heads=c.kv_heads, positional=positional)  # fmt: skip
        self.out = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tie_embeddings:
            self.out.weight = self.embed.embedding.weight

    def new_cache(self, max_len: int | None = None) -> DecoderCache:
        """An empty cache for :meth:`forward` (``max_len`` preallocates; None grows); latent attention's holds its latents."""
        if self.config.attention == "latent":
            return DecoderCache(self.config.layers, layer_cache=lambda: LatentCache(max_len))
        return DecoderCache(self.config.layers, max_len=max_len)

    def forward(self, ids: Tensor, *, lengths: Tensor | None = None, cache: DecoderCache | None = None,
                return_weights: bool = False):  # fmt: skip
        """``ids (b, i)`` -> next-token logits ``(b, i, V)``; per-layer weights ``(b, h, i, j)`` on request.

        ``lengths (b,)`` marks right padding (keys past a row's length are ignored). With a
        ``cache``, ``ids`` are the new tokens only and their positions start at ``cache.length``.
        """
        start = getattr(cache, "positions", None)  # a paged serving step: each token's own position
        layer_caches = getattr(cache, "self_attn", None) or [None]  # (a DecoderCache's; a paged step has none)
        if self.embed.position is not None and getattr(layer_caches[0], "positions_in_cache", False):
            raise ValueError(f"cache: a StreamingCache ranks its keys anew as it evicts them, which {self.embed.kind} "
                             "position embeddings, added to the tokens before the cache, cannot follow; use "
                             "positional='rotary', 'alibi' or 'none'")  # fmt: skip
        x = self.embed(ids, (0 if cache is None else cache.length) if start is None else start)
        lengths = lengths_for("lengths", lengths, ids)
        check_batch(ids=ids, lengths=lengths)
        if lengths is not None and cache is not None:
            raise ValueError("lengths: padding is not supported with a cache; decode rows of equal length")
        y = self.blocks(x, mask=key_padding(lengths), causal=True, cache=cache, return_weights=return_weights)
        if return_weights:
            return self.out(y[0]), y[1]
        return self.out(y)

    def loss(self, ids: Tensor, *, lengths: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy of ``ids (b, i)`` over the real (unpadded) targets.

        A batch with no target (rows of one token, or no row) is an error, not a NaN mean over nothing.
        """
        if isinstance(ids, Tensor) and ids.dim() == 2:
            check_rows("ids", ids)
            if ids.shape[1] < 2:
                raise ValueError(f"ids: expected at least 2 tokens per row (a next token to predict), got shape {tuple(ids.shape)}")
        logits = self(ids[:, :-1], lengths=None if lengths is None else (lengths - 1).clamp(min=1))
        targets = ids[:, 1:]
        if lengths is None:
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        keep = torch.arange(targets.shape[1], device=ids.device)[None, :] < (lengths[:, None] - 1)
        if not bool(keep.any()):
            raise ValueError(f"lengths: every row holds one token, so there is no next token to predict, got {lengths.tolist()}")
        return nn.functional.cross_entropy(logits[keep], targets[keep])

    @inference
    def generate(self, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        """``prompt (b, i)`` followed by ``max_new_tokens`` generated ids: ``(b, i + n)``.

        Greedy when ``temperature == 0``; sampling draws from ``generator``. With
        ``use_cache=False`` every step reruns the whole sequence (the slow, obvious twin).
        """
        positive_int("max_new_tokens", max_new_tokens)
        if isinstance(prompt, Tensor) and prompt.dim() == 2 and prompt.shape[-1] == 0:
            raise ValueError(f"prompt: expected at least one token per row (the first step's logits come from it), "
                             f"got shape {tuple(prompt.shape)}")  # fmt: skip
        total = prompt.shape[-1] + max_new_tokens if isinstance(prompt, Tensor) else 0
        # the model reads every token but the last one generated: total - 1 positions
        if self.config.positional == "learned" and total - 1 > self.config.max_len:
            raise ValueError(
                f"max_new_tokens: prompt length {prompt.shape[-1]} + {max_new_tokens} new tokens feeds the model "
                f"{total - 1} positions (every token but the last), more than max_len={self.config.max_len} "
                "of the learned positions"
            )
        cache = self.new_cache(total) if use_cache else None
        out, new = prompt, prompt
        for _ in range(max_new_tokens):
            logits = self(new, cache=cache) if use_cache else self(out)
            token = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, generator=generator)
            out = torch.cat((out, token[:, None]), dim=1)
            new = token[:, None]
        return out
