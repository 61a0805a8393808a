"""The encoder–decoder transformer (Vaswani et al. 2017) for sequence-to-sequence tasks,
and the token-embedding pieces every transformer model in ``qkv.models`` shares.

Shape legend: ``b`` batch, ``s`` source length, ``i`` target length, ``h`` heads,
``dim`` model size, ``V`` target vocabulary size. Token ids are ``(b, length)`` int64.

    memory = Encoder(Embed(src))                                      (b, s, dim)
    logits = W_out Decoder(Embed(tgt), memory)                        (b, i, V)

Embeddings are scaled by √dim (section 3.4) and initialised with std 1/√dim, so a scaled
embedding has unit-size entries like the sinusoid it is added to. Positions are one of
``"sinusoidal"`` / ``"learned"`` (added to the embeddings), ``"rotary"`` / ``"alibi"`` /
``"relative"`` (inside self-attention, one module shared by the layers) or ``"none"``.
Padding is given as ``lengths (b,)``: the number of real tokens at the start of each row.
Training uses teacher forcing: ``model(src, tgt[:, :-1])`` predicts ``tgt[:, 1:]``.
Tested in the test suite (overfits a small reversal task; cached greedy
decoding equals uncached).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import masks
from .._args import positive_int, probability
from ..blocks import Decoder, Encoder
from ..feed_forward import ACTIVATIONS
from ..cache import DecoderCache
from ..positional import ALiBi, LearnedPositionalEmbedding, Positional, RelativePositionBias, Rotary, SinusoidalEncoding
from .checks import check_batch, check_ids, check_lengths
from .sampling import sample_next

POSITIONS = ("sinusoidal", "learned", "rotary", "alibi", "relative", "none")


@dataclass(frozen=True)
class TransformerConfig:
    src_vocab: int  # source token ids are 0 .. src_vocab - 1
    tgt_vocab: int  # target token ids are 0 .. tgt_vocab - 1
    dim: int = 64  # model size
    heads: int = 4  # attention heads per layer
    kv_heads: int | None = None  # grouped K/V heads (None = heads)
    encoder_layers: int = 2  # depth of the encoder
    decoder_layers: int = 2  # depth of the decoder
    hidden: int | None = None  # feed-forward width (None = 4 · dim)
    activation: str = "relu"  # feed-forward activation: relu, gelu or swiglu
    dropout: float = 0.0  # residual, feed-forward and attention-weight dropout
    norm_first: bool = True  # pre-norm (stable without warm-up) or the paper's post-norm
    positional: str = "sinusoidal"  # one of POSITIONS
    max_len: int = 512  # longest source or target (enforced for learned positions)

    def __post_init__(self):
        check_common(self)
        positive_int("src_vocab", self.src_vocab)
        positive_int("tgt_vocab", self.tgt_vocab)
        positive_int("encoder_layers", self.encoder_layers)
        positive_int("decoder_layers", self.decoder_layers)


def check_common(config) -> None:
    """Checks of the fields every transformer config shares (errors name the field)."""
    for name in ("dim", "heads", "max_len"):
        positive_int(name, getattr(config, name))
    if config.dim % config.heads:
        raise ValueError(f"dim: expected a multiple of heads={config.heads}, got dim={config.dim}")
    if config.activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {config.activation!r}")
    if config.positional not in POSITIONS:
        raise ValueError(f"positional: expected one of {POSITIONS}, got {config.positional!r}")
    probability("dropout", config.dropout)


def attention_positional(kind: str, heads: int, dim_head: int, *, causal: bool) -> Positional | None:
    """The module that puts position into attention for ``kind`` (None for absolute or no positions)."""
    if kind == "rotary":
        return Rotary(dim_head)
    if kind == "alibi":
        return ALiBi(heads)
    if kind == "relative":
        # T5's decoder distinguishes only past distances; its encoder both directions
        return RelativePositionBias(heads, bidirectional=not causal)
    return None


class TokenEmbedding(nn.Module):
    """Token ids ``(b, i)`` -> ``√dim · E[ids] + absolute position (b, i, dim)``, with dropout.

    Checks the ids (integer dtype, ``(b, i)``, within the vocabulary) and, for learned
    positions, the length. ``start`` is the position of the first token (KV-cache length).
    """

    def __init__(self, vocab: int, dim: int, *, positional: str, max_len: int, dropout: float = 0.0):
        super().__init__()
        self.vocab, self.dim, self.max_len, self.kind = vocab, dim, max_len, positional
        self.embedding = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embedding.weight, std=dim**-0.5)
        self.position: nn.Module | None = None
        if positional == "sinusoidal":
            self.position = SinusoidalEncoding(dim)
        elif positional == "learned":
            self.position = LearnedPositionalEmbedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor, start: int | Tensor = 0, name: str = "ids") -> Tensor:
        """``start``: the first token's position, or ``positions (i,)``, each token's own (a packed serving step)."""
        check_ids(name, ids, self.vocab)
        if isinstance(start, Tensor):
            return self._at(ids, start, name)
        if self.kind == "learned" and start + ids.shape[1] > self.max_len:
            raise ValueError(
                f"{name}: expected at most max_len={self.max_len} positions with learned position embeddings, "
                f"got {start + ids.shape[1]} (length {ids.shape[1]} after {start} cached)"
            )
        x = self.embedding(ids) * math.sqrt(self.dim)
        if self.position is not None:
            x = self.position(x, start)
        return self.dropout(x) if self.training else x  # identity in eval: skip the call

    def _at(self, ids: Tensor, positions: Tensor, name: str) -> Tensor:
        """Tokens ``ids (b, i)`` at ``positions (i,)``, not necessarily consecutive."""
        if positions.shape != (ids.shape[1],):
            raise ValueError(f"positions: expected one per token of {name} ({ids.shape[1]},), got {tuple(positions.shape)}")
        top = int(positions.max()) + 1 if positions.numel() else 0
        if self.kind == "learned" and top > self.max_len:
            raise ValueError(f"{name}: expected positions below max_len={self.max_len} (learned positions), got {top - 1}")
        x = self.embedding(ids) * math.sqrt(self.dim)
        if self.position is not None:
            sinusoidal = self.kind == "sinusoidal"
            table = self.position.encoding(top, dtype=x.dtype, device=x.device) if sinusoidal else self.position.encoding(top)
            x = x + table.to(x.dtype).index_select(0, positions.to(x.device))
        return self.dropout(x) if self.training else x


def inference(method):
    """Run a decoding ``method`` under ``torch.inference_mode`` and return an ordinary tensor.

    Inference mode skips autograd's per-operation bookkeeping, which matters when every step
    is a handful of tiny operations (single-token steps with a cache ran about 15% faster
    than under ``no_grad`` when this was written). The result is cloned outside that mode so
    that it can be fed to a model in training later (inference tensors cannot be saved for
    backward).
    """

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch.inference_mode():
            out = method(*args, **kwargs)
        return out.clone()

    return wrapper


def lengths_for(name: str, lengths: object, ids: Tensor) -> Tensor | None:
    """``lengths (b,)`` for ``ids (b, i)``, each in ``[1, i]``, on the ids' device; None passes through."""
    if lengths is None:
        return None
    return check_lengths(name, lengths, ids.shape[0], ids.shape[1]).to(ids.device)


def key_padding(lengths: Tensor | None) -> masks.Mask | None:
    """A lazy key-padding mask (True = real token) from ``lengths``, or None."""
    return None if lengths is None else masks.lengths(lengths)


class Transformer(nn.Module):
    """Encoder–decoder transformer for translation-style tasks; see the module docstring."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config: expected a TransformerConfig, got {type(config).__name__}")
        self.config = c = config
        dim_head = c.dim // c.heads
        common = dict(hidden=c.hidden, activation=c.activation, dropout=c.dropout, norm_first=c.norm_first,
                      kv_heads=c.kv_heads)  # fmt: skip
        self.src_embed = TokenEmbedding(c.src_vocab, c.dim, positional=c.positional, max_len=c.max_len,
                                        dropout=c.dropout)  # fmt: skip
        self.tgt_embed = TokenEmbedding(c.tgt_vocab, c.dim, positional=c.positional, max_len=c.max_len,
                                        dropout=c.dropout)  # fmt: skip
        enc_pos = attention_positional(c.positional, c.heads, dim_head, causal=False)
        dec_pos = attention_positional(c.positional, c.heads, dim_head, causal=True)
        self.encoder = Encoder(c.encoder_layers, c.dim, c.heads, positional=enc_pos, **common)
        self.decoder = Decoder(c.decoder_layers, c.dim, c.heads, positional=dec_pos, **common)
        self.out = nn.Linear(c.dim, c.tgt_vocab)

    def encode(self, src: Tensor, *, src_lengths: Tensor | None = None, return_weights: bool = False):
        """``src (b, s)`` -> memory ``(b, s, dim)``, and per-layer weights ``(b, h, s, s)`` on request."""
        src_lengths = lengths_for("src_lengths", src_lengths, _ids(src, "src"))
        check_batch(src=src, src_lengths=src_lengths)
        return self.encoder(self.src_embed(src, name="src"), mask=key_padding(src_lengths),
                            return_weights=return_weights)  # fmt: skip

    def decode(self, tgt: Tensor, memory: Tensor | None, *, src_lengths: Tensor | None = None,
               tgt_lengths: Tensor | None = None, cache: DecoderCache | None = None,
               return_weights: bool = False):  # fmt: skip
        """``tgt (b, i)`` and ``memory (b, s, dim)`` -> logits ``(b, i, V)``.

        With a ``cache``, ``tgt`` holds only the new tokens and ``memory`` may be None after
        the first call. With ``return_weights=True`` also ``{"self": [...], "cross": [...]}``.
        """
        tgt_lengths = lengths_for("tgt_lengths", tgt_lengths, _ids(tgt, "tgt"))
        check_batch(tgt=tgt, memory=memory, src_lengths=src_lengths, tgt_lengths=tgt_lengths)
        if tgt_lengths is not None and cache is not None:
            raise ValueError("tgt_lengths: target padding is not supported with a cache; decode rows of equal length")
        start = 0 if cache is None else cache.length
        x = self.tgt_embed(tgt, start, name="tgt")
        mask = key_padding(tgt_lengths)
        memory_mask = None if src_lengths is None else masks.lengths(src_lengths.to(tgt.device))
        y = self.decoder(x, memory, mask=mask, memory_mask=memory_mask, cache=cache, return_weights=return_weights)
        if return_weights:
            return self.out(y[0]), y[1]
        return self.out(y)

    def forward(self, src: Tensor, tgt: Tensor, *, src_lengths: Tensor | None = None,
                tgt_lengths: Tensor | None = None, return_weights: bool = False):  # fmt: skip
        """``src (b, s)``, ``tgt (b, i)`` -> logits ``(b, i, V)`` of the next target token at each position.

        With ``return_weights=True`` also ``{"encoder": [(b, h, s, s)], "decoder_self":
        [(b, h, i, i)], "decoder_cross": [(b, h, i, s)]}``, one tensor per layer.
        """
        check_batch(src=_ids(src, "src"), tgt=_ids(tgt, "tgt"))
        enc = self.encode(src, src_lengths=src_lengths, return_weights=return_weights)
        memory, w_enc = enc if return_weights else (enc, None)
        dec = self.decode(tgt, memory, src_lengths=src_lengths, tgt_lengths=tgt_lengths,
                          return_weights=return_weights)  # fmt: skip
        if not return_weights:
            return dec
        logits, w_dec = dec
        return logits, {"encoder": w_enc, "decoder_self": w_dec["self"], "decoder_cross": w_dec["cross"]}

    @inference
    def generate(self, src: Tensor, *, bos_id: int, max_new_tokens: int, eos_id: int | None = None,
                 src_lengths: Tensor | None = None, use_cache: bool = True, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        """Decode ``(b, 1 + n)`` target ids starting with ``bos_id``; greedy unless ``temperature > 0``.

        Rows that emitted ``eos_id`` keep emitting it; decoding stops early once every row
        has. ``use_cache=False`` recomputes the whole prefix each step (same tokens, slower).
        """

        _token("bos_id", bos_id, self.config.tgt_vocab)
        if eos_id is not None:
            _token("eos_id", eos_id, self.config.tgt_vocab)
        positive_int("max_new_tokens", max_new_tokens)
        # the decoder reads BOS and every generated token but the last: max_new_tokens positions
        if self.config.positional == "learned" and max_new_tokens > self.config.max_len:
            raise ValueError(
                f"max_new_tokens: BOS + {max_new_tokens} new tokens feeds the decoder {max_new_tokens} positions "
                f"(every token but the last), more than max_len={self.config.max_len} of the learned positions"
            )
        memory = self.encode(src, src_lengths=src_lengths)
        out = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        cache = DecoderCache(self.config.decoder_layers, max_len=1 + max_new_tokens) if use_cache else None
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_new_tokens):
            if cache is None:
                logits = self.decode(out, memory, src_lengths=src_lengths)
            else:
                new = out if cache.length == 0 else out[:, -1:]
                logits = self.decode(new, None if cache.has_memory else memory, src_lengths=src_lengths, cache=cache)
            token = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, generator=generator)
            if eos_id is not None:
                token = torch.where(done, torch.full_like(token, eos_id), token)
                done |= token == eos_id
            out = torch.cat((out, token[:, None]), dim=1)
            if eos_id is not None and bool(done.all()):
                break
        return out


def _ids(ids: object, name: str) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name}: expected a LongTensor of token ids (b, length), got {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected token ids of shape (b, length), got {tuple(ids.shape)}")
    return ids


def _token(name: str, value: object, vocab: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise ValueError(f"{name}: expected a token id in [0, {vocab}), got {value!r}")
