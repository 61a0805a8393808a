"""The flashinfer suite's machinery on tiny sizes: every row measured, and a wrapper that gave another answer would stop
the suite before any timing."""

import pytest
import torch

from qkv.bench import SUITES, flashinfer_dialect


def test_quick_section_times_every_row():
    lines = []
    text = flashinfer_dialect.section(True, lines.append)
    assert SUITES["flashinfer"] == "qkv.bench.flashinfer_dialect"
    assert "| BatchDecodeWithPagedKVCacheWrapper.run, decoding step, 3 requests" in text and "pages in a random order" in text
    assert "| BatchPrefillWithRaggedKVCacheWrapper.run, ragged prefill, 2 causal chunks" in text
    for target in ("time / qkv.paged_attention ≤ 1.05", "time / loop of SDPA ≤ 1.0", "time / padded SDPA ≤ 0.6",
                   "time / qkv.varlen_attention ≤ 1.05", "time / loop of SDPA ≤ 1.1"):  # fmt: skip
        assert target in text
    assert len(lines) == 3


def test_a_wrapper_that_differs_is_refused(monkeypatch):
    run = flashinfer_dialect.BatchDecodeWithPagedKVCacheWrapper.run
    monkeypatch.setattr(flashinfer_dialect.BatchDecodeWithPagedKVCacheWrapper, "run",
                        lambda self, q, cache, **kw: torch.zeros_like(run(self, q, cache, **kw)))  # fmt: skip
    with pytest.raises(AssertionError, match="differs from qkv.paged_attention"):
        flashinfer_dialect.section(True, lambda line: None)
