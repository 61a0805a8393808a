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
- **Rounds.** With ``P_p^(r)`` what query ``p`` sees in round ``r`` and ``N_pt`` the number of
  rounds in which it sees key ``t``, each round's logits get ``− log N_pt`` and the rounds
  are combined by their log-sum-exp ``z_r``: ``out_p = Σ_r exp(z_r − logsumexp_r z_r) out_p^(r)``.
  That is exactly softmax attention over the union ``∪_r P_p^(r)`` (section 2, "multi-round
  LSH attention"), each key counted once.

Causal (``causal=True``) also drops keys after the query; any bool mask ``(b, h, i, j)`` is
honoured by reading its entries for the pairs inside the chunks. Memory is
``O(b h r i · chunk)``: no ``(i, j)`` tensor is built. A length that is not a multiple of
``chunk_size`` is padded with tokens that sort last and are never attended to.

Randomness: the rotations are a buffer drawn from the module's generator (``seed`` or
``generator``, reproducible). The paper hashes with fresh rotations at every step; here
that is ``redraw_interval=1`` in training mode (the default), while evaluation keeps the
current rotations so that repeated calls agree. ``redraw()`` draws new ones.

``return_weights=True`` returns ``(out, weights (b, h, i, i))``: the effective weights
scattered into a dense matrix, ``O(i²)`` memory, for inspection only.

Checked against (tests/test_approx_reformer.py): exact shared-QK attention with the self
mask computed in the test (``n_buckets=1``, one chunk); a dense masked softmax over the
union of buckets-and-chunks rebuilt in the test from the module's own hashes (several
rounds, causal, padding); a run at ``i = 4096`` whose largest intermediate is far below ``i²``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor, nn

from .._args import positive_int
from ._common import (
    check_flags,
    check_interval,
    check_qkv,
    check_scale,
    dense_mask,
    make_generator,
    repeat_kv,
)


def random_rotations(
    n_hashes: int, d: int, n_buckets: int, *, generator: torch.Generator | None = None
) -> Tensor:
    """Gaussian rotations ``(r, d, n_buckets // 2)`` for angular LSH, float32."""
    device = generator.device if generator is not None else None
    return torch.randn(n_hashes, d, n_buckets // 2, generator=generator, device=device)


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Bucket of each vector of ``x (b, h, n, d)`` in each round: ``(b, h, r, n)`` in ``[0, n_buckets)``.

    ``argmax([xR; −xR])``; with zero-width rotations (``n_buckets=1``) every bucket is 0.
    """
    b, h, n, _ = x.shape
    if rotations.shape[-1] == 0:
        return torch.zeros(b, h, rotations.shape[0], n, dtype=torch.long, device=x.device)
    proj = einsum(x, rotations.to(x), "b h n d, r d k -> b h r n k")
    return torch.cat([proj, -proj], dim=-1).argmax(-1)


def _per_round(x: Tensor, order: Tensor) -> Tensor:
    """``x (b, h, n, f)`` read in each round's order ``(b, h, r, n)`` -> ``(b, h, r, n, f)``."""
    b, h, r, n = order.shape
    f = x.shape[-1]
    return x[:, :, None].expand(b, h, r, n, f).gather(3, order[..., None].expand(b, h, r, n, f))


def _with_previous(x: Tensor) -> Tensor:
    """Chunks ``(b, h, r, c, x, ...)`` joined with the chunk before them -> ``(b, h, r, c, 2x, ...)``."""
    return torch.cat([x, x.roll(1, dims=3)], dim=4)


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
    b, h, n, d = q.shape
    e = v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    n_buckets = max(1, 2 * rotations.shape[-1])
    size = min(chunk_size, n)
    length = math.ceil(n / size) * size  # padded length, a whole number of chunks
    chunks = length // size
    pad = length - n

    buckets = lsh_buckets(q.detach(), rotations)  # b h r n
    buckets = F.pad(buckets, (0, pad), value=n_buckets)  # padding sorts after every real bucket
    rounds = buckets.shape[2]
    positions = torch.arange(length, device=q.device)
    order = (buckets * length + positions).argsort(-1)  # sorted slot -> position; keys are unique
    slot = order.argsort(-1)  # position -> sorted slot

    queries = F.pad(q, (0, 0, 0, pad))
    keys = F.normalize(queries, dim=-1)
    values = F.pad(v, (0, 0, 0, pad))
    split = "b h r (c x) f -> b h r c x f"
    sq = rearrange(_per_round(queries, order), split, x=size)
    sk = _with_previous(rearrange(_per_round(keys, order), split, x=size))
    sv = _with_previous(rearrange(_per_round(values, order), split, x=size))
    qpos = rearrange(order, "b h r (c x) -> b h r c x", x=size)
    kpos = _with_previous(qpos)
    qbucket = buckets.gather(-1, order).view_as(qpos)
    kbucket = _with_previous(qbucket)

    logits = einsum(sq, sk, "b h r c x d, b h r c y d -> b h r c x y") * scale
    allowed = (qbucket[..., :, None] == kbucket[..., None, :]) & (kpos < n)[..., None, :]
    first = torch.zeros(chunks, 1, 2 * size, dtype=torch.bool, device=q.device)
    first[0, :, size:] = True  # the first chunk has no previous chunk (roll wrapped the last one in)
    allowed = allowed & ~first
    if causal:
        allowed = allowed & (kpos[..., None, :] <= qpos[..., :, None])
    if mask is not None:
        full = mask.expand(b, h, n, n)
        bi = torch.arange(b, device=q.device).view(b, 1, 1, 1, 1, 1)
        hi = torch.arange(h, device=q.device).view(1, h, 1, 1, 1, 1)
        allowed = allowed & full[bi, hi, qpos.clamp(max=n - 1)[..., :, None], kpos.clamp(max=n - 1)[..., None, :]]

    if rounds > 1:
        # N_pt: in how many rounds query p sees key t (same bucket, same or previous chunk).
        chunk_of = slot // size  # b h r n
        seen = torch.zeros_like(logits)
        for other in range(rounds):
            cq = chunk_of[:, :, other].gather(-1, qpos.flatten(2)).view_as(qpos)
            ck = chunk_of[:, :, other].gather(-1, kpos.flatten(2)).view_as(kpos)
            bq = buckets[:, :, other].gather(-1, qpos.flatten(2)).view_as(qpos)
            bk = buckets[:, :, other].gather(-1, kpos.flatten(2)).view_as(kpos)
            near = (ck[..., None, :] == cq[..., :, None]) | (ck[..., None, :] == cq[..., :, None] - 1)
            seen = seen + (near & (bk[..., None, :] == bq[..., :, None])).to(seen.dtype)
        logits = logits - seen.clamp_min(1).log()

    lowest = torch.finfo(logits.dtype).min
    itself = qpos[..., :, None] == kpos[..., None, :]
    logits = logits.masked_fill(~allowed, lowest)
    # Self pairs at lowest/2: zero weight next to any real key, all the weight if alone.
    logits = logits.masked_fill(itself & allowed, lowest / 2)
    lse = logits.logsumexp(-1)  # b h r c x
    probs = (logits - lse[..., None]).exp() * allowed  # rows with nothing allowed are zeros
    out = einsum(probs, sv, "b h r c x y, b h r c y e -> b h r c x e")
    out = rearrange(out, "b h r c x e -> b h r (c x) e")
    lse = rearrange(lse.masked_fill(~allowed.any(-1), lowest), "b h r c x -> b h r (c x)")

    # Back to positions, then combine the rounds by their share of the total mass.
    out = out.gather(3, slot[..., None].expand(b, h, rounds, length, e))
    share = lse.gather(3, slot).softmax(dim=2)  # b h r n
    result = (share[..., None] * out).sum(2)[:, :, :n]
    if not return_weights:
        return result
    weights = probs * rearrange(share.gather(3, order), "b h r (c x) -> b h r c x", x=size)[..., None]
    flat = (qpos[..., :, None] * length + kpos[..., None, :]).expand_as(weights)
    dense = torch.zeros(b, h, length * length, dtype=weights.dtype, device=q.device)
    dense = dense.scatter_add(2, flat.flatten(2), weights.flatten(2))
    return result, dense.view(b, h, length, length)[:, :, :n, :n]


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
