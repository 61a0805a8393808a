"""Tests of ``qkv.demo``: the quick run end to end, reproducibility, and a failed run's clean-up.

The quick run trains every model for a few dozen steps, so it checks the plumbing (files,
numbers, pictures, index.html), not the accuracy targets; those are met by the full run
(``qkv demo``), whose numbers are in the README.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import qkv.demo
from qkv.demo import DemoError, run
from qkv.demo.context import Context, Metric, StepResult
from qkv.demo.report import table

# What seed text 002 prints for its worked example (its `print(attention)`).
SEED_002 = np.array(
    [
        [0.98522025, 1.74174051, 0.75652026],
        [0.90965265, 1.40965265, 0.5],
        [0.99851226, 1.75849334, 0.75998108],
        [0.99560386, 1.90407309, 0.90846923],
    ]
)


def _numbers(lines: list[str]) -> list[str]:
    """Every printed line, with wall times and the output path (which vary by run) blanked out."""
    out = []
    for line in lines:
        line = re.sub(r"\d+(\.\d+)? s\b", "<time> s", line)
        line = re.sub(r"(output in|open) \S+", r"\1 <path>", line)
        out.append(line)
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick run (seed 0) shared by the tests below: its folder, printed lines and results."""
    out = tmp_path_factory.mktemp("demo") / "qkv-demo"
    lines: list[str] = []
    results = run(out, seed=0, quick=True, quiet=True, echo=lines.append)
    return out, lines, results


def test_quick_run_writes_every_figure_and_index(quick):
    out, _, results = quick
    figures = [figure.file for result in results for figure in result.figures]
    assert len(figures) == 9 and len(set(figures)) == 9
    for file in figures:
        data = (out / file).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", file
    page = (out / "index.html").read_text(encoding="utf-8")
    for file in figures:
        assert f'src="{file}"' in page
    # Offline: no resource is fetched from the network.
    assert "http://" not in page and "https://" not in page
    assert {p.name for p in out.iterdir()} >= {"index.html", "results.json", "demo.txt", *figures}
    # Nothing temporary is left beside the output.
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_quick_run_prints_the_measured_numbers(quick):
    out, lines, results = quick
    text = "\n".join(lines)
    # Step 1 prints the seed's matrix exactly as the seed shows it.
    printed = np.array(
        [[float(v) for v in re.findall(r"[\d.]+", line)] for line in lines if line.startswith((" [", "[["))]
    )
    np.testing.assert_allclose(printed, SEED_002, atol=1e-8)
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    metrics = [m for step in saved["steps"] for m in step["metrics"]]
    names = {(m["model"], m["measure"]) for m in metrics}
    for model in ("bag of words", "attention + reads the next two words, relative positions", "Bahdanau", "Luong"):
        assert any(m == model for m, _ in names), model
    # Every accuracy in results.json is the one printed on screen (as a percentage).
    for metric in metrics:
        if metric["measure"] in ("test accuracy", "exact match, held-out dates"):
            shown = f"{100 * metric['value']:.1f}%"
            assert re.search(rf"{re.escape(metric['model'].split(' +')[0])}\s.*{re.escape(shown)}", text), metric
            assert 0.0 <= metric["value"] <= 1.0
    # The summary table is printed, with one row per metric.
    assert sum(len(r.metrics) for r in results) == len(metrics)
    assert "summary" in lines and any("targets met" in line for line in lines)
    # Bag of words is at chance by construction (every test bag occurs with both labels).
    bow = next(m for m in metrics if m["model"] == "bag of words")
    assert bow["value"] == pytest.approx(0.5, abs=0.06)


def test_steps_are_named_by_what_they_show(quick):
    out, lines, results = quick
    assert "[1/6] worked example: four words, numpy seed 42" in lines
    assert "[5/6] decoding past the training length" in lines
    assert "[6/6] packed documents" in lines
    assert results[0].name == "worked example"
    # User-facing text names what it shows: no source file names, no internal example numbers.
    page = (out / "index.html").read_text(encoding="utf-8")
    for text in ("\n".join(lines), page):
        for internal in ("seed 002", "seed002", "Seed 002", "seed text", "seed_example", ".py"):
            assert internal not in text, internal


def test_order_step_states_its_model_and_measures_the_negation_link(quick):
    out, lines, results = quick
    text = "\n".join(lines)
    assert "attention = a one-layer encoder in which each word reads the two words after it" in text
    order = next(r for r in results if r.name == "order matters")
    links = order.data["links"]
    forward = links["negation → negated word"]
    # measured on the test sentences with a negation, printed as measured
    assert forward["sentences"] > 0 and 0.0 <= forward["top_link"] <= 1.0
    assert f"the row's top link in {100 * forward['top_link']:3.0f}%" in text
    # the negated word cannot see the negation before it (the reach is rightward only)
    assert links["negated word → negation"]["top_link"] == 0.0
    assert links["negated word → negation"]["mean_weight"] == 0.0


def test_streaming_step_reports_the_three_caches_as_printed(quick):
    out, lines, results = quick
    text = "\n".join(lines)
    step = next(r for r in results if r.name == "decoding past the training length")
    data = step.data
    labels = ["full cache, positions in the text", "sliding window", "window + 4 attention sinks"]
    assert list(data["perplexity"]) == labels
    assert data["stream_length"] > 2 * data["training_length"]
    for label in labels:
        values = data["perplexity"][label]
        assert len(values) == len(data["stretch_centres"]) and all(v > 1 for v in values)
        # every perplexity printed is the one in results.json
        first = next(m for m in step.metrics if m.model == label and m.name.startswith("perplexity, first"))
        last = next(m for m in step.metrics if m.model == label and m.name.startswith("perplexity, last"))
        assert re.search(rf"{re.escape(label)}\s+{first.value:.2f}\s+{last.value:.2f}\s+\d+", text), label
    # within the training length nothing is evicted: the three agree up to float32 rounding
    # (each cache runs its own engine, which sums in its own order: 2.4e-7 apart, relative,
    # under AVX2 kernels; 1e-5 is about 80 float32 ulps)
    firsts = {m.value for m in step.metrics if m.name.startswith("perplexity, first")}
    assert max(firsts) - min(firsts) <= 1e-5 * max(firsts)
    # the two streaming caches hold the training length, the full cache everything
    held = dict(re.findall(r"^(full cache, positions in the text|sliding window|window \+ 4 attention sinks)\s.*\s(\d+)$",
                           text, flags=re.M))  # fmt: skip
    assert held == {labels[0]: str(data["stream_length"] - 1), labels[1]: str(data["training_length"]),
                    labels[2]: str(data["training_length"])}  # fmt: skip
    assert 0.0 <= data["first_token_attention"] <= 1.0


def test_same_seed_prints_the_same_numbers(tmp_path):
    # Two short runs with the same arguments (steps=2 keeps them cheap; same code path).
    first: list[str] = []
    second: list[str] = []
    run(tmp_path / "a", seed=3, quick=True, steps=2, quiet=True, echo=first.append)
    run(tmp_path / "b", seed=3, quick=True, steps=2, quiet=True, echo=second.append)
    assert _numbers(first) == _numbers(second)
    assert any(re.search(r"\d+\.\d%", line) for line in first)


def _fake_steps(fail: bool):
    def writes(ctx: Context) -> StepResult:
        (ctx.out / "half.png").write_bytes(b"half")
        if fail:
            raise RuntimeError("step failed")
        return StepResult("fake", metrics=[Metric("fake", "m", "value", 1.0, ">= 0.5")])

    return lambda: [("fake step", writes)]


def test_failed_run_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.setattr(qkv.demo, "_steps", _fake_steps(fail=True))
    with pytest.raises(RuntimeError, match="step failed"):
        run(tmp_path / "out", quiet=True, echo=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_failed_run_keeps_the_previous_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(qkv.demo, "_steps", _fake_steps(fail=False))
    run(out, quiet=True, echo=lambda _: None)
    before = sorted(p.name for p in out.iterdir())
    assert "half.png" in before and (out / "index.html").exists()
    monkeypatch.setattr(qkv.demo, "_steps", _fake_steps(fail=True))
    with pytest.raises(RuntimeError):
        run(out, quiet=True, echo=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # A successful run replaces a previous demo output.
    monkeypatch.setattr(qkv.demo, "_steps", _fake_steps(fail=False))
    run(out, seed=5, quiet=True, echo=lambda _: None)
    assert json.loads((out / "results.json").read_text())["settings"]["seed"] == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "--steps: expected a positive integer, got 0"),
        ({"steps": -3}, "--steps: expected a positive integer, got -3"),
        ({"seed": -1}, "--seed: expected a non-negative integer, got -1"),
    ],
)
def test_bad_numbers_are_refused(tmp_path, kwargs, message):
    with pytest.raises(DemoError, match=re.escape(message)):
        run(tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_bad_out_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DemoError, match="--out: .* exists and is not a folder"):
        run(tmp_path / "file")
    with pytest.raises(DemoError, match="--out: the parent folder .* does not exist"):
        run(tmp_path / "file" / "out")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DemoError, match="not written by qkv demo"):
        run(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_metric_targets_and_table():
    passed = Metric("s", "m", "accuracy", 0.97, ">= 0.95", "%")
    failed = Metric("s", "m", "accuracy", 0.61, "<= 0.60", "%")
    info = Metric("s", "m", "gap", 1.5e-6)
    assert (passed.met, failed.met, info.met) == (True, False, None)
    assert passed.format_value() == "97.0%" and passed.format_target() == "≥ 95%"
    text = table([StepResult("s", metrics=[passed, failed, info])])
    rows = text.splitlines()
    assert rows[0].split() == ["step", "model", "measure", "value", "target", "met"]
    assert rows[2].endswith("yes") and rows[3].endswith("NO") and rows[4].endswith("1.5e-06")


def test_packing_step_measures_what_it_prints(quick):
    _, lines, results = quick
    packed = next(r for r in results if r.name == "packing")
    values = {m.name: m.value for m in packed.metrics}
    assert values["documents equal to themselves alone (1 = all)"] == 1.0
    assert 0.0 < values["share of the T×T scores computed"] < 0.5
    assert "every document's output equals the document run alone, bit for bit: yes" in lines
