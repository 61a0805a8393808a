"""Reformer's LSH attention: shared-QK attention restricted to tokens that hash alike.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length (``j == i`` here), ``d`` query/key size, ``e`` value size, ``r`` hash rounds,
``c`` chunks, ``x`` queries of a chunk, ``y`` keys a chunk sees (``2 · chunk_size``).

Kitaev, Kaiser, Levskaya, "Reformer: The Efficient Transformer" (ICLR 2020), section 2.

- **Shared QK.** Keys are the normalised queries, ``k_t = q_t / |q_t|``; the ``k``
  argument is checked for shape (so the module is a drop-in mechanism) but its values are
  not used. A token's key is its own query direction, so it would attend mostly to itself:
  the self pair gets a huge penalty and is used only when nothing else is available
  (e.g. the first token of a causal sequence).
- **Hash.** Per round a random rotation ``R (d, n_buckets/2)``; ``bucket(x) =
  argmax([xR; −xR])`` (angular LSH). ``n_buckets=1`` puts every token in one bucket.
- **Sort and chunk.** Per round, tokens are sorted by ``(bucket, position)`` and cut into
  chunks of ``chunk_size``; each chunk attends to itself and to the chunk before it in
  sorted order (the first chunk has none), and only to keys of the query's own bucket
  (eq. 3, ``m(j, P_i) = ∞`` outside the bucket). Logits ``scale · q_p · k_t``.
- **Rounds.** A key that query ``p`` sees in several rounds is counted once: the paper
  subtracts ``log N_pt`` (``N_pt`` rounds see the pair) and combines the rounds by their
  log-sum-exp ``z_r``, ``out_p = Σ_r exp(z_r − logsumexp_r z_r) out_p^(r)``, which is softmax
  attention over the union ``∪_r P_p^(r)`` (section 2, "multi-round LSH attention"). Here
  each pair is kept in the first round that sees it and masked in later ones: the same
  union, each key once, and no count to compute.

How it is computed (``O(b h r i · chunk)`` time and memory, no ``(i, j)`` tensor): inside a
round, the sorted order is bucket-major and position-ordered within a bucket, so the keys a
sorted query may see form one interval of its window (its bucket, cut to the window;
causal: up to itself). Whether round ``r'`` already paired ``p`` and ``t`` is one integer
test: with ``code(s)`` counting +2 at each bucket change and +1 at each chunk start along
round ``r'``'s sorted order, ``p`` sees ``t`` in that round exactly when
``code(p) − code(t) ∈ {0, 1}`` (same bucket and same or previous chunk). The intervals, the
earlier-round test and the self penalty become one additive mask per slab of chunks, and
one fused attention call (PyTorch's CPU flash kernel, which also returns each row's
log-sum-exp) does the rest. Work is done in blocks of ``(b, h)`` rows and slabs of chunks
with buffers reused across them: at long lengths, allocating fresh pages costs as much as
the arithmetic. Every op runs with the caller's thread count. The pieces (hashing, intervals, codes, windows, the kernel and
its plain twin, round combination) are in :mod:`qkv.approx._lsh`.

Causal (``causal=True``) also drops keys after the query; any bool mask ``(b, h, i, j)`` is
honoured by reading its entries for the pairs inside the chunks. A length that is not a
multiple of ``chunk_size`` is padded with tokens that sort last, in a bucket of their own.

Randomness: the rotations are a buffer drawn from the module's generator (``seed`` or
``generator``, reproducible). The paper hashes with fresh rotations at every step; here
that is ``redraw_interval=1`` in training mode (the default), while evaluation keeps the
current rotations so that repeated calls agree. ``redraw()`` draws new ones.

``return_weights=True`` returns ``(out, weights (b, h, i, i))``: the effective weights
scattered into a dense matrix, ``O(i²)`` memory, for inspection only.

Checked against (tests/test_approx_reformer.py): exact shared-QK attention with the self
mask computed in the test (``n_buckets=1``, one chunk); a dense masked softmax over the
union of buckets-and-chunks rebuilt in the test from the module's own hashes (several
rounds, causal, padding, masks, the flash kernel and the plain fallback); a run at
``i = 4096`` whose largest intermediate is far below ``i²``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import positive_int
from ._common import check_flags, check_interval, check_qkv, check_scale, dense_mask, make_generator, repeat_kv
from ._lsh import (
    Buffers,
    chunk_attention,
    combine_rounds,
    dense_weights,
    hash_into,
    interval_bounds,
    window_codes,
    windows,
)

BLOCK_ROWS = 1 << 14  # sorted positions per block of (b, h) rows: a block's buffers stay ~50 MB at d = e = 64
SLAB = 1 << 21  # logits per slab of chunks: one mask of 8 MB (float32), one attention call
INTERVAL_TABLE = 1 << 20  # largest table of all (lo, hi) mask rows, in entries (chunk_size <= 50)


def random_rotations(
    n_hashes: int, d: int, n_buckets: int, *, generator: torch.Generator | None = None
) -> Tensor:
    """Gaussian rotations ``(r, d, n_buckets // 2)`` for angular LSH, float32."""
    device = generator.device if generator is not None else None
    return torch.randn(n_hashes, d, n_buckets // 2, generator=generator, device=device)


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Bucket of each vector of ``x (b, h, n, d)`` in each round: ``(b, h, r, n)`` in ``[0, n_buckets)``.

    ``argmax([xR; −xR])`` (first maximum on ties); with zero-width rotations (``n_buckets=1``)
    every bucket is 0.
    """
    b, h, n, d = x.shape
    rounds, _, half = rotations.shape
    if half == 0:
        return torch.zeros(b, h, rounds, n, dtype=torch.long, device=x.device)
    out = torch.empty(b * h * n, rounds, dtype=torch.long, device=x.device)
    hash_into(out, x.reshape(b * h * n, d), rotations.to(x))
    return out.view(b, h, n, rounds).permute(0, 1, 3, 2)


def lsh_attention(
    q: Tensor,
    v: Tensor,
    rotations: Tensor,
    *,
    chunk_size: int = 64,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Shared-QK LSH attention of ``q (b, h, i, d)`` over ``v (b, h, i, e)`` -> ``(b, h, i, e)``.

    ``rotations (r, d, n_buckets // 2)``; ``mask``: bool, 4-d, broadcastable to ``(b, h, i, i)``.
    """
    # Intra-op threads are left as the caller set them: scoping the bookkeeping to one thread
    # helped only on an oversubscribed machine (quiet, 2 threads: 0.51 s with the caller's
    # threads vs 0.59 s scoped at i = 16K) and changing the global count is not thread-safe.
    return _lsh_attention(q, v, rotations, chunk_size, mask, causal, scale, return_weights)


def _lsh_attention(q, v, rotations, chunk_size, mask, causal, scale, return_weights):
    b, h, n, d = q.shape
    e = v.shape[-1]
    w = max(d, e)  # the flash kernel wants one head size: q, k or v get zero columns
    rounds, _, half = rotations.shape
    n_buckets = max(1, 2 * half)
    size = min(chunk_size, n)
    length = math.ceil(n / size) * size
    step = max(1, BLOCK_ROWS // length)  # (b, h) rows per block
    # Buffers are reused across blocks, rounds and slabs, unless autograd has to keep them.
    bufs = Buffers(not (torch.is_grad_enabled() and (q.requires_grad or v.requires_grad)), q.device)
    call = _Call(size=size, w=w, scale=d**-0.5 if scale is None else scale, n=n, heads=h, dtype=q.dtype,
                 per_slab=max(1, SLAB // (size * 2 * size)), bufs=bufs,
                 mask=None if mask is None else mask.expand(b, h, n, n))  # fmt: skip
    rot = rotations.to(q)
    results, weights = [], []
    final = q.new_empty(b * h, n, e) if bufs.reuse else None  # written block by block
    for i0 in range(0, b * h, step):
        m = min(step, b * h - i0)
        qb, vb = q.reshape(b * h, n, d)[i0 : i0 + m], v.reshape(b * h, n, e)[i0 : i0 + m]
        buckets = torch.full((m, rounds, length), n_buckets, dtype=torch.long, device=q.device)  # padding sorts last
        if half:
            hashed = torch.empty(m * n, rounds, dtype=torch.long, device=q.device)
            hash_into(hashed, qb.detach().reshape(m * n, d), rot)
            buckets[:, :, :n] = hashed.view(m, n, rounds).transpose(1, 2)
        else:
            buckets[:, :, :n] = 0
        sorted_buckets, order = buckets.sort(dim=-1, stable=True)  # m r length: slot -> position
        lo, hi = interval_bounds(sorted_buckets, size, causal)
        code = window_codes(sorted_buckets, order, size) if rounds > 1 else None
        # [q | q/|q| | v] by position, zero-padded to the width w and the length
        table = bufs.get("table", (m * length, 3 * w), q.dtype).view(m, length, 3 * w)
        if w != d or w != e or length != n:
            table.zero_()
        table[:, :n, :d] = qb
        table[:, :n, w : w + d] = F.normalize(qb, dim=-1)
        table[:, :n, 2 * w : 2 * w + e] = vb
        offsets = (torch.arange(m, device=q.device) * length)[:, None]
        heads = torch.arange(i0, i0 + m, device=q.device)
        outs, lses, kept = [], [], []
        for r in range(rounds):
            # the same rows by sorted slot, after `size` zero rows (the first chunk's empty window half)
            flat = (order[:, r] + offsets).reshape(-1)
            if bufs.reuse:
                rows = bufs.get("rows", (size + m * length, 3 * w), q.dtype)
                rows[:size] = 0
                torch.index_select(table.view(-1, 3 * w), 0, flat, out=rows[size:])
            else:
                rows = torch.cat([table.new_zeros(size, 3 * w), table.view(-1, 3 * w).index_select(0, flat)])
            earlier = None
            if r > 0:  # the earlier rounds' codes, read in this round's sorted order
                earlier = code[:, :r].gather(-1, order[:, r : r + 1].expand(m, r, length))
                earlier = earlier.transpose(0, 1).reshape(r, m * length)
            out_r, lse_r, empty_r, logits_r = _round(call, rows, lo[:, r], hi[:, r], earlier, order[:, r], heads,
                                                     return_weights)  # fmt: skip
            back = torch.empty_like(order[:, r]).scatter_(-1, order[:, r], _arange(length, q.device).expand(m, length))
            back = (back[:, :n] + offsets).reshape(-1)  # position -> flat sorted row
            if bufs.reuse:
                outs.append(torch.index_select(out_r, 0, back, out=bufs.get(f"by_position{r}", (m * n, w), q.dtype)))
            else:
                outs.append(out_r.index_select(0, back))
            outs[-1] = outs[-1].view(m, n, w)
            lses.append(lse_r.index_select(0, back).view(m, n))
            kept.append(None if empty_r is None else ~empty_r.index_select(0, back).view(m, n))
            if return_weights:
                weights.append((i0, order[:, r], logits_r - lse_r.view(-1, size, 1)))
        out, share = combine_rounds(outs, lses, kept)
        if final is not None:
            final[i0 : i0 + m] = out[..., :e]
        else:
            results.append(out[..., :e])
        if return_weights:
            weights.append((i0, None, share))
    out = (final if final is not None else torch.cat(results)).view(b, h, n, e)
    if not return_weights:
        return out
    return out, dense_weights(weights, b * h, n, length, size).view(b, h, n, n)


def _arange(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device)


class _Call:
    """What every round of one call shares: sizes, the mask, the buffers, the interval tables."""

    def __init__(self, *, size, w, scale, n, heads, dtype, per_slab, bufs, mask):
        self.size, self.w, self.scale, self.n, self.heads = size, w, scale, n, heads
        self.per_slab, self.bufs, self.mask = per_slab, bufs, mask
        self.lowest = torch.finfo(dtype).min
        # Masked keys get `lowest`, keys seen in an earlier round `lowest / 2`, the self pair
        # `lowest / 16`: each is far below the next (exp of the gap is 0), all far below real logits.
        self.self_logit = self.lowest / 16
        y = torch.arange(2 * size + 1, device=bufs.device)
        # rows of the additive interval mask: `above[lo]` keeps y >= lo, `below[hi]` keeps y < hi
        self.above = y.new_zeros(2 * size + 1, 2 * size, dtype=dtype).masked_fill_(y[None, :-1] < y[:, None], self.lowest)
        self.below = y.new_zeros(2 * size + 1, 2 * size, dtype=dtype).masked_fill_(y[None, :-1] >= y[:, None], self.lowest)
        self.intervals = None  # all (lo, hi) rows at once when that table is small (chunk_size <= 50)
        if (2 * size + 1) ** 2 * 2 * size <= INTERVAL_TABLE:
            self.intervals = torch.minimum(self.above[:, None], self.below[None]).view(-1, 2 * size)


def _round(call, rows, lo, hi, earlier, order, heads, keep_logits):
    """One hash round of a block: ``(out (m length, w), lse (m length), empty or None, logits or None)`` by sorted slot.

    ``rows (size + m length, 3 w)``: ``[q | k | v]`` by sorted slot after ``size`` zero rows;
    ``lo, hi (m, length)``: the interval each slot may see; ``earlier (r', m length)``:
    window codes of the earlier rounds; ``order (m, length)``: slot -> position.
    """
    size, w, bufs = call.size, call.w, call.bufs
    total = rows.shape[0] - size
    dtype = rows.dtype
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    out = bufs.get("out", (total, w), dtype) if bufs.reuse else []
    lse = bufs.get("lse", (total,), dtype) if bufs.reuse else []
    empty = None if call.mask is None else torch.empty(total, dtype=torch.bool, device=rows.device)
    kept_logits = []
    if earlier is not None:
        rounds = earlier.shape[0]
        cq = 2 * earlier - 1
        ck = torch.cat([earlier.new_zeros(rounds, size), 2 * earlier], 1)
        stretch = torch.tensor(-call.lowest / 2, dtype=dtype)
    if call.mask is not None:
        positions = torch.cat([order.new_zeros(size), order.reshape(-1)]).clamp_(max=call.n - 1)
        chunks_per_row = order.shape[1] // size
    for g0 in range(0, total // size, call.per_slab):
        s = min(call.per_slab, total // size - g0)
        part = slice(g0 * size, (g0 + s) * size)
        bias = bufs.get("bias", (s, size, 2 * size), dtype)
        other = bufs.get("other", (s, size, 2 * size), dtype)
        if call.intervals is not None:  # one row per (lo, hi) pair
            torch.index_select(call.intervals, 0, lo[part] * (2 * size + 1) + hi[part], out=bias.view(-1, 2 * size))
        else:
            torch.index_select(call.above, 0, lo[part], out=bias.view(-1, 2 * size))
            torch.index_select(call.below, 0, hi[part], out=other.view(-1, 2 * size))
            torch.minimum(bias, other, out=bias)
        if earlier is not None:
            # |2 code(p) − 1 − 2 code(t)| is 1 exactly when an earlier round paired p and t
            cqs = cq[:, part].view(rounds, s, size, 1)
            cks = ck.as_strided((rounds, s, 1, 2 * size), (ck.stride(0), size, 0, 1), ck.storage_offset() + g0 * size)
            gap = torch.sub(cqs, cks, out=bufs.get("gaps", (rounds, s, size, 2 * size), ck.dtype)).abs_()
            if rounds > 1:
                gap = torch.amin(gap, 0, out=bufs.get("closest", (s, size, 2 * size), ck.dtype))
            else:
                gap = gap[0]
            # (gap − 2) · |lowest|/2: lowest/2 for a pair seen before, >= 0 (no change) otherwise
            torch.minimum(bias, torch.mul(gap.sub_(2), stretch, out=other), out=bias)
        bias[:, :, size:].diagonal(dim1=1, dim2=2).fill_(call.self_logit)
        if call.mask is not None:
            qpos = positions[size:][part].view(s, 1, size, 1)
            kpos = windows(positions[:, None], size, s, g0, slice(None)).view(s, 1, 1, 2 * size)
            row = torch.div(torch.arange(g0, g0 + s, device=rows.device), chunks_per_row, rounding_mode="floor")
            flat = heads[row].view(s, 1, 1, 1)
            allowed = call.mask[flat // call.heads, flat % call.heads, qpos, kpos].view(s, size, 2 * size)
            bias.masked_fill_(~allowed, call.lowest)
            empty[part] = (bias.amax(-1) < call.lowest / 4).view(-1)  # no key and not even itself
        q_s = rows[size:][part, :w].view(s, size, w)
        k_s, v_s = windows(rows, size, s, g0, slice(w, 2 * w)), windows(rows, size, s, g0, slice(2 * w, 3 * w))
        o, l = chunk_attention(q_s, k_s, v_s, bias, call.scale)
        if bufs.reuse:
            out[part].view(s, size, w).copy_(o)
            lse[part].view(s, size).copy_(l)
        else:
            out.append(o.reshape(-1, w))
            lse.append(l.reshape(-1))
        if keep_logits:
            kept_logits.append(torch.baddbmm(bias, q_s, k_s.transpose(1, 2), alpha=call.scale))
    if not bufs.reuse:
        out, lse = torch.cat(out), torch.cat(lse)
    return out, lse, empty, (torch.cat(kept_logits) if keep_logits else None)


class LSHAttention(nn.Module):
    """Reformer LSH attention (Kitaev et al. 2020) as a qkv mechanism; keys are the queries.

    ``forward(q (b, h, i, d), k (b, g, i, d), v (b, g, i, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, i))``. ``k`` is
    checked but not read (shared QK, see the module docstring).

    Args:
        dim_head: ``d``, the size the rotations are drawn for.
        n_buckets: hash buckets per round, 1 or even (the paper uses about ``i / chunk_size``).
        n_hashes: hash rounds; more rounds, fewer missed neighbours, proportionally more work.
        chunk_size: tokens per chunk of the sorted sequence; each sees ``2 · chunk_size`` keys.
        scale: logits are ``scale · q · k/|k|``; default ``1/sqrt(d)``.
        redraw_interval: draw new rotations every this many training-mode forward calls
            (1, the default, is the paper's fresh hash per step); None never redraws on its own.
        seed, generator: the random stream of the rotations.
    """

    def __init__(
        self,
        dim_head: int,
        *,
        n_buckets: int = 32,
        n_hashes: int = 4,
        chunk_size: int = 64,
        scale: float | None = None,
        redraw_interval: int | None = 1,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.dim_head = positive_int("dim_head", dim_head)
        positive_int("n_buckets", n_buckets)
        if n_buckets != 1 and n_buckets % 2:
            raise ValueError(f"n_buckets: expected 1 or an even number (buckets come in ± pairs), got {n_buckets}")
        self.n_buckets = n_buckets
        self.n_hashes = positive_int("n_hashes", n_hashes)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self.scale = check_scale(scale)
        self.redraw_interval = check_interval(redraw_interval)
        self.generator = make_generator(seed, generator)
        self._steps = 0
        self.register_buffer("rotations", self._draw())

    def _draw(self) -> Tensor:
        return random_rotations(self.n_hashes, self.dim_head, self.n_buckets, generator=self.generator)

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw new hash rotations from the module's generator (in place)."""
        self.rotations.copy_(self._draw())

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: object = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        dims = check_qkv(q, k, v)
        check_flags(causal, return_weights)
        if dims.d != self.dim_head:
            raise ValueError(f"q: LSHAttention(dim_head={self.dim_head}) expects d={self.dim_head}, got d={dims.d}")
        if dims.j != dims.i:
            raise ValueError(
                f"k: LSHAttention uses the queries as keys (shared QK), so it needs j == i={dims.i}, "
                f"got j={dims.j} (shape {tuple(k.shape)}); use exact attention for cross-attention"
            )
        mask = dense_mask(mask, dims, q.device)
        if self.training and self.redraw_interval is not None:
            self._steps += 1
            if self._steps % self.redraw_interval == 0:
                self.redraw()
        return lsh_attention(
            q,
            repeat_kv(v, dims.h),
            self.rotations,
            chunk_size=self.chunk_size,
            mask=mask,
            causal=causal,
            scale=self.scale,
            return_weights=return_weights,
        )

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, n_buckets={self.n_buckets}, n_hashes={self.n_hashes}, "
            f"chunk_size={self.chunk_size}, redraw_interval={self.redraw_interval}"
        )
