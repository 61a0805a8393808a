"""The terminal summary of ``qkv inspect``: which head of each layer does what.

Shape legend: ``l`` layers, ``h`` chosen heads, ``i`` chosen query rows, ``j`` keys.

Three patterns that studies of BERT and GPT-2 heads keep finding (Clark et al. 2019,
"What does BERT look at?"; Kovaleva et al. 2019; Xiao et al. 2023 on attention sinks):
heads that attend to the **previous token**, heads that park their weight on the
**special tokens** ([CLS]/[SEP] of an encoder; the first token of a decoder, its BOS or
attention sink), and heads that attend to the token **itself**. For each layer and each
pattern, the head with the largest mean share of weight over the rows is reported, with
that share. Only the chosen heads and rows count. In a decoder the first row can only see
itself, so it is left out of the means (it would count as 100% for two patterns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .capture import Capture

__all__ = ["LayerSummary", "Pick", "anchor_label", "format_table", "scope", "summarize"]


@dataclass(frozen=True)
class Pick:
    """The head with the largest mean share of a pattern, and that share (0..1)."""

    head: int
    share: float


@dataclass(frozen=True)
class LayerSummary:
    layer: int
    previous: Pick | None  # None when no chosen row has a previous token
    anchor: Pick  # special tokens, or the first token when the text has none
    itself: Pick


def anchors(capture: Capture) -> tuple[int, ...]:
    """Key positions of the "special tokens" pattern: the special tokens, else the first token."""
    return capture.text.special or (0,)


def anchor_label(capture: Capture) -> str:
    """How the summary names the anchor keys, such as ``[CLS]/[SEP]`` or ``first token``."""
    if not capture.text.special:
        return "first token"
    names = dict.fromkeys(capture.text.labels[p] for p in capture.text.special)
    return "/".join(names)


def _pick(shares: np.ndarray, heads: tuple[int, ...]) -> Pick:
    best = int(np.argmax(shares))
    return Pick(head=heads[best], share=float(shares[best]))


def summarize(capture: Capture, *, causal: bool) -> list[LayerSummary]:
    """One :class:`LayerSummary` per layer, from the chosen heads and rows."""
    rows = np.asarray(capture.selection.rows)
    keep = rows > 0 if causal else np.ones(len(rows), dtype=bool)
    if not keep.any():  # a decoder's only chosen row is the first: nothing else to learn
        keep = np.ones(len(rows), dtype=bool)
    weights = capture.weights[:, :, keep, :]  # (l, h, i', j)
    rows = rows[keep]
    heads = capture.selection.heads
    index = np.arange(len(rows))
    itself = weights[:, :, index, rows].mean(axis=-1)  # (l, h)
    anchor = weights[..., list(anchors(capture))].sum(axis=-1).mean(axis=-1)
    has_previous = rows > 0
    previous = weights[:, :, index[has_previous], rows[has_previous] - 1].mean(axis=-1) if has_previous.any() else None
    return [
        LayerSummary(
            layer=layer,
            previous=None if previous is None else _pick(previous[layer], heads),
            anchor=_pick(anchor[layer], heads),
            itself=_pick(itself[layer], heads),
        )
        for layer in range(weights.shape[0])
    ]


def scope(rows: tuple[int, ...], total: int, *, causal: bool) -> str:
    """Which query rows the means are over, in words; their numbers when they are not all.

    A long text keeps a few rows (3 of 4871 for SmolLM2): the summary is then a sample of
    those rows, and says so with the rows, rather than reading as a verdict on the whole text.
    """
    first_out = causal and 0 in rows and len(rows) > 1  # as summarize() does
    if len(rows) == total:
        return "every row but the first, which can only see itself" if first_out else f"all {total} query rows"
    shown = ", ".join(map(str, rows)) if len(rows) <= 6 else f"{rows[0]}, {rows[1]}, {rows[2]}, ..., {rows[-1]}"
    counted = "only the row computed" if len(rows) == 1 else f"only the {len(rows)} rows computed"
    text = f"{counted}, of {total} query rows: {shown}"
    return text + ("; row 0 left out: it can only see itself" if first_out else "")


def _cell(pick: Pick | None) -> str:
    return "-" if pick is None else f"head {pick.head:<3d} {pick.share:4.0%}"


def format_table(summaries: list[LayerSummary], anchor: str) -> str:
    """The summary as aligned text: one line per layer, three patterns."""
    header = ("layer", "previous token", anchor, "itself")
    lines = [header] + [
        (str(s.layer), _cell(s.previous), _cell(s.anchor), _cell(s.itself)) for s in summaries
    ]
    widths = [max(len(line[k]) for line in lines) for k in range(4)]
    return "\n".join(
        "  ".join(cell.rjust(widths[0]) if k == 0 else cell.ljust(widths[k]) for k, cell in enumerate(line)).rstrip()
        for line in lines
    )
