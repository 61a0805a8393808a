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

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .attribution import Attribution
from .capture import Capture, run, tokenize
from .model import InspectError, Loaded, load, resolve
from .selection import Indices, Selection, SelectionError, choose, format_indices, parse_indices
from .summary import LayerSummary, anchor_label, format_table, scope, summarize

__all__ = ["Capture", "InspectError", "MARKER", "Report", "inspect", "parse_indices"]

#: A file in every folder :func:`inspect` writes, listing the files it wrote: a folder holding
#: it may be written again (its listed files replaced); any other non-empty folder is refused,
#: as ``qkv demo`` refuses one, so a user's own ``index.html`` is never overwritten.
MARKER = ".qkv-inspect"


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


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (for a relative path, at worst the current folder)."""
    while not (path.exists() or path.is_symlink()) and path.parent != path:
        path = path.parent
    return path


def _check_out(out: Path) -> None:
    """Raise InspectError unless ``out`` can be written: absent, empty, or an earlier output of inspect.

    Checked before the model is loaded, so a bad ``--out`` costs no forward pass.
    """
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise InspectError(f"--out: {out} is a file, expected a folder")
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise InspectError(f"--out: {out} is a non-empty folder not written by qkv inspect; choose another or "
                               "empty it")
        where = out
    else:  # made with its missing parents: the closest one that exists must be a folder
        where = _nearest_existing(out.parent)
        if not where.is_dir():
            raise InspectError(f"--out: cannot create {out}: {where} is a file, not a folder")
    # Made and removed: a folder may refuse new entries whatever its permission bits say (/proc).
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qkv-inspect-check-", dir=where))
    except OSError as error:
        what = f"cannot write in {out}" if where == out else f"cannot create {out}"
        raise InspectError(f"--out: {what} ({error.strerror})") from None


def _forget_earlier(out: Path) -> None:
    """Remove the files an earlier run listed in ``out``'s marker (the heatmaps of another layer, say)."""
    marker = out / MARKER
    if not marker.is_file():
        return
    for name in marker.read_text(encoding="utf-8").splitlines():
        # Only plain names in ``out`` itself: a marker edited by hand cannot point elsewhere.
        if name and name == Path(name).name and name != MARKER and (out / name).is_file():
            (out / name).unlink()


def _given(values: Sequence[int]) -> str:
    """``--heads`` as the user gave it: ``0-3,7`` for parsed ranges (never expanded), ``0,1,2`` for a tuple."""
    return str(values) if isinstance(values, Indices) else ",".join(map(str, values))


def inspect(
    text: str,
    *,
    model: str | Path | None = None,
    layer: int | None = None,
    head: int | None = None,
    rows: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    out: str | Path = "qkv-inspect",
    loaded: Loaded | None = None,
    attribution: bool = False,
    attribution_layers: Sequence[int] | None = None,
    echo=print,
) -> Report:
    """Run ``model`` on ``text`` with qkv attention; write the page and PNGs into ``out``.

    ``layer``/``head`` choose what the page opens on and what the PNGs show (default: the
    first layer and the first chosen head); ``rows``/``heads`` restrict the weights that are
    built: tuples, or :class:`~qkv.inspect.selection.Indices` from ``parse_ranges("--rows", "0,5-9")``
    (as the command line passes them), which are checked against the text and the model
    before they are expanded. ``out`` must be absent, empty or an earlier output of
    ``inspect`` (whose files are then replaced); a folder holding anything else is refused.
    ``loaded`` reuses a model already loaded (``qkv.inspect.model.load(...)``).
    ``attribution`` adds head importance (one more forward per head of ``attribution_layers``,
    default all layers) and attention rollout to the page (``qkv.inspect.attribution``).
    Raises :class:`InspectError` with a one-line message for anything the caller can fix.
    """
    if not text.strip():
        raise InspectError("TEXT: expected some text, got an empty string")
    if head is not None and heads is not None and head not in heads:
        raise InspectError(f"--head: {head} is not among --heads {_given(heads)}")
    out = Path(out)
    _check_out(out)
    if loaded is None:
        where = resolve(model)
        echo(f"loading {where.name} ...")
        loaded = load(where)
    _check_range("--layer", layer, loaded.layers, "layers")
    _check_range("--head", head, loaded.heads, "heads per layer")
    if attribution_layers is not None:
        # Parsed ranges are sorted and compared by their ends, unexpanded: "0-1000000000" is
        # refused at once and named as given (format_indices reads their runs).
        ordered = attribution_layers if isinstance(attribution_layers, Indices) else sorted(set(attribution_layers))
        if len(ordered) and (ordered[0] < 0 or ordered[-1] >= loaded.layers):
            raise InspectError(f"--attribution-layers: expected layers in 0..{loaded.layers - 1} ({loaded.layers} "
                               f"layers), got {format_indices(ordered)}")  # fmt: skip
        attribution_layers = tuple(attribution_layers)
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
    _forget_earlier(out)
    marker = out / MARKER
    # Written first: a run stopped half-way leaves a folder that the next run may still replace.
    marker.write_text("", encoding="utf-8")
    pngs = figures.write(capture, layer, head, out)
    captions = [f"Layer {layer}, head {head}: queries down, keys across.",
                f"Every head of layer {layer}" + ("." if selection.complete else " that was computed.")]  # fmt: skip
    html = page.render(capture, model=loaded.name, text=text, layer=layer, head=head, summaries=summaries,
                       anchor=anchor, images=list(zip(pngs, captions)), attribution=attributed)  # fmt: skip
    index = out / "index.html"
    index.write_text(html, encoding="utf-8")
    files = [index, *pngs]
    marker.write_text("".join(f"{path.name}\n" for path in files), encoding="utf-8")
    lines.append("wrote " + ", ".join(str(path) for path in files))
    for line in lines:
        echo(line)
    return Report(capture, summaries, anchor, layer, head, files, lines, attributed)
