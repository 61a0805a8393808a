"""FlashInfer's page bookkeeping: appending keys and values to a paged cache, and the indices that say where.

Shape legend: ``R`` requests, ``n`` appended entries of all requests, ``g`` KV heads, ``d``
key size, ``e`` value size, ``P`` page size.

The table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) already counts the appended
entries (FlashInfer's note: their pages are allocated first). Entry ``i`` of request
``b = batch_indices[i]`` at position ``positions[i]`` of its sequence goes to page
``kv_indices[kv_indptr[b] + positions[i] // P]``, slot ``positions[i] % P``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..paged.pages import as_pages
from .terms import check_layout, into


def get_seq_lens(kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int) -> Tensor:
    """Each request's key count ``(R,)``: ``max(pages - 1, 0) · page_size + kv_last_page_len`` (FlashInfer's formula)."""
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def get_batch_indices_positions(append_indptr: Tensor, seq_lens: Tensor, nnz: int, batch_indices: Tensor | None = None,
                                positions: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(batch_indices (nnz,), positions (nnz,))``, int32: each appended entry's request and its position there.

    Request ``b``'s ``append_indptr[b + 1] - append_indptr[b]`` entries are the last of its ``seq_lens[b]``
    positions. Entries past ``append_indptr[-1]`` keep request -1, position 0; ``batch_indices`` and
    ``positions`` are tensors to write into (int32, ``(nnz,)``).
    """
    device = append_indptr.device
    bounds = append_indptr.tolist()
    counts = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)
    if bounds and (bounds[0] < 0 or bounds[-1] > nnz or bool((counts < 0).any())):
        raise ValueError(f"append_indptr: expected non-decreasing offsets within 0 .. nnz = {nnz}, got {bounds[:8]}")
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    index = torch.arange(bounds[0], bounds[-1]) if bounds else torch.zeros(0, dtype=torch.int64)
    # entry bounds[b] + i is position seq_lens[b] - count[b] + i of request b
    first = seq_lens.to("cpu", torch.int64) - counts - torch.tensor(bounds[:-1], dtype=torch.int64)
    found_b = torch.full((nnz,), -1, dtype=torch.int32)
    found_p = torch.zeros(nnz, dtype=torch.int32)
    found_b[index] = rows.to(torch.int32)
    found_p[index] = (index + first[rows]).to(torch.int32)
    return into("batch_indices", batch_indices, found_b.to(device)), into("positions", positions, found_p.to(device))


def append_paged_kv_cache(append_key: Tensor, append_value: Tensor, batch_indices: Tensor, positions: Tensor,
                          paged_kv_cache, kv_indices: Tensor, kv_indptr: Tensor, kv_last_page_len: Tensor,
                          kv_layout: str = "NHD") -> None:  # fmt: skip
    """Write ``append_key (n, g, d)`` and ``append_value (n, g, e)`` into ``paged_kv_cache`` (either FlashInfer form,
    ``kv_layout``) at their requests' positions, in place."""
    check_layout(kv_layout)
    pages = as_pages(paged_kv_cache, kv_layout)
    n = append_key.shape[0] if isinstance(append_key, Tensor) and append_key.dim() == 3 else -1
    for name, x in (("batch_indices", batch_indices), ("positions", positions)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] < n:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected one entry per appended row ({n}), got {got}")
    b = batch_indices[:n].to("cpu", torch.int64)
    pos = positions[:n].to("cpu", torch.int64)
    start = kv_indptr.to("cpu", torch.int64)
    count = start[1:] - start[:-1]
    P = pages.page_size
    if n and (int(b.min()) < 0 or int(b.max()) >= count.numel()):
        raise ValueError(f"batch_indices: expected requests 0 .. {count.numel() - 1}, got {int(b.min())} .. {int(b.max())}")
    if n and (bool((pos < 0).any()) or bool((pos // P >= count[b]).any())):
        raise ValueError("positions: an entry lies past its request's pages (the table must count the appended entries)")
    page = kv_indices.to("cpu", torch.int64)[start[b] + pos // P]
    pages.write(page, pos % P, append_key, append_value)

