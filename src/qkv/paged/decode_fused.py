"""A tile of a decoding step through PyTorch's fused CPU kernel: every item of the tile in one call.

Shape legend: ``C`` items in the tile, ``L`` keys of an item, ``g`` KV heads, ``x = h / g``
query heads per KV head, ``d`` key size, ``e`` value size.

An item (a run of one request's pages, ``qkv.paged.items``) is one batch entry of the
kernel (``backends.tiling.flash_cpu``), its owner's ``x`` query heads of a KV head as ``x``
query rows of that head, so grouped heads need no copy of the keys::

    out_c, lse_c = flash(q[owner(c)] (g, x, d), K_c (g, L, d), V_c (g, L, e), mask_c)

``mask_c (1 or g, 1 or x, L)`` is 0 on a seen key and -inf on an unfilled slot or a key
outside the window, plus ALiBi's ``slope · (kp - qp)``; the scale goes to the kernel.
``qkv.paged.decode`` merges the items by their log-sum-exp.

Two things of the kernel are set right. A row whose every key is masked comes back with
``lse = 0``: it is set to ``-inf`` (only where a window or ALiBi's mask can hide a whole
item; with the unfilled slots alone, an item with no key is a filler block, dropped by the
merge). And an unfilled slot is read, weighted 0: where it holds nan or inf (a pool from
``torch.empty``) the product ``0 · nan`` reaches the output, so ``qkv.paged.decode`` checks
the merged step and, where it is not finite, :func:`repair` runs the items whose output is
not finite again with their unseen keys and values zeroed (a nan in a seen key stays a nan,
as it would in the attention written out).

One kernel call per tile instead of one per request: measured on the Intel Xeon, 32 requests
of 64 to 2048 keys took 2.2 ms in one call of 256-key items against 3.2 ms in 32 calls of
SDPA's kernel over each request's contiguous keys. Requests that are one run of pages each go
to ``qkv.paged.runs`` instead (a call a run of the kernel's own grouped rows, nothing to merge
or mask), which on the AMD EPYC Zen 5 ran such steps 7-22% faster than the items.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.tiling import flash_cpu
from .items import Layout
from .options import Options


def usable(q: Tensor, pages, opts: Options) -> bool:
    """Whether the fused kernel can compute the logits: no soft cap or score_mod, pages in ``q``'s dtype, values of
    the keys' size (the kernel takes one head size)."""
    return (opts.soft_cap <= 0 and opts.score_mod is None and pages.dtype == q.dtype
            and pages.value_dim == pages.head_dim and flash_cpu.unusable(q) is None)  # fmt: skip


def attend(q: Tensor, qpos: Tensor, where: Layout, pages, opts: Options, masks: dict) -> tuple[Tensor, Tensor]:
    """Per slot of ``where`` ``(out (M, g, x, e), lse (M, g, x))``: queries ``q (M, g, x, d)`` at ``qpos (M,)``
    against the slot's keys and values in ``pages``, one kernel call per tile. ``masks`` keeps the plain
    masks (no window, no ALiBi) for the next layer of the same step. An output that is not finite is
    left as the kernel gave it: see :func:`repair`."""
    if not plain(opts):
        mask, any_seen = _masks(q, qpos, where, opts)
    else:  # the table alone decides them
        if q.dtype not in masks:
            masks[q.dtype] = _masks(q, qpos, where, opts)
        mask, any_seen = masks[q.dtype]
    outs, lses = [], []
    for a, b, src in where.tiles:
        q_t, K, V = _exact(q[a:b], *where.read((a, b, src), pages))
        out, lse = flash_cpu.forward(q_t, K, V, 0.0, False, attn_mask=mask[a:b], scale=opts.scale)[:2]
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    if plain(opts):  # an item without a key is a filler, whose owner the merge drops
        return out, lse
    return out, torch.where(any_seen, lse, float("-inf"))  # the kernel's lse is 0 for a row with no key


def repair(q: Tensor, qpos: Tensor, where: Layout, pages, opts: Options, masks: dict, out: Tensor,
           lse: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`attend`'s ``(out, lse)`` with the items whose output is not finite run again, their unseen keys and
    values zeroed (masked slots that held nan or inf); a nan at a seen key stays."""
    mask = masks[q.dtype][0] if plain(opts) else _masks(q, qpos, where, opts)[0]
    return _without_unseen(q, where, pages, mask, opts, out, lse)


def _masks(q: Tensor, qpos: Tensor, where: Layout, opts: Options) -> tuple[Tensor, Tensor]:
    """The kernel's additive masks ``(M, 1 or g, 1 or x, L)`` and whether a row sees any key ``(M, 1 or g, 1 or x)``
    (None without a window or ALiBi: a filler is the only item without a key):
    -inf on an unfilled slot or a key outside the window, ALiBi's ``slope · (kp - qp)`` on a seen key."""
    M, L = where.keys.shape[0], where.item_keys
    dtype, device = flash_cpu.mask_dtype(q), q.device
    if plain(opts):
        return _first_keys(L, dtype, device).index_select(0, where.keys).view(M, 1, 1, L), None  # every item sees a key
    kpos = (where.base[:, None] + torch.arange(L, device=device)).view(M, 1, 1, L)
    qpos = qpos.view(M, 1, 1, 1)
    seen = (torch.arange(L, device=device) < where.keys[:, None]).view(M, 1, 1, L)
    by_position = opts.seen(qpos, kpos)
    seen = seen if by_position is None else seen & by_position
    mask = torch.zeros((), dtype=dtype, device=device)
    if opts.alibi_slopes is not None:
        g, x = q.shape[1], q.shape[2]
        mask = opts.alibi_slopes.to(dtype).view(g, x, 1) * (kpos - qpos).to(dtype)  # (M, g, x, L)
    return torch.where(seen, mask, float("-inf")), seen.any(-1)


def plain(opts: Options) -> bool:
    """No window and no ALiBi: the mask is the unfilled slots alone (causal hides nothing from a decoding step)."""
    return opts.window_left < 0 and opts.alibi_slopes is None


def _without_unseen(q, where: Layout, pages, mask, opts: Options, out, lse) -> tuple[Tensor, Tensor]:
    """Items whose output is not finite, again with their unseen keys and values zeroed (masked slots held nan or inf)."""
    bad = ~torch.isfinite(out.sum((1, 2, 3)))
    out, lse = out.clone(), lse.clone()
    for a, b, src in where.tiles:
        at = bad[a:b].nonzero().flatten()
        if at.numel() == 0:
            continue
        q_t, K, V = _exact(q[a:b], *where.read((a, b, src), pages))
        keep = (mask[a:b].index_select(0, at) > float("-inf")).any(1).any(1).unsqueeze(1).unsqueeze(-1)  # (c, 1, L, 1)
        Kz = torch.where(keep, K.index_select(0, at), 0)
        Vz = torch.where(keep, V.index_select(0, at), 0)
        o, s = flash_cpu.forward(q_t.index_select(0, at), Kz, Vz, 0.0, False,
                                 attn_mask=mask[a:b].index_select(0, at), scale=opts.scale)[:2]  # fmt: skip
        out[a + at], lse[a + at] = o, s
    return out, lse


def _exact(q: Tensor, K: Tensor, V: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A tile's operands in float32 where they are half precision: each item's output is merged with its request's
    others by their log-sum-exp, and the kernel's half-precision output, rounded per item, left 6x the flash
    rule's bound where items' outputs cancel (the tile is read in bounded pieces: ``items.tile_keys``)."""
    acc = torch.promote_types(K.dtype, torch.float32)
    if q.dtype == acc and K.dtype == acc and V.dtype == acc:  # (three conversions that return their input still cost)
        return q, K, V
    return q.to(acc), K.to(acc), V.to(acc)


_FIRST_KEYS: dict[tuple, Tensor] = {}


def _first_keys(L: int, dtype: torch.dtype, device) -> Tensor:
    """``(L + 1, L)``: row ``k`` is the additive mask that sees the first ``k`` keys (0) and no other (-inf)."""
    key = (L, dtype, str(device))
    if key not in _FIRST_KEYS:
        seen = torch.arange(L, device=device)[None, :] < torch.arange(L + 1, device=device)[:, None]
        _FIRST_KEYS[key] = torch.where(seen, 0.0, float("-inf")).to(dtype)
    return _FIRST_KEYS[key]
