"""Masks written as programs: FlexAttention's ``mask_mod`` and ``BlockMask``, as lazy qkv masks.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length; a tile is
``(b|1, h|1, it, jt)``; a block is FlexAttention's ``BLOCK_SIZE`` rows by keys.

* :func:`from_mask_mod`: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (flex's top-left raw
  positions) evaluated one tile at a time, as flex evaluates it (``qkv._mods``), and
  classified "empty", "full" or "partial" from that tile alone: never an ``(i, j)`` tensor
  for the whole call. Combine it with qkv's masks by ``&`` and ``|``.
* :class:`FlexBlocks`: torch's own ``BlockMask`` (``create_block_mask(...)``). Its block
  lists decide, as in flex: a block it does not list is never computed, a "full" block is
  computed without the ``mask_mod``, a "partial" one with it. A tile's state is read from
  the lists, so whole blocks are skipped or taken unmasked without evaluating anything.

A tile's evaluation is kept for the next request of the same tile (engines ask a tile's
state, then for the tile), one per thread, and forgotten when a new call starts
(``Mask.reset``): a program reading tensors the caller has since changed is evaluated
afresh.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import Tensor

from .. import _mods
from .base import Mask, State, Tile


class MaskMod(Mask):
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` over ``B`` batch rows and ``H`` heads (None: it reads neither)."""

    def __init__(self, mask_mod: Callable, B: int | None = None, H: int | None = None):
        if not callable(mask_mod):
            raise TypeError(f"mask_mod: expected a callable fn(b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
        for name, n in (("B", B), ("H", H)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}: expected a positive int or None (the mask does not depend on it), got {n!r}")
        self.mask_mod, self.B, self.H = mask_mod, B, H
        self._last = threading.local()

    def tile(self, t: Tile) -> Tensor:
        last = getattr(self._last, "value", None)
        if last is not None and last[0] == _key(t):
            return last[1]
        b = torch.arange(self.B or 1, device=t.device)
        h = torch.arange(self.H or 1, device=t.device)
        allowed = _mods.evaluate(self.mask_mod, None, b, h, t.rows, t.cols)
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
            raise TypeError(f"mask_mod: expected a bool tensor (True = may attend), got {got}")
        allowed = torch.broadcast_to(allowed, (len(b), len(h), t.i1 - t.i0, t.j1 - t.j0))
        self._last.value = (_key(t), allowed)
        return allowed

    def reset(self) -> None:
        self._last = threading.local()

    def state(self, t: Tile) -> State:
        if t.i0 >= t.i1 or t.j0 >= t.j1:
            return "empty"
        allowed = self.tile(t)
        if not bool(allowed.any()):
            return "empty"
        return "full" if bool(allowed.all()) else "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return () if self.B is None and self.H is None else (self.B or 1, self.H or 1)

    def describe(self) -> str:
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return f"qkv.masks.from_mask_mod({name}) was made for (B, H) = ({self.B}, {self.H})"

    def __repr__(self) -> str:
        return f"from_mask_mod({getattr(self.mask_mod, '__name__', type(self.mask_mod).__name__)}, B={self.B}, H={self.H})"


def from_mask_mod(mask_mod: Callable, B: int | None = None, H: int | None = None) -> MaskMod:
    """A FlexAttention ``mask_mod`` as a lazy qkv mask (``B``, ``H`` as ``create_block_mask``'s: None when it reads neither)."""
    return MaskMod(mask_mod, B, H)


class FlexBlocks(Mask):
    """torch's ``BlockMask``: its listed blocks, "full" ones unmasked and "partial" ones through its ``mask_mod``."""

    def __init__(self, block_mask):
        self.block_mask = block_mask
        self.q_block, self.kv_block = block_mask.BLOCK_SIZE
        self.q_len, self.kv_len = block_mask.seq_lengths
        self.states = _block_states(block_mask)  # (B, H, nq, nk) int8: 0 not listed, 1 partial, 2 full
        self._host = self.states.cpu()
        self._mod = MaskMod(block_mask.mask_mod, self.states.shape[0], self.states.shape[1])

    def _blocks(self, t: Tile) -> Tensor:
        qb = slice(t.i0 // self.q_block, (t.i1 - 1) // self.q_block + 1)
        kb = slice(t.j0 // self.kv_block, (t.j1 - 1) // self.kv_block + 1)
        return self._host[:, :, qb, kb]

    def tile(self, t: Tile) -> Tensor:
        blocks = self._blocks(t)
        if blocks.shape[-2:] == (1, 1) and bool((blocks == blocks.flatten()[0]).all()):  # one block, one state
            state = int(blocks.flatten()[0])
            if state == 1:
                return self._mod.tile(t)
            shape = (*self.states.shape[:2], t.i1 - t.i0, t.j1 - t.j0)
            return torch.full(shape, state == 2, dtype=torch.bool, device=t.device)
        states = self.states.to(t.device)
        per_row = states.index_select(2, torch.div(t.rows, self.q_block, rounding_mode="floor"))
        per_elem = per_row.index_select(3, torch.div(t.cols, self.kv_block, rounding_mode="floor"))  # (B, H, it, jt)
        full = per_elem == 2
        if not bool((per_elem == 1).any()):
            return full
        return full | ((per_elem == 1) & self._mod.tile(t))

    def state(self, t: Tile) -> State:
        if t.i0 >= t.i1 or t.j0 >= t.j1:
            return "empty"
        blocks = self._blocks(t)
        if not bool(blocks.any()):
            return "empty"
        if bool((blocks == 2).all()):
            return "full"
        return "partial"

    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.states.shape[:2])

    def describe(self) -> str:
        return f"block_mask was made for (B, H) = {tuple(self.states.shape[:2])}"

    def key_bounds(self, t: Tile) -> tuple[int, int] | None:
        """The keys of the blocks the lists hold for these rows' query blocks."""
        if t.i0 >= t.i1:
            return None
        listed = self._host[:, :, t.i0 // self.q_block : (t.i1 - 1) // self.q_block + 1].amax((0, 1, 2))  # (nk,)
        blocks = torch.nonzero(listed).flatten()
        if blocks.numel() == 0:
            return 0, 0
        return int(blocks[0]) * self.kv_block, min(self.kv_len, (int(blocks[-1]) + 1) * self.kv_block)

    def reset(self) -> None:
        self._mod.reset()

    def check(self, i_len: int, j_len: int) -> None:
        if (i_len, j_len) != (self.q_len, self.kv_len):
            raise ValueError(
                f"block_mask: created for (q_len, kv_len) = ({self.q_len}, {self.kv_len}), got ({i_len}, {j_len}); "
                "create a new block mask for these lengths"
            )

    def __repr__(self) -> str:
        return f"FlexBlocks(shape={tuple(self.states.shape)}, BLOCK_SIZE=({self.q_block}, {self.kv_block}))"


def _block_states(block_mask) -> Tensor:
    """``(B, H, nq, nk)`` int8 from a ``BlockMask``'s lists: 1 for its partial blocks, 2 for its full ones."""
    nk = max(1, -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1]))
    states = torch.zeros((*block_mask.kv_num_blocks.shape, nk), dtype=torch.int8, device=block_mask.kv_num_blocks.device)
    for value, counts, indices in ((1, block_mask.kv_num_blocks, block_mask.kv_indices),
                                   (2, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):  # fmt: skip
        if counts is None:
            continue
        listed = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]  # (B, H, nq, width)
        slots = indices.long().masked_fill(~listed, nk)  # what is not listed lands in a spare slot
        marks = torch.zeros((*states.shape[:-1], nk + 1), dtype=torch.int8, device=states.device)
        marks.scatter_(-1, slots, value)
        states = torch.maximum(states, marks[..., :nk])
    return states


def _key(t: Tile) -> tuple:
    return (t.i0, t.i1, t.j0, t.j1, t.i_len, t.j_len, str(t.device))
