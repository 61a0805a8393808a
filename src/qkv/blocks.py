"""Transformer blocks: encoder and decoder layers, and their stacks (the feed-forward: ``qkv.feed_forward``).

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query (target) length, ``j`` key length
(``j = i`` in self-attention, plus the cached positions), ``s`` memory (source) length,
``dim`` model size; every module takes and returns batch-first ``(b, i, dim)``.

Vaswani et al. 2017, "Attention Is All You Need", section 3.1: each sub-layer (self-
attention, cross-attention, feed-forward) is wrapped in a residual connection and a layer
norm. Two placements are offered::

    post-norm (the paper):   x = LayerNorm(x + Dropout(sublayer(x)))
    pre-norm  (norm_first):  x = x + Dropout(sublayer(LayerNorm(x)))   + a final LayerNorm

Pre-norm (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture")
trains without warm-up, which is why small models here default to it in ``qkv.models``.

The attention inside a layer is ``qkv.MultiHeadAttention``; ``attention=`` swaps its
mechanism (e.g. a ``qkv.approx`` class, same call as exact attention) and ``positional=``
adds RoPE, ALiBi or relative buckets. A layer given ``return_weights=True`` returns its
attention weights ``(b, h, i, j)``; a stack returns one per layer. Checked against
``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` with copied weights in the
test suite.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

from . import cached_step
from ._args import positive_int, probability
from .attention import MultiHeadAttention
from .cache import DecoderCache, KVCache
from .feed_forward import FeedForward
from .functional import foreign_keywords
from .masks import Mask
from .module_inputs import DECODER_TORCH_NAMES, ENCODER_TORCH_NAMES, input_dtype, stack_names
from .positional import Positional

#: A mechanism module, or a zero-argument factory that builds one (called once per layer).
MechanismArg = nn.Module | Callable[[], Callable[..., Tensor]] | None

class TransformerEncoderLayer(nn.Module):
    """Self-attention and a feed-forward network, each with a residual and a layer norm.

    With ``causal=True`` this is the block of a decoder-only language model (GPT).

    Args:
        dim, heads: model size and query heads.
        hidden: feed-forward width (default ``4 · dim``).
        activation: feed-forward activation (``"relu"``, ``"gelu"``, ``"swiglu"``).
        dropout: on the residual branches, the feed-forward hidden layer and the weights.
        norm_first: pre-norm (True) or the paper's post-norm (False).
        kv_heads: grouped K/V heads (default ``heads``).
        positional: a ``qkv.positional.Positional`` for the self-attention (RoPE, ALiBi, ...).
        attention: the mechanism, or a zero-argument factory of one (default exact attention).
        self_attention: a whole self-attention module in place of ``MultiHeadAttention``, called
            as ``self_attention(x, mask=, causal=, cache=, return_weights=)`` (e.g.
            ``qkv.MultiHeadLatentAttention``, which carries its own positions).
    """

    def __init__(self, dim: int, heads: int, *, hidden: int | None = None, activation: str = "relu",
                 dropout: float = 0.0, norm_first: bool = False, kv_heads: int | None = None,
                 positional: Positional | None = None, attention: MechanismArg = None,
                 self_attention: nn.Module | None = None):  # fmt: skip
        super().__init__()
        p = probability("dropout", dropout)
        if self_attention is None:
            self.self_attn = _mha(dim, heads, kv_heads, p, positional, attention, "attention")
        elif not isinstance(self_attention, nn.Module) or any(x is not None for x in (kv_heads, positional, attention)):
            raise ValueError(
                "self_attention: expected an nn.Module that replaces MultiHeadAttention whole, without kv_heads, "
                f"positional or attention (those configure MultiHeadAttention), got {type(self_attention).__name__}"
            )
        else:
            self.self_attn = self_attention
        self.ff = FeedForward(dim, hidden, activation=activation, dropout=p)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = nn.Dropout(p)
        self.norm_first = bool(norm_first)

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                cache: KVCache | None = None, return_weights: bool = False, **foreign):  # fmt: skip
        """``x (b, i, dim)``; ``mask`` bool True = may attend, broadcastable to ``(b, h, i, j)``.

        ``cache`` appends this call's keys and values (incremental decoding). Returns
        ``(b, i, dim)``, and the weights ``(b, h, i, j)`` with ``return_weights=True``.
        ``nn.TransformerEncoderLayer``'s keywords (``src_mask``, ``src_key_padding_mask``,
        ``is_causal``) raise a ``TypeError`` naming qkv's instead; its key padding mask is
        True = ignore, the reverse of qkv's: ``mask=~src_key_padding_mask[:, None, None, :]``.
        """
        if foreign:
            foreign_keywords(foreign, ENCODER_TORCH_NAMES, "TransformerEncoderLayer", "qkv's layer")
        _check_x(x, self.norm1.normalized_shape[0], self.ff)
        causal = _causal(causal, x, cache)
        h = self.norm1(x) if self.norm_first else x
        a = self.self_attn(h, mask=mask, causal=causal, cache=cache, return_weights=return_weights)
        a, w = a if return_weights else (a, None)
        x = _residual(self, x, a, self.norm1)
        x = _residual(self, x, self.ff(self.norm2(x) if self.norm_first else x), self.norm2)
        return (x, w) if return_weights else x


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, and a feed-forward network.

    Arguments as :class:`TransformerEncoderLayer`; ``positional`` applies to the self-
    attention only, and ``cross_attention`` is the mechanism of the cross-attention
    (default exact attention; ``attention`` is the self-attention's).
    """

    def __init__(self, dim: int, heads: int, *, hidden: int | None = None, activation: str = "relu",
                 dropout: float = 0.0, norm_first: bool = False, kv_heads: int | None = None,
                 positional: Positional | None = None, attention: MechanismArg = None,
                 cross_attention: MechanismArg = None):  # fmt: skip
        super().__init__()
        p = probability("dropout", dropout)
        self.self_attn = _mha(dim, heads, kv_heads, p, positional, attention, "attention")
        self.cross_attn = _mha(dim, heads, kv_heads, p, None, cross_attention, "cross_attention")
        self.ff = FeedForward(dim, hidden, activation=activation, dropout=p)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = nn.Dropout(p)
        self.norm_first = bool(norm_first)

    def forward(self, x: Tensor, memory: Tensor | None, *, mask: Mask | Tensor | None = None,
                memory_mask: Mask | Tensor | None = None, causal: bool = True,
                self_cache: KVCache | None = None, cross_cache: KVCache | None = None,
                return_weights: bool = False, **foreign):  # fmt: skip
        """``x (b, i, dim)``, ``memory (b, s, dim)``; ``memory_mask`` broadcastable to ``(b, h, i, s)``.

        ``mask`` and ``memory_mask`` are bool, True = may attend (``nn.TransformerDecoderLayer``'s
        bool ``memory_mask`` is the reverse: pass ``~memory_mask``). ``self_cache`` appends
        this call's self-attention keys and values. ``cross_cache`` holds the memory's K/V:
        filled from ``memory`` on the first call, then reused (``memory`` may then be None, or
        the same memory, which is not projected again). Returns ``(b, i, dim)``, and with
        ``return_weights=True`` also ``(self weights (b, h, i, j), cross weights (b, h, i, s))``.
        ``nn.TransformerDecoderLayer``'s other keywords (``tgt_mask``, ``tgt_key_padding_mask``,
        ``memory_key_padding_mask``, ``tgt_is_causal``, ``memory_is_causal``) raise a
        ``TypeError`` naming qkv's instead.
        """
        if foreign:
            foreign_keywords(foreign, DECODER_TORCH_NAMES, "TransformerDecoderLayer", "qkv's layer")
        dim = self.norm1.normalized_shape[0]
        _check_x(x, dim, self.ff)
        causal = _causal(causal, x, self_cache)
        h = self.norm1(x) if self.norm_first else x
        a = self.self_attn(h, mask=mask, causal=causal, cache=self_cache, return_weights=return_weights)
        a, w_self = a if return_weights else (a, None)
        x = _residual(self, x, a, self.norm1)
        if memory is None and getattr(cross_cache, "from_memory", False):
            # the memory's keys and values are in the cache, which reads only a memory's shape
            # from here on: a stand-in of that shape without storage (a view of one zero)
            memory = x.new_zeros(()).expand(x.shape[0], cross_cache.length, self.cross_attn.k_proj.in_features)
        elif memory is None:
            raise ValueError("memory: expected the encoder output (b, s, dim), got None with no filled cross_cache")
        h = self.norm2(x) if self.norm_first else x
        c = self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache, return_weights=return_weights)
        c, w_cross = c if return_weights else (c, None)
        x = _residual(self, x, c, self.norm2)
        x = _residual(self, x, self.ff(self.norm3(x) if self.norm_first else x), self.norm3)
        return (x, (w_self, w_cross)) if return_weights else x


class Encoder(nn.Module):
    """``depth`` :class:`TransformerEncoderLayer` s (a final layer norm if pre-norm).

    The layer arguments are those of :class:`TransformerEncoderLayer`. A ``positional``
    module is shared by every layer (one T5 bias table, as in T5); an ``attention`` module
    is copied per layer, a factory is called per layer; ``self_attention`` is a zero-argument
    factory of a whole self-attention module, called per layer.
    """

    def __init__(self, depth: int, dim: int, heads: int, *, hidden: int | None = None, activation: str = "relu",
                 dropout: float = 0.0, norm_first: bool = False, kv_heads: int | None = None,
                 positional: Positional | None = None, attention: MechanismArg = None,
                 self_attention: Callable[[], nn.Module] | None = None):  # fmt: skip
        super().__init__()
        positive_int("depth", depth)
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(dim, heads, hidden=hidden, activation=activation, dropout=dropout,
                                    norm_first=norm_first, kv_heads=kv_heads, positional=positional,
                                    attention=_per_layer(attention),
                                    self_attention=None if self_attention is None else self_attention())  # fmt: skip
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim) if norm_first else nn.Identity()

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                cache: DecoderCache | None = None, return_weights: bool = False, **foreign):  # fmt: skip
        """``x (b, i, dim)`` -> ``(b, i, dim)``, and a list of per-layer weights ``(b, h, i, j)`` on request.

        ``cache`` (a :class:`qkv.cache.DecoderCache` with one entry per layer; its cross
        part is unused) makes this a decoder-only stack for incremental decoding.
        ``nn.TransformerEncoder``'s keywords raise a ``TypeError`` naming qkv's; its ``mask=``
        is a keyword of both, True = may attend here (``~mask`` for PyTorch's bool mask).
        """
        if type(cache) is DecoderCache and mask is None and type(causal) is bool and not return_weights and not foreign and (
                y := cached_step.stack(self.layers, x, cache.self_attn, TransformerEncoderLayer)) is not None:  # fmt: skip
            return self.norm(y)  # a plain one-token step of every layer, in functional calls (qkv.cached_step)
        if foreign:
            foreign_keywords(foreign, stack_names(ENCODER_TORCH_NAMES, "nn.TransformerEncoder"), "Encoder", "qkv's stack")
        _check_cache(cache, len(self.layers))
        weights = []
        for n, layer in enumerate(self.layers):
            c = None if cache is None else cache.self_attn[n]
            x = layer(x, mask=mask, causal=causal, cache=c, return_weights=return_weights)
            if return_weights:
                x, w = x
                weights.append(w)
        x = self.norm(x)
        return (x, weights) if return_weights else x


class Decoder(nn.Module):
    """``depth`` :class:`TransformerDecoderLayer` s (a final layer norm if pre-norm).

    Arguments as :class:`Encoder`, plus ``cross_attention`` (module copied or factory called
    per layer).
    """

    def __init__(self, depth: int, dim: int, heads: int, *, hidden: int | None = None, activation: str = "relu",
                 dropout: float = 0.0, norm_first: bool = False, kv_heads: int | None = None,
                 positional: Positional | None = None, attention: MechanismArg = None,
                 cross_attention: MechanismArg = None):  # fmt: skip
        super().__init__()
        positive_int("depth", depth)
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(dim, heads, hidden=hidden, activation=activation, dropout=dropout,
                                    norm_first=norm_first, kv_heads=kv_heads, positional=positional,
                                    attention=_per_layer(attention),
                                    cross_attention=_per_layer(cross_attention))  # fmt: skip
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim) if norm_first else nn.Identity()

    def forward(self, x: Tensor, memory: Tensor | None, *, mask: Mask | Tensor | None = None,
                memory_mask: Mask | Tensor | None = None, cache: DecoderCache | None = None,
                return_weights: bool = False, **foreign):  # fmt: skip
        """``x (b, i, dim)``, ``memory (b, s, dim)`` -> ``(b, i, dim)``; causal self-attention.

        With ``return_weights=True`` also ``{"self": [(b, h, i, j)] per layer, "cross":
        [(b, h, i, s)] per layer}``. With a ``cache`` the memory is projected on the first
        call only; later calls may pass ``memory=None``. Masks as
        :meth:`TransformerDecoderLayer.forward` (True = may attend); ``nn.TransformerDecoder``'s
        keywords raise a ``TypeError`` naming qkv's.
        """
        if foreign:
            foreign_keywords(foreign, stack_names(DECODER_TORCH_NAMES, "nn.TransformerDecoder"), "Decoder", "qkv's stack")
        _check_cache(cache, len(self.layers))
        if memory is not None and memory.shape[0] != x.shape[0]:
            raise ValueError(
                f"memory: expected batch size {x.shape[0]} like x, got memory {tuple(memory.shape)}, x {tuple(x.shape)}"
            )
        weights: dict[str, list[Tensor]] = {"self": [], "cross": []}
        for n, layer in enumerate(self.layers):
            sc, cc = (None, None) if cache is None else (cache.self_attn[n], cache.cross[n])
            x = layer(x, memory, mask=mask, memory_mask=memory_mask, self_cache=sc, cross_cache=cc,
                      return_weights=return_weights)  # fmt: skip
            if return_weights:
                x, (w_self, w_cross) = x
                weights["self"].append(w_self)
                weights["cross"].append(w_cross)
        x = self.norm(x)
        return (x, weights) if return_weights else x


def _mha(dim, heads, kv_heads, dropout, positional, attention, name) -> MultiHeadAttention:
    mechanism = _build(attention, name)
    # MultiHeadAttention applies `dropout` to the weights only for its default mechanism;
    # a given mechanism handles (or lacks) dropout itself.
    return MultiHeadAttention(dim, heads, kv_heads=kv_heads, dropout=dropout, positional=positional,
                              attention=mechanism)  # fmt: skip


def _build(attention: MechanismArg, name: str):
    """A mechanism from ``attention=``: None (exact attention), a module, or a factory."""
    if attention is None or isinstance(attention, nn.Module):
        return attention
    if not callable(attention):
        raise TypeError(f"{name}: expected a mechanism module or a zero-argument factory, got {type(attention).__name__}")
    try:
        mechanism = attention()
    except TypeError as err:
        raise TypeError(
            f"{name}: a callable that is not an nn.Module is taken as a zero-argument factory of the "
            f"mechanism (wrap a plain attention function as `lambda: fn`); calling it failed: {err}"
        ) from err
    if not callable(mechanism):
        raise TypeError(f"{name}: the factory returned {type(mechanism).__name__}, expected a callable mechanism")
    return mechanism


def _per_layer(attention: MechanismArg) -> MechanismArg:
    # a module is copied so that layers do not share parameters or state; factories are
    # called by each layer
    return copy.deepcopy(attention) if isinstance(attention, nn.Module) else attention


def _residual(layer: nn.Module, x: Tensor, branch: Tensor, norm: nn.LayerNorm) -> Tensor:
    # Dropout is the identity in eval mode; not calling the module there saves a module call
    # per sub-layer, which is measurable in single-token decoding steps (bench "generation").
    y = x + (layer.dropout(branch) if layer.training else branch)
    return y if layer.norm_first else norm(y)


def _causal(causal: bool, x: Tensor, cache: KVCache | None) -> bool:
    # One new query after a cache sees every key under the bottom-right causal mask, so the
    # mask is dropped: same result, and the fused kernel runs without building a mask.
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    return causal and not (cache is not None and x.shape[1] == 1)


def _check_x(x: object, dim: int, ff: FeedForward) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor (b, i, {dim}), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x: expected shape (b, i, {dim}) (batch first), got {tuple(x.shape)}")
    # the linear maps' dtype, not the norms': norms kept in float32 for half inputs are fine
    input_dtype("x", x, ff.w_in.weight)


def _check_cache(cache: object, layers: int) -> None:
    if cache is None:
        return
    if getattr(cache, "paged", False):  # qkv.paged.serve's step: one paged layer per layer
        if len(cache.self_attn) != layers:
            raise ValueError(f"cache: a PagedStep over a PagedKVCache of {len(cache.self_attn)} layers, for a stack of "
                             f"{layers}: make the cache with layers={layers}")  # fmt: skip
        return
    if not isinstance(cache, DecoderCache):
        raise TypeError(f"cache: expected a qkv.cache.DecoderCache, got {type(cache).__name__}")
    if len(cache) != layers:
        raise ValueError(f"cache: expected one entry per layer ({layers}), got a DecoderCache of {len(cache)}")
