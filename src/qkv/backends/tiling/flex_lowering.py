"""qkv's lazy masks and biases as FlexAttention's ``mask_mod``, ``score_mod`` and ``BlockMask``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``nq``/``nk`` the number of query/key
blocks of flex's ``BLOCK`` rows/keys; ``L = i + j - 1`` the number of query-key offsets.

``torch.nn.attention.flex_attention`` takes a call as three pieces, and :func:`lower` builds
them from a :class:`~qkv.backends.request.Request`:

* ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for each qkv mask (:func:`mask_mod`). Flex's
  indices are raw positions; qkv's positional masks are aligned bottom-right, so
  ``causal()``, ``window`` and ``offsets`` become ``lo <= kv_idx - q_idx - (j - i) <= hi``
  (``Tile.diagonal``). ``lengths``: ``kv_idx < key_lengths[b]``; ``starts``: ``kv_idx >=
  key_starts[b]``; ``documents``: ``ids_q[b, q_idx] == ids_k[b, kv_idx]``; a dense bool
  mask is read at ``[b, h, q_idx, kv_idx]`` (index 0 along its size-1 dims);
  ``from_mask_mod`` is its own function; a ``BlockMask`` (``qkv.masks.FlexBlocks``) is
  used as it is when it alone is the mask, else read through its block states; ``&`` and
  ``|`` combine.
* a ``BlockMask`` whose lists come from qkv's own tiles (:func:`block_mask`): the mask is
  evaluated a band of ``BLOCK`` query rows at a time (bounded memory, never the whole
  ``(b, h, i, j)`` bool tensor that ``create_block_mask`` builds without compiling), and
  each ``BLOCK × BLOCK`` block is "full" (every entry allowed: flex skips the
  ``mask_mod``), "partial" or left out (not computed), as ``create_block_mask`` classifies
  them, ragged edge blocks never full. Block masks of masks of positions and of tensors
  are kept for the next call with the same mask, lengths and device (the layers of a
  model share one), in a small cache (:data:`CACHE`).
* ``score_mod(score, b, h, q_idx, kv_idx)``: the bias, then the caller's ``score_mod``,
  in qkv's order (``e = mod(scale · q·k + bias)``, then the mask; ``qkv.attention``).
  ALiBi is ``- slope[h] · |kv_idx - q_idx - (j - i)|``; any other shift-invariant lazy
  bias (T5's buckets) is one ``(h, L)`` profile over offsets, read at ``kv_idx - q_idx +
  i - 1`` (its gradient reaches the bias's parameters through the profile); a dense float
  bias is read at ``[b, h, q_idx, kv_idx]``. Bias values are in the logits' precision
  (float32, float64 for float64 inputs), as the reference adds them. ``qkv.SoftCap`` in
  half precision on CUDA is written through a sigmoid, the same function on a cheaper
  instruction (:func:`_kernel_form`).

Scalars that change with the lengths (``j - i``) are captured as 0-d tensors, not Python
ints: ``torch.compile`` guards on a closure's ints, so each new length of a growing KV
cache would compile anew; a tensor is an input of the compiled kernel instead.

Head sizes below 16 (flex's Triton kernels need ``d, e >= 16``) are padded with zeros:
zeros appended to q and k leave every dot product unchanged, zeros appended to v add
output columns that the caller slices off (``Lowered.e``).

Checked in the test suite's GPU tests: the block lists against the mask, entry by
entry (``qkv.masks.FlexBlocks`` reads them back), and flex's own CPU forward on the
lowered call against the reference backend.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._trace import version
from ...masks import And, Dense, Documents, FlexBlocks, Lengths, Mask, MaskMod, Offsets, Or, Starts, Tile, Window
from ...masks.reads import reads_argument
from ...positional import ALiBi, LazyBias
from ...score_mods import SoftCap
from ..request import Request
from .tiles import as_heads

#: flex's block side (``torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE``).
BLOCK = 128
#: Largest band of the mask (bool elements) evaluated at once while the block lists are built.
BAND_ELEMENTS = 2**24
#: Smallest head size flex's Triton kernels take; smaller ones are zero-padded.
MIN_HEAD = 16
#: Block masks kept for reuse (least recently used forgotten first).
CACHE = 16

_MASK_TYPES = (Offsets, Window, Lengths, Starts, Documents, Dense, MaskMod, FlexBlocks)
_cache: OrderedDict[tuple, tuple[list[Tensor], object]] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class Lowered:
    """A request as flex_attention's arguments: ``flex(q, k, v, score_mod, block_mask, scale, enable_gqa)``."""

    q: Tensor  # (b, h, i, d'), prepared by the score and zero-padded to d' >= MIN_HEAD
    k: Tensor  # (b, g, j, d')
    v: Tensor  # (b, g, j, e'), e' >= MIN_HEAD
    score_mod: Callable | None
    block_mask: object | None  # torch's BlockMask, or None (no mask)
    scale: float
    enable_gqa: bool
    e: int  # the value size to keep of flex's output


def mask_problem(mask: Mask | None) -> str | None:
    """Why ``mask`` has no lowering here (a mask type of its own), or None."""
    if mask is None:
        return None
    if type(mask) in (And, Or):
        return mask_problem(mask.a) or mask_problem(mask.b)
    if type(mask) in _MASK_TYPES:
        return None
    return f"the mask {type(mask).__name__} has no flex_attention lowering (qkv's own masks do)"


def bias_problem(bias: Tensor | LazyBias | None) -> str | None:
    """Why ``bias`` has no lowering here, or None: lazy biases must be ALiBi or shift-invariant."""
    if bias is None or isinstance(bias, (Tensor, ALiBi)) or bias.shift_invariant:
        return None
    return f"the lazy bias {type(bias).__name__} is not shift-invariant: it has no flex_attention lowering"


def lower(req: Request) -> Lowered:
    """The request as flex_attention's arguments (the module docstring says how each piece is built)."""
    qp, kp = req.score.prepare(req.q, req.k)
    e = req.v.shape[-1]
    qp, kp, v = _padded(qp, kp, req.v)
    return Lowered(
        q=qp, k=kp, v=v, score_mod=score_mod(req), block_mask=block_mask(req), scale=req.scale,
        enable_gqa=int(req.heads) != int(req.kv_heads), e=e,
    )  # fmt: skip


def _padded(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d, e = q.shape[-1], v.shape[-1]
    if d < MIN_HEAD:
        q, k = F.pad(q, (0, MIN_HEAD - d)), F.pad(k, (0, MIN_HEAD - d))
    if e < MIN_HEAD:
        v = F.pad(v, (0, MIN_HEAD - e))
    return q, k, v


# --------------------------------------------------------------------------- masks


def mask_mod(req: Request) -> Callable | None:
    """``fn(b, h, q_idx, kv_idx) -> bool`` for ``req.mask`` (None without a mask)."""
    return None if req.mask is None else _mask_fn(req.mask, req)


def _pick(index: Tensor, size: int) -> Tensor:
    """``index`` along a dim of ``size``, or 0 along a broadcast (size-1) dim: a tensor either way."""
    return index if size > 1 else index * 0


def _mask_fn(mask: Mask, req: Request) -> Callable:
    device, kind = req.q.device, type(mask)
    if kind in (And, Or):
        a, b_ = _mask_fn(mask.a, req), _mask_fn(mask.b, req)
        if kind is And:
            return lambda b, h, q_idx, kv_idx: a(b, h, q_idx, kv_idx) & b_(b, h, q_idx, kv_idx)
        return lambda b, h, q_idx, kv_idx: a(b, h, q_idx, kv_idx) | b_(b, h, q_idx, kv_idx)
    if kind in (Offsets, Window):
        lo, hi = mask.lo, mask.hi
        shift = torch.tensor(req.j - req.i, device=device)

        def offsets(b, h, q_idx, kv_idx):
            offset = kv_idx - q_idx - shift  # Tile.diagonal: bottom-right aligned
            if lo is None:
                return offset <= hi if hi is not None else offset == offset
            return (offset >= lo) & (offset <= hi) if hi is not None else offset >= lo

        return offsets
    if kind is Lengths:
        lengths = mask.key_lengths.to(device)
        return lambda b, h, q_idx, kv_idx: kv_idx < lengths[_pick(b, lengths.shape[0])]
    if kind is Starts:
        first = mask.key_starts.to(device)
        return lambda b, h, q_idx, kv_idx: kv_idx >= first[_pick(b, first.shape[0])]
    if kind is Documents:
        ids_q, ids_k = mask.ids_q.to(device), mask.ids_k.to(device)
        return lambda b, h, q_idx, kv_idx: ids_q[_pick(b, ids_q.shape[0]), q_idx] == ids_k[_pick(b, ids_k.shape[0]), kv_idx]
    if kind is Dense:
        m = as_heads(mask.mask.to(device), 4)  # (b|1, h|1, i|1, j|1)
        sizes = m.shape
        return lambda b, h, q_idx, kv_idx: m[_pick(b, sizes[0]), _pick(h, sizes[1]), _pick(q_idx, sizes[2]), _pick(kv_idx, sizes[3])]
    if kind is MaskMod:
        fn, B, H = mask.mask_mod, mask.B or 1, mask.H or 1
        # qkv evaluates it over arange(B or 1), arange(H or 1) and broadcasts: index 0 along a dim of 1
        return lambda b, h, q_idx, kv_idx: fn(_pick(b, B), _pick(h, H), q_idx, kv_idx)
    if kind is FlexBlocks:
        return _blocks_fn(mask, device)
    raise TypeError(mask_problem(mask))  # supports() declined it first


def _blocks_fn(mask: FlexBlocks, device) -> Callable:
    """torch's BlockMask read entry by entry: listed full blocks allowed, partial ones through its mask_mod."""
    states = mask.states.to(device)  # (B, H, nq, nk) int8: 0 not listed, 1 partial, 2 full
    inner, qb, kb = mask.block_mask.mask_mod, mask.q_block, mask.kv_block
    sb, sh = states.shape[:2]
    # the mask_mod at the b and h FlexBlocks evaluates it at: the call's own where it was given the call's
    # batch and heads for a block mask made with B=None / H=None (as flex does), else 0 along a dim of 1
    mb, mh = mask._mod.B or 1, mask._mod.H or 1

    def blocks(b, h, q_idx, kv_idx):
        state = states[_pick(b, sb), _pick(h, sh), q_idx // qb, kv_idx // kb]
        return (state == 2) | ((state == 1) & inner(_pick(b, mb), _pick(h, mh), q_idx, kv_idx))

    return blocks


def block_mask(req: Request, mod: Callable | None = None):
    """torch's ``BlockMask`` for ``req.mask`` with its ``mask_mod`` (``mod``, else :func:`mask_mod`'s); None without a mask.

    A cached one (the module docstring says which) keeps the ``mask_mod`` it was built with:
    it reads the very tensors this call's would.
    """
    mask = req.mask
    if mask is None:
        return None
    if type(mask) is FlexBlocks and _usable_as_is(mask, req):
        return mask.block_mask
    described = _describe(mask)
    tensors = _signature_tensors(mask)
    key = None if described is None else (described, req.i, req.j, str(req.q.device), req.q.shape[0], req.heads)
    if key is not None:
        with _cache_lock:
            found = _cache.get(key)
            if found is not None and _same(found[0], tensors):
                _cache.move_to_end(key)
                return found[1]
    made = _build(mask, mask_mod(req) if mod is None else mod, req.i, req.j, req.q.device)
    if key is not None:
        with _cache_lock:
            _cache[key] = (tensors, made)  # the tensors kept alive with it: their ids stay theirs
            _cache.move_to_end(key)
            while len(_cache) > CACHE:
                _cache.popitem(last=False)
    return made


def _usable_as_is(mask: FlexBlocks, req: Request) -> bool:
    """Whether flex, given torch's BlockMask itself, reads it as qkv does: flex evaluates the mask_mod at every
    batch row's and head's own b and h, qkv at 0 along a dim the block mask was made without (B=None) unless
    it was given the call's (``FlexBlocks(bm, batch, heads)``)."""
    bm = mask.block_mask
    fn = bm.mask_mod
    same_b = (mask._mod.B or 1) == req.q.shape[0] or req.q.shape[0] == 1 or not reads_argument(fn, 0)
    same_h = (mask._mod.H or 1) == req.heads or req.heads == 1 or not reads_argument(fn, 1)
    return bm.kv_num_blocks.device == req.q.device and tuple(bm.seq_lengths) == (req.i, req.j) and same_b and same_h



def _build(mask: Mask, mod: Callable, i_len: int, j_len: int, device):
    """The block lists from qkv's tiles, a band of query blocks at a time (see the module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    nk = math.ceil(j_len / BLOCK)  # key blocks; query blocks go a band at a time
    first = as_heads(mask.tile(Tile(0, min(BLOCK, i_len), 0, j_len, i_len, j_len, device)), 4)
    band = BLOCK * max(1, BAND_ELEMENTS // (first.shape[0] * first.shape[1] * BLOCK * nk * BLOCK))
    partial, full = [], []
    for i0 in range(0, i_len, band):
        i1 = min(i0 + band, i_len)
        allowed = first if i0 == 0 and i1 <= BLOCK else as_heads(mask.tile(Tile(i0, i1, 0, j_len, i_len, j_len, device)), 4)
        # a band's batch and head dims are its own (a block mask's partial blocks read b and h, its full ones not)
        mb, mh = allowed.shape[:2]
        allowed = allowed.expand(mb, mh, i1 - i0, j_len)
        rows = math.ceil((i1 - i0) / BLOCK)
        # padding is masked: a ragged edge block is never full, as in create_block_mask
        allowed = F.pad(allowed, (0, nk * BLOCK - j_len, 0, rows * BLOCK - (i1 - i0)))
        counts = allowed.reshape(mb, mh, rows, BLOCK, nk, BLOCK).sum(dim=(3, 5))  # (mb, mh, rows, nk)
        full.append(counts == BLOCK * BLOCK)
        partial.append((counts > 0) & (counts < BLOCK * BLOCK))
    lead = torch.broadcast_shapes(*(x.shape[:2] for x in full))
    partial, full = ([x.expand(*lead, *x.shape[2:]) for x in xs] for xs in (partial, full))
    kv_num, kv_idx = _ordered(torch.cat(partial, dim=2))
    full_num, full_idx = _ordered(torch.cat(full, dim=2))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mod,
                                    seq_lengths=(i_len, j_len))  # fmt: skip


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(count (.., nq), indices (.., nq, nk))`` int32 of a bool ``(.., nq, nk)``: listed blocks first, in order."""
    dense = blocks.to(torch.int32)
    return dense.sum(dim=-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def _describe(mask: Mask) -> tuple | None:
    """A hashable description of a mask of positions and tensors, or None (programs: never cached).

    Tensors are described by identity and version (``_version`` grows with every in-place
    change), so a cached entry is used only for the very tensors, unchanged.
    """
    kind = type(mask)
    if kind in (And, Or):
        a, b = _describe(mask.a), _describe(mask.b)
        return None if a is None or b is None else (kind.__name__, a, b)
    if kind in (Offsets, Window):
        return ("offsets", mask.lo, mask.hi)
    if kind not in (Lengths, Starts, Documents, Dense):
        return None
    tensors = _signature_tensors(mask)
    versions = [version(x) for x in tensors]
    if any(v is None for v in versions):
        return None
    return (kind.__name__, *((id(x), x.device.type, v) for x, v in zip(tensors, versions)))


def _signature_tensors(mask: Mask) -> list[Tensor]:
    kind = type(mask)
    if kind in (And, Or):
        return _signature_tensors(mask.a) + _signature_tensors(mask.b)
    if kind is Lengths:
        return [mask.key_lengths]
    if kind is Starts:
        return [mask.key_starts]
    if kind is Documents:
        return [mask.ids_q, mask.ids_k]
    if kind is Dense:
        return [mask.mask]
    return []


def _same(kept: list[Tensor], tensors: list[Tensor]) -> bool:
    """The cache entry holds these very tensors (kept alive by it, so their ids are theirs)."""
    return len(kept) == len(tensors) and all(a is b for a, b in zip(kept, tensors))


def clear_cache() -> None:
    """Forget every cached block mask."""
    with _cache_lock:
        _cache.clear()


# --------------------------------------------------------------------------- scores


def score_mod(req: Request) -> Callable | None:
    """``fn(score, b, h, q_idx, kv_idx)``: the bias, then the caller's score_mod (None when there is neither)."""
    bias, user = req.bias, _kernel_form(req.score_mod, req)
    if bias is None and user is None:
        return None
    device = req.q.device
    acc = torch.float64 if req.q.dtype == torch.float64 else torch.float32  # flex's working precision
    slopes = profile = dense = None
    if isinstance(bias, ALiBi):
        slopes = bias.slopes.to(device=device, dtype=acc)  # (h|1,)
        shift = torch.tensor(req.j - req.i, device=device)
    elif isinstance(bias, LazyBias):
        profile = _profile(bias, req.i, req.j, device).to(acc)  # (h|1, L)
        last = torch.tensor(req.i - 1, device=device)
    elif bias is not None:
        dense = as_heads(bias, 4).to(acc)  # (b|1, h|1, i|1, j|1)

    def composed(score, b, h, q_idx, kv_idx):
        if slopes is not None:
            score = score - slopes[_pick(h, slopes.shape[0])] * (kv_idx - q_idx - shift).abs()
        if profile is not None:
            score = score + profile[_pick(h, profile.shape[0]), kv_idx - q_idx + last]
        if dense is not None:
            s = dense.shape
            score = score + dense[_pick(b, s[0]), _pick(h, s[1]), _pick(q_idx, s[2]), _pick(kv_idx, s[3])]
        if user is not None:
            score = user(score, b, h, q_idx, kv_idx)
        return score

    return composed


#: Whether a soft cap in half precision on CUDA is lowered as ``c·(2σ(2s/c) − 1)`` (:func:`_kernel_form`).
SIGMOID_SOFT_CAP = True


def _kernel_form(user: Callable | None, req: Request) -> Callable | None:
    """The caller's score_mod as the kernel computes it: :class:`~qkv.SoftCap` in bfloat16 or float16 on CUDA
    as ``c · (2σ(2s/c) − 1)``, the same function (``tanh x = 2σ(2x) − 1``).

    Inductor writes ``torch.tanh`` as libdevice's precise ``tanh`` (a branchy polynomial per
    logit, in a kernel otherwise bound by its tensor cores) and ``torch.sigmoid`` as Triton's
    ``1 / (1 + exp(-x))`` on the fast exponential. In float32 logits the sigmoid form is off
    by at most about ``2 · 2^-24 · c`` (``2σ − 1`` near 0 cancels to one ulp of 1), far
    below one rounding of a half-precision result; its derivative ``4σ(1 − σ)`` stays finite
    for any logit. float32 and float64 calls, and other devices, keep ``tanh``.
    """
    if not (
        SIGMOID_SOFT_CAP and isinstance(user, SoftCap) and req.q.device.type == "cuda"
        and req.q.dtype in (torch.bfloat16, torch.float16)
    ):  # fmt: skip
        return user
    cap, twice_inverse = user.cap, 2.0 / user.cap

    def soft_cap(score, b, h, q_idx, kv_idx):
        return (2.0 * torch.sigmoid(score * twice_inverse) - 1.0) * cap

    return soft_cap


def _profile(bias: LazyBias, i_len: int, j_len: int, device) -> Tensor:
    """``(h|1, L)``: the bias at offsets ``-(j - 1) .. i - 1``, differentiable in its parameters.

    A one-row tile whose columns run over every offset, as ``tiling.tiles.BiasSource``
    builds it; index ``n`` is offset ``n - (i - 1) - (j - i)``, so the entry of query
    ``q_idx`` and key ``kv_idx`` is ``kv_idx - q_idx + i - 1``.
    """
    lo = -(i_len - 1) - (j_len - i_len)
    t = Tile(0, 1, 0, i_len + j_len - 1, 1, 1 - lo, device)
    return bias.tile(t)[:, 0, :]
