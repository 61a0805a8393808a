"""A page table in FlashInfer's CSR form, checked once and read on the host.

Shape legend: ``R`` requests, ``T`` query rows of all requests (``total_q``), ``N`` page
entries of all requests, ``P`` page size, ``g`` KV heads, ``d`` head size.

Request ``r``'s queries are rows ``qo_indptr[r] : qo_indptr[r + 1]`` of ``q (T, h, d)``; its
pages are ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]``, in order, the last one holding
``kv_last_page_len[r]`` entries (1 to ``P``; any value with no pages). ``kv_indices`` may run past
``kv_indptr[-1]``, its tail unread (FlashInfer's buffers). It has ``kv_len = (pages - 1) · P + last``
keys (0 with no pages), and its queries are the last ``qo_len`` of those positions: query
``t`` sits at position ``kv_len - qo_len + t`` (the bottom-right alignment of a chunk after a
cache). A request may have more queries than keys, or none: with ``causal`` its first
``qo_len - kv_len`` queries sit before position 0 and see no key (``out = 0``, ``lse = -inf``:
FlashInfer's fully masked rows, its test ``test_paged_prefill_fully_masked_rows``); without it
every query sees all of them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class PageTable:
    """The checked table: per request, its query rows, its pages and its key count (host ints)."""

    qo_start: list[int]  # (R,) first query row
    qo_len: list[int]  # (R,) query rows
    kv_len: list[int]  # (R,) keys
    page_start: list[int]  # (R,) first entry of its pages in ``indices``
    page_count: list[int]  # (R,) pages
    indices: Tensor  # (N,) int64 page ids, on the cache's device
    page_size: int

    @property
    def requests(self) -> int:
        return len(self.qo_len)

    @cached_property
    def breaks(self) -> list[int]:
        """Where page ids stop being consecutive: each ``b`` with ``indices[b] != indices[b - 1] + 1``, ascending."""
        ids = self.indices
        return [b + 1 for b in torch.diff(ids).ne_(1).nonzero().view(-1).tolist()] if ids.numel() > 1 else []

    def first_of_range(self, r: int) -> int | None:
        """Request ``r``'s first page id where its pages are consecutive ids (a range of the pool, readable as
        views), else None (no pages, or a break between two of them)."""
        a, n = self.page_start[r], self.page_count[r]
        if n == 0:
            return None
        after = bisect_right(self.breaks, a)  # the first break past its first entry
        if after < len(self.breaks) and self.breaks[after] < a + n:
            return None
        return int(self.indices[a])

    def pages(self, r: int) -> Tensor:
        """Request ``r``'s page ids, in order: ``(pages,)``."""
        return self.indices[self.page_start[r] : self.page_start[r] + self.page_count[r]]


def _ints(name: str, x, device) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected an integer tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32 or int64), got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d tensor, got shape {tuple(x.shape)}")
    if x.device.type == "meta" or torch.device(device).type == "meta":
        where = "a meta tensor" if x.device.type == "meta" else "pages on meta"
        raise ValueError(f"{name}: the page table's values are read on the host to plan the call, got {where} (a "
                         "meta tensor has a shape but no values)")  # fmt: skip
    if x.dtype == torch.long and x.device == torch.device(device):
        return x  # (a step's planning runs from cold caches: each skipped operation counts)
    return x.to(device=device, dtype=torch.long)


def _indptr(name: str, x: Tensor, last: int | None, what: str) -> list[int]:
    values = x.tolist()
    if not values or values[0] != 0:
        raise ValueError(f"{name}: expected an offsets tensor starting at 0, got {values[:4]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: offsets must not decrease, got {values}")
    if last is not None and values[-1] != last:
        raise ValueError(f"{name}: the last offset must be the number of {what} ({last}), got {values[-1]}")
    return values


def page_table(
    total_q: int, num_pages: int, page_size: int, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, device
) -> PageTable:
    """Check FlashInfer's four tensors against ``q``'s rows and the cache's pages; clear errors otherwise."""
    qo = _indptr("qo_indptr", _ints("qo_indptr", qo_indptr, "cpu"), total_q, "query rows in q")
    indices = _ints("kv_indices", kv_indices, device)
    kv = _indptr("kv_indptr", _ints("kv_indptr", kv_indptr, "cpu"), None, "")
    if kv[-1] > indices.numel():
        raise ValueError(f"kv_indptr: the last offset ({kv[-1]}) is past the end of kv_indices ({indices.numel()})")
    # FlashInfer reads kv_indices[:kv_indptr[-1]] only (its MLA plan: "[kv_indptr[-1]] or larger"): engines
    # pass a preallocated buffer whose tail is never read, nor checked here
    indices = indices[: kv[-1]]
    last = _ints("kv_last_page_len", kv_last_page_len, "cpu").tolist()
    requests = len(qo) - 1
    if len(kv) - 1 != requests or len(last) != requests:
        raise ValueError(
            f"qo_indptr, kv_indptr and kv_last_page_len describe different numbers of requests: "
            f"{len(qo) - 1}, {len(kv) - 1} and {len(last)}"
        )
    low, high = torch.stack(torch.aminmax(indices)).tolist() if indices.numel() else (0, -1)  # none named: no range
    if indices.numel() and (low < 0 or high >= num_pages):
        raise ValueError(f"kv_indices: page ids must lie in 0 .. {num_pages - 1} (the cache's pages), got {low} .. {high}")
    qo_len, kv_len, count = [], [], []
    for r in range(requests):
        pages, n_q = kv[r + 1] - kv[r], qo[r + 1] - qo[r]
        if pages and not 1 <= last[r] <= page_size:
            raise ValueError(f"kv_last_page_len[{r}]: expected 1 to {page_size} (the page size), got {last[r]}")
        keys = 0 if pages == 0 else (pages - 1) * page_size + last[r]
        qo_len.append(n_q)
        kv_len.append(keys)
        count.append(pages)
    return PageTable(qo[:-1], qo_len, kv_len, kv[:-1], count, indices, page_size)


def longs(xs: list[int], device="cpu") -> Tensor:
    """``torch.tensor(xs, dtype=torch.long)``, in a third of the time for host lists of a step's size.

    ``torch.tensor`` converts a list element by element (0.15 µs each, 24 µs for a 32-request
    step's 150 items); an ``array`` is filled in C and shared with the tensor (which keeps it
    alive)."""
    if not xs:
        return torch.zeros(0, dtype=torch.long, device=device)
    t = torch.frombuffer(array("q", xs), dtype=torch.long)
    return t if torch.device(device).type == "cpu" else t.to(device)


def by_lengths(kv_indptr: Tensor, kv_indices: Tensor, kv_len: Tensor, page_size: int,
               name: str = "kv_len") -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """A table that counts keys (FlashInfer's MLA and ``BatchAttention`` plans: ``kv_len``, named ``name`` in errors) as
    the page table reads it: ``(kv_indptr, kv_indices, kv_last_page_len)``.

    Request ``r``'s keys are the first ``kv_len[r]`` slots of its pages, so it reads
    ``⌈kv_len / P⌉`` of them; pages past those (held, not yet begun) are never read, as
    FlashInfer's schedulers bound a request by ``kv_len`` alone, and are dropped here. Offsets that
    do not start at 0 are read from ``kv_indices[kv_indptr[0]]`` on, as FlashInfer's kernels read them.
    """
    for label, x in (("kv_indptr", kv_indptr), (name, kv_len)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{label}: expected a 1-d integer tensor, got {got}")
    offsets = kv_indptr.long().cpu().tolist()
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    lengths = kv_len.long().cpu().tolist()
    if len(lengths) != len(counts):
        raise ValueError(f"{name}: expected one length per request ({len(counts)}, from kv_indptr), got {len(lengths)}")
    used, last = [], []
    for r, (pages, n) in enumerate(zip(counts, lengths)):
        if pages >= 0 and not 0 <= n <= pages * page_size:
            raise ValueError(f"{name}[{r}]: {n} keys but {pages} pages of {page_size} (expected 0 to {pages * page_size})")
        need = -(-n // page_size) if pages >= 0 else pages
        used.append(need)
        last.append(n - (need - 1) * page_size if need > 0 else 1)  # no pages: the table reads no length
    last = torch.tensor(last, dtype=torch.long)
    readable = isinstance(kv_indices, Tensor) and offsets[:1] >= [0] and min(counts, default=0) >= 0 and (
        offsets[-1] <= kv_indices.numel())  # fmt: skip
    if (used == counts and offsets[:1] == [0]) or not readable:  # (a malformed table is passed on whole: the page table names its fault)
        return kv_indptr, kv_indices, last
    keep = torch.cat([torch.arange(a, a + u) for a, u in zip(offsets, used)])
    return torch.tensor([0, *torch.tensor(used).cumsum(0).tolist()]), kv_indices.index_select(0, keep.to(kv_indices.device)), last
