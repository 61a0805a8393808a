"""Reading pages of a paged KV cache where they lie: a range as views, a list as one copy of those pages.

Shape legend: ``n`` pages read, ``P`` page size, ``g`` KV heads, ``d`` key size, ``e`` value size.

``kv_cache (num_pages, 2, P, g, d)`` is FlashInfer's NHD layout: keys at ``[:, 0]``, values at
``[:, 1]``. The attention reads it a tile of pages at a time, never a request's whole cache
as one contiguous copy. :class:`qkv.paged.quant.Int8Pages` reads the same way, dequantising
only the pages asked for.
"""

from __future__ import annotations

from torch import Tensor


class FloatPages:
    """A float ``kv_cache (num_pages, 2, P, g, d)``."""

    def __init__(self, kv_cache: Tensor):
        if not isinstance(kv_cache, Tensor):
            raise TypeError(f"kv_cache: expected a tensor (num_pages, 2, page_size, kv_heads, head_dim), got {type(kv_cache).__name__}")
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache: expected shape (num_pages, 2, page_size, kv_heads, head_dim), keys at [:, 0] and values "
                f"at [:, 1] (FlashInfer's NHD layout), got {tuple(kv_cache.shape)}"
            )
        if not kv_cache.dtype.is_floating_point:
            raise TypeError(f"kv_cache: expected a floating-point cache (qkv.paged.Int8Pages for int8), got {kv_cache.dtype}")
        self.cache = kv_cache
        self.num_pages, _, self.page_size, self.kv_heads, self.head_dim = kv_cache.shape
        self.value_dim = self.head_dim
        self.dtype, self.device = kv_cache.dtype, kv_cache.device

    def range(self, p0: int, p1: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1``: ``(K (n, P, g, d), V (n, P, g, e))``, views of the cache."""
        return self.cache[p0:p1, 0], self.cache[p0:p1, 1]

    def take(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pages ``ids (n,)`` in that order (repeats allowed): ``(K, V)``, one copy of those pages."""
        both = self.cache.index_select(0, ids)
        return both[:, 0], both[:, 1]

    def write(self, page: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """Token ``n`` of ``k (n, g, d)``, ``v (n, g, e)`` into page ``page[n]`` at ``offset[n]``."""
        self.cache[page, 0, offset] = k.to(self.dtype)
        self.cache[page, 1, offset] = v.to(self.dtype)

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` becomes a copy of page ``src`` (copy-on-write of a shared page)."""
        self.cache[dst] = self.cache[src]

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()
