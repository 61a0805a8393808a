"""The ``decoding`` benchmark suite on tiny sizes: it checks its contenders, writes its section, says when it cannot run.

No timing is asserted (the figures belong in benchmarks/RESULTS.md, not in unit tests).
"""

import importlib.util

import pytest
import torch
from inspect_models import needs_smollm2

from qkv.bench import SUITES
from qkv.bench import decoding as suite

needs_transformers = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "gguf", "accelerate")),
    reason="transformers, gguf or accelerate is not installed (the transformers extra)",
)


def test_prompts_are_fixed_and_of_different_lengths():
    first = suite.prompts(4)
    assert first == suite.prompts(4) and len(first) == 4
    assert len({len(p.split()) for p in first}) == 4
    assert SUITES["decoding"] == "qkv.bench.decoding"


def test_agreement_counts_leading_new_tokens():
    a = torch.tensor([[9, 9, 1, 2, 3], [9, 9, 4, 5, 6]])
    b = torch.tensor([[9, 9, 1, 2, 3], [9, 9, 4, 7, 6]])
    assert suite.agreement(a, b, prompt=2) == [3, 1]  # row 1 differs at its second new token, later ones not counted


def test_without_the_model_the_section_says_why(monkeypatch):
    monkeypatch.setattr(suite, "missing", lambda: "the packaged SmolLM2-135M-Instruct is not installed")
    lines = []
    text = suite.section(True, lines.append)
    assert "Not measured: the packaged SmolLM2-135M-Instruct is not installed." in text
    assert lines == ["  skipped: the packaged SmolLM2-135M-Instruct is not installed"]


@needs_transformers
@needs_smollm2
def test_quick_section_has_the_table_and_the_target(monkeypatch):
    if suite.missing() is not None:
        pytest.skip(suite.missing())
    monkeypatch.setattr(suite, "QUICK", dict(prompts=4, new_tokens=2, repeats=1))
    lines = []
    text = suite.section(True, lines.append)
    assert "| case | new tokens | greedy tokens | sdpa ms | qkv ms | qkv / sdpa |" in text
    assert "| left-padded batch of 4 (prompts of " in text and "| batch of 1, no padding (" in text
    assert "| left-padded batch: qkv time / sdpa time ≤ 1 |" in text
    assert "Where the time goes." in text
    assert len(lines) == 3 and lines[0].startswith("  left-padded batch of 4: sdpa ")
