"""What :meth:`qkv.PagedKVCache.plan` hands every layer of one step: the page table and where each new token goes.

Shape legend: ``R`` requests in the step, ``N`` pages listed, ``T`` new tokens.

The counts it carries (admissions, frees, copy-on-writes, the cache that made it) let the
cache refuse a step that went stale between its plan and a layer's write or attend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .plan import PagedPlan


@dataclass(frozen=True)
class Step:
    """One step's table: FlashInfer's four tensors, where each new token goes, and its position."""

    requests: tuple  # the requests, in the order of their rows
    qo_indptr: Tensor  # (R + 1,)
    kv_indptr: Tensor  # (R + 1,)
    kv_indices: Tensor  # (N,)
    kv_last_page_len: Tensor  # (R,)
    page: Tensor  # (T,) the page of each new token
    offset: Tensor  # (T,) its place in that page
    positions: Tensor  # (T,) its position in its sequence
    plan: PagedPlan | None = None  # the table laid out once, run by every layer (made by PagedKVCache.plan)
    admitted: tuple = ()  # each request's admission number when planned: a step of a request freed since is refused
    frees: int = 0  # the cache's count of frees when planned: the same count, no request of the step was freed
    copies: int = 0  # the cache's count of copy-on-writes when planned: a write into a page copied since is refused
    cache: object = field(default=None, repr=False, compare=False)  # the PagedKVCache that planned it: its page ids

    @property
    def table(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len
