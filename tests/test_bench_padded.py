"""The padded suite's machinery on tiny sizes: both sides run the same batch, and a wrong answer stops it."""

import pytest
import torch

from qkv.bench import SUITES, padded


def test_quick_section_times_right_and_left_padding_both_ways():
    lines = []
    text = padded.section(True, lines.append)
    for side in ("right", "left"):
        for mode in ("fwd", "fwd+bwd"):
            assert f"| 2 rows of 64 | float32 | {side} | {mode} | " in text
            assert f"padded causal batch, 2 rows of 64, {side} padding, float32, {mode}: qkv / SDPA with the dense mask ≤ 1.0 |" in text
    assert len(lines) == 5 and SUITES["padded"] == "qkv.bench.padded"
    assert "| 64 | 16 | " in text  # a decoding step over a static cache of 64 slots filled to 16
    assert "decoding step, static cache of 64 filled to 16: qkv / SDPA over the whole cache ≤ 0.5 |" in text


def test_an_answer_that_differs_is_refused(monkeypatch):
    monkeypatch.setattr(padded, "attention", lambda q, k, v, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="qkv and SDPA differ"):
        padded.contenders(padded.QUICK, (64, 40), "right", torch.float32, grad=False)


def test_a_static_cache_step_that_differs_is_refused(monkeypatch):
    monkeypatch.setattr(padded, "attention", lambda q, k, v, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="qkv and SDPA differ"):
        padded.static_cache(padded.QUICK, 16)
