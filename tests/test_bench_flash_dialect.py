"""The flash-attn suite's machinery on tiny sizes: every row measured, and a dialect call that gave another answer
would stop the suite before any timing."""

import pytest
import torch

from qkv.bench import SUITES, flash_dialect


def test_quick_section_times_every_row():
    lines = []
    text = flash_dialect.section(True, lines.append)
    assert SUITES["flash-attn"] == "qkv.bench.flash_dialect"
    for mode in ("fwd", "fwd+bwd"):
        assert f"| flash_attn_func, causal, b = 2, s = 32 | {mode} | " in text
    assert "| flash_attn_with_kvcache, decoding step, 3 requests" in text and "cache_leftpad = 1" in text
    assert "time / loop of SDPA ≤ 1.0" in text and "time / padded SDPA ≤ 0.6" in text
    assert len(lines) == 3


def test_a_call_that_differs_is_refused(monkeypatch):
    monkeypatch.setattr(flash_dialect, "flash_attn_func", lambda q, k, v, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="flash_attn_func differs from SDPA"):
        flash_dialect.section(True, lambda line: None)
