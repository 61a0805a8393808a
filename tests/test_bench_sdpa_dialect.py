"""The sdpa suite's machinery on tiny sizes: every call of the grid measured both ways, and a
drop-in that gave another answer would stop the suite before any timing."""

import pytest
import torch

from qkv.bench import SUITES, sdpa_dialect


def test_quick_section_times_every_call_both_ways():
    lines = []
    text = sdpa_dialect.section(True, lines.append)
    names = list(sdpa_dialect.cases(sdpa_dialect.QUICK))
    steps = [name for name in names if name.startswith("decoding step")]  # inference: forward only
    assert len(names) == 11 and len(steps) == 3 and len(lines) == 2 * len(names) - len(steps)
    for name in names:
        for mode in ("fwd",) if name in steps else ("fwd", "fwd+bwd"):
            assert f"| {name} | {mode} | " in text
            assert f"{name}, {mode}: qkv.scaled_dot_product_attention / F.scaled_dot_product_attention ≤ 1.05 |" in text
    assert SUITES["sdpa"] == "qkv.bench.sdpa_dialect"


def test_a_drop_in_that_differs_is_refused(monkeypatch):
    monkeypatch.setattr(sdpa_dialect, "scaled_dot_product_attention", lambda q, k, v, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="differs from F.scaled_dot_product_attention"):
        sdpa_dialect.section(True, lambda line: None)
