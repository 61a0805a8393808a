"""Attention modules: ``Attention`` (no projections) and ``MultiHeadAttention``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size (``dim_head``), ``e`` per-head value size
(``dim_value_head``); modules take and return batch-first ``(b, i, dim)``.

``MultiHeadAttention`` is Vaswani et al. (2017), section 3.2.2:

    head_n = Attention(Q W_n^Q, K W_n^K, V W_n^V)        W^Q, W^K: dim -> d,  W^V: dim -> e
    MultiHead(Q, K, V) = [head_1; ...; head_h] W^O       W^O: h·e -> dim

with grouped KV heads (Ainslie et al. 2023, GQA: ``g`` K/V heads shared by ``h/g`` query
heads each; ``g = 1`` is multi-query attention), any score per head, an optional positional
module (RoPE rotates q and k, ALiBi / T5 buckets add a lazy bias) and a pluggable mechanism
(``attention=``, e.g. a ``qkv.approx`` class). Checked against ``nn.MultiheadAttention`` in
the test suite through :meth:`MultiHeadAttention.from_torch`, and by gradcheck for
every score.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from torch import Tensor, nn

from . import score_mods
from ._args import positive_int as _positive
from ._args import probability
from .edits import attention as edited_attention
from .edits.ablate import refuse_mean_with_cache
from .functional import attention, foreign_call
from .masks import Mask
from .module_inputs import (MODULE_NAMES, checked_inputs, check_layer_cache, check_unbatched, memory_held,
                            memory_positions, name_device, seq2seq_mask, split_heads, squeeze_dims)
from .positional import LazyBias, Positional
from .projection import Linear
from .scores import Score, make


class Attention(nn.Module):
    """Attention without projections: ``c_i = Σ_j α_ij v_j``, ``α_i = softmax_j(score(q_i, k_j))``.

    The classic encoder-decoder (seq2seq) form: the query is a decoder state ``(b, dq)`` or states
    ``(b, i, dq)``, the keys are encoder states ``(b, j, dk)`` and the values default to the
    keys (Bahdanau: the context is a weighted sum of the annotations ``h_j``). Also the
    default mechanism inside :class:`MultiHeadAttention`, on ``(b, h, i, d)`` tensors.

    Args:
        score: a name or a ``qkv.scores.Score``; learned names (``"general"``, ``"concat"``,
            ``"location"``) need ``query_dim`` (and ``key_dim``, ``hidden``, ``max_len``).
        dropout: on the weights, in training mode only.
        backend: passed to ``qkv.attention``.
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` on the logits, passed to
            ``qkv.attention`` (e.g. ``qkv.SoftCap(50.0)``); an ``nn.Module`` becomes a submodule,
            so its parameters train with this module's.
    """

    def __init__(
        self,
        score: str | Score = "dot",
        *,
        query_dim: int | None = None,
        key_dim: int | None = None,
        hidden: int = 64,
        max_len: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
        score_mod: Callable | None = None,
    ):
        super().__init__()
        self.score = make(score, query_dim, key_dim, hidden=hidden, max_len=max_len)
        self.dropout, self.backend = probability("dropout", dropout), backend
        self.score_mod = score_mods.check(score_mod)
        #: ``qkv.edits`` applied to every call (an edit or a list; None: plain attention). For
        #: interpretability: ``mha.attention.edits = [qkv.edits.AblateHeads([2])]``.
        self.edits = None

    @classmethod
    def from_keras(cls, layer) -> Attention:
        """Keras' ``Attention`` or ``AdditiveAttention`` with its weights (see ``qkv.interop_keras``)."""
        from .interop_keras import from_keras

        return from_keras(cls, layer)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        causal: bool = False,
        bias: Tensor | LazyBias | None = None,
        return_weights: bool = False,
        **foreign,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``query (..., i, dq)`` or a single step ``(b, dq)``; ``key (..., j, dk)``; ``value (..., j, e)``.

        In the seq2seq form, ``(b, i, dq)`` with ``(b, j, dk)``, the first dim is the batch and
        must be the same for all three (in ``(b, h, i, d)`` form the heads may be grouped).
        Its ``mask`` (or tensor ``bias``) is a lazy ``qkv.masks`` object (``lengths(lens)``,
        one length per batch row), or a tensor ``(b, i, j)``, ``(i, j)``, or a padding mask
        ``(b, j)`` (True = a real key); a 2-d mask that could be either, ``b = i``, is refused.
        A single step ``(b, dq)`` takes ``(b, j)`` or a ``qkv.masks`` object. The weights are
        ``(b, i, j)``, or ``(b, j)`` for a single step.
        """
        foreign_call("Attention", query, mask, foreign, MODULE_NAMES)  # Keras' or PyTorch's form: qkv's named
        key = query if key is None else key
        value = key if value is None else value
        single_step = query.dim() == key.dim() - 1
        if single_step:
            query = query.unsqueeze(-2)  # (b, dq) -> (b, 1, dq)
            # a mask / bias shaped like the single-step weights (b, j) gets the query axis too
            mask, bias = (x.unsqueeze(-2) if isinstance(x, Tensor) and x.dim() == key.dim() - 1 else x
                          for x in (mask, bias))
        seq2seq = key.dim() == 3
        if seq2seq:
            for name, x in (("key", key), ("value", value)):
                if x.shape[0] != query.shape[0]:
                    raise ValueError(f"{name}: expected batch {query.shape[0]} like query, got {x.shape[0]}")
            # qkv.attention reads (x, i, d) as heads without a batch, so a lengths mask (one length
            # per batch row) or a (b, j) padding mask had no batch dim to apply to: a head dim of 1
            # makes dim 0 the batch, (b, 1, i, d), and the masks follow it.
            b, i, j = query.shape[0], query.shape[1], key.shape[1]
            mask, bias = seq2seq_mask("mask", mask, b, i, j), seq2seq_mask("bias", bias, b, i, j)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        run = attention if self.edits is None else partial(edited_attention, edits=self.edits)
        result = run(
            query, key, value, score=self.score, mask=mask, bias=bias, causal=causal,
            dropout=self.dropout if self.training else 0.0, return_weights=return_weights,
            backend=self.backend, score_mod=self.score_mod,
        )  # fmt: skip
        drop = [1] if seq2seq else []  # the head dim added above, then the single step's query axis
        drop += [-2] if single_step else []
        if not drop:
            return result
        return tuple(squeeze_dims(x, drop) for x in result) if return_weights else squeeze_dims(result, drop)

    def extra_repr(self) -> str:
        text = f"dropout={self.dropout}, backend={self.backend!r}"
        if self.score_mod is not None and not isinstance(self.score_mod, nn.Module):
            text += f", score_mod={self.score_mod!r}"
        return text


class MultiHeadAttention(nn.Module):
    """Multi-head attention with learned ``W^Q, W^K, W^V, W^O``; batch-first by default; self or cross.

    Args:
        dim: model size of the query input and of the output.
        heads: query heads ``h``.
        kv_heads: K/V heads ``g`` (default ``heads``; 1 = multi-query); ``heads % kv_heads == 0``.
        dim_head: per-head query/key size ``d`` (default ``dim // heads``).
        dim_value_head: per-head value size ``e`` (default ``dim_head``).
        kdim, vdim: sizes of the key and value inputs (default ``dim``).
        bias: biases in the four projections.
        dropout: on the attention weights, in training mode.
        score: a name or a ``qkv.scores.Score`` on ``(d, d)`` heads; learned names get
            per-module parameters shared by the heads (``"concat"`` with hidden size ``d``).
        positional: a ``qkv.positional.Positional`` (RoPE, ALiBi, relative buckets).
        attention: the mechanism (default exact attention with ``score``): any callable with
            ``(q, k, v, *, mask, causal, return_weights)`` on ``(b, h, i, d)``, e.g. ``qkv.approx``;
            one with ``accepts_bias = True`` also gets a positional bias as ``bias=``, and one
            with a ``positions(q, k, start)`` method (``qkv.distributed.SequenceParallel``, whose
            rows are a shard of a longer sequence) tells rotary embeddings where its rows stand.
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` on the logits of the default
            mechanism (e.g. ``qkv.SoftCap(50.0)``, Gemma 2); see ``qkv.attention``.
        qk_norm: a module ``(q, k) -> (q, k)`` applied per head right after the projections,
            before any rotation, e.g. ``qkv.QKNorm(dim_head)`` (default none).
        gate: a module ``(out (b, h, i, e), query (b, i, dim)) -> out`` applied to the heads'
            outputs before ``W^O``, e.g. ``qkv.OutputGate(dim, heads, dim_value_head)``.
        batch_first: inputs and output are ``(b, length, dim)`` (default); False takes and
            returns ``(length, b, dim)``, as ``nn.MultiheadAttention``'s default does.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        kv_heads: int | None = None,
        dim_head: int | None = None,
        dim_value_head: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        score: str | Score = "scaled_dot",
        positional: Positional | None = None,
        attention: Callable[..., Tensor] | None = None,
        score_mod: Callable | None = None,
        qk_norm: nn.Module | None = None,
        gate: nn.Module | None = None,
        batch_first: bool = True,
    ):
        super().__init__()
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first: expected a bool, got {type(batch_first).__name__}")
        self.batch_first = batch_first
        _positive("dim", dim)
        _positive("heads", heads)
        kv_heads = heads if kv_heads is None else kv_heads
        _positive("kv_heads", kv_heads)
        if heads % kv_heads != 0:
            raise ValueError(f"kv_heads: heads={heads} must be a multiple of kv_heads, got kv_heads={kv_heads}")
        if dim_head is None:
            if dim % heads != 0:
                raise ValueError(
                    f"dim: expected a multiple of heads={heads} when dim_head is not given, got dim={dim}"
                )
            dim_head = dim // heads
        dim_value_head = dim_head if dim_value_head is None else dim_value_head
        _positive("dim_head", dim_head)
        _positive("dim_value_head", dim_value_head)
        if positional is not None and not isinstance(positional, Positional):
            raise TypeError(f"positional: expected a qkv.positional.Positional, got {type(positional).__name__}")
        made_for = getattr(positional.bias(), "heads", None) if positional is not None else None
        if made_for not in (None, 1, heads):  # (the call's own check would name only its bias= argument)
            raise ValueError(f"positional: {type(positional).__name__} was made for {made_for} heads but the module has "
                             f"{heads}: make it with {heads} (qkv.{type(positional).__name__}({heads}))")  # fmt: skip
        self.dim, self.heads, self.kv_heads = dim, heads, kv_heads
        self.dim_head, self.dim_value_head = dim_head, dim_value_head
        # nn.Linear subclasses that run large float32 inputs on oneDNN (qkv.projection says why)
        self.q_proj = Linear(dim, heads * dim_head, bias=bias)
        self.k_proj = Linear(kdim or dim, kv_heads * dim_head, bias=bias)
        self.v_proj = Linear(vdim or dim, kv_heads * dim_value_head, bias=bias)
        self.out_proj = Linear(heads * dim_value_head, dim, bias=bias)
        self.positional = positional
        if attention is None:
            attention = Attention(make(score, dim_head, dim_head, hidden=dim_head), dropout=dropout, score_mod=score_mod)
        elif score != "scaled_dot":
            raise ValueError("score: give the score to the mechanism passed as attention=, not to both")
        elif score_mod is not None:
            raise ValueError("score_mod: give it to the mechanism passed as attention=, not to both")
        elif positional is not None and positional.bias() is not None and not isinstance(attention, Attention) and (
                not getattr(attention, "accepts_bias", False)):  # fmt: skip
            # Approximate mechanisms never form the (i, j) logits, so there is nothing to add a bias to.
            raise ValueError(
                f"positional: {type(positional).__name__} adds a bias to the logits, which the mechanism "
                f"{type(attention).__name__} cannot take; use qkv.positional.Rotary or exact attention"
            )
        part = dim_head // getattr(attention, "head_parts", 1)  # differential attention: each head's q and k are halves
        if part < dim_head and getattr(positional, "rotary_dim", 0) > part and (not positional.interleaved or part % 2):
            raise ValueError(f"positional: {positional!r} rotates pairs of channels across the parts of {part} of "
                             f"{type(attention).__name__}'s heads, whose logits then depend on absolute positions; "
                             "use interleaved=True with an even part, or rotary_dim <= the size of one part")  # fmt: skip
        self.attention = attention
        for name, slot in (("qk_norm", qk_norm), ("gate", gate)):
            if slot is not None and not isinstance(slot, nn.Module):
                raise TypeError(f"{name}: expected an nn.Module or None, got {type(slot).__name__}")
        # None is a plain attribute, not a submodule: a default module's state dict is unchanged
        self.qk_norm, self.gate = qk_norm, gate

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A copy of ``nn.MultiheadAttention`` with the same weights (see ``qkv.interop``)."""
        from .interop import from_torch

        return from_torch(cls, module)

    def to_torch(self) -> nn.MultiheadAttention:
        """This module as ``nn.MultiheadAttention`` with the same weights, where PyTorch's can hold it (``qkv.interop``)."""
        from .interop import to_torch

        return to_torch(self, type(self.attention) is Attention, type(self).forward is MultiHeadAttention.forward)

    @classmethod
    def from_keras(cls, layer) -> MultiHeadAttention:
        """Keras' ``MultiHeadAttention`` or ``GroupQueryAttention`` with its weights (see ``qkv.interop_keras``)."""
        from .interop_keras import from_keras

        return from_keras(cls, layer)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        causal: bool = False,
        cache=None,
        return_weights: bool = False,
        **foreign,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``query (b, i, dim)``, ``key (b, j, kdim)`` (default query), ``value (b, j, vdim)`` (default key).

        ``mask`` is bool True = may attend, broadcastable to ``(b, h, i, j)`` (a key padding
        mask is ``keep[:, None, None, :]``), or a lazy ``qkv.masks`` object. ``cache`` is a
        ``qkv.cache.KVCache`` (or ``StreamingCache``) for incremental decoding:

        * self-attention (``key`` not given, or ``key is query``): this call's keys and values
          are appended to it and the queries attend to all of it;
        * cross-attention (``mha(x, memory, cache=c)``, ``key is not query``): the keys and
          values depend on the memory only, so the first call fills the cache from ``memory``
          and later calls attend to what it holds without projecting ``memory`` again (as
          transformers' ``EncoderDecoderCache`` and fairseq's ``static_kv`` do). Later calls
          must pass a memory of the same batch and length, whose values are not read;
          ``c.reset()`` before a new memory. A positional module places the memory at
          positions 0 .. j - 1 and the queries at its last ones, as the same call without a cache does. Give each its own cache (a
          ``qkv.cache.DecoderCache`` holds both kinds per layer); a cache of the other kind
          is refused, and so is a ``StreamingCache``, which would evict memory keys.

        (A ``LatentCache`` is ``qkv.MultiHeadLatentAttention``'s.) Returns ``(b, i, dim)``,
        and per-head weights ``(b, h, i, j)`` with ``return_weights=True``. With
        ``batch_first=False`` the inputs and the output are ``(length, b, dim)`` instead (the
        weights stay ``(b, h, i, j)``). Unbatched ``(length, dim)`` inputs give ``(i, dim)``
        and ``(h, i, j)``, as in ``nn.MultiheadAttention`` (not with ``cache``). Inputs have
        the parameters' dtype (under ``torch.autocast`` any floating type).
        """
        foreign_call("MultiHeadAttention", query, mask, foreign, MODULE_NAMES)  # Keras' or PyTorch's form: qkv's named
        if isinstance(mask, Tensor) and mask.dtype.is_floating_point:
            raise TypeError("mask: expected a bool mask (True = may attend) or a qkv.masks object; a float mask "
                            "(PyTorch's float attn_mask) is added to the logits: qkv.attention(q, k, v, bias=...) on "
                            "the projected heads, or a positional bias (positional=)")  # fmt: skip
        key = query if key is None else key
        value = key if value is None else value
        if cache is not None:
            check_layer_cache(cache, cross=key is not query)
        if cache is None and all(isinstance(x, Tensor) and x.dim() == 2 for x in (query, key, value)):
            # unbatched (length, dim), as nn.MultiheadAttention takes it: a batch of one, given back without it
            for name, x, projection in zip(("query", "key", "value"), (query, key, value), (self.q_proj, self.k_proj, self.v_proj)):
                check_unbatched(name, x, projection, self.batch_first)
            one = (query[None], key[None], value[None]) if self.batch_first else (query[:, None], key[:, None], value[:, None])
            result = self.forward(*(one[0], one[1] if key is not query else None, one[2] if value is not key else None),
                                  mask=mask, causal=causal, return_weights=return_weights)  # fmt: skip
            y, weights = result if return_weights else (result, None)
            y = y[0] if self.batch_first else y[:, 0]
            return (y, weights[0]) if return_weights else y
        # checked in the caller's layout, then (length, b, dim) -> (b, length, dim): views, one per distinct input
        query, key, value = checked_inputs(query, key, value, (self.q_proj, self.k_proj, self.v_proj), self.batch_first)
        cross = cache is not None and key is not query and not hasattr(cache, "attend")
        if cross and memory_held(cache, key):
            # the memory's keys and values are in the cache: project no rows, update() appends
            # nothing and returns them (appending them again each step grew the cache by s a step)
            key, value = key[:, :0], value[:, :0]
        try:
            q, k, v = split_heads(self, self.q_proj(query), self.k_proj(key), self.v_proj(value))
        except RuntimeError:  # an input on another device than its projection: named (read only now, see name_device)
            name_device(("query", "key", "value"), (query, key, value), (self.q_proj, self.k_proj, self.v_proj))
            raise
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if cache is not None and hasattr(cache, "attend"):  # a serving step over pages (qkv.paged.serve)
            return self._paged(q, k, v, query, cache, return_weights)
        extra = {}
        # A cache that re-positions its keys (qkv.cache.StreamingCache: positions within the
        # cache) gets them unrotated; every key is rotated after the update instead.
        late = cache is not None and getattr(cache, "positions_in_cache", False)
        if self.positional is not None:
            if not late:
                # a memory's positions do not follow the decoded ones: as without a cache
                start = 0 if cache is None or cross else cache.length
                placed = getattr(self.attention, "positions", None)  # a shard's rows stand elsewhere than 0 .. i-1
                where = {} if placed is None else {"positions": placed(q, k, start)}
                if cross and cache is not None and k.shape[-2] == 0 and cache.length:  # the memory's keys held, rotated
                    where = {"positions": memory_positions(q, cache)}
                q, k = self.positional.rotate(q, k, start, **where)
            if (pos_bias := self.positional.bias()) is not None:
                extra["bias"] = pos_bias
        if cache is not None:
            if getattr(self.attention, "edits", None) is not None and not cross and cache.length:  # (edits first: rare)
                refuse_mean_with_cache(self.attention.edits, "MultiHeadAttention", q.shape[-2], cache.length + q.shape[-2], "or no cache")
            k, v = cache.update(k, v)
            if cross:
                cache.from_memory = True  # filled: later calls read it (KVCache.reset clears it)
            if late and self.positional is not None:
                q, k = self.positional.rotate(q, k, 0)
        result = self.attention(q, k, v, mask=mask, causal=causal, return_weights=return_weights, **extra)
        out, weights = result if return_weights else (result, None)
        if self.gate is not None:
            out = self.gate(out, query)
        y = self.out_proj(out.transpose(1, 2).flatten(2))  # "b h i e -> b i (h e)"
        y = y if self.batch_first else y.transpose(0, 1)
        return (y, weights) if return_weights else y

    def _paged(self, q: Tensor, k: Tensor, v: Tensor, query: Tensor, layer, return_weights: bool) -> Tensor:
        """``q (1, h, T, d)``: a packed step of many requests; ``layer`` writes ``k, v`` to its pages and attends."""
        if return_weights:
            raise ValueError("return_weights: a paged serving step does not build weights")
        if self.positional is not None:
            if self.positional.bias() is not None:
                raise ValueError(
                    f"positional: a paged serving step rotates keys by position (rotary) or adds positions to the "
                    f"embeddings; {type(self.positional).__name__}'s bias is not passed to the pages"
                )
            q, k = self.positional.rotate(q, k, positions=(layer.positions, layer.positions))
        out = layer.attend(q, k, v)
        if self.gate is not None:
            out = self.gate(out, query)
        y = self.out_proj(out.transpose(1, 2).flatten(2))
        return y if self.batch_first else y.transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, kv_heads={self.kv_heads}, "
            f"dim_head={self.dim_head}, dim_value_head={self.dim_value_head}"
            + ("" if self.batch_first else ", batch_first=False")
        )
