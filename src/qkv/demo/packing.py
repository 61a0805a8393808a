"""Demo step 6: a packed batch, its documents run one call each, and the tiles the engines skip.

Shape legend: ``T`` packed tokens, ``h`` heads, ``d`` head size; ``n`` one document's length.

Several documents of different lengths laid end to end in one row, as training pipelines
pack them, attend causally inside themselves only: ``qkv.masks.documents(ids) &
qkv.masks.causal()``. The step draws how the engines see that mask (``qkv.viz.tile_states``:
the tiles of other documents are never computed), runs the packed batch, and measures:
that every document's output equals the document run alone, bit for bit; how much of the
``T × T`` score matrix was computed (``Σ n²`` of ``T²``); and the time against PyTorch's
SDPA given the same mask as a dense ``(T, T)`` tensor.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from qkv import attention, masks, viz

from .context import Context, Figure, Metric, StepResult

NAME = "packing"


def _best(fn, rounds: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(ctx: Context) -> StepResult:
    """Pack documents, draw the tiles, check each against itself alone, time it against the dense mask."""
    lengths = [37, 90, 15, 160, 64, 122] if ctx.quick else [300, 811, 97, 1405, 520, 701, 162, 0, 1000]
    total, h, d = sum(lengths), 4, 32
    gen = ctx.generator(6)
    q, k, v = (torch.randn(1, h, total, d, generator=gen) for _ in range(3))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = masks.documents(ids) & masks.causal()
    viz.save(viz.tile_states(mask, total, total, tile=64 if ctx.quick else 128,
                             title=f"{len(lengths)} packed documents, {total} tokens"), ctx.out / "packing_tiles.png")  # fmt: skip
    with torch.no_grad():
        packed = attention(q, k, v, mask=mask)
        starts = [0, *torch.cumsum(torch.tensor(lengths), 0).tolist()]
        alone = [attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], causal=True) for a, b in zip(starts, starts[1:])]
        identical = all(torch.equal(packed[..., a:b, :], x) for (a, b), x in zip(zip(starts, starts[1:]), alone))
        dense = (ids[:, None] == ids[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        t_packed = _best(lambda: attention(q, k, v, mask=mask))
        t_dense = _best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    share = sum(n * n for n in lengths) / total**2
    speed = t_dense / t_packed
    ctx.echo(f"{len(lengths)} documents packed into {total} tokens: each computed as its own call, "
             f"{100 * share:.1f}% of the {total}×{total} scores")  # fmt: skip
    ctx.echo(f"every document's output equals the document run alone, bit for bit: {'yes' if identical else 'NO'}")
    ctx.echo(f"time: packed {t_packed:.3f} s, SDPA with the same mask as a dense (T, T) tensor {t_dense:.3f} s")
    return StepResult(
        NAME,
        metrics=[
            Metric(NAME, "packed", "share of the T×T scores computed", share),
            Metric(NAME, "packed", "documents equal to themselves alone (1 = all)", float(identical)),
        ],
        data={"seconds_packed": t_packed, "seconds_dense_mask": t_dense, "speed_up_over_dense_mask": speed},
        figures=[
            Figure(
                "packing_tiles.png",
                "A packed batch as the engines see it",
                "Documents of different lengths in one row, causal inside themselves. Grey tiles "
                "(other documents) are never computed; blue ones run without a mask; only the "
                "orange ones, on each document's diagonal and edges, need it.",
            )
        ],
    )
