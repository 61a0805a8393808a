"""The varlen suite's machinery on tiny sizes: every row measured, and a dialect call that gave another answer would
stop the suite before any timing."""

import pytest
import torch

from qkv.bench import SUITES, varlen_dialect


def test_quick_section_times_every_row():
    lines = []
    text = varlen_dialect.section(True, lines.append)
    assert SUITES["varlen"] == "qkv.bench.varlen_dialect"
    for mode in ("fwd", "fwd+bwd"):
        assert f"tokens, causal | {mode} | " in text
    assert "| decoding step over pages, 3 requests" in text
    assert "time / loop of SDPA ≤ 1.05" in text and "time / padded SDPA ≤ 0.6" in text
    assert len(lines) == 3


def test_a_call_that_differs_is_refused(monkeypatch):
    monkeypatch.setattr(varlen_dialect, "varlen_attn", lambda q, *a, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="qkv.varlen_attn differs from the loop of SDPA"):
        varlen_dialect.section(True, lambda line: None)
