"""The offline page of ``qkv inspect``: a head view, a model view, the summary and the heatmaps.

Shape legend: ``l`` layers, ``h`` chosen heads, ``i`` chosen query rows, ``j`` keys.

One self-contained HTML file: the styles and the script (``page.css``, ``page.js`` beside
this module) are inlined, the weights are embedded as JSON and the PNG heatmaps as data
URIs, so the file can be mailed or opened with no connection and loads nothing. The
weights are stored as 16-bit fixed point (``round(w * 65535)``, error below 1e-5, a
quarter of the size of JSON numbers), base64 in ``(l, h, i, j)`` order. The page shows
exactly the heads and rows that were computed and says so when they are not all.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from . import attribution_page
from .encoding import encode_weights, script_json
from .attribution import Attribution
from .capture import Capture
from .selection import format_indices
from .summary import LayerSummary

__all__ = ["encode_weights", "render", "scope_text"]

_HERE = Path(__file__).resolve().parent


def scope_text(capture: Capture, layers: int) -> str:
    """One sentence saying which weights were computed (all, or which rows and heads)."""
    selection = capture.selection
    tokens = len(capture.text.ids)
    if selection.complete:
        return (f"All weights: {layers} layers \u00d7 {selection.total_heads} heads \u00d7 "
                f"{tokens} queries \u00d7 {tokens} keys.")  # fmt: skip
    heads = ("all " + str(selection.total_heads)) if len(selection.heads) == selection.total_heads \
        else f"{len(selection.heads)} of {selection.total_heads} ({format_indices(selection.heads)})"
    rows = f"{len(selection.rows)} of {tokens} ({format_indices(selection.rows)})"
    why = ("chosen to fit the page, spread over the text" if selection.automatic else "chosen with --rows")
    return (
        f"Only some weights were computed: query rows {rows}, {why}; heads {heads}; every key, "
        f"in all {layers} layers. The other weights were never built, and this page shows only these."
    )


def _summary_table(summaries: list[LayerSummary], anchor: str) -> str:
    esc = html.escape

    def cell(pick) -> str:
        if pick is None:
            return '<td>-</td><td class="num"></td>'
        return f'<td>head {pick.head}</td><td class="num">{pick.share:.0%}</td>'

    head = (f'<tr><th>layer</th><th colspan="2">previous token</th><th colspan="2">{esc(anchor)}</th>'
            '<th colspan="2">itself</th></tr>')  # fmt: skip
    rows = "".join(
        f"<tr><td>{s.layer}</td>{cell(s.previous)}{cell(s.anchor)}{cell(s.itself)}</tr>" for s in summaries
    )
    return f'<table class="summary">{head}{rows}</table>'


def _image(path: Path, caption: str) -> str:
    uri = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
    esc = html.escape
    return f'<figure><img src="{uri}" alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'


def render(
    capture: Capture,
    *,
    model: str,
    text: str,
    layer: int,
    head: int,
    summaries: list[LayerSummary],
    anchor: str,
    images: list[tuple[Path, str]],
    attribution: Attribution | None = None,
) -> str:
    """The page as a string; ``images`` are (PNG path, caption) pairs to embed.

    ``attribution`` (``qkv inspect --attribution``) adds the head-importance and rollout
    sections (``attribution_page``).
    """
    layers = capture.weights.shape[0]
    payload = {
        "model": model,
        "tokens": list(capture.text.labels),
        "special": list(capture.text.special),
        "layers": layers,
        "heads": list(capture.selection.heads),
        "rows": list(capture.selection.rows),
        "layer": layer,
        "head": head,
        "weights": encode_weights(capture.weights),
    }
    rows = capture.selection.rows
    over = "the row" if len(rows) == 1 else f"the {len(rows)} rows"
    # Name the rows: means over the few rows of a long text are not means over the text.
    summary_rows = "" if capture.selection.complete else \
        f", over {over} computed, of {len(capture.text.ids)} query rows ({format_indices(rows)})"
    esc = html.escape
    fill = {
        "title": esc(f"Attention in {model}"),
        "text": esc(text),
        "scope": esc(scope_text(capture, layers)),
        "anchor": esc(anchor),
        "summary_rows": esc(summary_rows),
        "summary": _summary_table(summaries, anchor),
        "images": "\n".join(_image(path, caption) for path, caption in images),
        "model": esc(model),
        "css": (_HERE / "page.css").read_text(encoding="utf-8") + ("" if attribution is None else attribution_page.css()),
        "attribution": "" if attribution is None else
        attribution_page.section(attribution, list(capture.text.labels), list(capture.selection.heads)),
        "js": (_HERE / "page.js").read_text(encoding="utf-8"),
        "data": script_json(payload),
    }
    template = (_HERE / "page.html").read_text(encoding="utf-8")
    # One pass over the template: text put in is never scanned again for placeholders.
    return re.sub(r"\{\{(\w+)\}\}", lambda match: fill[match.group(1)], template)
