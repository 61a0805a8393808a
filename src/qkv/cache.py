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
* :class:`DecoderCache` — one ``KVCache`` per layer of a decoder stack, plus the
  cross-attention K/V of each layer, projected once from the encoder memory and reused.

``tests/test_cache.py`` checks that token-by-token decoding with the cache gives the logits
of the full pass (float64, 1e-10) for plain, grouped, rotary and ALiBi attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._args import positive_int


class KVCache:
    """Keys ``(b, g, j, d)`` and values ``(b, g, j, e)`` of one attention layer, appended to in place.

    The layout is the one ``MultiHeadAttention`` hands to the mechanism, so
    ``mha(x, cache=c)`` appends the new keys and attends over all of them.

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

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (b, g, n, d)``, ``v (b, g, n, e)``; return all keys and values so far."""
        self._check(k, v)
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
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)

    def reset(self) -> None:
        """Forget everything (the buffer is reallocated on the next update)."""
        self._k = self._v = None
        self._length = 0

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

    def __repr__(self) -> str:
        return f"KVCache(length={self._length}, max_len={self.max_len})"


class DecoderCache:
    """The caches of a decoder stack: per layer, a self-attention :class:`KVCache` and the
    cross-attention K/V.

    Self-attention caches grow by one position per step. Cross-attention keys and values
    depend only on the encoder memory, so each layer projects them on the first step and
    reads them from ``cross[l]`` afterwards (the layer then passes a zero-length memory to
    its attention, which appends nothing and attends over the stored K/V).

    Args:
        layers: the number of layers of the stack.
        max_len: preallocated length of each self-attention cache (None = growing).
    """

    def __init__(self, layers: int, *, max_len: int | None = None):
        positive_int("layers", layers)
        self.self_attn = [KVCache(max_len) for _ in range(layers)]
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
        return self.cross[0].length > 0

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in every cache (beam search)."""
        for c in (*self.self_attn, *self.cross):
            c.reorder(index)

    def reset(self) -> None:
        for c in (*self.self_attn, *self.cross):
            c.reset()

    def __repr__(self) -> str:
        return f"DecoderCache(layers={len(self)}, length={self.length}, has_memory={self.has_memory})"
