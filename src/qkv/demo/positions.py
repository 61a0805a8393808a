"""Demo step 4: positional information, the sinusoidal table and RoPE's relative property.

Shape legend: ``p`` positions, ``c`` model dims (sinusoidal); ``d`` head size, ``m`` query
positions (curves), ``r`` key positions (RoPE).

* Sinusoidal encoding (Vaswani et al. 2017, section 3.5), ``qkv.positional.sinusoidal``:
  the ``(p, c)`` table as a heatmap, positions down and dimensions across; low dims
  oscillate fast, high dims slowly.
* RoPE (Su et al. 2021), ``qkv.positional.Rotary``: one random query vector placed at
  several positions ``m`` and one random key vector at every position ``n``; the score
  ``q_m · k_n`` plotted against ``m − n`` gives curves that lie on top of each other,
  because the rotation makes the score a function of the offset only. The step measures
  how far apart the curves are (float32 rounding, about 1e-6) and, for contrast, how much
  the score varies with the offset at all.
"""

from __future__ import annotations

import torch

from qkv import viz
from qkv.positional import Rotary, sinusoidal

from .context import Context, Figure, Metric, StepResult

NAME = "positions"


def rope_curves(dim_head: int, positions: list[int], length: int, generator: torch.Generator):
    """Scores ``(m, r)`` of a query at each of ``positions`` against a key at ``0 .. length-1``.

    Returns ``(scores, offsets)`` with ``offsets (m, r) = m − n``.
    """
    rotary = Rotary(dim_head)
    q = torch.randn(1, dim_head, generator=generator)
    k = torch.randn(1, dim_head, generator=generator)
    keys = rotary.rotate_at(k.expand(length, dim_head), torch.arange(length))  # (r, d)
    rows, offsets = [], []
    for m in positions:
        query = rotary.rotate_at(q, torch.tensor([m]))  # (1, d)
        rows.append((query @ keys.T)[0])
        offsets.append(m - torch.arange(length))
    return torch.stack(rows), torch.stack(offsets)


def curve_spread(scores: torch.Tensor, offsets: torch.Tensor) -> float:
    """Largest difference between two curves' scores at the same offset ``m − n``."""
    spread = 0.0
    for offset in torch.unique(offsets).tolist():
        values = scores[offsets == offset]
        if values.numel() > 1:
            spread = max(spread, float(values.max() - values.min()))
    return spread


def run(ctx: Context) -> StepResult:
    """Draw the sinusoidal table and the RoPE curves; report how well the curves coincide."""
    positions, dims = (64, 64) if ctx.quick else (100, 128)
    table = sinusoidal(positions, dims)
    viz.save(
        viz.positional_encoding(table, title=f"sinusoidal encoding: {positions} positions × {dims} dims"),
        ctx.out / "positions_sinusoidal.png",
    )
    # The table's own relative property: PE_m · PE_n = Σ cos(ω (m − n)), a function of m − n.
    gram = table.double() @ table.double().T
    gram_spread = curve_spread(gram, torch.arange(positions)[:, None] - torch.arange(positions)[None, :])

    generator = ctx.generator(4)
    query_positions = [8, 24, 40]
    scores, offsets = rope_curves(64, query_positions, 48, generator)
    spread = curve_spread(scores, offsets)
    swing = float(scores.max() - scores.min())
    viz.save(
        viz.rope_relative(
            scores, offsets, positions=query_positions,
            title="RoPE: the score depends only on m − n",
        ),  # fmt: skip
        ctx.out / "positions_rope.png",
    )
    ctx.echo(f"sinusoidal table {positions} × {dims}: PE_m·PE_n varies by {gram_spread:.1e} across pairs with the same m − n")
    ctx.echo(
        f"RoPE, head size 64, query at m = {query_positions}: curves of q_m·k_n against m − n differ by "
        f"at most {spread:.1e}, while the score itself swings over {swing:.2f}"
    )
    return StepResult(
        NAME,
        metrics=[
            Metric(NAME, "RoPE", "max gap between curves at equal m − n", spread),
            Metric(NAME, "RoPE", "range of q_m·k_n over m − n", swing),
            Metric(NAME, "sinusoidal", "max gap of PE_m·PE_n at equal m − n", gram_spread),
        ],
        figures=[
            Figure(
                "positions_sinusoidal.png",
                "Sinusoidal positional encoding",
                "Each row is the vector added to the token at that position. The first "
                "dimensions oscillate quickly and the last slowly, so every position gets "
                "a distinct pattern.",
            ),
            Figure(
                "positions_rope.png",
                "RoPE: the same query at three positions",
                "The score of a rotated query against a rotated key, plotted against their "
                "distance m − n. The three curves coincide (they differ by at most "
                f"{spread:.1e} in this run, while the score swings over {swing:.2f}): with RoPE, "
                "attention sees relative positions only.",
            ),
        ],
    )
