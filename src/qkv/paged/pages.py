"""Reading pages of a paged KV cache where they lie: a range as views, a list as one copy of those pages.

Shape legend: ``n`` pages read, ``P`` page size, ``g`` KV heads, ``d`` key size, ``e`` value size.

FlashInfer's two NHD layouts: one tensor ``kv_cache (num_pages, 2, P, g, d)`` (keys at
``[:, 0]``, values at ``[:, 1]``), or a tuple ``(k_cache, v_cache)``, ``(num_pages, P, g, d)``
and ``(num_pages, P, g, e)`` (values of another size, as FlashInfer's ``head_dim_vo``); with ``kv_layout="HND"`` (FlashInfer's other layout, named because shapes alone cannot tell
it: ``P == g`` reads either way) each page is ``(g, P, d)``, read as a transposed view. In the tuple form a run of consecutive pages is one contiguous block of keys, which the
decoding pass reads as one matrix (``qkv.paged.decode``); ``qkv.PagedKVCache`` keeps its pages
that way. The attention reads a tile of pages at a time, never a request's whole cache as one
contiguous copy. :class:`qkv.paged.Int8Pages` reads the same way, dequantising only the pages
asked for.

Float8 pages (FlashInfer's ``float8_e4m3fn`` / ``float8_e5m2`` KV cache) are read under a wider
``q``: each tile is converted to ``q``'s dtype as it is read (every float8 number is exact in
float16, bfloat16 and float32), never the whole cache at once.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from .float8 import widen

_SHAPE = ("(num_pages, 2, page_size, kv_heads, head_dim) or a tuple (k_cache, v_cache) of (num_pages, page_size, "
          "kv_heads, head_dim) and (num_pages, page_size, kv_heads, value_dim)")


def key_view(pool: Tensor, first: int, items: int, keys: int, item_pages: int) -> Tensor:
    """``(items, g, keys, d)``: ``items`` runs of ``item_pages`` consecutive pages of a contiguous pool ``(num_pages, P,
    g, d)`` from page ``first``, the first ``keys`` keys of each, one strided view (keys step by ``g · d``)."""
    _, P, g, d = pool.shape
    return pool.as_strided((items, g, keys, d), (item_pages * P * g * d, d, g * d, 1),
                           pool.storage_offset() + first * P * g * d)  # fmt: skip


class FloatPages:
    """A float cache in either of FlashInfer's layouts; float8 pages read as ``read_as`` (the queries' dtype)."""

    def __init__(self, kv_cache, kv_layout: str = "NHD", read_as: torch.dtype | None = None):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout: expected 'NHD' or 'HND' (FlashInfer's layouts), got {kv_layout!r}")
        if isinstance(kv_cache, (tuple, list)):
            if len(kv_cache) != 2 or not all(isinstance(x, Tensor) for x in kv_cache):
                raise TypeError(f"kv_cache: expected {_SHAPE}, got a {type(kv_cache).__name__} of {len(kv_cache)}")
            k, v = kv_cache
            if k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"kv_cache: expected k_cache (num_pages, page_size, kv_heads, head_dim) and v_cache "
                                 f"(num_pages, page_size, kv_heads, value_dim) of the same first three sizes, got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
        elif isinstance(kv_cache, Tensor):
            if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
                raise ValueError(f"kv_cache: expected {_SHAPE} (FlashInfer's NHD layouts), got {tuple(kv_cache.shape)}")
            k, v = kv_cache[:, 0], kv_cache[:, 1]
        else:
            raise TypeError(f"kv_cache: expected {_SHAPE}, got {type(kv_cache).__name__}")
        if kv_layout == "HND":  # (num_pages, g, P, d): the same pages seen as (num_pages, P, g, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if not k.dtype.is_floating_point:
            raise TypeError(f"kv_cache: expected a floating-point cache (qkv.paged.Int8Pages for int8), got {k.dtype}")
        if v.dtype != k.dtype or v.device != k.device:
            raise TypeError(f"kv_cache: keys and values in one dtype and device, got {k.dtype} on {k.device} and "
                            f"{v.dtype} on {v.device}")  # fmt: skip
        self.keys, self.values = k, v
        self.num_pages, self.page_size, self.kv_heads, self.head_dim = k.shape
        self.value_dim = v.shape[3]
        #: the dtype reads give (the engine computes in it): the pages' own, or q's for float8 pages
        self.dtype, self.device = k.dtype, k.device
        #: whether :meth:`blocks` gives views (each pool's pages one after the other) rather than copies
        self.views = k.is_contiguous() and v.is_contiguous()
        if k.dtype.itemsize == 1 and read_as is not None:  # FlashInfer's float8 cache, read under a wider q
            self._read_as(read_as)

    def reading(self, dtype: torch.dtype) -> FloatPages:
        """These float8 pages (the same tensors) read as ``dtype``, a call's q's: each call gets its own reader."""
        pages = copy.copy(self)
        pages._read_as(dtype)
        return pages

    def _read_as(self, dtype) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize == 1:
            raise TypeError(f"kv_cache: {self.keys.dtype} pages are read under a float16, bfloat16, float32 or float64 "
                            f"q (FlashInfer's float8 KV cache), got q of {dtype}")  # fmt: skip
        self.dtype, self.views = dtype, False  # reads are converted copies

    @property
    def converts(self) -> bool:
        """Whether reads convert the stored pages (float8) to :attr:`dtype`."""
        return self.keys.dtype != self.dtype

    def range(self, p0: int, p1: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1``: ``(K (n, P, g, d), V (n, P, g, e))``, views of the cache (float8: converted)."""
        return self._read(self.keys[p0:p1]), self._read(self.values[p0:p1])

    def blocks(self, p0: int, p1: int, S: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1`` as ``(p1 - p0) / S`` items of ``S`` pages: ``(K, V (items, g, S·P, d))``.

        Views in the tuple form (each pool's pages one after the other: one ``as_strided`` a pool, where slicing,
        reshaping and transposing took three operations, a decoding step's tiles 20-40 µs each from cold caches);
        a copy of these pages in the single-tensor form, whose keys and values alternate page by page, or of
        float8 pages."""
        if self.views:
            items, keys = (p1 - p0) // S, S * self.page_size
            return key_view(self.keys, p0, items, keys, S), key_view(self.values, p0, items, keys, S)

        def items(pool: Tensor) -> Tensor:
            x = self._read(pool[p0:p1])
            return x.reshape(-1, S * x.shape[1], *x.shape[2:]).transpose(1, 2)

        return items(self.keys), items(self.values)

    def take(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pages ``ids (n,)`` in that order (repeats allowed): ``(K, V)``, one copy of those pages."""
        return self._read(self.keys.index_select(0, ids)), self._read(self.values.index_select(0, ids))

    def _read(self, x: Tensor) -> Tensor:
        return widen(x, self.dtype) if self.converts else x

    def write(self, page: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """Token ``n`` of ``k (n, g, d)``, ``v (n, g, e)`` into page ``page[n]`` at ``offset[n]``.

        Into float8 pages a value beyond the format's range is saturated to its largest, as PyTorch's
        ``float8_e4m3fn`` conversion does (``float8_e5m2``'s would make it inf, and every output it
        reaches nan); a nan stays nan."""
        check_write(self, page.tolist(), offset.tolist(), k, v)
        self.keys[page, offset] = _stored(k, self.keys.dtype)
        self.values[page, offset] = _stored(v, self.values.dtype)

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` becomes a copy of page ``src`` (copy-on-write of a shared page)."""
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]

    def keep_first(self, page: int, tokens: int) -> None:
        """Nothing to do: slots past a holder's ``tokens`` are rewritten before they are read (see ``Int8Pages``)."""

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def _stored(x: Tensor, dtype: torch.dtype) -> Tensor:
    # float8 pages: a wider token saturates rather than overflows; a float8 one (FlashInfer's append takes the
    # cache's dtype) converts as it is, PyTorch having no float8 clamp (float8_e4m3fn's conversion saturates)
    if dtype.itemsize == 1 and x.dtype.itemsize > 1:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def check_write(pages, page: list[int], offset: list[int], k: Tensor, v: Tensor) -> None:
    """Clear errors for a write of ``k (n, g, d)``, ``v (n, g, e)`` at pages ``page`` and offsets ``offset`` (host ints)."""
    n = len(page)
    if len(offset) != n:
        raise ValueError(f"offset: expected one per token of page ({n}), got {len(offset)}")
    for name, x, size in (("k", k, pages.head_dim), ("v", v, pages.value_dim)):
        if not isinstance(x, Tensor) or tuple(x.shape) != (n, pages.kv_heads, size):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected ({n}, {pages.kv_heads}, {size}) (tokens, kv_heads, size), got {got}")
    if n and not (0 <= min(page) and max(page) < pages.num_pages):
        raise IndexError(f"page: ids must lie in 0 .. {pages.num_pages - 1}, got {min(page)} .. {max(page)}")
    if n and not (0 <= min(offset) and max(offset) < pages.page_size):
        raise IndexError(f"offset: must lie in 0 .. {pages.page_size - 1} (the page size), got {min(offset)} .. {max(offset)}")


def as_pages(kv_cache, kv_layout: str = "NHD", read_as: torch.dtype | None = None):
    """A store the paged engine reads (``take``, ``blocks``: ``Int8Pages``, ``LatentPages``, ``FloatPages``) as it is;
    a FlashInfer tensor or tuple, in ``kv_layout``, as :class:`FloatPages` (float8 pages read as ``read_as``)."""
    if hasattr(kv_cache, "take") and hasattr(kv_cache, "blocks"):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout: {kv_layout!r} names a tensor's layout; a {type(kv_cache).__name__} has its own")
        if isinstance(kv_cache, FloatPages) and kv_cache.keys.dtype.itemsize == 1 and read_as is not None:
            return kv_cache.reading(read_as)  # a PagedKVCache's float8 pool, read as this call's q
        return kv_cache
    return FloatPages(kv_cache, kv_layout, read_as)


def empty(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, device,
          value_dim: int | None = None) -> FloatPages:  # fmt: skip
    """Zeroed pages in the tuple form: keys and values in pools of their own (values of ``value_dim``, default ``head_dim``)."""
    shape = (num_pages, page_size, kv_heads)
    return FloatPages((torch.zeros(*shape, head_dim, dtype=dtype, device=device),
                       torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)))  # fmt: skip
