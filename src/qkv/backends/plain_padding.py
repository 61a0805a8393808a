"""A decoding step's padding in ``qkv.attention``'s plain-call lane (``backends.sdpa_plain``): the kernel's mask from a lazy padding mask, over the keys some row sees.

Shape legend: ``b`` batch, ``j`` keys; the step has one query a row (``i = 1``).

With one query a row, bottom-right ``causal`` hides no key (the query is the last key's
position), so the step's mask is the padding's tile, ``b · j`` bools, built once per mask
and kept on it (a model's layers share one step's mask), over the keys some row sees: keys
past the longest ``lengths`` row (and, on a GPU, before the earliest ``starts``) are hidden
from every row and never read (``key_bounds``, from the numbers the mask read when made). On the CPU the kernel's output
is scanned for the nan a hidden key that is not finite brings (``hidden_keys.after``); on a
GPU, where reading a value on the host stalls the stream, the hidden keys are zeroed in
copies of ``k`` and ``v`` before the kernel, as ``hidden_keys.guard`` does there.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .._trace import version
from ..masks import Dense, Lengths, Mask, Starts, Tile
from .sdpa import _give_dead_rows_every_key


#: The lazy padding masks a decoding step takes the lane with: their whole ``(b, 1, 1, j)`` tile is small.
PADDING = (Lengths, Starts)


def mask_tensor(mask: Dense | Lengths | Starts) -> Tensor:
    """The one tensor a plan's mask reads (a Dense mask's, the padding's per-row one), whose version :func:`fits` compares."""
    return mask.tensors()[0][1]


def kept_on_mask(mask: Mask, tensor: Tensor, key: tuple, build: Callable[[], object]) -> object:
    """What ``build()`` gives for a mask reading ``tensor``, kept on the mask per ``key`` and the tensor's version.

    A model's layers share one step's mask, so the first layer builds what the kernel takes and
    the others find it: kept while ``tensor`` is the same object unchanged (an in-place change
    bumps its version). A tensor made under ``torch.inference_mode`` keeps no version: built at
    every call. A None from ``build`` (the call is not the lane's) is not kept.
    """
    changes = version(tensor)
    key = (*key, changes)
    kept = getattr(mask, "_plain", None)
    if changes is not None and kept is not None and kept[0] is tensor and kept[1] == key:
        return kept[2]
    parts = build()
    if changes is not None and parts is not None:
        mask._plain = (tensor, key, parts)
    return parts


def _step_rows(mask: Lengths | Starts, q: Tensor, k: Tensor) -> Tensor | None:
    """The padding's ``(b,)`` per-row tensor where the call is a decoding step (one query a row) of ``b`` rows."""
    rows = mask_tensor(mask)
    if q.shape[2] != 1 or type(rows) is not Tensor or rows.shape != (q.shape[0],):
        return None  # (several queries, a batch of one broadcast: the full path)
    mask.check(1, k.shape[-2])  # rows past the keys: the full path's own message
    return rows


def plain_padding(mask: Lengths | Starts, q: Tensor, k: Tensor) -> tuple[tuple[Tensor, Tensor | None], tuple | None] | None:
    """``((attn_mask (b, 1, 1, jt), live_rows), keys)`` of a CPU decoding step's padding; else None.

    The full path builds the same tensor for the kernel, after a request and the walk over
    the backends that cost a padded decoding step 3x the kernel's time (a ``(4, 8, 1, 64)``
    step over 64 keys: 110 µs against SDPA's 30). ``keys`` is ``(0, j1, None, device)`` where
    the kernel reads keys ``0:j1`` only, up to the last some row sees (a static cache is read up
    to its longest row; on the Intel Xeon, 4 rows filled to 256 of 4096 slots, 8 heads on 2,
    the whole cache took 0.92 ms a step and its filled part 0.18), None where that is every key. Kept on the mask per ``j``, dtype and the per-row tensor's
    version.
    """
    rows = _step_rows(mask, q, k)
    if rows is None or rows.device.type != "cpu":
        return None  # (a GPU's rows: the full path)
    j = k.shape[-2]

    def build():
        # up to the last key some row sees, from the numbers the mask read when made; every key where those are
        # stale (the tensor changed in place since) or no row sees one (each row then given every key, and zeroed
        # after). Not from the first: keys dropped before the real ones move the kernel's blocks, and its sums round
        # differently (1 ulp, against the full path's bit for bit), where a left-padded batch's earliest start is 0
        j1 = _keys_seen(mask, j)[1] if mask.read_is_current() else j
        j1 = j1 if j1 > 0 else j
        allowed = mask.tile(Tile(0, 1, 0, j1, 1, j))  # (b, 1, 1, jt)
        dead = ~allowed.any(-1, keepdim=True)
        return (_give_dead_rows_every_key(allowed, dead if bool(dead.any()) else None, q.dtype),
                None if j1 == j else (0, j1, None, q.device))  # fmt: skip

    return kept_on_mask(mask, rows, (j, q.dtype), build)


def device_padding(mask: Lengths | Starts, q: Tensor, k: Tensor) -> tuple[tuple, tuple] | None:
    """``((attn_mask (b, 1, 1, jt), live_rows), (j0, j1, hidden (b, 1, jt, 1), device))`` of a GPU step's padding.

    The full path's call on a GPU without its request and backend walk (0.2-0.3 ms of host
    time a call on the H200's host, against a kernel of 0.04): :func:`~.sdpa_plain.run`
    reads keys ``j0:j1`` only (a view), those some row sees: ``lengths`` hide every key past
    the longest row, ``starts`` every key before the earliest start (a cache allocated for
    its longest request, a static cache, is read up to what is filled, by the kernel and by
    the copies below). Within them the padding's tile is the kernel's mask, and ``hidden``
    (None where no key of the range is hidden) its keys to zero in copies of ``k`` and ``v``
    before the kernel, branch-free as ``hidden_keys.guard`` does on an accelerator, so
    gradients flow as there (a hidden key's is 0). Rows with no key (a length of 0, a start
    at ``j``, known from the host numbers the mask read when made) are given every key and
    zeroed after, found on the device without a host read. None where no row sees a key, or
    the call is not one query a row. Kept on the mask per ``j``, dtype, device and the
    per-row tensor's version.
    """
    rows = _step_rows(mask, q, k)
    if rows is None or not mask.read_is_current():
        return None  # (changed in place since the mask read its numbers: the full path reads the tensor itself)
    j = k.shape[-2]
    j0, j1 = _keys_seen(mask, j)
    if j1 <= j0:
        return None  # no row sees a key: the full path's zeros

    def build():
        seen = Tile(0, 1, j0, j1, 1, j, q.device)
        if mask.state(seen) == "full":  # from the host numbers: every row sees every key of the range
            return (None, None), (j0, j1, None, q.device)
        allowed = mask.tile(seen)  # (b, 1, 1, jt)
        dead = None if _every_row_sees_a_key(mask, j) else allowed.logical_not().all(-1, keepdim=True)  # (no host read)
        hidden = allowed.transpose(-1, -2).logical_not()  # (b, 1, jt, 1)
        return _give_dead_rows_every_key(allowed, dead, q.dtype), (j0, j1, hidden, q.device)

    # (inference_mode in the key: what is built under it cannot be saved for a later call's backward)
    return kept_on_mask(mask, rows, (j, q.dtype, q.device, torch.is_inference_mode_enabled()), build)


def _keys_seen(mask: Lengths | Starts, j: int) -> tuple[int, int]:
    """``(j0, j1)``: the keys some row may see, from the numbers the mask read when made (``key_bounds``); an empty
    range where those are unknown."""
    bounds = mask.key_bounds(Tile.whole(1, j))
    return (0, 0) if bounds is None else bounds


def _every_row_sees_a_key(mask: Lengths | Starts, j: int) -> bool:
    """From the numbers the mask read when made: every row of ``lengths`` sees key 0, of ``starts`` key ``j - 1``."""
    column = Tile(0, 1, 0, 1, 1, j) if type(mask) is Lengths else Tile(0, 1, j - 1, j, 1, j)
    return mask.state(column) == "full"
