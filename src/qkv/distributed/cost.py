"""A cost model of sequence-parallel attention: time per layer for ring, Ulysses and hybrid at any P.

Shape legend: ``n`` sequence length, ``h`` query heads, ``g`` KV heads, ``d`` query/key size,
``e`` value size, ``P`` ranks, ``U`` ranks per Ulysses group (hybrid), ``R = P/U`` ring size.

Two fitted ingredients, both measured on the machine at hand:

* a link: sending ``m`` bytes between two ranks takes ``α + m·β`` (Hockney's model), fitted by
  least squares to a gloo ping-pong over message sizes (:func:`fit_link`);
* compute: one block of attention, forward and backward as the ring runs it
  (``backends.engines.key_blocks`` and the merge and gradient bookkeeping around it), takes
  ``c0 + γ·pairs·h·(d + e)`` seconds on one thread, fitted on blocks of a few sizes
  (:func:`fit_compute`). A rank with ``t`` cores is ``t`` times faster (the kernels are
  data-parallel; measured speed-ups on 2 cores are close to 2).

How many cores a rank has (:func:`cores_per_rank`): its threads, unless the ranks outnumber
the cores. ``P`` processes of ``t`` threads on ``C`` cores time-share them, so each gets
``min(t, C/P)``: 4 ranks on 2 cores run each at half a core. ``C`` is the machine's core
count, or fewer when other programs keep some busy: :func:`available_cores` measures it by
running the block kernel in ``C`` processes at once. Measured on a 2-core machine shared with
other work (load 3.5-4.8): 0.8-0.9 cores free; the causal zigzag ring at n = 8192 and
16384 took 2.4-3x the time predicted from the core count, and 2-8% (P = 2) and 17-23%
(P = 4) more than predicted from the free cores. The rest at P = 4 is not modelled: ranks
that time-share a core also wait for each other's turn at every exchange.

Prediction for one attention layer, forward and backward, causal, balanced (zigzag):

* ring: ``P`` steps; each step computes ``1/P`` of the rank's pairs and moves one shard of
  K/V (``(n/P)·g·(d+e)`` elements; the backward moves it again and its gradient back), and
  the two overlap, so a step costs ``max(compute, transfer)``. The shard moves and is
  computed in the ring's own pieces (``blocks.piece_rows``), one message and one block call
  (``c0``) each: under a causal mask, ``N(N+1)/2`` blocks over all ranks for ``N`` pieces;
* Ulysses: all of the rank's pairs (``1/P`` of the heads over the whole sequence) plus the
  all-to-alls (q, [k | v], out, and their gradients), which do not overlap the compute;
  each moves ``(P - 1)/P`` of a rank's tensor in ``P - 1`` messages;
* hybrid: Ulysses inside groups of ``U`` over the fast link, ring over ``R = P/U`` ranks over
  the slow one, whose steps carry ``1/U`` of the heads of ``U`` shards.

The links in :data:`LINKS` besides the fitted one are nominal figures: their bandwidth is
the standard's line rate, their latency an assumed typical value (stated with each).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .blocks import piece_rows
from .launch import run_local


@dataclass(frozen=True)
class Link:
    """``α + m·β`` seconds for ``m`` bytes between two ranks."""

    name: str
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    source: str  # where the figures come from

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta


#: Documented links (bandwidth: the standard's nominal line rate; latency: an assumed typical value).
LINKS = {
    "25GbE": Link("25 Gb/s Ethernet", 20e-6, 1 / 3.125e9,
                  "IEEE 802.3by line rate 25 Gb/s = 3.125 GB/s; latency 20 us assumed (TCP through gloo)"),
    "IB-EDR": Link("100 Gb/s InfiniBand EDR", 2e-6, 1 / 12.5e9,
                   "InfiniBand EDR 4x line rate 100 Gb/s = 12.5 GB/s; latency 2 us assumed (RDMA)"),
    "IB-NDR": Link("400 Gb/s InfiniBand NDR", 2e-6, 1 / 50e9,
                   "InfiniBand NDR 4x line rate 400 Gb/s = 50 GB/s; latency 2 us assumed (RDMA)"),
}  # fmt: skip


@dataclass(frozen=True)
class Compute:
    """``c0 + γ·pairs·h·(d + e)`` seconds per block (forward + backward) on one thread."""

    c0: float  # seconds per block call
    gamma: float  # seconds per pair·head·(d + e)

    def seconds(self, pairs: float, h: int, d: int, e: int, blocks: float = 1.0, cores: float = 1.0) -> float:
        return (blocks * self.c0 + self.gamma * pairs * h * (d + e)) / cores


@dataclass(frozen=True)
class Shape:
    """One attention layer: ``n`` tokens, ``h`` / ``g`` heads, sizes ``d``, ``e``, element bytes."""

    n: int
    h: int = 8
    g: int = 8
    d: int = 64
    e: int = 64
    bytes: int = 4  # float32

    @property
    def causal_pairs(self) -> float:
        return self.n * (self.n + 1) / 2


def cores_per_rank(p: int, cores: float | None = None, threads: int = 1) -> float:
    """Cores one of ``p`` ranks of ``threads`` threads computes on, sharing ``cores`` (default: this machine's).

    ``min(threads, cores / p)``: ranks that outnumber the cores time-share them, each slowed
    by ``p / cores``.
    """
    cores = float(os.cpu_count() or 1) if cores is None else float(cores)
    return min(float(threads), cores / p)


def ring_pieces(shape: Shape, p: int) -> tuple[int, int]:
    """``(pieces per rank, block calls per rank)`` of a causal zigzag ring over ``p`` ranks.

    Pieces as the ring cuts them: rows of ``max(g·(d+e)·bytes, h·e·4)`` bytes (K/V out, float32
    output back), ``blocks.piece_rows`` of them a piece, in each of a rank's two slots.
    """
    s = shape
    rows = piece_rows(max(s.g * (s.d + s.e) * s.bytes, s.h * s.e * 4))
    slot = math.ceil(s.n / (2 * p))
    per_rank = 2 * math.ceil(slot / rows)
    total = per_rank * p
    return per_rank, math.ceil(total * (total + 1) / 2 / p)


def ring(shape: Shape, p: int, link: Link, compute: Compute, cores: float = 1.0) -> float:
    """Seconds per layer (forward + backward) of ring attention over ``p`` ranks of ``cores`` cores each."""
    s = shape
    pairs = s.causal_pairs / p  # zigzag: balanced
    shard = s.n / p * s.g * (s.d + s.e) * s.bytes  # one rank's [k | v]
    pieces, calls = ring_pieces(s, p)
    work = compute.seconds(pairs, s.h, s.d, s.e, blocks=calls, cores=cores)
    if p == 1:
        return work
    messages = pieces
    # forward: K/V; backward: K/V again and the gradient back (float32)
    transfer = link.seconds(shard, messages) + link.seconds(shard + shard * 4 / s.bytes, 2 * messages)
    step = work / p
    return step + (p - 1) * max(step, transfer)


def ulysses(shape: Shape, p: int, link: Link, compute: Compute, cores: float = 1.0) -> float:
    """Seconds per layer of Ulysses over ``p`` ranks (``p`` must divide ``h``)."""
    s = shape
    work = compute.seconds(s.causal_pairs, max(1, s.h // p), s.d, s.e, blocks=1, cores=cores)
    if p == 1:
        return work
    rows = s.n / p
    # forward: q (h·d), [k | v] (g·(d+e)), out (h·e); backward: the same three again
    per_rank = rows * (s.h * s.d + s.g * (s.d + s.e) + s.h * s.e) * s.bytes
    moved = 2 * per_rank * (p - 1) / p
    return work + link.seconds(moved, 6 * (p - 1))


def hybrid(shape: Shape, p: int, u: int, inner: Link, outer: Link, compute: Compute, cores: float = 1.0) -> float:
    """Seconds per layer of Ulysses over groups of ``u`` (``inner`` link) and ring over ``p/u`` (``outer``)."""
    s = shape
    r = p // u
    heads = Shape(s.n, s.h // u, max(1, s.g // u), s.d, s.e, s.bytes)  # what one ring carries
    ring_part = ring(heads, r, outer, compute, cores)
    rows = s.n / p
    per_rank = rows * (s.h * s.d + s.g * (s.d + s.e) + s.h * s.e) * s.bytes
    return ring_part + inner.seconds(2 * per_rank * (u - 1) / u, 6 * (u - 1))


def predict(shape: Shape, p: int, link: Link, compute: Compute, cores: float = 1.0, node: int = 8,
            inner: Link | None = None) -> dict[str, float | None]:  # fmt: skip
    """``{"ring": s, "ulysses": s or None, "hybrid": s or None}`` per layer at ``p`` ranks."""
    out: dict[str, float | None] = {"ring": ring(shape, p, link, compute, cores)}
    out["ulysses"] = ulysses(shape, p, link, compute, cores) if shape.h % p == 0 else None
    u = min(node, p)
    ok = p % u == 0 and shape.h % u == 0 and u > 1 and p > u
    out["hybrid"] = hybrid(shape, p, u, inner or link, link, compute, cores) if ok else None
    return out


# -- fitting ---------------------------------------------------------------------------


def _ping_pong(rank: int, world: int, sizes: list[int]) -> list[float] | None:
    import torch.distributed as dist

    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4))
        times = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)
        out.append(statistics.median(times[2:]))
    return out if rank == 0 else None


def fit_link(sizes: list[int] | None = None, timeout: float = 300.0) -> Link:
    """``α``, ``β`` of gloo between two local processes, from a ping-pong over ``sizes`` bytes."""
    sizes = sizes or [2**k for k in range(10, 25, 2)]
    times = run_local("qkv.distributed.cost:_ping_pong", 2, sizes, timeout=timeout, threads=1)[0]
    alpha, beta = _line(sizes, times)
    return Link("gloo, this machine", max(alpha, 0.0), beta, "fitted: gloo ping-pong between two local processes")


def fit_compute(sides: tuple[int, ...] = (128, 256, 512), h: int = 8, d: int = 64, e: int = 64,
                repeats: int = 3) -> Compute:  # fmt: skip
    """``c0``, ``γ`` of one block's forward + backward as the ring runs it, on one thread.

    A block is timed through the ring's own per-block code (``blocks.Work``): the framed
    request, ``backends.engines.key_blocks``'s kernels, the merge into the running ``(out, lse)`` and
    the gradients added into ``dq``, ``dk``, ``dv``; the bookkeeping is most of ``c0``.
    """
    from .. import checks
    from ..backends.tiling.threads import one_intra_op_thread
    from .blocks import Pieces, Work

    with one_intra_op_thread():
        xs, ts = [], []
        for side in sides:
            q, k, v = (torch.randn(1, h, side, n) for n in (d, d, e))
            req = checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False, scale=None,
                                 dropout=0.0, return_weights=False)  # fmt: skip
            qp, kp = req.score.prepare(q, k)
            work, piece = Work(req, side, side, 0, None, h), Pieces.cut(((0, side),), side, side)
            times = []
            for _ in range(repeats + 1):
                out, lse = torch.zeros(1, h, side, e), torch.full((1, h, side), float("-inf"))
                grads = [torch.zeros_like(x) for x in (qp, kp, v)]
                start = time.perf_counter()
                work.forward(qp, piece, kp, v, piece, None, None, out, lse)
                work.backward(qp, piece, kp, v, piece, None, None, out, lse, torch.ones_like(out), *grads, None, [])
                times.append(time.perf_counter() - start)
            xs.append(side * side * h * (d + e))
            ts.append(statistics.median(times[1:]))
    c0, gamma = _line(xs, ts)
    return Compute(max(c0, 0.0), gamma)


def _probe(rank: int, world: int, seconds: float) -> float:
    """Median seconds of one block's forward + backward, repeated for ``seconds`` (all ranks at once)."""
    import torch.distributed as dist

    from .. import checks
    from ..backends.engines import key_blocks

    q, k, v = (torch.randn(1, 8, 256, 64) for _ in range(3))
    req = key_blocks.prepare(checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False,
                                         scale=None, dropout=0.0, return_weights=False))  # fmt: skip
    dist.barrier()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        out, lse = key_blocks.forward(req)
        key_blocks.backward(req, out, lse, torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def available_cores(seconds: float = 1.0, cores: int | None = None, timeout: float = 300.0) -> float:
    """Cores free for our ranks now: ``C · t_alone / t_together``, at most ``C`` (the core count).

    The block kernel runs on one thread in one process, then in ``C`` processes at once; on an
    idle machine they take as long as one alone; when other programs keep cores busy, the
    ``C`` processes share what is left and each takes longer in proportion.
    """
    cores = int(os.cpu_count() or 1) if cores is None else int(cores)
    alone = run_local("qkv.distributed.cost:_probe", 1, seconds, timeout=timeout, threads=1)[0]
    together = max(run_local("qkv.distributed.cost:_probe", cores, seconds, timeout=timeout, threads=1))
    return min(float(cores), cores * alone / together)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b
