"""Key/value caches for incremental decoding.

Shape legend: ``b`` batch, ``g`` KV heads, ``j`` cached length, ``n`` new positions in one
update, ``d`` per-head key size, ``e`` per-head value size.

A decoder that emits one token at a time would otherwise recompute the keys and values of
the whole prefix at every step (O(n²) projections for n tokens). A cache keeps them::

    step t:   k_new, v_new (b, g, 1, ·)  --update-->  k_all, v_all (b, g, t + 1, ·)

and the query of the new token attends to all of them. Because qkv's causal mask is
aligned bottom-right, ``causal=True`` stays right when ``i < j`` (``i`` new queries, ``j``
keys including the cache): query ``r`` sees keys up to ``r + j - i``. Rotary positions are
offset by ``cache.length`` (``Positional.rotate(q, k, start)``) and the lazy biases read
positions from the same alignment, so both agree with the full pass.

* :class:`KVCache` — one attention layer's cache, storing the ``g`` KV heads only (grouped
  or multi-query attention keeps ``h / g`` times less). ``max_len`` preallocates a buffer
  that updates write into; ``max_len=None`` grows by concatenation (works under autograd).
* :class:`StreamingCache` — StreamingLLM's bounded cache: the first ``sink_tokens`` keys
  and a rolling window of the last ``window``, positions counted within the cache.
* :class:`LatentCache` — the per-token latent of multi-head latent attention
  (``qkv.MultiHeadLatentAttention``): ``c_KV`` and the shared rotary key, not K and V.
* :class:`DecoderCache` — one ``KVCache`` per layer of a decoder stack, plus the
  cross-attention K/V of each layer, projected once from the encoder memory and reused.

A ``KVCache`` given to a cross-attention call, ``mha(x, memory, cache=c)``, is that second
kind: filled from the memory on the first call, then read (``from_memory``), never appended
to, as transformers' ``EncoderDecoderCache`` and fairseq's ``static_kv`` keep it.

The test suite checks that token-by-token decoding with the cache gives the logits
of the full pass (float64, 1e-10) for plain, grouped, rotary and ALiBi attention, and that
the streaming cache gives, at every step, attention over exactly the first ``k`` and the
last ``w`` tokens at their positions within the cache.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._args import positive_int


class KVCache:
    """Keys ``(b, g, j, d)`` and values ``(b, g, j, e)`` of one attention layer, appended to in place.

    The layout is the one ``MultiHeadAttention`` hands to the mechanism, so
    ``mha(x, cache=c)`` appends the new keys and attends over all of them. In cross-attention,
    ``mha(x, memory, cache=c)``, the first call fills it from the memory and sets
    :attr:`from_memory`; later calls read it and append nothing.

    Args:
        max_len: preallocate room for this many positions on the first update and raise
            ``ValueError`` beyond it; ``None`` grows without bound (a new tensor per update).
    """

    def __init__(self, max_len: int | None = None):
        if max_len is not None:
            positive_int("max_len", max_len)
        self.max_len = max_len
        self._k: Tensor | None = None  # (b, g, capacity or j, d)
        self._v: Tensor | None = None  # (b, g, capacity or j, e)
        self._length = 0
        #: True once ``MultiHeadAttention`` filled it from a cross-attention memory: later calls
        #: attend to these keys and values instead of projecting the memory again (``reset()``
        #: clears it). A cache of either kind is refused by the other kind of call.
        self.from_memory = False

    @property
    def length(self) -> int:
        """Positions cached so far (the position of the next new token)."""
        return self._length

    @property
    def keys(self) -> Tensor | None:
        """The cached keys ``(b, g, j, d)``, or None before the first update."""
        return None if self._k is None else self._k[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """The cached values ``(b, g, j, e)``, or None before the first update."""
        return None if self._v is None else self._v[:, :, : self._length]

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held (``length`` positions; a preallocated buffer's spare room not counted)."""
        if self._k is None:
            return 0
        return sum(x.numel() * x.element_size() for x in (self.keys, self.values))

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (b, g, n, d)``, ``v (b, g, n, e)``; return all keys and values so far."""
        self._check(k, v)
        return self.append(k, v)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`update` without its checks, for a caller that has made sure of them (a decoding step that
        projected ``k`` and ``v`` itself, ``qkv.cached_step``): shapes, dtype and device like the cache's."""
        n = k.shape[-2]
        if self.max_len is None:
            if self._k is None:
                self._k, self._v = k, v
            elif n:
                self._k, self._v = torch.cat((self._k, k), dim=-2), torch.cat((self._v, v), dim=-2)
        else:
            if self._length + n > self.max_len:
                raise ValueError(
                    f"k: the cache holds at most max_len={self.max_len} positions, "
                    f"got {n} new after {self._length} cached"
                )
            if self._k is None:
                b, g, _, d = k.shape
                with torch.inference_mode(False):  # a normal buffer even from inference mode: later steps write it
                    self._k = k.new_zeros(b, g, self.max_len, d)
                    self._v = v.new_zeros(b, g, self.max_len, v.shape[-1])
            # writes into the buffer: meant for inference (under autograd use max_len=None)
            self._k[:, :, self._length : self._length + n] = k
            self._v[:, :, self._length : self._length + n] = v
        self._length += n
        return self.keys, self.values

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index (b',)`` (beam search: follow the surviving hypotheses)."""
        if self._k is not None:
            with torch.inference_mode(False):  # (as update's buffer: a preallocated one is written in place later)
                self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)

    def reset(self) -> None:
        """Forget everything (the buffer is reallocated on the next update; a memory is read again)."""
        self._k = self._v = None
        self._length = 0
        self.from_memory = False

    def _check(self, k: Tensor, v: Tensor) -> None:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 4:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected a 4-d tensor (b, g, n, ·), got {got}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"v: expected (b, g, n) = {tuple(k.shape[:3])} like k, got shape {tuple(v.shape)}"
            )
        if self._k is not None:
            want_k = (self._k.shape[0], self._k.shape[1], self._k.shape[3])
            want_v = (self._v.shape[0], self._v.shape[1], self._v.shape[3])
            got_k, got_v = (k.shape[0], k.shape[1], k.shape[3]), (v.shape[0], v.shape[1], v.shape[3])
            if got_k != want_k or got_v != want_v:
                raise ValueError(
                    f"k: expected (b, g, ·, d) = {want_k} and v (b, g, ·, e) = {want_v} like the cached ones, "
                    f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
                )
            for name, x, kept in (("k", k, self._k), ("v", v, self._v)):
                # a buffer would cast silently (float64 keys rounded to float32), a list of tensors promote
                if x.dtype != kept.dtype:
                    raise TypeError(f"{name}: dtype {x.dtype} but the cache holds {kept.dtype}; reset() it to change")
                if x.device != kept.device:
                    raise ValueError(f"{name}: on {x.device} but the cache is on {kept.device}; reset() it to move")

    def __repr__(self) -> str:
        return f"KVCache(length={self._length}, max_len={self.max_len})"


class StreamingCache(KVCache):
    """StreamingLLM's cache (Xiao et al. 2024, "Efficient Streaming Language Models with
    Attention Sinks", arXiv 2309.17453, section 3.2): the first ``sink_tokens`` keys and
    values, the "attention sinks", plus a rolling window of the last ``window``.

    ``sink_tokens + window`` positions at most are held, however long the stream, and each
    step attends to exactly those::

        k = 2 sinks, w = 3, decoding token 7:   kept 0 1 . . . 5 6 7   (2, 3, 4 evicted)
        positions within the cache:                 0 1       2 3 4

    **Positions within the cache**, as the paper prescribes: the keys are stored unrotated
    and a ``MultiHeadAttention`` with ``Rotary`` rotates them after each update at their
    rank in the cache (``positions_in_cache``); lazy biases (ALiBi) read the same ranks from
    the bottom-right alignment. The query and its window are at their true distances; only
    the sinks move closer. No position ever exceeds ``sink_tokens + window - 1``, so a model
    trained on that length never sees a position it was not trained on, which is how the
    paper decodes millions of tokens with models trained on 4K. (Positions in the original
    text would carry the distances to the sinks past the training length.) Absolute
    position embeddings are added to the tokens before the cache and cannot be re-ranked:
    use rotary, ALiBi or no positions.

    Several new tokens in one call are accepted while they fit (a prompt up to
    ``sink_tokens + window``); past that, one token per call, because each token must see
    its own window. Not for use under autograd (memory is the point).

    Args:
        sink_tokens: how many of the first tokens are kept forever (the paper uses 4).
        window: how many of the most recent tokens are kept (including the new one).
    """

    #: ``MultiHeadAttention`` rotates keys after ``update``, at their positions in the cache.
    positions_in_cache = True

    def __init__(self, *, sink_tokens: int, window: int):
        super().__init__(None)
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens: expected a non-negative int, got {sink_tokens!r}")
        self.sink_tokens, self.window = sink_tokens, positive_int("window", window)
        self._seen = 0

    @property
    def capacity(self) -> int:
        """The most positions ever held: ``sink_tokens + window``."""
        return self.sink_tokens + self.window

    @property
    def seen(self) -> int:
        """Tokens passed through the cache so far (``length`` stops growing at ``capacity``)."""
        return self._seen

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (b, g, n, d)``, ``v (b, g, n, e)``, evict beyond the window; return what is kept."""
        self._check(k, v)
        n = k.shape[-2]
        if n > 1 and self._length + n > self.capacity:
            raise ValueError(
                f"k: {n} new tokens after {self._length} cached exceed sink_tokens + window = {self.capacity}; "
                "past that, add one token per call (each must see its own window)"
            )
        if self._k is not None:
            k, v = torch.cat((self._k, k), dim=-2), torch.cat((self._v, v), dim=-2)
        if k.shape[-2] > self.capacity:  # one token over: drop the oldest of the window
            s, w = self.sink_tokens, self.window
            k = torch.cat((k[:, :, :s], k[:, :, -w:]), dim=-2)
            v = torch.cat((v[:, :, :s], v[:, :, -w:]), dim=-2)
        self._k, self._v, self._length = k, v, k.shape[-2]
        self._seen += n
        return k, v

    def reset(self) -> None:
        super().reset()
        self._seen = 0

    def __repr__(self) -> str:
        return f"StreamingCache(sink_tokens={self.sink_tokens}, window={self.window}, length={self._length}, seen={self._seen})"


class LatentCache(KVCache):
    """The cache of multi-head latent attention (DeepSeek-V2, ``qkv.MultiHeadLatentAttention``):
    per token the compressed latent ``c_KV`` and the rotary key ``k^R`` shared by the heads,
    ``d_c + d_R`` numbers instead of MHA's ``2·h·d``.

    ``update(c_kv (b, 1, n, d_c), k_rope (b, 1, n, d_R))`` stores them side by side in one
    buffer, ``[c_KV; k^R] (b, 1, j, d_c + d_R)`` (:attr:`combined`), which is exactly the key
    of the absorbed decoding step, so a step reads the cache without copying it; it returns
    views ``(c_KV, k^R)``. (Any ``KVCache`` works with the module too, holding ``c_KV`` as
    its keys and ``k^R`` as its values; it then concatenates them at every step.)
    """

    def __init__(self, max_len: int | None = None):
        super().__init__(max_len)
        self._rank: int | None = None  # d_c, where the rotary key starts in the buffer

    def update(self, c_kv: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        for name, x in (("c_kv", c_kv), ("k_rope", k_rope)):
            if not isinstance(x, Tensor) or x.dim() != 4 or x.shape[1] != 1:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected (b, 1, n, ·), got {got}")
        if self._rank is not None and c_kv.shape[-1] != self._rank:
            raise ValueError(f"c_kv: expected latent size {self._rank} like the cached one, got {tuple(c_kv.shape)}")
        if self._k is not None and (c_kv.shape[0] != self._k.shape[0] or k_rope.shape[-1] != self._k.shape[-1] - self._rank):
            raise ValueError(f"c_kv, k_rope: expected (b, 1, ·, d_c), (b, 1, ·, d_R) = ({self._k.shape[0]}, 1, ·, {self._rank}), "
                             f"({self._k.shape[0]}, 1, ·, {self._k.shape[-1] - self._rank}) like the cached ones, got "
                             f"{tuple(c_kv.shape)} and {tuple(k_rope.shape)}; reset() the cache for another batch")  # fmt: skip
        self._rank = c_kv.shape[-1]
        both = torch.cat((c_kv, k_rope), dim=-1)
        super().update(both, both[..., :0])  # the values slot stays empty: one buffer holds both
        return self.latent, self.rope_keys

    @property
    def combined(self) -> Tensor | None:
        """``[c_KV; k^R] (b, 1, j, d_c + d_R)``, or None before the first update."""
        return self.keys

    @property
    def latent(self) -> Tensor | None:
        """``c_KV (b, 1, j, d_c)`` (a view), or None before the first update."""
        return None if self._k is None else self.keys[..., : self._rank]

    @property
    def rope_keys(self) -> Tensor | None:
        """``k^R (b, 1, j, d_R)`` (a view, already rotated), or None before the first update."""
        return None if self._k is None else self.keys[..., self._rank :]

    def reset(self) -> None:
        super().reset()
        self._rank = None

    def __repr__(self) -> str:
        return f"LatentCache(length={self._length}, max_len={self.max_len})"


class DecoderCache:
    """The caches of a decoder stack: per layer, a self-attention :class:`KVCache` and the
    cross-attention K/V.

    Self-attention caches grow by one position per step. Cross-attention keys and values
    depend only on the encoder memory, so each layer projects them on the first step and
    reads them from ``cross[l]`` afterwards (``KVCache.from_memory``; the memory may then be
    None).

    Args:
        layers: the number of layers of the stack.
        max_len: preallocated length of each self-attention cache (None = growing).
        layer_cache: a zero-argument factory of each layer's self-attention cache instead of
            ``KVCache(max_len)``, e.g. ``lambda: StreamingCache(sink_tokens=4, window=508)``.
    """

    def __init__(self, layers: int, *, max_len: int | None = None, layer_cache: Callable[[], KVCache] | None = None):
        positive_int("layers", layers)
        if layer_cache is not None and max_len is not None:
            raise ValueError("max_len: give it to the caches layer_cache builds, not to both")
        make = (lambda: KVCache(max_len)) if layer_cache is None else layer_cache
        self.self_attn = [make() for _ in range(layers)]
        for cache in self.self_attn:
            if not isinstance(cache, KVCache):
                raise TypeError(f"layer_cache: expected a factory of qkv.cache.KVCache, got {type(cache).__name__}")
        if len({id(cache) for cache in self.self_attn}) < layers:  # one cache for every layer: each appends to it
            raise ValueError("layer_cache: expected a factory that builds a new cache on each call, got one that returned "
                             "the same cache twice (every layer would append its keys to it)")  # fmt: skip
        self.cross = [KVCache() for _ in range(layers)]

    def __len__(self) -> int:
        return len(self.self_attn)

    @property
    def length(self) -> int:
        """Decoder positions cached so far (the position of the next token)."""
        return self.self_attn[0].length

    @property
    def has_memory(self) -> bool:
        """True once the cross-attention K/V have been computed from the memory."""
        return self.cross[0].from_memory

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in every cache (beam search)."""
        for c in (*self.self_attn, *self.cross):
            c.reorder(index)

    def reset(self) -> None:
        for c in (*self.self_attn, *self.cross):
            c.reset()

    def __repr__(self) -> str:
        return f"DecoderCache(layers={len(self)}, length={self.length}, has_memory={self.has_memory})"
