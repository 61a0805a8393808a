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
  ``n_buckets=(f_1, f_2, …)`` hashes with one rotation per factor and combines the indices
  into ``Π f`` buckets (the factorised buckets of the authors' trax code and of HF's
  Reformer, meant for long sequences): ``i/64`` buckets cost ``Σ f/2`` columns of
  ``xR``, about ``√(i/64)``, instead of ``i/128``, so hashing stops growing as ``i²``.
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
the arithmetic. Every op runs with the caller's thread count. The pieces (hashing, intervals,
codes, windows, the kernel and its plain twin, round combination) live in private
helper modules, one of them for a single round's masks and kernel calls.

Causal (``causal=True``) also drops keys after the query; any bool mask ``(b, h, i, j)`` is
honoured by reading its entries for the pairs inside the chunks. Causal here means no query
attends to a later key, not that a prefix's outputs are those of the prefix alone: which keys
share a query's chunks depends on the buckets and sorted positions of every token, so a later
token changes the chunks and, with ``n_buckets > 1``, the earlier outputs (the Reformer's own
chunking; a causal LM trained with it reads its whole sequence at once and cannot be run token
by token with a cache). A length that is not a
multiple of ``chunk_size`` is padded with tokens that sort last, in a bucket of their own;
so is a token a key padding mask ``(b|1, h|1, 1, j)`` hides (a padded batch's padding): whatever
it holds then moves no other token's chunk, and a right-padded row's real outputs are those of the
row alone. Such a token's own row sees only its bucket's keys, all hidden: 0, as a row that sees
no key. (A mask of ``(i, j)`` hides edges: a key it hides from every query keeps its token's
query in its own bucket, and so its place in the chunks.)

Randomness: the rotations are a buffer drawn from the module's generator (``seed`` or
``generator``, reproducible). The paper hashes with fresh rotations at every step; here
that is ``redraw_interval=1`` in training mode (the default), while evaluation keeps the
current rotations so that repeated calls agree. ``redraw()`` draws new ones.

``return_weights=True`` returns ``(out, weights (b, h, i, i))``: the effective weights
scattered into a dense matrix, ``O(i²)`` memory, for inspection only.

Checked in the test suite against: exact shared-QK attention with the self
mask computed in the test (``n_buckets=1``, one chunk); a dense masked softmax over the
union of buckets-and-chunks rebuilt in the test from the module's own hashes (several
rounds, causal, padding, masks, the flash kernel and the plain fallback); a run at
``i = 4096`` whose largest intermediate is far below ``i²``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._args import positive_int
from ._common import Dims, Scratch, check_interval, check_scale, make_generator, needs_grad, repeat_kv
from ._lsh import combine_rounds, dense_weights, hash_buckets, interval_bounds, sort_buckets, window_codes
from ._lsh_round import RoundSetup, attend_round
from .base import ApproxAttention, unseen_zeroed

BLOCK_ROWS = 1 << 14  # sorted positions per block of (b, h) rows: a block's buffers stay ~50 MB at d = e = 64
SLAB = 1 << 21  # logits per slab of chunks: one mask of 8 MB (float32), one attention call


def bucket_factors(n_buckets: int | Sequence[int]) -> tuple[int, ...]:
    """``n_buckets`` as the factors the hash is built from: ``()`` for one bucket, else even sizes.

    An int is one factor (the paper's hash); a sequence is factorised buckets (``Π f`` in all).
    """
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, (int, Sequence)):
        raise TypeError(f"n_buckets: expected an int or a sequence of ints, got {type(n_buckets).__name__}")
    if isinstance(n_buckets, int):
        positive_int("n_buckets", n_buckets)
        if n_buckets != 1 and n_buckets % 2:
            raise ValueError(f"n_buckets: expected 1 or an even number (buckets come in ± pairs), got {n_buckets}")
        return () if n_buckets == 1 else (n_buckets,)
    factors = tuple(n_buckets)
    if not factors or any(isinstance(f, bool) or not isinstance(f, int) or f < 2 or f % 2 for f in factors):
        raise ValueError(f"n_buckets: expected factors that are even ints >= 2, got {n_buckets!r}")
    return factors


def random_rotations(
    n_hashes: int, d: int, n_buckets: int | Sequence[int], *, generator: torch.Generator | None = None
) -> Tensor:
    """Gaussian rotations ``(r, d, Σ f/2)`` for angular LSH (``f`` the factors of ``n_buckets``), float32."""
    device = generator.device if generator is not None else None
    columns = sum(f // 2 for f in bucket_factors(n_buckets))
    return torch.randn(n_hashes, d, columns, generator=generator, device=device)


def lsh_buckets(x: Tensor, rotations: Tensor, n_buckets: int | Sequence[int] | None = None) -> Tensor:
    """Bucket of each vector of ``x (b, h, n, d)`` in each round: ``(b, h, r, n)`` in ``[0, Π f)``.

    ``n_buckets`` as given to :func:`random_rotations`; None: one factor ``2 · columns`` (or 1).
    """
    b, h, n, d = x.shape
    factors = _factors(rotations, n_buckets)
    dtype = torch.promote_types(x.dtype, torch.float32)  # as lsh_attention hashes
    out = hash_buckets(x.reshape(b * h * n, d).to(dtype), rotations.to(device=x.device, dtype=dtype), factors)
    return out.view(-1, b, h, n).permute(1, 2, 0, 3)


def _factors(rotations: Tensor, n_buckets) -> tuple[int, ...]:
    width = rotations.shape[-1]
    factors = (2 * width,) if n_buckets is None and width else bucket_factors(1 if n_buckets is None else n_buckets)
    if sum(f // 2 for f in factors) != width:
        raise ValueError(f"n_buckets: {n_buckets!r} needs {sum(f // 2 for f in factors)} rotation columns, "
                         f"the rotations have {width}")  # fmt: skip
    return factors


def lsh_attention(
    q: Tensor,
    v: Tensor,
    rotations: Tensor,
    *,
    n_buckets: int | Sequence[int] | None = None,
    chunk_size: int = 64,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Shared-QK LSH attention of ``q (b, h, i, d)`` over ``v (b, h, i, e)`` -> ``(b, h, i, e)``.

    ``rotations (r, d, Σ f/2)`` for the factors ``f`` of ``n_buckets`` (None: one factor,
    ``2 · columns`` buckets); ``mask``: bool, 4-d, broadcastable to ``(b, h, i, i)``.
    """
    # Intra-op threads are left as the caller set them: scoping the bookkeeping to one thread
    # helped only on an oversubscribed machine (quiet, 2 threads: 0.51 s with the caller's
    # threads vs 0.59 s scoped at i = 16K) and changing the global count is not thread-safe.
    factors = _factors(rotations, n_buckets)
    return _lsh_attention(q, v, rotations, factors, chunk_size, mask, causal, scale, return_weights)


def _lsh_attention(q, v, rotations, factors, chunk_size, mask, causal, scale, return_weights):
    b, h, n, d = q.shape
    e = v.shape[-1]
    w = max(d, e)  # the flash kernel wants one head size: q, k or v get zero columns
    rounds = rotations.shape[0]
    size = min(chunk_size, n)
    length = math.ceil(n / size) * size
    step = max(1, BLOCK_ROWS // length)  # (b, h) rows per block
    # Buffers are reused across blocks, rounds and slabs, unless autograd has to keep them.
    bufs = Scratch(not needs_grad(q, v))
    setup = RoundSetup(size=size, w=w, scale=d**-0.5 if scale is None else scale, n=n, heads=h, dtype=q.dtype, device=q.device,
                       per_slab=max(1, SLAB // (size * 2 * size)), bufs=bufs,
                       mask=None if mask is None else mask.expand(b, h, n, n))  # fmt: skip
    hash_dtype = torch.promote_types(q.dtype, torch.float32)  # a bf16 projection would move tokens across borders
    rot = rotations.to(device=q.device, dtype=hash_dtype)
    qf = F.pad(q.reshape(b * h, n, d), (0, w - d)) if w != d else q.reshape(b * h, n, d)
    vf = F.pad(v.reshape(b * h, n, e), (0, w - e)) if w != e else v.reshape(b * h, n, e)
    results, weights = [], []
    # keys no query sees: zeroed (a nan there never reaches a product); a key padding mask's (b|1, h|1, 1, j), whose
    # hidden keys are whole tokens, not edges some query may not take, also sorts them into the padding bucket
    hidden = None if mask is None else ~mask.any(-2).expand(b, h, n).reshape(b * h, n)
    padding = hidden if mask is not None and mask.shape[-2] == 1 else None
    final = q.new_empty(b * h, n, e) if bufs.enabled else None  # written block by block
    for i0 in range(0, b * h, step):
        m = min(step, b * h - i0)
        qb, vb = qf[i0 : i0 + m], vf[i0 : i0 + m]
        buckets = torch.full((m, rounds, length), math.prod(factors), dtype=torch.long, device=q.device)  # padding last
        hashed = hash_buckets(qb.detach().reshape(m * n, w)[:, :d].to(hash_dtype), rot, factors)  # r (m n)
        buckets[:, :, :n] = hashed.view(rounds, m, n).transpose(0, 1)
        if padding is not None:
            buckets[:, :, :n].masked_fill_(padding[i0 : i0 + m, None, :], math.prod(factors))
        sorted_buckets, order = sort_buckets(buckets)  # m r length: slot -> position
        lo, hi = interval_bounds(sorted_buckets, size, causal, math.prod(factors) + 1)  # + the padding bucket
        code = window_codes(sorted_buckets, order, size) if rounds > 1 else None
        # k = q/|q| (F.normalize's eps), a multiplication by the reciprocal: a division costs several times more
        inverse = torch.linalg.vector_norm(qb, dim=-1, keepdim=True).clamp_min(1e-12).reciprocal()
        unit = torch.mul(qb, inverse, out=bufs.take("unit", qb.shape, qb)) if bufs.enabled else qb * inverse
        if hidden is not None:  # (in place in this block's own buffer)
            fill = unit.masked_fill_ if bufs.enabled else unit.masked_fill
            unit = fill(hidden[i0 : i0 + m, :, None], 0.0)
        sources = (qb.reshape(m * n, w), unit.reshape(m * n, w), vb.reshape(m * n, w))
        offsets = (torch.arange(m, device=q.device) * length)[:, None]
        starts = (torch.arange(m, device=q.device) * n)[:, None]
        heads = torch.arange(i0, i0 + m, device=q.device)
        outs, lses, kept = [], [], []
        for r in range(rounds):
            flat = (order[:, r] + offsets).reshape(-1)  # sorted slot -> flat position row (padding included)
            pick = (order[:, r].clamp(max=n - 1) + starts).reshape(-1)  # sorted slot -> row of the sources
            rows = [_sorted_rows(x, pick, size, m, n, length, bufs, key) for x, key in zip(sources, "qkv")]
            earlier = None
            if r > 0:  # the earlier rounds' codes, read in this round's sorted order
                earlier = code[:, :r].gather(-1, order[:, r : r + 1].expand(m, r, length))
                earlier = earlier.transpose(0, 1).reshape(r, m * length)
            out_r, lse_r, empty_r, logits_r = attend_round(setup, rows, lo[:, r], hi[:, r], earlier, order[:, r],
                                                           heads, flat, f"by_position{r}", return_weights)  # fmt: skip
            outs.append(out_r.view(m, length, w)[:, :n])
            lses.append(lse_r.view(m, length)[:, :n])
            kept.append(None if empty_r is None else ~empty_r.view(m, length)[:, :n])
            if return_weights:
                lse_sorted = lse_r.view(m, length).gather(1, order[:, r])  # by sorted slot
                weights.append((i0, order[:, r], logits_r - lse_sorted.view(-1, size, 1)))
        into = final[i0 : i0 + m] if final is not None and w == e else None
        out, share = combine_rounds(outs, lses, kept, into=into)
        if final is not None:
            if into is None:
                final[i0 : i0 + m] = out[..., :e]
        else:
            results.append(out[..., :e])
        if return_weights:
            weights.append((i0, None, share))
    out = (final if final is not None else torch.cat(results)).view(b, h, n, e)
    if not return_weights:
        return out
    return out, dense_weights(weights, b * h, n, length, size).view(b, h, n, n)


def _sorted_rows(source: Tensor, pick: Tensor, size: int, m: int, n: int, length: int, bufs: Scratch, key: str) -> Tensor:
    """``source (m n, w)`` rows in sorted-slot order after ``size`` zero rows -> ``(size + m length, w)``.

    Padding slots (the last ``length − n`` of each row: they sort last) are zero rows.
    """
    w = source.shape[-1]
    if bufs.enabled:
        rows = bufs.take("rows_" + key, (size + m * length, w), source)
        rows[:size] = 0
        torch.index_select(source, 0, pick, out=rows[size:])
    else:
        rows = torch.cat([source.new_zeros(size, w), source.index_select(0, pick)])
    if length != n:
        rows[size:].view(m, length, w)[:, n:] = 0
    return rows


class LSHAttention(ApproxAttention):
    """Reformer LSH attention (Kitaev et al. 2020) as a qkv mechanism; keys are the queries.

    ``forward(q (b, h, i, d), k (b, g, i, d), v (b, g, i, e), *, mask=None, causal=False,
    return_weights=False) -> out (b, h, i, e)`` or ``(out, weights (b, h, i, i))``. ``k`` is
    checked but not read (shared QK, see the module docstring).

    Args:
        dim_head: ``d``, the size the rotations are drawn for.
        n_buckets: hash buckets per round, 1 or even (the paper uses about ``i / chunk_size``);
            or a sequence of even factors, factorised buckets (``Π f`` buckets hashed with
            ``Σ f/2`` rotation columns instead of ``Π f / 2``, for long sequences).
        n_hashes: hash rounds; more rounds, fewer missed neighbours, proportionally more work.
        chunk_size: tokens per chunk of the sorted sequence; each sees ``2 · chunk_size`` keys.
        scale: logits are ``scale · q · k/|k|``; default ``1/sqrt(d)``.
        redraw_interval: draw new rotations every this many training-mode forward calls
            (1, the default, is the paper's fresh hash per step); None never redraws on its own.
        seed, generator: the random stream of the rotations.
    """

    # Causal, and any bool mask is honoured (see honoured_mask), so no mask_hint.
    method = "LSHAttention"

    def __init__(
        self,
        dim_head: int,
        *,
        n_buckets: int | Sequence[int] = 32,
        n_hashes: int = 4,
        chunk_size: int = 64,
        scale: float | None = None,
        redraw_interval: int | None = 1,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.dim_head = positive_int("dim_head", dim_head)
        self.factors = bucket_factors(n_buckets)
        self.n_buckets = n_buckets if isinstance(n_buckets, int) else self.factors
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
        dims, mask = self.check_call(q, k, v, mask=mask, causal=causal, return_weights=return_weights)
        if (empty := self.empty_result(q, k, v, dims, return_weights)) is not None:
            return empty
        v = unseen_zeroed(v, None if mask is None else mask.any(-2))  # (b|1, h|1, j): keys some query sees
        if self.training and self.redraw_interval is not None:
            self._steps += 1
            if self._steps % self.redraw_interval == 0:
                self.redraw()
        return lsh_attention(
            q,
            repeat_kv(v, dims.h),
            self.rotations,
            n_buckets=self.n_buckets,
            chunk_size=self.chunk_size,
            mask=mask,
            causal=causal,
            scale=self.scale,
            return_weights=return_weights,
        )

    def check_sizes(self, dims: Dims, k: Tensor) -> None:
        if dims.d != self.dim_head:
            raise ValueError(f"q: LSHAttention(dim_head={self.dim_head}) expects d={self.dim_head}, got d={dims.d}")
        if dims.j != dims.i:
            raise ValueError(
                f"k: LSHAttention uses the queries as keys (shared QK), so it needs j == i={dims.i}, "
                f"got j={dims.j} (shape {tuple(k.shape)}); use exact attention for cross-attention"
            )

    def honoured_mask(self, mask: Tensor | None, dims: Dims) -> Tensor | None:
        """Any bool mask, dense ``(b|1, h|1, i|1, i)``: the chunks read its entries pair by pair."""
        return mask

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, n_buckets={self.n_buckets}, n_hashes={self.n_hashes}, "
            f"chunk_size={self.chunk_size}, redraw_interval={self.redraw_interval}"
        )
