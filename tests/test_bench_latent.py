"""The latent suite's machinery on tiny sizes: it measures, and reports what it measured.

No timing assertions: only that the cache figures are the exact per-token sizes and that
the section states them.
"""

import torch

from qkv.bench import SUITES, latent


def test_contenders_report_the_cache_bytes_per_token_and_step():
    steps, per_token = latent.contenders(16, torch.float32, repeats=1)
    d, h = latent.DIM_HEAD, latent.HEADS
    assert per_token == {"MHA": 2 * h * d * 4, "MLA absorbed": (4 * d + d // 2) * 4, "MLA naive": (4 * d + d // 2) * 4}
    outs = {name: step() for name, step in steps.items()}
    # absorbed and naive decode the same token from the same cache contents
    torch.testing.assert_close(outs["MLA absorbed"], outs["MLA naive"], rtol=1e-4, atol=1e-5)


def test_quick_section_has_the_table_and_targets(monkeypatch):
    monkeypatch.setattr(latent, "QUICK", dict(contexts=(8,), dtypes=("float32",), repeats=1))
    lines = []
    text = latent.section(True, lines.append)
    assert text.startswith("## Multi-head latent attention: decoding against MHA")
    assert "| float32 | 8 | 4096 | 1152 | 0.281 |" in text
    assert "MLA cache bytes per token / MHA's ≤ 0.3 (float32) | 0.281 | met" in text
    assert len(lines) == 1 and SUITES["latent"] == "qkv.bench.latent"
