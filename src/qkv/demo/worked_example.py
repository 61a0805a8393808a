"""Demo step 1: a worked example (four words, numpy seed 42), computed with ``qkv.attention``.

Shape legend: ``i`` = ``j`` = 4 words, ``d`` = ``e`` = 3 features.

A textbook worked example of self-attention stacks four
one-hot-ish word vectors, draws ``W^Q, W^K, W^V`` with ``numpy.random.seed(42)`` and
``randint(3, size=(3, 3))`` three times, and prints ``softmax(Q Kᵀ / √3) V``. The same draws
fed to ``qkv.attention`` (scaled dot product by default) print the same matrix, in the same
numpy format; the test suite compares it with the textbook's printed numbers. The weights are
drawn as a heatmap.
"""

from __future__ import annotations

import numpy as np
import torch

import qkv
from qkv import viz

from .context import Context, Figure, Metric, StepResult

NAME = "worked example"
WORDS = ("word_1", "word_2", "word_3", "word_4")


def compute() -> tuple[np.ndarray, np.ndarray]:
    """The example's ``attention (4, 3)`` and the weights ``(4, 4)`` behind it, in float64."""
    words = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float64)
    # The example's own draws: numpy's legacy generator seeded with 42, three randint calls.
    rng = np.random.RandomState(42)
    w_q, w_k, w_v = (torch.from_numpy(rng.randint(3, size=(3, 3))).double() for _ in range(3))
    out, weights = qkv.attention(words @ w_q, words @ w_k, words @ w_v, return_weights=True)
    return out.numpy(), weights.numpy()


def run(ctx: Context) -> StepResult:
    """Print the example's result, check rows of the weights sum to 1, save the weights heatmap."""
    out, weights = compute()
    ctx.echo("four words, W^Q, W^K, W^V from numpy seed 42, qkv.attention (scaled dot product):")
    # np.array2string with 8 digits is what the example's print(attention) shows.
    for line in np.array2string(out, precision=8).splitlines():
        ctx.echo(line)
    row_error = float(np.abs(weights.sum(-1) - 1.0).max())
    figure = viz.heatmap(weights, WORDS, WORDS, title="four words: softmax(QKᵀ/√3)")
    viz.save(figure, ctx.out / "worked_example_weights.png")
    return StepResult(
        NAME,
        metrics=[Metric(NAME, "qkv.attention", "max |row sum − 1| of weights", row_error)],
        figures=[
            Figure(
                "worked_example_weights.png",
                "Worked example: the four words attending to each other",
                "Row i holds word i's weights over the four words; each row sums to 1. The "
                "output above is these weights times V.",
            )
        ],
        data={"attention": out.tolist(), "weights": weights.tolist()},
    )
