"""The masks a transformers model asks for, built as qkv's own lazy masks.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length.

transformers builds each layer's mask through its ``AttentionMaskInterface``: one call
with the batch size, the query and key lengths, where those sit in the sequence
(``q_offset`` and ``kv_offset``, the absolute positions of the first query and the first
key), a *mask function* (causal, bidirectional, sliding window, or something custom) and
the user's 2-d padding mask ``(b, kv_offset + j)``, True = a real token. Its ``sdpa``
implementation answers with a ``(b, 1, i, j)`` bool tensor, ``eager`` with a float one.
:func:`mask_interface` answers with a ``qkv.masks`` object that holds a few numbers:

=========================================  ===========================================
the model asks for                         qkv mask
=========================================  ===========================================
causal                                     ``offsets(None, δ)``, ``causal()`` when δ = 0
causal sliding window of ``W`` keys        ``offsets(δ - W + 1, δ)``, ``window(W - 1)``
  (``kv > q - W``: its own and W - 1 before)
bidirectional sliding window ``W``         ``offsets(δ - W, δ + W)``
  (``|q - kv| <= W``)
bidirectional                              ``offsets(None, None)`` (everything)
right padding / left padding / both        ``lengths(ends)`` / ``starts(firsts)`` / ``&``
=========================================  ===========================================

Positions: query ``r`` is token ``q_offset + r`` and key ``c`` token ``kv_offset + c``.
qkv aligns its masks bottom-right, as if the queries were the last ``i`` of the ``j``
keys; the two agree when ``q_offset + i == kv_offset + j`` (every dynamic and sliding
cache) and otherwise differ by ``δ = (q_offset - kv_offset) - (j - i)`` (a static cache
whose key slots run past the tokens seen so far: ``δ < 0`` hides the empty slots).

The answer is wrapped in a :class:`LayerMask`, which transformers carries from mask
creation to the attention layers like a 4-d mask (``generate`` with a static cache builds
the masks in advance, calls ``.contiguous()`` on them and hands them back to the model,
which hands them back here).

A padding mask whose real tokens are not one run per row becomes a per-key
``(b, 1, 1, j)`` bool mask (still no ``(i, j)``). Packed sequences (transformers detects
them from ``position_ids``) are ``documents(ids) &`` the pattern above
(``transformers_packing``). Any other mask function (chunked attention, image-token
overlays, a user's own) is built by transformers' own ``sdpa_mask`` as a ``(b, 1, i, j)``
bool tensor: right, but not lazy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks
from ..backends.sdpa import MASK_ELEMENTS
from ..masks import Dense, Mask
from .transformers_closures import closure
from .transformers_packing import has_documents, packed_parts


class LayerMask:
    """A qkv mask on its way from transformers' mask creation to :func:`attention_forward`.

    transformers treats a prepared mask as a 4-d tensor in two places (``.contiguous()``
    and ``.ndim``); this wrapper answers those, so the lazy mask passes through unchanged.
    ``shape`` is the ``(b, 1, i, j)`` the mask stands for.
    """

    ndim = 4

    def __init__(self, mask: Mask, shape: tuple[int, int, int, int], before: Callable[[], LayerMask] | None = None):
        self.mask = mask
        self.shape = shape
        self._before, self._filled = before, None
        self._calls: dict[tuple, Mask | None] = {}

    @property
    def filled(self) -> LayerMask | None:
        """Where the keys run past the last query's position under a causal mask (a static cache's unfilled slots,
        which no query sees), the mask of the keys before them (``filled.shape[-1]`` keys), made on first use (by an
        edited call); else None."""
        if self._filled is None and self._before is not None:
            self._filled = self._before()
        return self._filled

    def for_call(self, i: int, j: int, device: torch.device) -> Mask | None:
        """The mask one layer call runs with, made once and shared by every layer of the forward.

        None when it hides nothing (a decoding step without padding: the fastest path); for
        a call whose mask PyTorch's kernel would be given as a tensor anyway
        (``qkv.backends.sdpa.MASK_ELEMENTS``: a decoding step after a cache, or a padded
        prompt), that tensor, built once here rather than by each of a model's layers; else
        (packed documents, causal or windowed masks without padding, long sequences) the
        lazy mask itself.
        """
        key = (i, j, device)
        if key not in self._calls:
            self._calls[key] = _for_call(self.mask, i, j, device)
        return self._calls[key]

    def dim(self) -> int:
        return self.ndim

    def contiguous(self) -> LayerMask:
        return self

    def __repr__(self) -> str:
        return f"LayerMask({self.mask!r}, shape={self.shape})"

    # A model whose attention does not call transformers' attention functions (Bloom, MPT: the class sets
    # ``_supports_attention_backend = False``) still asks the mask interface for its mask, then reads it as a tensor:
    # say why, where it would fail on an operator or an attribute of a tensor.
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"LayerMask has no {name!r}: {UNSUPPORTED}")

    def _unsupported(self, *args):
        raise TypeError(UNSUPPORTED)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _unsupported
    __invert__ = __neg__ = _unsupported


#: What a model that reads qkv's lazy mask as a tensor is told.
UNSUPPORTED = ("attn_implementation='qkv' runs in the attention functions transformers hands a layer "
               "(AttentionInterface), and this model's attention computes its own instead (its class sets "
               "_supports_attention_backend=False), reading the mask as a tensor; load it with attn_implementation="
               "'sdpa' or 'eager'")  # fmt: skip


def _for_call(mask: Mask, i: int, j: int, device: torch.device) -> Mask | None:
    if isinstance(mask, Dense):
        return mask
    if mask.state(masks.Tile.whole(i, j, device)) == "full":
        return None
    rows = mask.batch_shape()[0] if mask.batch_shape() else 1
    if rows * i * j > MASK_ELEMENTS or has_documents(mask):  # packed documents stay lazy: one call per document
        return mask
    if i >= j and mask.hidden_keys(i, j) is None:  # no padding: causal and windows keep their kernels' flags
        return mask
    return Dense(mask.dense(i, j, device))  # a step after a cache, or a padded prompt: the tensor SDPA would build


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> LayerMask:
    """``AttentionMaskInterface`` entry: the lazy qkv mask for one request (never None).

    A :class:`LayerMask` handed back as ``attention_mask`` (masks prepared in advance by
    ``generate``) is returned as it is.

    The other keywords transformers passes (``allow_is_causal_skip``, ``dtype``,
    ``config``, ...) tune its own dense masks and mean nothing for a lazy one, except
    ``use_vmap``, which is handed to ``sdpa_mask`` for a pattern built densely.
    """
    from transformers import masking_utils

    if isinstance(attention_mask, LayerMask):
        return attention_mask

    def build(j: int) -> Mask:
        return _build(masking_utils, batch_size, q_length, j, q_offset, kv_offset, mask_function, attention_mask,
                      local_size, device, kwargs)  # fmt: skip

    q_offset, kv_offset = int(q_offset), int(kv_offset)  # (read once: a device's offsets sync at each read)
    filled = q_offset + q_length - kv_offset  # keys up to the last query's position
    before = None
    if 0 < filled < kv_length and (describe(mask_function or masking_utils.causal_mask_function) or ("",))[0] in (
            "causal", "sliding_causal"):  # fmt: skip
        before = lambda: LayerMask(build(filled), (batch_size, 1, q_length, filled))  # noqa: E731
    return LayerMask(build(kv_length), (batch_size, 1, q_length, kv_length), before)


def _build(masking_utils, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
           attention_mask, local_size, device, kwargs) -> Mask:  # fmt: skip
    if mask_function is None:
        mask_function = masking_utils.causal_mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    packed = packed_parts(mask_function)
    if packed is not None:  # position-id packing: the pattern within each sequence, and its ids
        base, ids = packed
        inner = _build(masking_utils, batch_size, q_length, kv_length, q_offset, kv_offset, base,
                       attention_mask, local_size, device, kwargs)  # fmt: skip
        return masks.documents(ids.expand(batch_size, -1)) & inner
    pattern = describe(mask_function)
    if pattern is None or (local_size is not None and pattern[1] not in (None, local_size)):
        dense = masking_utils.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
            use_vmap=kwargs.get("use_vmap", False), device=device,
        )  # fmt: skip
        return Dense(dense)
    kind, size = pattern
    shift = (q_offset - kv_offset) - (kv_length - q_length)  # δ of the module docstring
    position = _positions(kind, size, shift)
    padding = None if attention_mask is None else padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return position
    if isinstance(position, masks.Offsets) and position.lo is None and position.hi is None:
        return padding  # bidirectional: the padding is the whole mask
    return position & padding


def describe(mask_function: Callable) -> tuple[str, int | None] | None:
    """``(kind, window)`` of one of transformers' own mask functions, or None for any other.

    ``kind`` is ``"causal"``, ``"bidirectional"``, ``"sliding_causal"`` or
    ``"sliding_bidirectional"``; ``window`` the ``sliding_window`` of the two sliding
    kinds. The sliding ones are ``and_masks(overlay(W), base)`` closures, read through
    their closure cells; anything not recognised is left to the dense path.
    """
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return "causal", None
    if mask_function is mu.bidirectional_mask_function:
        return "bidirectional", None
    parts = closure(mask_function, "and_masks.<locals>.and_mask").get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    for kind, maker, expected_base in (
        ("sliding_causal", "sliding_window_overlay", mu.causal_mask_function),
        ("sliding_bidirectional", "sliding_window_bidirectional_overlay", mu.bidirectional_mask_function),
    ):
        size = closure(overlay, f"{maker}.<locals>.inner_mask").get("sliding_window")
        if base is expected_base and isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return kind, size
    return None


def _positions(kind: str, size: int | None, shift: int) -> masks.Offsets:
    """The position part of the mask, shifted by ``shift`` (δ) when the queries do not end with the keys."""
    if kind == "bidirectional":
        return masks.Window(None, None)
    if kind == "causal":
        return masks.causal() if shift == 0 else masks.offsets(None, shift)
    if kind == "sliding_causal":
        return masks.window(size - 1) if shift == 0 else masks.offsets(shift - size + 1, shift)
    return masks.window(size, size) if shift == 0 else masks.offsets(shift - size, shift + size)


def padding_mask(attention_mask: Tensor, kv_length: int, kv_offset: int = 0) -> Mask | None:
    """The user's ``(b, kv_offset + j)`` padding mask for keys ``kv_offset … kv_offset + j``, lazily; None if all real.

    Rows whose real keys are one run ``first … end`` (right padding, left padding, or
    both) become ``starts(first) & lengths(end)`` (only the parts that cut anything);
    a row with holes turns the whole mask into a ``(b, 1, 1, j)`` bool one. A shorter
    mask is padded with False, as transformers does (key slots no token has filled).
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected a 2-d padding mask (b, j), got shape {tuple(attention_mask.shape)}")
    real = attention_mask.to(torch.bool)
    missing = kv_offset + kv_length - real.shape[-1]
    if missing > 0:
        real = F.pad(real, (0, missing))
    real = real[:, kv_offset : kv_offset + kv_length]  # (b, j)
    if bool(real.all()):
        return None
    count = real.sum(-1)
    first = real.int().argmax(-1)
    end = torch.where(count > 0, kv_length - real.flip(-1).int().argmax(-1), 0)
    first = torch.where(count > 0, first, 0)
    if not bool((end - first == count).all()):
        return Dense(real[:, None, None, :])
    mask = masks.starts(first) if bool((first > 0).any()) else None
    if bool((end < kv_length).any()):
        mask = masks.lengths(end) if mask is None else mask & masks.lengths(end)
    return mask
