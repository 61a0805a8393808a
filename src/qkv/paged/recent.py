"""The plans of the page tables a thread called ``qkv.paged_attention`` with last, kept while their values repeat.

Shape legend: ``R`` requests, ``N`` page entries of all requests.

A model's layers call ``qkv.paged_attention`` once each in a decoding step, every one with
that step's table: FlashInfer asks such a caller to ``plan`` once and ``run`` per layer, and
a caller who writes the one-call form pays the plan (checking the table on the host, cutting
the requests' pages into items and laying them out: 0.3-0.5 ms of a 32-request step's 2.5-3
ms, measured from cold caches on an AMD EPYC Zen 5) at every layer. So the call keeps the
plans of the last :data:`KEPT` tables it was given and reuses one when the four index
tensors hold the same values as when it was made (compared element by element, ``torch.equal``:
a few µs for thousands of entries; of ``kv_indices`` the entries the table names, not a buffer's
unread tail), for the same pool geometry and query count. The plan is a
function of those values alone, so a reused plan gives the result a new one would, and any
changed entry, however it was written (in place, through a numpy view of the buffer, or into
a new tensor), makes a new plan.

Kept per thread (a plan's memo fills at its first run; threads do not share one), on the CPU
only: elsewhere the comparison is a device synchronisation, and the one-call form there is
left as it was (a plan a call). While a call is traced (``torch.compile``, ``torch.export``,
``torch.jit.trace``) nothing is kept or reused.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from typing import Callable

from .._trace import tracing
from .plan import PagedPlan

#: Tables whose plans a thread keeps: a serving loop's decoding step and prefill calls, alternating layer by layer.
KEPT = 4

_local = threading.local()


def plan_for(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_pages: int, page_size: int, device,
             total_q: int) -> PagedPlan:  # fmt: skip
    """The plan of this table: one kept from an earlier call of the same values and geometry, or a new one (kept)."""
    given = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    if not all(type(x) is Tensor and x.is_cpu for x in given) or str(device) != "cpu" or tracing():
        return PagedPlan.once(*given, num_pages=num_pages, page_size=page_size, device=device, total_q=total_q)
    geometry = (num_pages, page_size, total_q)
    kept: list = _local.__dict__.setdefault("plans", [])
    for n, (seen_geometry, seen, plan) in enumerate(kept):
        if isinstance(seen, tuple) and seen_geometry == geometry and _same_table(seen, given):
            return _first(kept, n)
    plan = PagedPlan(*given, num_pages=num_pages, page_size=page_size, device=device, total_q=total_q)
    # copies to compare the next call's with: of kv_indices only the entries the plan read (a buffer's tail is not)
    used = plan.table.indices.numel()
    seen = (qo_indptr.clone(), kv_indptr.clone(), kv_indices[:used].clone(), kv_last_page_len.clone())
    return _keep(kept, geometry, seen, plan)


def plan_keyed(key: tuple, make: Callable[[], PagedPlan], device, values: Tensor | None = None) -> PagedPlan:
    """The plan kept under ``key``, host values that alone decide a table its caller builds from them (a contiguous
    cache's rows read as pages: ``qkv.flash_attn``'s decoding step), and under ``values``' entries where given (a
    ``block_table`` the table is read from: ``qkv.varlen_paged``; compared element by element with a copy, as
    :func:`plan_for` compares its tables), or ``make()``'s, kept with the tables' plans. Nothing kept off the CPU or
    while traced, as for :func:`plan_for`."""
    if str(device) != "cpu" or tracing() or (values is not None and not (type(values) is Tensor and values.is_cpu)):
        return make()
    if values is not None:
        key = (*key, values.dtype, tuple(values.shape))  # (torch.equal below compares entries of one shape and dtype)
    kept: list = _local.__dict__.setdefault("plans", [])
    for n, (seen_key, seen, plan) in enumerate(kept):
        if not isinstance(seen, tuple) and seen_key == key and (seen is None) == (values is None) and (
                seen is None or torch.equal(seen, values)):  # fmt: skip
            return _first(kept, n)
    plan = make()  # (a call make() refuses keeps nothing)
    return _keep(kept, key, None if values is None else values.clone(), plan)


def _first(kept: list, n: int) -> PagedPlan:
    """Entry ``n``'s plan, the entry moved first: a step's layers ask for the same table in a row."""
    if n:
        kept.insert(0, kept.pop(n))
    return kept[0][2]


def _keep(kept: list, key: tuple, seen: tuple | Tensor | None, plan: PagedPlan) -> PagedPlan:
    """``plan`` kept first (under ``key`` and the table values ``seen``: a tuple of the four index tensors, or a keyed
    plan's tensor of values or None), the oldest dropped."""
    kept.insert(0, (key, seen, plan))
    del kept[KEPT:]
    return plan


def _same_table(seen: tuple[Tensor, ...], given: tuple[Tensor, ...]) -> bool:
    """Whether ``given`` holds the kept values: the same dtypes (a float table is refused by the plan, never matched by
    an integer one), the offsets and last-page lengths whole, and the entries of ``kv_indices`` the plan read (FlashInfer's
    buffers run past ``kv_indptr[-1]``, a tail no plan reads nor keeps)."""
    for n, (a, b) in enumerate(zip(seen, given)):
        if a.dtype != b.dtype or b.dim() != 1:
            return False
        if n == 2:  # kv_indices: its first entries, as many as were read
            if b.numel() < a.numel() or not torch.equal(a, b[: a.numel()]):
                return False
        elif a.shape != b.shape or not torch.equal(a, b):
            return False
    return True


def forget() -> None:
    """Drop this thread's kept plans (the tests' fresh start)."""
    _local.__dict__.pop("plans", None)
