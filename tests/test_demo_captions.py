"""The demo's figure captions say what the run measured, not what a full run shows.

The quick run's streaming caption read "ten times longer" and "perplexity stays where it
was" under a picture of streams four times longer and of rising perplexity. Each step is
run here on its own in quick mode (order and dates with one training step: the captions
must agree with the numbers whatever they are), and :func:`qkv.demo.streaming.caption` is
given made-up results for the two outcomes a run can have.
"""

from __future__ import annotations

import pytest
import torch

from qkv.demo import dates, order, streaming
from qkv.demo.context import Context

pytest.importorskip("matplotlib")
pytest.importorskip("babel")

LABELS = ("full cache, positions in the text", "sliding window", "window + 4 attention sinks")


def _run(step, number: int, tmp_path, steps: int | None = None):
    ctx = Context(out=tmp_path, seed=0, quick=True, steps=steps, quiet=True, echo=lambda line: None)
    torch.manual_seed(ctx.seed_for(number))  # as qkv.demo.run does before each step
    return step.run(ctx)


def test_streaming_caption_of_a_run_that_rises():
    text = streaming.caption(32, 128, dict.fromkeys(LABELS, 3.0), dict(zip(LABELS, (5.0, 4.9, 4.8))),
                             dict(zip(LABELS, (127, 32, 32))), 0.05)  # fmt: skip
    assert "4 times longer than the 32-token training sequences" in text
    assert "its perplexity rises from 3.00 to 5.00 (1.7×)" in text
    assert "with the sliding window the perplexity rises from 3.00 to 4.90" in text
    assert "with attention sinks it rises from 3.00 to 4.80" in text
    assert "ten times" not in text and "stays near" not in text and "stays where" not in text
    assert "hold 32 tokens" in text and "5.0% on the first token" in text


def test_streaming_caption_of_a_run_that_keeps_its_perplexity():
    text = streaming.caption(64, 640, dict.fromkeys(LABELS, 3.0), dict(zip(LABELS, (30.0, 3.1, 3.05))),
                             dict(zip(LABELS, (639, 64, 64))), 0.2)  # fmt: skip
    assert "10 times longer than the 64-token training sequences" in text
    assert "its perplexity rises from 3.00 to 30.00 (10.0×)" in text
    assert "the sliding window the perplexity stays near where it was (3.00, then 3.10)" in text
    assert "with attention sinks it stays near where it was (3.00, then 3.05)" in text


def test_quick_streaming_caption_agrees_with_its_numbers(tmp_path):
    result = _run(streaming, 5, tmp_path)
    (figure,) = result.figures
    text, data = figure.caption, result.data
    times = data["stream_length"] // data["training_length"]
    assert times == 4 and f"test streams {times} times longer" in text and "ten times" not in text
    for label in LABELS:
        first = next(m.value for m in result.metrics if m.model == label and m.name.startswith("perplexity, first"))
        last = next(m.value for m in result.metrics if m.model == label and m.name.startswith("perplexity, last"))
        if last > 1.2 * first:
            assert f"rises from {first:.2f} to {last:.2f}" in text, label
        elif last < first / 1.2:
            assert f"falls from {first:.2f} to {last:.2f}" in text, label
        else:
            assert f"stays near where it was ({first:.2f}, then {last:.2f})" in text, label
    assert f"{100 * data['first_token_attention']:.1f}% on the first token" in text


def test_order_caption_gives_the_measured_link(tmp_path):
    result = _run(order, 2, tmp_path, steps=1)
    link = result.data["links"]["negation → negated word"]
    text = result.figures[0].caption
    assert f"on the {link['sentences']} test sentences with a negation" in text
    assert f"in {100 * link['top_link']:.0f}% of them, with {100 * link['mean_weight']:.0f}% of the row's attention" in text
    assert "mostly" not in text  # a claim about other rows that the run does not measure


def test_dates_captions_give_the_measured_alignment(tmp_path):
    result = _run(dates, 3, tmp_path, steps=1)
    for name, figure in zip(("Bahdanau", "Luong"), result.figures):
        measured = result.data[name]
        fields = ", ".join(f"{field} {100 * share:.0f}%" for field, share in measured["alignment"].items())
        assert f"on the right input field for {fields}; exact match {100 * measured['exact']:.1f}%." in figure.caption
