"""The edit contract: a call of ``qkv.attention`` (:class:`Call`) and what an :class:`Edit` may change in it.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size; ``H`` and ``R`` the number
of chosen heads and query rows.

An edit acts at one or more of three points of ``out = softmax(logits, masked) @ v``:

* :meth:`Edit.prepare`, before the call: the inputs and options of ``qkv.attention`` (a
  mask joined to the call's, a change of the logits). The edited call still runs on qkv's
  dispatcher, so a mask or a logit change keeps the memory-efficient engines;
* :meth:`Edit.finish`, after it: the per-head output ``z (..., h, i, e)``, the tensor
  TransformerLens hooks as ``hook_z`` (before ``W_O``);
* :meth:`Edit.weights`, on weights that are returned or recorded, so that they show what
  the edited call used (only :class:`~qkv.edits.PatchPattern` changes them afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ..checks import broadcasts


@dataclass(frozen=True)
class Call:
    """One call of ``qkv.attention``: ``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` and its keywords."""

    q: Tensor  # (..., h, i, d); edits may change it (a per-head temperature scales it)
    k: Tensor  # (..., g, j, d)
    v: Tensor  # (..., g, j, e)
    options: dict = field(default_factory=dict)  # the keyword arguments of qkv.attention (mask, bias, scale, ...)

    @property
    def heads(self) -> int:
        """``h``, the query heads."""
        return self.q.shape[-3]

    @property
    def kv_heads(self) -> int:
        """``g``, the KV heads (``h % g == 0``; query head ``n`` reads KV head ``n // (h/g)``)."""
        return self.k.shape[-3]

    @property
    def rows(self) -> int:
        """``i``, the query rows."""
        return self.q.shape[-2]

    def with_options(self, **changes) -> Call:
        """The same call with some keyword arguments replaced."""
        return Call(self.q, self.k, self.v, {**self.options, **changes})


class Edit:
    """Base class of edits; each subclass overrides the points it acts at (all default to no change)."""


    def prepare(self, call: Call) -> Call:
        """The call to run instead of ``call`` (its inputs or options changed)."""
        return call

    def finish(self, call: Call, out: Tensor) -> Tensor:
        """``z (..., h, i, e)`` after the edit, from the edited call's output ``out``."""
        return out

    def weights(self, call: Call, weights: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
        """Weights ``(..., H, R, j)`` of heads ``heads`` and rows ``rows`` (None: all) as the edited call used them."""
        return weights

    def with_weights(self, call: Call, weights: Tensor) -> Edit:
        """This edit reading ``weights (..., h, i, j)``, the call's whole pattern as hook functions left it, where it
        would read weights of its own (a patch recomputes its rows from them); the others are themselves."""
        return self


def as_edits(edits: Edit | Sequence[Edit] | None) -> tuple[Edit, ...]:
    """One edit, a sequence of them or None, as a tuple; anything else is a ``TypeError``."""
    if edits is None:
        return ()
    found = (edits,) if isinstance(edits, Edit) else edits
    if not isinstance(found, (list, tuple)) or not all(isinstance(e, Edit) for e in found):
        kinds = type(edits).__name__ if not isinstance(edits, (list, tuple)) else [type(e).__name__ for e in edits]
        raise TypeError(
            f"edits: expected a qkv.edits edit (AblateHeads, Knockout, ScaleHeads, PatchPattern, PatchZ) or a list of them, got {kinds}"
        )
    return tuple(found)


def indices(name: str, value: object, size: int) -> Tensor:
    """Heads or rows given as an int, a slice, a range, a list of ints or a 1-d integer tensor: a long tensor in ``[0, size)``.

    Negative indices count from the end, as in Python. ``name`` names the argument in errors.
    """
    if isinstance(value, slice):
        value = range(size)[value]
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, slice, range, list of ints or 1-d integer tensor, got bool")
    if isinstance(value, int):
        value = [value]
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(f"{name}: expected a 1-d integer tensor, got {value.dtype} of shape {tuple(value.shape)}")
        index = value.reshape(-1).long().cpu()
    elif isinstance(value, (list, tuple, range)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        index = torch.tensor(list(value), dtype=torch.long)
    else:
        raise TypeError(f"{name}: expected an int, slice, range, list of ints or 1-d integer tensor, got {type(value).__name__}")
    if index.numel() == 0:
        raise ValueError(f"{name}: selects nothing, expected at least one index in [0, {size})")
    if bool((index < -size).any() or (index >= size).any()):
        raise ValueError(f"{name}: expected indices in [0, {size}) (or negative from the end), got {value!r}")
    return torch.where(index < 0, index + size, index)


def rows_of(name: str, value: object, call: Call) -> Tensor:
    """:func:`indices` of query rows in ``call``, whose error says that rows count within each call (generate's steps have one)."""
    try:
        return indices(name, value, call.rows)
    except ValueError as error:
        raise ValueError(f"{error}; rows count within each call, and this one has {call.rows} (a generate() "
                         "decoding step has 1, so a patch of the prompt's rows fits the prompt's call only)") from None  # fmt: skip


def once_each(name: str, value: object, index: Tensor, what: str) -> None:
    """Refuse ``index`` (from :func:`indices` of ``value``) naming one ``what`` twice: rows given per index would be ambiguous."""
    unique, counts = index.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name}: {value!r} names {what} {int(unique[counts > 1][0])} twice, "
                         "so which of its given rows applies is ambiguous; name each once")


def check_selection(name: str, value: object) -> None:
    """Reject, when an edit is made, what :func:`indices` could never accept (sizes are known only at the call)."""
    ok = isinstance(value, (int, slice, range, list, tuple, Tensor)) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"{name}: expected an int, slice, range, list of ints or 1-d integer tensor, got {type(value).__name__}")
    if isinstance(value, Tensor) and (value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1):
        raise TypeError(f"{name}: expected a 1-d integer tensor, got {value.dtype} of shape {tuple(value.shape)}")
    if isinstance(value, (list, tuple)) and not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        kinds = sorted({type(x).__name__ for x in value if not isinstance(x, int) or isinstance(x, bool)})
        raise TypeError(f"{name}: expected an int, slice, range, list of ints or 1-d integer tensor, got a list holding {', '.join(kinds)}")


def check_batch(name: str, given: Tensor, call: Call) -> None:
    """Refuse a recorded tensor whose batch (its dims before the last three) does not broadcast to the call's.

    A recording keeps its run's batch: one of 2 prompts patches a run of the same 2, or of
    any batch as ``given[:1]`` (one row, put into every row alike); anything else would
    end in a broadcasting error that names neither the edit nor the batch.
    """
    lead, batch = tuple(given.shape[:-3]), tuple(call.q.shape[:-3])
    if not broadcasts(lead, batch):
        raise ValueError(f"{name}: {tuple(given.shape)} has batch {lead}, which does not broadcast to this call's "
                         f"batch {batch}; record the same batch, or give one row ([:1]) to patch every row alike")  # fmt: skip


def check_patch(edit: str, heads: object, rows: object, name: str, given: object, layout: str) -> None:
    """A patch's arguments: ``heads`` and ``rows`` selections, and ``given`` (its ``name``) a float tensor of at
    least 3 dims laid out as ``layout`` says."""
    check_selection(f"{edit}: heads", heads)
    check_selection(f"{edit}: rows", rows)
    if not isinstance(given, Tensor) or not given.dtype.is_floating_point or given.dim() < 3:
        got = f"{given.dtype} of shape {tuple(given.shape)}" if isinstance(given, Tensor) else type(given).__name__
        raise TypeError(f"{edit}: {name} expected a float tensor {layout}, got {got}")


def patched(edit: str, heads: object, rows: object, call: Call) -> tuple[Tensor, Tensor]:
    """The heads and query rows a patch names in ``call``, as index tensors, each named once (one patch per pair)."""
    head_index, row_index = indices(f"{edit}: heads", heads, call.heads), rows_of(f"{edit}: rows", rows, call)
    once_each(f"{edit}: heads", heads, head_index, "head")
    once_each(f"{edit}: rows", rows, row_index, "row")
    return head_index, row_index
