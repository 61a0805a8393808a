"""Masks written as programs: FlexAttention's ``mask_mod`` and ``BlockMask``, as lazy qkv masks.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length; a tile is
``(b|1, h|1, it, jt)``; a block is FlexAttention's ``BLOCK_SIZE`` rows by keys.

* :func:`from_mask_mod`: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (flex's top-left raw
  positions) evaluated one tile at a time, as flex evaluates it, and
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
import weakref
from typing import Callable

import torch
from torch import Tensor

from .. import _mods
from .._trace import tracing
from .base import Mask, State, Tile
from .reads import fingerprint


class _KeptTiles(Mask):
    """A mask whose tiles are kept for later calls (the engines read them as they are): ``dense`` gives a copy, the
    caller's own to change."""

    def dense(self, i_len: int, j_len: int, device: torch.device | str = "cpu") -> Tensor:
        return super().dense(i_len, j_len, device).clone()


class MaskMod(_KeptTiles):
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` over ``B`` batch rows and ``H`` heads (None: it reads neither)."""

    def __init__(self, mask_mod: Callable, B: int | None = None, H: int | None = None):
        if not callable(mask_mod):
            raise TypeError(f"mask_mod: expected a callable fn(b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
        problem = None if tracing() else _mods.arguments_problem(mask_mod, 4)
        if problem is not None:
            raise TypeError(f"mask_mod: expected a function of (b, h, q_idx, kv_idx) (FlexAttention's signature), "
                            f"got one that {problem}")  # fmt: skip
        for name, n in (("B", B), ("H", H)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}: expected a positive int or None (the mask does not depend on it), got {n!r}")
        self.mask_mod, self.B, self.H = mask_mod, B, H
        self._last: dict[int, tuple] = {}  # thread id -> (tile key, its evaluation): one per thread

    def tile(self, t: Tile) -> Tensor:
        # traced (torch.compile, torch.export): no host state; the graph evaluates the program at each tile
        thread = None if tracing() else threading.get_ident()
        last = None if thread is None else self._last.get(thread)
        if last is not None and last[0] == _key(t):
            return last[1]
        b = torch.arange(self.B or 1, device=t.device)
        h = torch.arange(self.H or 1, device=t.device)
        allowed = _mods.evaluate(self.mask_mod, None, b, h, t.rows, t.cols)
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
            raise TypeError(f"mask_mod: expected a bool tensor (True = may attend), got {got}")
        if allowed.dim() < 4:
            allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        # a batch or head dim the program does not read stays 1: the tile is (b|1, h|1, it, jt)
        lead = tuple(1 if size == 1 else n for n, size in zip((len(b), len(h)), allowed.shape[:2]))
        allowed = torch.broadcast_to(allowed, (*lead, t.i1 - t.i0, t.j1 - t.j0))
        if thread is not None:
            self._last[thread] = (_key(t), allowed)
        return allowed

    def reset(self) -> None:
        if not tracing():
            self._last = {}

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


class FlexBlocks(_KeptTiles):
    """torch's ``BlockMask``: its listed blocks, "full" ones unmasked and "partial" ones through its ``mask_mod``."""

    #: Up to this many partial blocks in a tile, the mask_mod runs on each alone (else on the whole tile).
    FEW_PARTIAL = 16

    def __init__(self, block_mask, batch: int | None = None, heads: int | None = None):
        """``batch``, ``heads``: the call's, where the block mask was made for one (``B=None``, ``H=None``): its
        partial blocks then evaluate the ``mask_mod`` at each batch row's and query head's own ``b`` and ``h``,
        as flex does (None: at 0)."""
        self.block_mask = block_mask
        self.q_block, self.kv_block = block_mask.BLOCK_SIZE
        self.q_len, self.kv_len = block_mask.seq_lengths
        B, H = block_mask.kv_num_blocks.shape[:2]
        self._mod = MaskMod(block_mask.mask_mod, batch if B == 1 and batch else B, heads if H == 1 and heads else H)
        self._kept = _kept_for(block_mask)
        self.states, self._host = self._kept.states, self._kept.host  # (B, H, nq, nk) int8: 0 not listed, 1 partial, 2 full

    def _blocks(self, t: Tile) -> Tensor:
        qb = slice(t.i0 // self.q_block, (t.i1 - 1) // self.q_block + 1)
        kb = slice(t.j0 // self.kv_block, (t.j1 - 1) // self.kv_block + 1)
        return self._host[:, :, qb, kb]

    def tile(self, t: Tile) -> Tensor:
        key = (_key(t), self._mod.B, self._mod.H)  # (a block mask serves calls of other batches and heads)
        kept = self._kept.tiles.get(key)
        if kept is None:
            kept = self._evaluate(t)
            self._kept.keep(key, kept)
        return kept

    def _evaluate(self, t: Tile) -> Tensor:
        blocks = self._blocks(t)  # on the host: whole blocks are decided without touching the tile
        if blocks.shape[-2:] == (1, 1) and bool((blocks == blocks.flatten()[0]).all()):  # one block, one state
            state = int(blocks.flatten()[0])
            if state == 1:
                return self._mod.tile(t)
            shape = (*self.states.shape[:2], t.i1 - t.i0, t.j1 - t.j0)
            return torch.full(shape, state == 2, dtype=torch.bool, device=t.device)
        if not bool((blocks == 1).any()):
            return self._spread(blocks == 2, t)
        partial = (blocks == 1).any(0).any(0)  # (nq, nk): partial for some batch row or head
        spots = partial.nonzero().tolist()
        if len(spots) > self.FEW_PARTIAL or 2 * len(spots) > partial.numel():
            return torch.where(self._spread(blocks == 1, t), self._mod.tile(t), self._spread(blocks == 2, t))
        # Few partial blocks (a causal diagonal): the program runs on those blocks alone, as flex runs it.
        qb0, kb0 = t.i0 // self.q_block, t.j0 // self.kv_block
        parts = []
        for qb, kb in spots:
            i0, i1 = max(t.i0, (qb0 + qb) * self.q_block), min(t.i1, (qb0 + qb + 1) * self.q_block)
            j0, j1 = max(t.j0, (kb0 + kb) * self.kv_block), min(t.j1, (kb0 + kb + 1) * self.kv_block)
            part = self._mod.tile(Tile(i0, i1, j0, j1, t.i_len, t.j_len, t.device))
            states = blocks[:, :, qb : qb + 1, kb : kb + 1].to(t.device)  # (B, H, 1, 1): partial, full or not listed
            parts.append(((slice(i0 - t.i0, i1 - t.i0), slice(j0 - t.j0, j1 - t.j0)), torch.where(states == 1, part, states == 2)))
        full = self._spread(blocks == 2, t)
        lead = torch.broadcast_shapes(full.shape[:2], *(x.shape[:2] for _, x in parts))  # b, h: the program's, if it reads them
        allowed = full.expand(*lead, *full.shape[2:]).clone()
        for (rows, cols), x in parts:
            allowed[:, :, rows, cols] = x
        return allowed

    def _spread(self, blocks: Tensor, t: Tile) -> Tensor:
        """``blocks (B, H, nq, nk)``, one value per block, as one per element of tile ``t``."""
        n_b, n_h, nq, nk = blocks.shape
        per_elem = blocks.to(t.device)[:, :, :, None, :, None].expand(n_b, n_h, nq, self.q_block, nk, self.kv_block)
        per_elem = per_elem.reshape(n_b, n_h, nq * self.q_block, nk * self.kv_block)
        r0, c0 = t.i0 % self.q_block, t.j0 % self.kv_block  # the tile's offset in its first block
        return per_elem[:, :, r0 : r0 + t.i1 - t.i0, c0 : c0 + t.j1 - t.j0]

    def diagonal_groups(self) -> Tensor | None:
        """``(L,)`` int64: a group id per token when the lists never cross between groups, else None.

        Runs of blocks along the diagonal that no listed block joins are independent
        attentions (packed documents, at block granularity): a query of one group sees no key
        of another. With more than one such group the call is block-diagonal, and
        ``qkv.masks.documents(groups) & self`` is the same mask, which the segments backend
        runs as one ordinary call per group. None for one group, or when queries and keys are
        blocked differently.
        """
        if self.q_block != self.kv_block or self.q_len != self.kv_len:
            return None
        listed = self._host.amax((0, 1)) > 0  # (nq, nk): listed for some batch row or head
        n = min(listed.shape)
        if n < 2:
            return None
        cols = torch.arange(listed.shape[1])
        last = torch.where(listed, cols, -1).amax(1)[:n]  # each query block's last listed key block
        first = torch.where(listed, cols, listed.shape[1]).amin(1)[:n]
        reach_before = torch.cummax(last, 0).values[:-1]  # rows above a cut t reach keys < t only
        reach_after = torch.flip(torch.cummin(torch.flip(first, (0,)), 0).values, (0,))[1:]  # rows below: keys >= t
        cut = torch.arange(1, n)
        cuts = (reach_before < cut) & (reach_after >= cut)
        if not bool(cuts.any()):
            return None
        block_group = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(cuts.long(), 0)])  # (n,)
        return block_group.repeat_interleave(self.q_block)[: self.q_len]

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


class _Kept:
    """What one ``BlockMask`` keeps between calls: its block states, and its evaluated tiles
    while its ``mask_mod`` reads the same values (:func:`qkv.masks.reads.fingerprint`)."""

    #: Evaluated tiles kept per block mask, in bytes (a model's layers reuse one block mask).
    LIMIT = 32 * 2**20

    def __init__(self, block_mask):
        self.states = _block_states(block_mask)
        self.host = self.states.cpu()
        self.read = _reads(block_mask)
        self.tiles: dict = {}
        self.size = 0

    def keep(self, key: tuple, allowed: Tensor) -> None:
        if self.read is None or self.size + allowed.numel() > self.LIMIT:
            return  # what the program reads can change unseen, or the budget is spent
        self.tiles[key] = allowed
        self.size += allowed.numel()


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept_for(block_mask) -> _Kept:
    """The block mask's :class:`_Kept`, started afresh when its program now reads other values."""
    kept = _KEPT.get(block_mask)
    if kept is None or kept.read is None or kept.read != _reads(block_mask):
        kept = _Kept(block_mask)
        try:
            _KEPT[block_mask] = kept
        except TypeError:  # not weakly referable: nothing is kept between calls
            pass
    return kept


def _reads(block_mask) -> tuple | None:
    """The fingerprint of the block lists and of what the ``mask_mod`` reads."""
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return fingerprint((block_mask.mask_mod, *lists))


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
