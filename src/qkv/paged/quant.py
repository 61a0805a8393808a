"""``Int8Pages``: a paged KV cache held in int8 (KIVI's scales), dequantised a tile of pages at a time.

Shape legend: ``N`` pages in the pool, ``n`` pages read or written, ``P`` page size, ``g`` KV
heads, ``d`` head size (keys and values alike, FlashInfer's layout).

KIVI (Liu et al. 2024) quantises keys **per channel** and values **per token**: a key channel
carries outliers that persist across tokens, while a value's error is mixed by the attention
weights token by token. Per page, symmetric absmax int8 with scales stored as float32::

    sK[c, j, i] = max_p |K[c, p, j, i]| / 127        (N, g, d)     one per page, head, channel
    sV[c, p, j] = max_i |V[c, p, j, i]| / 127        (N, P, g)     one per page, token, head
    K8 = round(K / sK) ∈ [-127, 127],   K ≈ K8 · sK   (|error| ≤ sK / 2), and the same for V

A key channel's scale spans the page's ``P`` tokens, so a page is quantised once, when its
``P`` offsets are written; until then it lives in full precision in a small residual (KIVI's
recent tokens): one ``(2, P, g, d)`` tensor per partially filled page, read back as written.
``range`` and ``take`` dequantise only the pages asked for, never the whole cache.

Bytes per token of a full page: ``2·g·d`` (int8 K and V) ``+ 4·g·d / P`` (key scales) ``+ 4·g``
(value scales), i.e. ``(1 + 2/P + 2/d) / 4`` of float32's ``2·g·d·4``: at most 0.3 where
``1/P + 1/d ≤ 0.1`` (P = 16, d = 64: 0.289; P = 32, d = 32: 0.281). The scales are float32,
not float16, for speed: the decoding step multiplies by them in place, and PyTorch widens a
float16 operand element by element inside that product (about 6% of an int8 step on the
benchmark CPU, for 0.02 of float32's bytes per token).

The store is head-major, ``(g, N, P, d)``: a run of consecutive pages is then one contiguous
block per head, which the decoding step widens in one pass (reading the run through
FlashInfer's page-major layout, ``P · g · d`` with ``d``-long pieces, made that step about 13%
slower). :attr:`Int8Pages.keys` and the other public names are page-major views of it.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
from torch import Tensor

from .._args import positive_int
from ..backends.tiling.tile_math import Scratch
from .pages import check_write

#: A scale lies in [tiny, max] of float32: an all-zero channel or token gets ``tiny`` (never 0, never
#: a division by zero), and an infinite value is clipped to 127 rather than scaled to nan.
_TINY, _HUGE = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


#: Pages between two runs that a group of runs dequantises for nothing, at most (:meth:`Int8Pages.runs`): a block of
#: ``qkv.PagedKVCache``'s, the most that separates one reserved request from the next.
RUN_GAP_PAGES = 16


def _groups(ranges: list[tuple[int, int]], most: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs ``(first page, pages)`` in read order cut into groups of ascending runs, each group's page span
    ``(a, b)`` at most ``most`` pages (or one run) with gaps of at most :data:`RUN_GAP_PAGES`; and each run's group."""
    spans: list[tuple[int, int]] = []
    group_of: list[int] = []
    for p0, c in ranges:
        if spans:
            a, b = spans[-1]
            if b <= p0 <= b + RUN_GAP_PAGES and p0 + c - a <= most:
                spans[-1] = (a, p0 + c)
                group_of.append(len(spans) - 1)
                continue
        spans.append((p0, p0 + c))
        group_of.append(len(spans) - 1)
    return spans, group_of


class Int8Pages:
    """``num_pages`` pages of int8 keys and values with float32 scales; reads give ``dtype``."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device="cpu"):  # fmt: skip
        self.num_pages = positive_int("num_pages", num_pages)
        self.page_size = P = positive_int("page_size", page_size)
        self.kv_heads = g = positive_int("kv_heads", kv_heads)
        self.head_dim = self.value_dim = d = positive_int("head_dim", head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize == 1:
            raise TypeError(f"dtype: expected the floating-point dtype the pages dequantise to (16 bits or more), got {dtype}")
        self.dtype, self.device = dtype, torch.device(device)
        # head-major, each head's pages one contiguous block (module docstring)
        self._keys = torch.zeros(g, num_pages, P, d, dtype=torch.int8, device=self.device)
        self._values = torch.zeros(g, num_pages, P, d, dtype=torch.int8, device=self.device)
        self._key_scale = torch.ones(g, num_pages, d, dtype=torch.float32, device=self.device)  # over the page's tokens
        self._value_scale = torch.ones(g, num_pages, P, dtype=torch.float32, device=self.device)  # over the channels
        self.device = self._keys.device  # as the tensors report it ("cuda:0", not "cuda"): compared with q's
        self.residual: dict[int, Tensor] = {}  # page -> (2, P, g, d) in dtype, while partially filled
        self.filled = [0] * num_pages  # how many of the page's offsets were written since it was (re)started
        self._written = [0] * num_pages  # those offsets, as bits: steps may arrive out of order
        self._scratch = Scratch(self.device)  # runs' dequantised K and V, kept between steps
        self.views = False  # reads are dequantised copies

    #: Keys a decoding step dequantises at a time (16 MiB of float32 keys and values at g = 2, d = 64):
    #: measured on the Intel Xeon, a 32-request step took 8.3-9.0 ms in ranges of 16384 keys against
    #: 9.7-10.8 in ranges of 4096 (each range pays its own kernel call) and 9.1-9.8 all at once.
    tile_keys = 16384
    #: Keys of consecutive runs a decoding step's runs path dequantises in one go (8 MiB of float32 keys and values at
    #: g = 2, d = 64), where the runs lie at most :data:`RUN_GAP_PAGES` apart: measured on the AMD EPYC Zen 5 from cold
    #: caches, a 32-request step over ``PagedKVCache``'s reserved runs took 1.30x the float32 step in groups of 8192
    #: keys against 1.52x a run at a time (four operations a run), 1.42x in groups of 4096 and 1.45x in one group.
    run_group_keys = 8192

    # ------------------------------------------------------------------ layout

    @property
    def keys(self) -> Tensor:
        """int8 keys ``(N, P, g, d)``: a view of the head-major store (writes through it land in the cache)."""
        return self._keys.permute(1, 2, 0, 3)

    @property
    def values(self) -> Tensor:
        """int8 values ``(N, P, g, d)``, a view like :attr:`keys`."""
        return self._values.permute(1, 2, 0, 3)

    @property
    def key_scale(self) -> Tensor:
        """Key scales ``(N, g, d)``, one per page, head and channel (a view)."""
        return self._key_scale.permute(1, 0, 2)

    @property
    def value_scale(self) -> Tensor:
        """Value scales ``(N, P, g)``, one per page, token and head (a view)."""
        return self._value_scale.permute(1, 2, 0)

    # ------------------------------------------------------------------ reads

    def range(self, p0: int, p1: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1``: ``(K (n, P, g, d), V (n, P, g, d))``, dequantised."""
        K, V = self._dequantise(slice(p0, p1))
        for p, both in self.residual.items():
            if p0 <= p < p1:
                K[p - p0], V[p - p0] = both[0], both[1]
        return K, V

    def take(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pages ``ids (n,)`` in that order (repeats allowed): ``(K, V)``, dequantised."""
        ids = ids.to(device=self.device, dtype=torch.long)
        K, V = self._dequantise(ids)
        if self.residual:
            at = [(n, p) for n, p in enumerate(ids.tolist()) if p in self.residual]
            if at:
                where = torch.tensor([n for n, _ in at], device=self.device)
                both = torch.stack([self.residual[p] for _, p in at])  # (m, 2, P, g, d)
                K.index_copy_(0, where, both[:, 0])
                V.index_copy_(0, where, both[:, 1])
        return K, V

    def _dequantise(self, pages) -> tuple[Tensor, Tensor]:
        work = torch.promote_types(self.dtype, torch.float32)  # the product in float32 at least, then dtype
        page_major = torch.contiguous_format  # (n, P, g, d), as FlashInfer lays pages out
        K = self.keys[pages].to(self.dtype, memory_format=page_major).mul_(self.key_scale[pages].to(work)[:, None])
        V = self.values[pages].to(self.dtype, memory_format=page_major).mul_(self.value_scale[pages].to(work)[..., None])
        return K, V

    def runs(self, ranges: list[tuple[int, int]]):
        """``read(n, count) -> (K (g, count, d), V (g, count, d))``: the first ``count`` keys of range ``n``, dequantised.

        ``ranges``: ``(first page, pages)`` each, read in their order. The attention's view of a run of pages, head by
        head, as the fused kernel reads it; a result is valid until the next read (:meth:`_widen`). Ranges that follow
        each other in the pool, at most :data:`RUN_GAP_PAGES` pages apart, are dequantised together, up to
        :attr:`run_group_keys` keys (a gap's pages too: zeros, or pages no run reads), so a step of many short runs
        pays a few operations per group instead of per run.
        """
        g, P, d = self.kv_heads, self.page_size, self.head_dim
        partial = sorted(self.residual)  # once for the step's many runs
        spans, group_of = _groups(ranges, max(1, self.run_group_keys // P))
        held = [-1, None, None]  # the group whose pages the buffers hold, and its K, V (g, pages, P, d)

        def read(n: int, count: int) -> tuple[Tensor, Tensor]:
            k = group_of[n]
            a, b = spans[k]
            if held[0] != k:
                held[:] = [k, *self._widen(a, b - a, partial)]
            p0, c = ranges[n]
            K, V = (x.narrow(1, p0 - a, c).reshape(g, c * P, d).narrow(1, 0, count) for x in held[1:])
            return K, V

        return read

    def blocks(self, p0: int, p1: int, S: int) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p1 - 1`` as ``(p1 - p0) / S`` items of ``S`` pages: ``(K, V (items, g, S·P, d))``, dequantised.

        Views of the buffers of :meth:`_widen`, valid until the next read."""
        g, P, d = self.kv_heads, self.page_size, self.head_dim
        K, V = self._widen(p0, p1 - p0, sorted(self.residual))
        return K.view(g, -1, S * P, d).transpose(0, 1), V.view(g, -1, S * P, d).transpose(0, 1)

    def _widen(self, p0: int, c: int, partial: list[int]) -> tuple[Tensor, Tensor]:
        """Pages ``p0 .. p0 + c - 1`` dequantised, head-major: ``(K, V (g, c, P, d))``, in two reused buffers;
        the partially filled pages among them (``partial``: the residual's pages, sorted) as written.

        Every read lands in the same two buffers (``tile_math.Scratch``, grown to the largest
        read), so the floats stay in cache between the write and the kernel's read, and fresh
        memory is not faulted in for each read or step; a result is valid until the next read.
        Laid out head-major, so the threads that dequantise a head are the ones the kernel
        gives that head in a run. Each of K and V is two passes: the int8 values widened into
        the buffer, then scaled in place (one fused ``int8 × scale`` operation measured slower
        than the two, PyTorch casting it element by element).
        """
        g, P, d = self.kv_heads, self.page_size, self.head_dim
        KV = self._scratch.take("KV", (2, g, c, P, d), self.dtype)
        K = KV[0].copy_(self._keys.narrow(1, p0, c)).mul_(self._key_scale[:, :, None].narrow(1, p0, c))
        V = KV[1].copy_(self._values.narrow(1, p0, c)).mul_(self._value_scale[..., None].narrow(1, p0, c))
        inside = partial[bisect_left(partial, p0) : bisect_left(partial, p0 + c)]
        if len(inside) == 1:  # a run's one partial page (its request's last), as written: one copy, no index built
            KV[:, :, inside[0] - p0].copy_(self.residual[inside[0]].transpose(1, 2))  # (2, P, g, d) -> (2, g, P, d)
        elif inside:  # every request's last page, as written: one copy for all (two per page cost 0.6 ms a step)
            at = torch.tensor([p - p0 for p in inside], device=self.device)
            both = torch.stack([self.residual[p] for p in inside])  # (m, 2, P, g, d)
            KV.index_copy_(2, at, both.permute(1, 3, 0, 2, 4))  # into (2, g, c, P, d)
        return K, V

    # ------------------------------------------------------------------ writes

    def write(self, page: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """Token ``n`` of ``k, v (n, g, d)`` into page ``page[n]`` at ``offset[n]``; pages filled by it are quantised.

        A page is quantised once each of its ``P`` offsets has been written, in whatever order
        the writes arrive (a later step written before an earlier one adds to the page). A page
        freed is :meth:`discard`-ed before it is handed out again; without that, a write at
        offset 0 into a full page starts it over (a page reused), and one elsewhere rewrites
        those tokens of it.
        """
        pages, offsets = page.tolist(), offset.tolist()
        check_write(self, pages, offsets, k, v)
        if not pages:
            return
        order = sorted(range(len(pages)), key=lambda n: (pages[n], offsets[n]))
        index = torch.tensor(order, device=self.device)
        both = torch.stack([k.to(self.device, self.dtype).index_select(0, index),
                            v.to(self.device, self.dtype).index_select(0, index)], 1)  # (n, 2, g, d) by page  # fmt: skip
        full = []
        a = 0
        while a < len(order):
            p = pages[order[a]]
            b = a
            while b < len(order) and pages[order[b]] == p:
                b += 1
            offs = [offsets[n] for n in order[a:b]]
            res = self._residual(p, restart=offs[0] == 0 and self.filled[p] == self.page_size)
            if offs == list(range(offs[0], offs[0] + b - a)):
                res[:, offs[0] : offs[0] + b - a] = both[a:b].transpose(0, 1)  # a run of offsets: a slice
            else:
                res[:, torch.tensor(offs, device=self.device)] = both[a:b].transpose(0, 1)
            for o in offs:
                self._written[p] |= 1 << o
            self.filled[p] = self._written[p].bit_count()
            if self.filled[p] == self.page_size:
                full.append(p)
            a = b
        if full:
            self._quantise(full)

    def _residual(self, p: int, restart: bool) -> Tensor:
        """Page ``p``'s full-precision copy: zeros when it starts over, its dequantised values when a full page is rewritten.

        A page partly written has its residual already (a page with none is fresh or full)."""
        # normal tensors even when made in inference mode: a later write outside it fills them in place
        with torch.inference_mode(False):
            if restart or self.filled[p] == 0:
                self.filled[p] = self._written[p] = 0
                self.residual[p] = torch.zeros(2, *self.keys.shape[1:], dtype=self.dtype, device=self.device)
            elif p not in self.residual:
                self.residual[p] = torch.cat(self._dequantise(slice(p, p + 1)))
        return self.residual[p]

    def _quantise(self, full: list[int]) -> None:
        """Full pages leave the residual for int8, all in one batch."""
        ids = torch.tensor(full, device=self.device)
        both = torch.stack([self.residual.pop(p) for p in full]).to(torch.promote_types(self.dtype, torch.float32))
        K, V = both[:, 0], both[:, 1]  # (n, P, g, d)
        sK = _scale(K.abs().amax(1))  # (n, g, d)
        sV = _scale(V.abs().amax(-1))  # (n, P, g)
        head_major = (2, 0, 1, 3)  # (n, P, g, d) -> (g, n, P, d), the store's layout
        self._keys.index_copy_(1, ids, _round(K / sK.to(K.dtype)[:, None]).permute(head_major))
        self._values.index_copy_(1, ids, _round(V / sV.to(V.dtype)[..., None]).permute(head_major))
        self._key_scale.index_copy_(1, ids, sK.transpose(0, 1))
        self._value_scale.index_copy_(1, ids, sV.permute(2, 0, 1))

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` becomes a copy of page ``src`` (int8 data, scales, residual and filled count)."""
        for t in (self._keys, self._values, self._key_scale, self._value_scale):
            t[:, dst] = t[:, src]
        self.filled[dst], self._written[dst] = self.filled[src], self._written[src]
        if src in self.residual:
            with torch.inference_mode(False):  # (as _residual: written in place later)
                self.residual[dst] = self.residual[src].clone()
        else:
            self.residual.pop(dst, None)

    def keep_first(self, page: int, tokens: int) -> None:
        """Page ``page`` holds its first ``tokens`` slots for its one holder: slots after them that another holder
        wrote (the request a fork's copy came from, or one freed since) are unwritten again.

        A full, quantised page becomes a partial one: those tokens dequantised into a full-precision residual,
        so the holder's own tokens are stored as an unshared request's are and the page is quantised once they
        fill it. Without it the page counted the other holder's slots as written: a full page was re-quantised at
        every write with the other's tokens in its scales (2e-2 off the written keys), a partial one reached
        "full" before the holder had written its slots (0.27 off, its steps written out of order)."""
        kept = (1 << tokens) - 1
        if not self._written[page] & ~kept:
            return  # nothing written past them
        with torch.inference_mode(False):  # (as _residual: written in place later)
            both = self.residual[page] if page in self.residual else torch.cat(self._dequantise(slice(page, page + 1)))
            both[:, tokens:] = 0
            self.residual[page] = both
        self._written[page] &= kept
        self.filled[page] = self._written[page].bit_count()

    def discard(self, page: int) -> None:
        """Page ``page`` is free: its full-precision residual goes now, and its next write starts it over.

        ``qkv.PagedKVCache`` calls it when a request's last holder of the page is freed, so a
        freed request's partial last pages return their memory at once (kept until the page was
        written again, they held ``2·P·g·d`` floats each after every request had ended).
        """
        self.residual.pop(page, None)
        self.filled[page] = self._written[page] = 0

    # ------------------------------------------------------------------ size

    @property
    def nbytes(self) -> int:
        """Bytes of the cache: every page's int8 data and scales (allocated up front) and the residual pages.

        Not counted: the attention's workspace, two buffers of the longest run's keys and values
        in ``dtype``, kept between decoding steps (:meth:`runs`).
        """
        stored = (self._keys, self._values, self._key_scale, self._value_scale, *self.residual.values())
        return sum(t.numel() * t.element_size() for t in stored)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token of a full page: ``2·g·d + 4·g·d / P + 4·g`` (see the module docstring)."""
        g, d, P = self.kv_heads, self.head_dim, self.page_size
        return 2 * g * d + 4 * g * d / P + 4 * g


def _scale(absmax: Tensor) -> Tensor:
    """absmax / 127 in float32, kept within its normal range (never 0, never inf)."""
    return (absmax.float() / 127).clamp(_TINY, _HUGE)


def _round(x: Tensor) -> Tensor:
    # absmax / 127 may round below its true value: clamp the few values that land past 127
    return x.round().clamp(-127, 127).to(torch.int8)
