"""The ``transformers`` benchmark suite on tiny sizes: it checks its contenders, writes its section, says when it cannot run.

No timing is asserted (the figures belong in benchmarks/RESULTS.md, not in unit tests).
"""

import pytest

from qkv.bench import transformers as suite


def test_inputs_are_fixed_and_long_enough():
    first = suite.sentences(32)
    assert first == suite.sentences(32) and len(first) == 32
    assert all(5 <= len(s.split()) <= 30 for s in first)
    assert len(suite.long_text(512).split()) == 512  # at least one word piece per word


def test_without_the_model_the_section_says_why(monkeypatch):
    monkeypatch.setattr(suite, "missing", lambda: "the packaged all-MiniLM-L6-v2 is not installed")
    lines = []
    text = suite.section(True, lines.append)
    assert "Not measured: the packaged all-MiniLM-L6-v2 is not installed." in text
    assert lines == ["  skipped: the packaged all-MiniLM-L6-v2 is not installed"]


def test_quick_section_measures_both_targets(monkeypatch):
    if suite.missing() is not None:
        pytest.skip(suite.missing())
    monkeypatch.setattr(suite, "QUICK", dict(sentences=3, long=24, batch_long=1, repeats=1))
    lines = []
    text = suite.section(True, lines.append)
    assert "| 3 sentences, padded to" in text and "| forward, 1 × 24 tokens, output_attentions=True |" in text
    assert "Where the time goes: one attention call on the layer's (b, h, i, d) = (3, 12," in text
    assert "| 3 sentences: qkv time / sdpa time ≤ 1.05 |" in text
    assert "| output_attentions=True at 24 tokens: eager time / qkv time ≥ 2 |" in text
    assert len(lines) == 3
