"""Demo step 3: translating dates to ISO ``YYYY-MM-DD``, and the alignment behind each character.

Shape legend: ``n`` examples, ``j`` source characters (keys), ``t`` generated characters
(queries), ``u`` target length with bos and eos.

The data (``qkv.tasks.make_date_task``) are dates in many formats and nine languages'
month and weekday names ("jeudi 21 nov. 19", "14 agosto 2026", "07/02/2026"), with the
character span of the year, month and day in each source string; test dates are
calendar days never seen in training. Two character-level RNN encoder–decoders from
``qkv.models.seq2seq`` learn the task with the same loop:

* ``Bahdanau`` — additive attention queried by the previous decoder state (Bahdanau et
  al. 2015);
* ``Luong`` — "general" (bilinear) global attention queried by the current state, with
  input feeding (Luong et al. 2015).

Both are scored by exact match of greedy decoding on the held-out dates. The alignment
is measured with the spans: for each output digit of the year, month and day, is the
source character with the largest attention weight inside that field of the input?
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv import viz
from qkv.models.seq2seq import Bahdanau, Luong, LuongConfig, Seq2SeqConfig
from qkv.tasks import make_date_task

from .context import Context, Figure, Metric, StepResult
from .train import fit

NAME = "dates"
# Output positions of YYYY-MM-DD that copy or translate a field of the input (row of spans).
_FIELD_OF_POSITION = {0: 0, 1: 0, 2: 0, 3: 0, 5: 1, 6: 1, 8: 2, 9: 2}
FIELDS = ("year", "month", "day")


def _loss(model, src: Tensor, src_lengths: Tensor, tgt: Tensor) -> Tensor:
    # Trim the padding columns no row of this batch uses: the encoder's cost is per column.
    return model.loss(src[:, : int(src_lengths.max())], tgt, src_lengths)


def decode(model, src: Tensor, src_lengths: Tensor, *, ctx: Context, desc: str = "decoding", batch_size: int = 250):
    """Greedy decoding of ``src (n, j)`` in batches: generated ids ``(n, t)`` and their attention ``(n, t, j)``."""
    tokens, weights = [], []
    starts = range(0, src.shape[0], batch_size)
    for start in ctx.progress(starts, total=len(starts), desc=desc):
        rows = slice(start, start + batch_size)
        width = int(src_lengths[rows].max())
        out = model.greedy(src[rows, :width], src_lengths[rows], max_len=12)
        w = torch.zeros(out.weights.shape[0], 12, src.shape[1])
        w[:, : out.weights.shape[1], :width] = out.weights
        t = torch.zeros(out.tokens.shape[0], 12, dtype=torch.long)
        t[:, : out.tokens.shape[1]] = out.tokens
        tokens.append(t)
        weights.append(w)
    return torch.cat(tokens), torch.cat(weights)


def alignment_hits(weights: Tensor, spans: Tensor, sources: list[str]) -> list[float]:
    """For year, month and day: the fraction of output digits whose top source character is in the field.

    ``weights (n, t, j)`` are the attention weights behind each generated character,
    ``spans (n, 3, 2)`` the fields' ``[start, end)`` in the source. A two-digit year's
    century ("19" of "1994" from "94") is not in the input, so those two outputs are skipped.
    """
    hits, counts = [0, 0, 0], [0, 0, 0]
    top = weights.argmax(-1)  # (n, t)
    for n in range(len(sources)):
        for position, field in _FIELD_OF_POSITION.items():
            start, end = (int(v) for v in spans[n, field])
            if start < 0 or (field == 0 and end - start == 2 and position < 2):
                continue
            counts[field] += 1
            hits[field] += int(start <= int(top[n, position]) < end)
    return [h / max(c, 1) for h, c in zip(hits, counts)]


def _picture_rows(task) -> list[int]:
    """Three test examples: a long spelled-out date, an abbreviated month, a numeric one."""
    wanted = (
        lambda p: "EEEE" in p and "MMMM" in p,
        lambda p: "MMM" in p and "MMMM" not in p and "yy" not in p.replace("yyyy", ""),
        lambda p: p.startswith("d") and "MMM" not in p,
    )
    rows: list[int] = []
    for test in wanted:
        # Different languages per panel make the point that names, not positions, are read.
        seen = {task.test_languages[r] for r in rows}
        row = next((n for n, p in enumerate(task.test_patterns) if test(p) and task.test_languages[n] not in seen), 0)
        rows.append(row)
    return rows


def _figure(task, name: str, rows: list[int], tokens: Tensor, weights: Tensor):
    """One alignment panel per example, output characters down, input characters across."""
    from matplotlib.figure import Figure as MplFigure

    widths = [int(task.test_source_lengths[r]) for r in rows]
    figure = MplFigure(figsize=(1.6 + 0.26 * max(widths) + 1.2, 3.9 * len(rows)), layout="constrained")
    for ax, row, width in zip(figure.subplots(len(rows), 1), rows, widths):
        out = task.target_vocab.decode(tokens[row], keep_special=True)
        length = out.index("<eos>") + 1 if "<eos>" in out else len(out)
        labels = ["</s>" if c == "<eos>" else c for c in out[:length]]
        source = task.test_sources[row]
        viz.alignment(weights[row, :length, :width], source, labels, ax=ax,
                      title=f"{task.test_languages[row]}: {source!r} → {''.join(labels[:-1])}")  # fmt: skip
        ax.title.set_fontsize(9)
    figure.suptitle(f"{name} attention: output characters (rows) over input characters")
    return figure


def run(ctx: Context) -> StepResult:
    """Train both encoder–decoders, report exact match and alignment, draw the alignments."""
    n_train, n_test = (600, 60) if ctx.quick else (8000, 1000)
    task = make_date_task(n_train, n_test, seed=ctx.seed_for(3))
    sv, tv = len(task.source_vocab), len(task.target_vocab)
    ctx.echo(f"{n_train} training and {n_test} held-out dates in {len(task.languages)} languages, e.g.")
    for row in range(3):
        ctx.echo(f"    {task.test_sources[row]!r:32} → {task.test_targets[row]}")
    sizes = {"embed_dim": 32, "hidden": 64, "attention_dim": 64}
    models = {
        "Bahdanau": Bahdanau(Seq2SeqConfig(sv, tv, **sizes)),
        "Luong": Luong(LuongConfig(sv, tv, score="general", alignment="global", **sizes)),
    }
    steps = ctx.training_steps(full=400, quick=30)
    train = (task.train_source, task.train_source_lengths, task.train_target)
    metrics, figures, data = [], [], {}
    rows = _picture_rows(task)
    for offset, (name, model) in enumerate(models.items()):
        fit(model, _loss, train, ctx=ctx, steps=steps, generator=ctx.generator(30 + offset),
            batch_size=64, lr=3e-3, desc=name)  # fmt: skip
        tokens, weights = decode(model, task.test_source, task.test_source_lengths, ctx=ctx, desc=f"{name}: decoding")
        predicted = ["".join(task.target_vocab.decode(row)) for row in tokens]
        exact = sum(p == t for p, t in zip(predicted, task.test_targets)) / n_test
        hits = alignment_hits(weights, task.test_spans, task.test_sources)
        ctx.echo(f"{name:9} exact match {100 * exact:5.1f}% on held-out dates ({steps} steps); top attention "
                 + ", ".join(f"{field} {100 * h:.0f}%" for field, h in zip(FIELDS, hits))
                 + " on the right field")  # fmt: skip
        wrong = [(s, p, t) for s, p, t in zip(task.test_sources, predicted, task.test_targets) if p != t]
        if wrong:
            source, got, want = wrong[0]
            ctx.echo(f"          e.g. wrong: {source!r} → {got!r} (expected {want})")
        file = f"dates_{name.lower()}.png"
        viz.save(_figure(task, name, rows, tokens, weights), ctx.out / file, dpi=90)
        metrics.append(Metric(NAME, name, "exact match, held-out dates", exact, ">= 0.95", "%"))
        metrics += [Metric(NAME, name, f"output {field} digits: top attention on input {field}", h, "", "%")
                    for field, h in zip(FIELDS, hits)]  # fmt: skip
        figures.append(
            Figure(
                file,
                f"{name} attention: the alignment of output and input characters",
                "Each row is one generated character of YYYY-MM-DD, each column one input "
                "character; a bright cell is where the model looked to write that character. "
                "A model that aligns puts the year digits on the input year, the month digits on "
                "the month (a name or a number), the day digits on the day. Measured in this run "
                f"on the {n_test} held-out dates, the top attention of the output digits falls on "
                "the right input field for "
                + ", ".join(f"{field} {100 * h:.0f}%" for field, h in zip(FIELDS, hits))
                + f"; exact match {100 * exact:.1f}%.",
            )
        )
        data[name] = {"exact": exact, "alignment": dict(zip(FIELDS, hits)), "errors": len(wrong)}
    return StepResult(NAME, metrics=metrics, figures=figures, data=data)
