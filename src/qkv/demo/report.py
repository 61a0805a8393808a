"""The demo's summary: a plain-text table, ``results.json`` and an offline ``index.html``.

Everything here is built from the :class:`~qkv.demo.context.StepResult` objects the steps
returned, so the page shows exactly the numbers that were printed. ``index.html`` links
the PNGs by relative path and has no scripts, fonts or styles from the network: the
folder can be copied anywhere and opened without a connection.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from .context import Metric, StepResult

COLUMNS = ("step", "model", "measure", "value", "target", "met")


def _rows(results: list[StepResult]) -> list[tuple[str, ...]]:
    rows = []
    for result in results:
        for metric in result.metrics:
            met = {True: "yes", False: "NO", None: ""}[metric.met]
            rows.append((metric.step, metric.model, metric.name, metric.format_value(), metric.format_target(), met))
    return rows


def table(results: list[StepResult]) -> str:
    """The summary table as aligned text, one row per measured number."""
    rows = [COLUMNS, *_rows(results)]
    widths = [max(len(row[k]) for row in rows) for k in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def targets(results: list[StepResult]) -> tuple[int, int]:
    """``(met, total)`` over the metrics that have a target."""
    checked = [m.met for r in results for m in r.metrics if m.met is not None]
    return sum(checked), len(checked)


def _metric_json(metric: Metric) -> dict:
    return {
        "step": metric.step,
        "model": metric.model,
        "measure": metric.name,
        "value": metric.value,
        "target": metric.target or None,
        "met": metric.met,
    }


def write_json(path: Path, results: list[StepResult], settings: dict) -> None:
    """All measured numbers (and each step's extra data) as JSON, for scripts and tests."""
    payload = {
        "settings": settings,
        "steps": [
            {
                "name": r.name,
                "seconds": round(r.seconds, 2),
                "metrics": [_metric_json(m) for m in r.metrics],
                "figures": [f.file for f in r.figures],
                "data": r.data,
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { margin-bottom: 0.2rem; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 1rem 0; } td, th { padding: 0.2rem 0.7rem; border-bottom: 1px solid #ddd; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } .no { color: #b00; font-weight: bold; }
figure { margin: 1.5rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; max-width: 50rem; } pre { background: #f6f6f6; padding: 0.8rem; overflow-x: auto; font-size: 0.85rem; }
"""


def write_html(path: Path, results: list[StepResult], settings: dict, log: str) -> None:
    """``index.html``: the summary table, then every figure with its title and caption, then the log."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>qkv demo</title>',
        f"<style>{_STYLE}</style></head><body>",
        "<h1>qkv demo</h1>",
        f'<p class="sub">qkv {esc(str(settings["version"]))}, seed {settings["seed"]}, '
        f'{"quick" if settings["quick"] else "full"} run, {settings["seconds"]:.0f} s</p>',
        "<h2>Summary</h2>",
        "<table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in COLUMNS) + "</tr>",
    ]
    for row in _rows(results):
        cells = [f"<td>{esc(row[0])}</td>", f"<td>{esc(row[1])}</td>", f"<td>{esc(row[2])}</td>",
                 f'<td class="num">{esc(row[3])}</td>', f"<td>{esc(row[4])}</td>",
                 f'<td class="{"no" if row[5] == "NO" else ""}">{esc(row[5])}</td>']  # fmt: skip
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</table>")
    for result in results:
        if not result.figures and not result.notes:
            continue
        parts.append(f"<h2>{esc(result.name)}</h2>")
        parts += [f"<p>{esc(note)}</p>" for note in result.notes]
        for figure in result.figures:
            parts.append(
                f'<figure><img src="{esc(figure.file)}" alt="{esc(figure.title)}">'
                f"<figcaption><b>{esc(figure.title)}.</b> {esc(figure.caption)}</figcaption></figure>"
            )
    parts += ["<h2>What the demo printed</h2>", f"<pre>{esc(log)}</pre>", "</body></html>"]
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
