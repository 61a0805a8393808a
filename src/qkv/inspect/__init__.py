"""``qkv inspect``: the attention of a real pretrained model on a sentence, as a page and a summary.

Shape legend: ``l`` layers, ``h`` heads, ``i`` query rows, ``j`` keys.

One file per job in this package:

* ``model`` — find the model (the packaged all-MiniLM-L6-v2 by default, a Hugging Face
  folder or a GGUF file) and load it with ``attn_implementation="qkv"``;
* ``selection`` — which heads and rows to build (``--heads``/``--rows``, or automatically
  for long texts, within a size budget);
* ``capture`` — tokenise, run the model once, keep the weights ``(l, h, i, j)``;
* ``summary`` — per layer, the head that attends most to the previous token, to the
  special tokens, to itself;
* ``figures`` — PNG heatmaps of the chosen head and of its layer (``qkv.viz``);
* ``page`` — the offline HTML page (head view, model view), with ``page.html``,
  ``page.css`` and ``page.js``;
* ``attribution`` — head importance by ablation and attention rollout (``--attribution``),
  drawn on the page by ``attribution_page`` with ``attribution.js`` and ``attribution.css``.

:func:`inspect` is the Python entry point; the command line calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .attribution import Attribution
from .capture import Capture, run, tokenize
from .model import InspectError, Loaded, load, resolve
from .selection import Selection, SelectionError, choose, format_indices, parse_indices
from .summary import LayerSummary, anchor_label, format_table, scope, summarize

__all__ = ["Capture", "InspectError", "Report", "inspect", "parse_indices"]


@dataclass
class Report:
    """What :func:`inspect` made: the weights it kept, the summary and the files it wrote."""

    capture: Capture
    summaries: list[LayerSummary]
    anchor: str  # how the summary names the special tokens, e.g. "[CLS]/[SEP]"
    layer: int
    head: int
    files: list[Path]
    lines: list[str]  # the text printed to the terminal
    attribution: Attribution | None = None  # with attribution=True


def _check_range(option: str, value: int | None, size: int, what: str) -> None:
    if value is not None and not 0 <= value < size:
        raise InspectError(f"{option}: expected 0..{size - 1} ({size} {what}), got {value}")


def inspect(
    text: str,
    *,
    model: str | Path | None = None,
    layer: int | None = None,
    head: int | None = None,
    rows: tuple[int, ...] | None = None,
    heads: tuple[int, ...] | None = None,
    out: str | Path = "qkv-inspect",
    loaded: Loaded | None = None,
    attribution: bool = False,
    attribution_layers: tuple[int, ...] | None = None,
    echo=print,
) -> Report:
    """Run ``model`` on ``text`` with qkv attention; write the page and PNGs into ``out``.

    ``layer``/``head`` choose what the page opens on and what the PNGs show (default: the
    first layer and the first chosen head); ``rows``/``heads`` restrict the weights that are
    built. ``loaded`` reuses a model already loaded (``qkv.inspect.model.load(...)``).
    ``attribution`` adds head importance (one more forward per head of ``attribution_layers``,
    default all layers) and attention rollout to the page (``qkv.inspect.attribution``).
    Raises :class:`InspectError` with a one-line message for anything the caller can fix.
    """
    if not text.strip():
        raise InspectError("TEXT: expected some text, got an empty string")
    if head is not None and heads is not None and head not in heads:
        raise InspectError(f"--head: {head} is not among --heads {','.join(map(str, heads))}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InspectError(f"--out: {out} is a file, expected a folder")
    if loaded is None:
        where = resolve(model)
        echo(f"loading {where.name} ...")
        loaded = load(where)
    _check_range("--layer", layer, loaded.layers, "layers")
    _check_range("--head", head, loaded.heads, "heads per layer")
    if any(not 0 <= value < loaded.layers for value in attribution_layers or ()):
        given = format_indices(tuple(sorted(set(attribution_layers))))
        raise InspectError(f"--attribution-layers: expected layers in 0..{loaded.layers - 1} ({loaded.layers} layers), "
                           f"got {given}")  # fmt: skip
    words = tokenize(loaded, text)
    try:
        selection = choose(layers=loaded.layers, heads=loaded.heads, tokens=len(words.ids),
                           rows_option=rows, heads_option=heads)  # fmt: skip
    except SelectionError as error:
        raise InspectError(str(error)) from None
    layer = 0 if layer is None else layer
    head = selection.heads[0] if head is None else head
    if head not in selection.heads:
        selection = Selection(tuple(sorted({*selection.heads, head})), selection.rows,
                              selection.total_heads, selection.total_rows, selection.automatic)  # fmt: skip
    kind = "decoder" if loaded.causal else "encoder"
    lines = [f"{loaded.name}: {kind}, {loaded.layers} layers x {loaded.heads} heads; {len(words.ids)} tokens"]
    if selection.automatic:
        lines.append(
            f"long text: weights for {len(selection.rows)} of {len(words.ids)} query rows, spread over the "
            "text (choose them with --rows and --heads); the others are never built"
        )
    capture = run(loaded, words, selection)
    summaries = summarize(capture, causal=loaded.causal)
    anchor = anchor_label(capture)
    over = scope(selection.rows, len(words.ids), causal=loaded.causal)
    lines.append(f"the head of each layer with the largest mean share of weight on ... ({over})")
    lines.append(format_table(summaries, anchor))
    attributed = None
    if attribution:
        from .attribution import attribute, top_heads

        count = len(attribution_layers or range(loaded.layers)) * loaded.heads
        echo(f"attribution: {count} more forwards, one per ablated head ...")
        attributed = attribute(loaded, words, capture, layers=attribution_layers)
        lines.append(top_heads(attributed.importance))
        for note in (attributed.importance.note, attributed.rollout.note):
            if note:
                lines.append(note)

    from . import figures, page  # matplotlib only now, after the model ran

    out.mkdir(parents=True, exist_ok=True)
    pngs = figures.write(capture, layer, head, out)
    captions = [f"Layer {layer}, head {head}: queries down, keys across.",
                f"Every head of layer {layer}" + ("." if selection.complete else " that was computed.")]  # fmt: skip
    html = page.render(capture, model=loaded.name, text=text, layer=layer, head=head, summaries=summaries,
                       anchor=anchor, images=list(zip(pngs, captions)), attribution=attributed)  # fmt: skip
    index = out / "index.html"
    index.write_text(html, encoding="utf-8")
    files = [index, *pngs]
    lines.append("wrote " + ", ".join(str(path) for path in files))
    for line in lines:
        echo(line)
    return Report(capture, summaries, anchor, layer, head, files, lines, attributed)
