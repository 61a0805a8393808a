"""Multi-head latent attention (MLA) over pages: FlashInfer's MLA page layout, read by the paged engine.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``c`` latent size
(``head_dim_ckv``), ``r`` rotary size (``head_dim_kpe``), ``N`` pages in the pool, ``n`` pages
read, ``P`` page size, ``R`` requests.

DeepSeek-V2's absorbed decoding (``qkv.MultiHeadLatentAttention``) is multi-query attention
over the cached latent: every head's query ``[W^UKᵀ q^C; q^R]`` against the one shared key
``[c^KV; k^R]``, the value being ``c^KV`` itself::

    out[t, n] = Σ_j softmax_j(sm_scale · (q_nope[t, n] · ckv_j + q_pe[t, n] · kpe_j)) ckv_j     (T, h, c)

FlashInfer keeps the two parts in pools of their own, ``ckv_cache (N, P, c)`` and
``kpe_cache (N, P, r)``, and names a request's keys by ``kv_len`` rather than by its last
page's fill (``BatchMLAPagedAttentionWrapper``). :class:`LatentPages` reads those pools as
one KV head whose key and value are both ``[ckv; kpe]`` (``c + r``), so every path of
``qkv.paged_attention`` (decoding steps in one fused call, prefill chunks, shared prefixes)
runs unchanged; the value's last ``r`` columns are dropped from the output. PyTorch's fused
CPU kernel wants one head size for keys and values, which this meets. Where the two pools
are the two halves of one buffer ``(N, P, c + r)`` (``ckv = buf[..., :c]``, ``kpe =
buf[..., c:]``: how ``qkv.cache.LatentCache`` stores a request), pages are read where they
lie; otherwise a tile of pages is joined into one copy as it is read.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ..backends.tiling.tile_math import Scratch
from .attention import paged_attention
from .table import by_lengths

_SHAPES = "ckv_cache (num_pages, page_size, head_dim_ckv) and kpe_cache (num_pages, page_size, head_dim_kpe)"


class LatentPages:
    """FlashInfer's MLA caches as the paged engine reads them: one KV head, key = value = ``[ckv; kpe]``."""

    def __init__(self, ckv_cache: Tensor, kpe_cache: Tensor):
        for name, x in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if not isinstance(x, Tensor) or x.dim() != 3:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected {_SHAPES}, got {got}")
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating-point cache, got {x.dtype}")
        if ckv_cache.shape[:2] != kpe_cache.shape[:2] or ckv_cache.dtype != kpe_cache.dtype or (
                ckv_cache.device != kpe_cache.device):  # fmt: skip
            raise ValueError(
                f"kpe_cache: expected the pages, page size, dtype and device of ckv_cache {tuple(ckv_cache.shape[:2])} "
                f"{ckv_cache.dtype} {ckv_cache.device}, got {tuple(kpe_cache.shape[:2])} {kpe_cache.dtype} {kpe_cache.device}"
            )
        self.ckv, self.kpe = ckv_cache, kpe_cache
        self.num_pages, self.page_size, self.latent_dim = ckv_cache.shape
        self.rope_dim = kpe_cache.shape[-1]
        self.kv_heads = 1
        self.head_dim = self.value_dim = self.latent_dim + self.rope_dim  # the engine's value: [ckv; kpe]
        self.dtype, self.device = ckv_cache.dtype, ckv_cache.device
        self.pool = _one_buffer(ckv_cache, kpe_cache)  # (N, P, c + r) where the two are halves of one buffer
        #: whether reads are views of the pool (see the module docstring) rather than joined copies
        self.views = self.pool is not None
        self._scratch = Scratch(self.device)

    def _joined(self, pages: slice | Tensor, reuse: bool = False) -> Tensor:
        """Pages ``(n, P, c + r)``: a view of the pool where there is one, else the two parts joined.

        ``reuse``: the join lands in one buffer kept between reads (valid until the next such
        read), so a step's tiles do not each fault in fresh memory: with pools of their own, a
        32-request step ran 2.4x a loop of SDPA joining into new tensors, 1.5x with the buffer (one
        buffer: 0.9x; tiles of 2048 to 8192 keys alike).
        """
        if self.pool is not None:
            return self.pool[pages] if isinstance(pages, slice) else self.pool.index_select(0, pages)
        if isinstance(pages, slice):
            ckv, kpe = self.ckv[pages], self.kpe[pages]
        else:
            ckv, kpe = self.ckv.index_select(0, pages), self.kpe.index_select(0, pages)
        if not reuse:
            return torch.cat((ckv, kpe), -1)
        out = self._scratch.take("joined", (ckv.shape[0], self.page_size, self.head_dim), self.dtype)
        return torch.cat((ckv, kpe), -1, out=out)

    def range(self, p0: int, p1: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1``: ``(K, V (n, P, 1, c + r))``, the same tensor."""
        kv = self._joined(slice(p0, p1)).unsqueeze(2)
        return kv, kv

    def take(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pages ``ids (n,)`` in that order (repeats allowed): ``(K, V (n, P, 1, c + r))``, the same tensor."""
        kv = self._joined(ids.to(device=self.device, dtype=torch.long)).unsqueeze(2)
        return kv, kv

    def blocks(self, p0: int, p1: int, S: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1`` as ``(p1 - p0) / S`` items of ``S`` pages: ``(K, V (items, 1, S·P, c + r))``
        (with pools of their own, valid until the next read)."""
        x = self._joined(slice(p0, p1), reuse=True)
        kv = x.reshape(-1, S * self.page_size, 1, self.head_dim).transpose(1, 2)
        return kv, kv

    def runs(self, ranges: list[tuple[int, int]]):
        """``read(n, count) -> (K, V (1, count, c + r))``: the first ``count`` keys of run ``n`` (``(first page, pages)``)."""

        def read(n: int, count: int) -> tuple[Tensor, Tensor]:
            p0, c = ranges[n]
            kv = self._joined(slice(p0, p0 + c), reuse=True).reshape(1, c * self.page_size, self.head_dim)[:, :count]
            return kv, kv

        return read


    def write(self, page: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """Token ``n``'s latent ``k (n, 1, c + r)`` (``[c^KV; k^R]``) into page ``page[n]`` at ``offset[n]``.

        The value is the key itself (the engine reads ``[ckv; kpe]`` as both), so ``v`` is not
        stored; it must be the same latent."""
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (1, self.head_dim):
            raise ValueError(f"k, v: expected the latents (n, 1, {self.head_dim}) as both, got {tuple(k.shape)} and {tuple(v.shape)}")
        k = k[:, 0].to(self.dtype)
        self.ckv[page, offset] = k[:, : self.latent_dim]
        self.kpe[page, offset] = k[:, self.latent_dim :]

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` becomes a copy of page ``src`` (copy-on-write of a shared page)."""
        self.ckv[dst] = self.ckv[src]
        self.kpe[dst] = self.kpe[src]

    def keep_first(self, page: int, tokens: int) -> None:
        """Nothing to do: slots past a holder's ``tokens`` are rewritten before they are read (see ``Int8Pages``)."""

    @property
    def nbytes(self) -> int:
        return (self.ckv.numel() + self.kpe.numel()) * self.ckv.element_size()


def empty(num_pages: int, page_size: int, latent_dim: int, rope_dim: int, dtype, device) -> LatentPages:
    """Zeroed MLA pages, ``ckv`` and ``kpe`` the two halves of one buffer (read where they lie)."""
    buf = torch.zeros(num_pages, page_size, latent_dim + rope_dim, dtype=dtype, device=device)
    return LatentPages(buf[..., :latent_dim], buf[..., latent_dim:])


def _one_buffer(ckv: Tensor, kpe: Tensor) -> Tensor | None:
    """``(N, P, c + r)`` when ``ckv`` and ``kpe`` are the two halves of one contiguous buffer, else None."""
    N, P, c = ckv.shape
    width = c + kpe.shape[-1]
    strides = (P * width, width, 1)
    if ckv.stride() != strides or kpe.stride() != strides or ckv.untyped_storage().data_ptr() != (
            kpe.untyped_storage().data_ptr()):  # fmt: skip
        return None
    if kpe.data_ptr() != ckv.data_ptr() + c * ckv.element_size():
        return None
    return ckv.as_strided((N, P, width), strides)


def paged_latent_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_len: Tensor,
    *,
    sm_scale: float,
    causal: bool = True,
    return_lse: bool = False,
):
    """``out (T, h, c)``, or ``(out, lse (T, h))``: MLA's absorbed attention of each request over its pages.

    FlashInfer's ``BatchMLAPagedAttentionWrapper`` (plan and run in one call): ``q_nope (T, h, c)``
    (the queries with ``W^UK`` absorbed), ``q_pe (T, h, r)`` (their rotary part);
    ``ckv_cache (N, P, c)`` and ``kpe_cache (N, P, r)``; request ``r``'s queries are rows
    ``qo_indptr[r] : qo_indptr[r + 1]``, the last of its ``kv_len[r]`` positions (bottom-right
    causal; with ``causal`` a query before the first key sees none: ``out = 0``), its keys the
    first ``kv_len[r]`` slots of pages ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]`` (pages past
    them are not read, as in FlashInfer). ``causal`` defaults to True; FlashInfer's plan has no
    default. ``head_dim_kpe = 0`` (NoPE MLA, FlashInfer's too): ``q_pe (T, h, 0)``, ``kpe_cache (N, P, 0)``. ``sm_scale`` has no default, as in FlashInfer: MLA's scale is
    ``1/√(d + r)`` of the head size before absorption (DeepSeek-V2: ``1/√192``), not of
    ``c + r``. ``lse`` is the natural log-sum-exp (FlashInfer's is base 2). Apply ``W^UV`` per head
    to ``out`` for the layer's values (``qkv.MultiHeadLatentAttention``).
    """
    pages = LatentPages(ckv_cache, kpe_cache)
    if pages.dtype.is_floating_point and pages.dtype.itemsize == 1:
        raise TypeError(f"ckv_cache, kpe_cache: {pages.dtype} latents (FlashInfer's float8 MLA cache) are not supported; "
                        "keep them in float16, bfloat16, float32 or float64 (float8 caches of keys and values: "
                        "qkv.paged_attention)")  # fmt: skip
    c, r = pages.latent_dim, pages.rope_dim
    if not isinstance(q_nope, Tensor) or not isinstance(q_pe, Tensor) or q_nope.dim() != 3 or q_pe.dim() != 3:
        got = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in (q_nope, q_pe)]
        raise ValueError(f"q_nope, q_pe: expected (total_q, num_heads, {c}) and (total_q, num_heads, {r}), got {got}")
    if q_nope.shape[:2] != q_pe.shape[:2] or q_nope.shape[-1] != c or q_pe.shape[-1] != r:
        raise ValueError(
            f"q_nope, q_pe: expected (total_q, num_heads, {c}) and (total_q, num_heads, {r}) (the caches' sizes), "
            f"got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    if q_nope.dtype != q_pe.dtype:
        raise TypeError(f"q_pe: expected q_nope's dtype {q_nope.dtype}, got {q_pe.dtype}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):  # (numpy's floats too)
        raise TypeError(f"sm_scale: expected a float (MLA's 1/√(head size before absorption)), got {sm_scale!r}")
    kv_indptr, kv_indices, last = by_lengths(kv_indptr, kv_indices, kv_len, pages.page_size)
    result = paged_attention(torch.cat((q_nope, q_pe), -1), pages, qo_indptr, kv_indptr, kv_indices, last,
                             causal=causal, sm_scale=float(sm_scale), return_lse=return_lse)  # fmt: skip
    out, lse = result if return_lse else (result, None)
    out = out[..., :c].contiguous()  # the value's rotary columns: not part of the output
    return (out, lse) if return_lse else out
