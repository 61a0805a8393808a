"""One rank of a large world (P = 64 .. 512) under the "fake" process group: shapes, bytes sent, memory.

The fake backend (``torch.distributed`` with a ``FakeStore``) runs every collective and
point-to-point call without communicating, so one process can play rank ``r`` of a world
of 512: the shapes that come out, the bytes the communication layer counts
(``qkv.distributed.comm``) and the heap the call needs can be checked at sizes no test
machine can spawn. Received buffers hold garbage, so values are not checked here (the
spawned-gloo tests do that).
"""

import pytest
import torch
import torch.distributed as dist

import qkv.distributed as qd
from qkv.distributed import comm

heap = pytest.importorskip("heap")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

ROWS, H, D = 16, 4, 8  # per rank: 16 rows (two zigzag chunks of 8), 4 heads of 8


@pytest.fixture
def world(request):
    """``world(P, rank)`` initialises the fake group; it is destroyed after the test."""

    def init(size, rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=size, store=fake_pg.FakeStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _inputs(rows=ROWS, h=H, g=H):
    torch.manual_seed(0)
    return [torch.randn(1, n, rows, D, requires_grad=True) for n in (h, g, g)]


def _step(strategy, q, k, v, **kw):
    """Bytes sent by one forward + backward, and the output's shape and gradients' shapes."""
    with comm.counting() as traffic:
        out = qd.attention(q, k, v, strategy=strategy, **kw)
        out.sum().backward()
    return dict(traffic.sent), out.shape


@pytest.mark.parametrize("size", [64, 256])
def test_ring_sends_its_kv_once_per_step(world, size):
    rank = size // 3
    world(size, rank)
    q, k, v = _inputs()
    sent, shape = _step("ring", q, k, v, causal=True)
    assert shape == (1, H, ROWS, D) and k.grad.shape == k.shape and q.grad.shape == q.shape
    piece = ROWS // 2 * H * 2 * D * 4  # one zigzag chunk's [k | v], float32 (one piece here)
    # zigzag + causal: every rank's late chunk sees this rank's early chunk (sent to all P - 1
    # others), but this rank's late chunk 2P-1-r only the ranks a < r, whose late chunks come
    # after it; the forward and the backward send the same pieces
    assert sent["kv"] == 2 * (size - 1 + rank) * piece
    # gradients go back for what this rank received: every early chunk, and the late chunks
    # of the ranks o > r (2P-1-o is before this rank's late chunk)
    assert sent["grad"] == (size - 1 + size - 1 - rank) * piece


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_window_sends_to_neighbours_only(world, layout):
    per_p = {}
    for size in (64, 512):
        world(size, size // 2)
        q, k, v = _inputs()
        sent, _ = _step("ring", q, k, v, mask=qd_window(12), layout=layout)
        per_p[size] = sent["kv"]
    chunk = ROWS * H * 2 * D * 4 // (1 if layout == "contiguous" else 2)  # one chunk's [k | v]
    # contiguous: a window of 12 keys reaches one rank back (16 rows each), so each chunk goes
    # to the next rank only. zigzag (chunks of 8 rows): the early chunk goes to the two ranks
    # after (their early chunks follow it), the late chunk to the two before; whatever P
    sends = 1 if layout == "contiguous" else 4
    assert per_p[64] == per_p[512] == 2 * sends * chunk  # forward and backward


@pytest.mark.parametrize("size", [64, 256])
def test_ring_sends_a_documents_keys_only_to_the_ranks_it_spans(world, size):
    """Packed documents of two ranks' rows, causal, contiguous: the first rank of a document sends
    its K/V to the second only (forward and backward), and receives nothing, so sends no gradient."""
    from qkv import masks

    world(size, size // 2)
    q, k, v = _inputs()
    ids = torch.arange(size * ROWS) // (2 * ROWS)
    sent, _ = _step("ring", q, k, v, mask=masks.documents(ids) & masks.causal(), layout="contiguous")
    packed = ROWS * H * 2 * D * 4
    assert sent.get("kv", 0) == 2 * packed and sent.get("grad", 0) == 0


def qd_window(left):
    from qkv import masks

    return masks.window(left)


def test_allgather_and_ulysses_bytes(world):
    size = 64
    world(size, 5)
    q, k, v = _inputs(h=size, g=size)  # Ulysses: P divides the heads
    local = ROWS * size * D * 4  # one rank's q (or k, v, out): float32
    sent, _ = _step("allgather", q, k, v, causal=True)
    assert sent["kv"] == (size - 1) * 2 * local  # k and v gathered in one message
    assert sent["grad"] == (size - 1) * 2 * local  # their gradients reduce-scattered
    for x in (q, k, v):
        x.grad = None
    sent, _ = _step("ulysses", q, k, v, causal=True)
    # forward: q, [k | v] and the output; backward: the same three in reverse
    assert sent["a2a"] == 4 * local * (size - 1) // size
    assert sent["grad"] == 4 * local * (size - 1) // size


@pytest.mark.skipif(not heap.available(), reason="needs glibc's mallinfo2")
def test_ring_memory_per_rank_does_not_grow_with_p(world):
    peaks = {}
    for strategy in ("ring", "allgather"):
        for size in (64, 256):
            world(size, size // 3)
            q, k, v = _inputs()
            for _ in range(2):  # the first call also pays one-time allocations
                with heap.HeapPeak() as h:
                    qd.attention(q, k, v, strategy=strategy, causal=True).sum().backward()
            peaks[strategy, size] = h.peak
    whole_kv = 256 * ROWS * H * 2 * D * 4  # the gathered K/V at P = 256
    assert peaks["ring", 256] < 1.5 * peaks["ring", 64] + 64 * 1024
    assert peaks["ring", 256] < whole_kv / 4
    assert peaks["allgather", 256] > whole_kv  # what the ring avoids: all of K/V (and its gradient)


@pytest.mark.slow
def test_ring_at_512(world):
    world(512, 300)
    q, k, v = _inputs()
    sent, shape = _step("ring", q, k, v, causal=True, layout="contiguous")
    packed = ROWS * H * 2 * D * 4
    # contiguous + causal: rank 300 receives from the 300 ranks before it, sends to the 211 after
    assert sent["kv"] == 2 * 211 * packed and sent["grad"] == 300 * packed
    assert shape == (1, H, ROWS, D)
