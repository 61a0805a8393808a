"""What every demo step receives and returns.

A step is a function ``run(ctx: Context) -> StepResult``. It prints a few lines through
``ctx.echo``, writes its figures into ``ctx.out`` (a temporary folder that becomes the
user's ``--out`` only when every step has succeeded) and returns the numbers it measured,
so the summary table and ``index.html`` are built from the same values that were printed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """Settings shared by the steps of one demo run."""

    out: Path  # the folder being written (temporary until the run succeeds)
    seed: int  # base seed; each step derives its own from it (see `seed_for`)
    quick: bool  # small data and few training steps: checks the plumbing in < 1 minute
    steps: int | None  # training steps per model; None = each step's own default
    quiet: bool  # no progress bars (results are still printed: they are the point)
    echo: Callable[[str], None] = print  # where the step's lines go

    def seed_for(self, offset: int) -> int:
        """A per-step seed, so a step's numbers do not depend on which steps ran before it."""
        return self.seed * 1000 + offset

    def generator(self, offset: int) -> torch.Generator:
        """A seeded CPU ``torch.Generator`` for sampling batches in step ``offset``."""
        return torch.Generator().manual_seed(self.seed_for(offset))

    def training_steps(self, full: int, quick: int) -> int:
        """``--steps`` if given, else the step's default for a full or a quick run."""
        if self.steps is not None:
            return self.steps
        return quick if self.quick else full

    def progress(self, iterable: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterable[T]:
        """``iterable`` wrapped in a tqdm bar with an ETA, silent when quiet or not on a terminal."""
        show = not self.quiet and sys.stderr.isatty()
        if not show:
            return iterable
        from tqdm.auto import tqdm

        # leave=False: the finished bar is erased, so the screen keeps only the results.
        return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


@dataclass(frozen=True)
class Figure:
    """A picture a step saved: its file name inside the output folder and its caption."""

    file: str  # relative to the output folder, e.g. "order_attention.png"
    title: str  # one line, shown above the picture in index.html
    caption: str  # what to look for in the picture


@dataclass(frozen=True)
class Metric:
    """One measured number for the summary table, with its target when it has one."""

    step: str  # e.g. "order matters"
    model: str  # e.g. "bag of words"
    name: str  # e.g. "test accuracy"
    value: float
    target: str = ""  # e.g. ">= 0.95", "<= 0.60"; empty when the number is informative only
    unit: str = ""  # "%" to print fractions as percentages

    @property
    def met(self) -> bool | None:
        """Whether ``value`` satisfies ``target``; None when there is no target."""
        if not self.target:
            return None
        op, bound = self.target.split()
        return self.value >= float(bound) if op == ">=" else self.value <= float(bound)

    def format_value(self) -> str:
        return f"{100 * self.value:.1f}%" if self.unit == "%" else f"{self.value:.4g}"

    def format_target(self) -> str:
        if not self.target:
            return ""
        op, bound = self.target.split()
        shown = f"{100 * float(bound):.0f}%" if self.unit == "%" else bound
        return f"{op.replace('>=', '≥').replace('<=', '≤')} {shown}"


@dataclass
class StepResult:
    """What a step measured and drew."""

    name: str
    metrics: list[Metric] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0  # wall time, filled in by the runner
    notes: list[str] = field(default_factory=list)  # extra lines for index.html
    data: dict[str, Any] = field(default_factory=dict)  # JSON-ready extras for results.json
