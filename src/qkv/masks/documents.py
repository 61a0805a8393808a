"""Document masks: packed sequences, where each query attends only to the keys of its own document.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length; a tile is ``(b, 1, it, jt)``.

A packed batch lays many documents end to end in one row (transformers'
``DataCollatorWithFlattening``, every pretraining pipeline); a document id per token says
which. ``documents(ids_q, ids_k)`` allows query ``r`` to see key ``c`` of batch row ``n``
iff ``ids_q[n, r] == ids_k[n, c]``; combined with ``causal()`` (or any mask) by ``&``::

    ids = [0, 0, 0, 1, 1]        documents(ids) & causal()
                                     k0 k1 k2 k3 k4
                                 q0   1  .  .  .  .
                                 q1   1  1  .  .  .
                                 q2   1  1  1  .  .
                                 q3   .  .  .  1  .
                                 q4   .  .  .  1  1

Where a document has other counts in ``ids_q`` and ``ids_k`` (cross-attention, a chunked
prefill), ``causal()`` stays aligned to the whole call's bottom-right corner (``c <= r + j - i``), not to each
document's: ``flash_attn_varlen_func``'s per-sequence alignment is ``qkv.varlen_attention``'s,
or a ``mask_mod`` over positions inside each document (``from_mask_mod``).

It is lazy: a tile whose query and key documents are disjoint is "empty" (skipped), one
inside a single document "full", all from the ids' ends when they are sorted, in
O(tile) memory. When each document's tokens are contiguous (:meth:`Documents.runs`), the
``segments`` backend runs a call as one call per document, so the work is ``Σ lenᵢ²``,
not ``T²``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import merge_lead
from .._trace import concrete
from .base import Mask, State, Tile
from .padding import pull


class Documents(Mask):
    """Query ``r`` sees key ``c`` of row ``n`` iff ``ids_q[n, r] == ids_k[n, c]``; ids are integers, ``(b, i)``."""

    def __init__(self, ids_q: Tensor, ids_k: Tensor | None = None):
        self.ids_q = _ids("ids_q", ids_q)
        self.ids_k = self.ids_q if ids_k is None else _ids("ids_k", ids_k)
        if self.ids_k.shape[0] not in (1, self.ids_q.shape[0]) and self.ids_q.shape[0] != 1:
            raise ValueError(
                f"ids_k: expected batch {self.ids_q.shape[0]} like ids_q (or 1), got shape {tuple(self.ids_k.shape)}"
            )
        # host copies, read once: state() is called per tile and must read no tensor
        self._host = None
        if concrete(self.ids_q, self.ids_k):
            q, k = self.ids_q.cpu(), self.ids_k.cpu()
            rows = max(q.shape[0], k.shape[0])
            q, k = q.expand(rows, -1), k.expand(rows, -1)
            self._host = (q, k, bool((q[:, 1:] >= q[:, :-1]).all() and (k[:, 1:] >= k[:, :-1]).all()))

    def tile(self, t: Tile) -> Tensor:
        q = self.ids_q[:, t.i0 : t.i1].to(t.device)
        k = self.ids_k[:, t.j0 : t.j1].to(t.device)
        return (q[:, :, None] == k[:, None, :])[:, None]  # (b, 1, it, jt)

    def state(self, t: Tile) -> State:
        if self._host is None or t.i0 >= t.i1 or t.j0 >= t.j1:
            return "partial" if self._host is None else "empty"
        q, k, ordered = self._host
        qs, ks = q[:, t.i0 : t.i1], k[:, t.j0 : t.j1]
        if ordered:  # sorted rows: the ends are the extremes
            q_lo, q_hi, k_lo, k_hi = qs[:, 0], qs[:, -1], ks[:, 0], ks[:, -1]
        else:
            q_lo, q_hi, k_lo, k_hi = qs.amin(1), qs.amax(1), ks.amin(1), ks.amax(1)
        if bool(((q_hi < k_lo) | (k_hi < q_lo)).all()):
            return "empty"  # disjoint ranges of ids share no document
        if bool(((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()):
            return "full"
        return "partial"

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        """The keys of the documents rows ``t.i0:t.i1`` belong to (sorted ids: found by bisection)."""
        if self._host is None or not self._host[2] or t.i0 >= t.i1:
            return None
        q, k, _ = self._host
        lo = torch.searchsorted(k, q[:, t.i0 : t.i0 + 1].contiguous()).min()  # (b, 1) columns: copy b ints
        hi = torch.searchsorted(k, q[:, t.i1 - 1 : t.i1].contiguous(), right=True).max()
        return int(lo), max(int(lo), int(hi))

    def runs(self) -> list[list[tuple[int, int, int, int]]] | None:
        """Per batch row, ``(q0, q1, k0, k1)`` of each document in both ids, in query order; None if unknown.

        None when the ids cannot be read on the host (tracing, meta) or a document's
        queries or keys are not contiguous. A document with queries and no keys is left
        out (its rows see nothing), as is one with keys and no queries.
        """
        if self._host is None:
            return None
        q, k, _ = self._host
        found = []
        for row in range(q.shape[0]):
            q_runs, k_runs = _contiguous(q[row]), _contiguous(k[row])
            if q_runs is None or k_runs is None:
                return None
            found.append([(q0, q1, *k_runs[doc]) for doc, (q0, q1) in q_runs.items() if doc in k_runs])
        return found

    def batch_shape(self) -> tuple[int, ...]:
        return (max(self.ids_q.shape[0], self.ids_k.shape[0]), 1)

    def tensors(self) -> list[tuple[str, Tensor]]:
        pairs = [("qkv.masks.documents' ids_q", self.ids_q)]
        return pairs if self.ids_k is self.ids_q else [*pairs, ("qkv.masks.documents' ids_k", self.ids_k)]

    def describe(self) -> str:
        # (i,) ids were made (1, i) on the way in; a batch of 1 always fits: only (b, i) ids get here
        shapes = f"ids_q of shape {tuple(self.ids_q.shape)}"
        if self.ids_k is not self.ids_q:
            shapes += f" and ids_k of shape {tuple(self.ids_k.shape)}"
        return f"qkv.masks.documents got {shapes}, one per batch row"

    def check(self, i_len: int, j_len: int) -> None:
        for name, ids, n, what in (("ids_q", self.ids_q, i_len, "i queries"), ("ids_k", self.ids_k, j_len, "j keys")):
            if ids.shape[-1] != n:
                raise ValueError(f"mask: documents' {name} has {ids.shape[-1]} positions, the call has {what[0]} = {n} {what[2:]}")

    def merge_lead(self, lead: tuple[int, ...]) -> Mask:
        if len(lead) <= 1:
            return self

        def merged(ids: Tensor) -> Tensor:
            return merge_lead(ids[:, None, None, :], lead)[:, 0, 0, :]

        return Documents(merged(self.ids_q), merged(self.ids_k))

    def row(self, n: int) -> Documents:
        """The mask of batch row ``n`` alone."""
        pick = lambda ids: ids if ids.shape[0] == 1 else ids[n : n + 1]  # noqa: E731
        return Documents(pick(self.ids_q), pick(self.ids_k))

    def __repr__(self) -> str:
        return f"documents(shape={tuple(self.ids_q.shape)})"


def documents(ids_q: Tensor, ids_k: Tensor | None = None) -> Documents:
    """Each query sees only keys with its document id: ``ids_q (b, i)``, ``ids_k (b, j)`` (default ``ids_q``).

    1-d ids are one batch row. Combine with ``causal()`` for packed causal language models.
    """
    return Documents(ids_q, ids_k)


def documents_of(mask: Mask | None) -> tuple[Documents | None, Mask | None]:
    """``(documents, rest)`` of a mask ``documents & rest`` (either side of a top-level ``&``), else ``(None, mask)``."""
    return pull(mask, lambda m: m if isinstance(m, Documents) else None)


def _ids(name: str, ids: object) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name}: expected an integer tensor of document ids (b, i), got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of document ids, got {ids.dtype}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected document ids of shape (b, i) or (i,), got {tuple(ids.shape)}")
    return ids


def _contiguous(ids: Tensor) -> dict[int, tuple[int, int]] | None:
    """``{doc: (start, stop)}`` when every id's positions form one run, else None."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    if values.numel() != torch.unique(values).numel():
        return None  # some document comes back after another
    stops = torch.cumsum(counts, 0).tolist()
    return {doc: (stop - n, stop) for doc, n, stop in zip(values.tolist(), counts.tolist(), stops)}
