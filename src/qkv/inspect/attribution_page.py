"""The attribution sections of the ``qkv inspect`` page: the head-importance heat map and the rollout view.

Shape legend: ``m`` metrics, ``l`` layers, ``h`` heads, ``n`` tokens; ``k`` rollout layers kept.

:func:`section` returns the HTML that ``page.render`` puts after the model view: the two
sections, their data as JSON (importance values as numbers, ``null`` for layers not run;
the rollout as 16-bit fixed point like the weights, ``(k, n, n)``) and ``attribution.js``,
which draws them. Its styles are ``attribution.css``. The rollout through every layer is
embedded when it fits :data:`ROLLOUT_ELEMENTS` values; else an evenly spread subset of
layers, always with the last.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np

from .attribution import ROLLOUT_TOKENS, Attribution
from .encoding import encode_weights, script_json

__all__ = ["ROLLOUT_ELEMENTS", "css", "rollout_layers", "section"]

_HERE = Path(__file__).resolve().parent

#: Most rollout values embedded in the page (4 MiB as 16-bit fixed point).
ROLLOUT_ELEMENTS = 2**21


def rollout_layers(layers: int, tokens: int, budget: int = ROLLOUT_ELEMENTS) -> list[int]:
    """The layers whose rollout is embedded: all if they fit ``budget`` values, else spread, the last always in."""
    fit = max(1, budget // (tokens * tokens))
    if fit >= layers:
        return list(range(layers))
    return sorted({round((k + 1) * layers / fit) - 1 for k in range(fit)})


def _number(value: float) -> float | None:
    return None if not math.isfinite(value) else float(f"{value:.6g}")


def payload(attribution: Attribution, tokens: list[str], heads: list[int]) -> dict:
    """The JSON the script reads; ``heads`` are the page's computed heads (a cell click opens them)."""

    importance = attribution.importance
    data = {
        "tokens": tokens,
        "pageHeads": heads,
        "importance": {
            "metrics": [{"key": m.key, "label": m.label, "explain": m.explain} for m in importance.metrics],
            "values": [[[_number(v) for v in row] for row in metric] for metric in importance.values],
            "layers": list(importance.layers),
            "clean": importance.clean,
        },
        "rollout": None,
    }
    matrices = attribution.rollout.matrices
    if matrices is not None:
        kept = rollout_layers(matrices.shape[0], matrices.shape[1])
        data["rollout"] = {"layers": kept, "weights": encode_weights(matrices[kept].astype(np.float32))}
    return data


def css() -> str:
    return (_HERE / "attribution.css").read_text(encoding="utf-8")


def section(attribution: Attribution, tokens: list[str], heads: list[int]) -> str:
    """The two sections, their data and their script, as HTML."""

    esc = html.escape
    importance = attribution.importance
    note = f'<p class="note">{esc(importance.note)}</p>' if importance.note else ""
    rollout_note = esc(attribution.rollout.note)
    rollout_body = (
        f'<p id="rollout-note" class="note">{rollout_note}</p>' if attribution.rollout.matrices is None else
        '<div class="controls">\n'
        '    <label>token <select id="rollout-token"></select></label>\n'
        '    <label>through layer <select id="rollout-layer"></select></label>\n'
        '    <span id="rollout-status" aria-live="polite"></span>\n'
        '  </div>\n'
        '  <p class="note">The chosen token\'s share of each input token, darker for more; the matrix below '
        'has every token as a row (click one to choose it) and the input tokens as columns.</p>\n'
        '  <p id="rollout-strip" class="strip"></p>\n'
        '  <canvas id="rollout-matrix"></canvas>'
    )  # fmt: skip
    clean = "".join(f" Clean run: {m.label.replace(chr(0x394) + ' ', '')} {importance.clean[m.key]:.4g}."
                    for m in importance.metrics if m.key in importance.clean)  # fmt: skip
    return f"""<section id="importance-view">
  <h2>Head importance</h2>
  <div class="controls">
    <label>metric <select id="importance-metric"></select></label>
    <label>layers <select id="importance-from"></select></label>
    <label>to <select id="importance-to"></select></label>
    <span id="importance-status" aria-live="polite"></span>
  </div>
  <p class="note">Each cell: the change when that head's output is zeroed
  (<code>qkv.edit(model, {{layer: AblateHeads([head])}})</code>, one run per head), red for an
  increase, blue for a decrease, on a scale set by the largest change shown; click a cell to
  open the head in the head view.<span id="importance-explain"></span>{esc(clean)}</p>
  {note}
  <table id="importance"></table>
</section>

<section id="rollout-view">
  <h2>Attention rollout</h2>
  <p class="note">Abnar &amp; Zuidema (2020): the head-averaged weights of each layer, half of
  each row kept on the token itself for the residual (0.5&middot;A + 0.5&middot;I), multiplied
  through the layers; texts up to {ROLLOUT_TOKENS} tokens.</p>
  {rollout_body}
</section>
<script type="application/json" id="qkv-attribution">{script_json(payload(attribution, tokens, heads))}</script>
<script>
{(_HERE / "attribution.js").read_text(encoding="utf-8")}
</script>"""
