"""The small training loop the demo's models share: Adam, cosine decay, clipped gradients.

Shape legend: ``n`` examples in a data set; every tensor passed as data has ``n`` rows.

Batches are drawn epoch by epoch from a seeded permutation (each example once per epoch,
in a different order each time), so a run is reproduced exactly by its seed. The loop
shows a tqdm bar with the running loss and an ETA when the demo is on a terminal.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .context import Context

LossFn = Callable[..., Tensor]


def batches(n: int, batch_size: int, steps: int, generator: torch.Generator):
    """Yield ``steps`` index tensors of ``batch_size`` rows from ``range(n)``, epoch by epoch."""
    order = torch.randperm(n, generator=generator)
    position = 0
    for _ in range(steps):
        if position + batch_size > n:
            # A fresh permutation per epoch; the few rows left over are dropped, not reused.
            order = torch.randperm(n, generator=generator)
            position = 0
        yield order[position : position + batch_size]
        position += batch_size


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    data: Sequence[Tensor],
    *,
    ctx: Context,
    steps: int,
    generator: torch.Generator,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup: int = 20,
    clip: float = 1.0,
    desc: str = "training",
) -> list[float]:
    """Train ``model`` for ``steps`` optimizer steps; return the loss of every step.

    ``loss_fn(model, *batch)`` gets one batch of each tensor in ``data`` (rows picked by the
    same indices) and returns a scalar loss. The learning rate warms up linearly over
    ``warmup`` steps (Adam's first updates are noisy) and then follows a cosine down to a
    tenth of ``lr``, which settles the weights for a clean final accuracy.
    """
    n = data[0].shape[0]
    if any(t.shape[0] != n for t in data):
        raise ValueError(f"data: expected tensors with the same number of rows, got {[t.shape[0] for t in data]}")
    batch_size = min(batch_size, n)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.train()
    losses: list[float] = []
    bar = ctx.progress(batches(n, batch_size, steps, generator), total=steps, desc=desc)
    for index in bar:
        loss = loss_fn(model, *(t[index] for t in data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix_str") and len(losses) % 10 == 0:
            bar.set_postfix_str(f"loss {sum(losses[-10:]) / 10:.3f}")
    model.eval()
    return losses


@torch.no_grad()
def predict(fn: Callable[..., Tensor], data: Sequence[Tensor], *, batch_size: int = 500) -> Tensor:
    """``fn(*batch)`` over ``data`` in batches without gradients, concatenated along rows."""
    n = data[0].shape[0]
    outs = [fn(*(t[start : start + batch_size] for t in data)) for start in range(0, n, batch_size)]
    return torch.cat(outs)
