"""The ``mechanisms`` benchmark suite: its contenders compute the same thing, and its section renders.

Shape legend: ``b`` batch, ``h`` heads, ``i = j`` sequence length, ``d = e`` head size.
"""

import pytest
import torch

from qkv.bench import SUITES, mechanisms


@pytest.mark.parametrize("mod", list(mechanisms.MODS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contenders_compute_the_same_attention(mod, dtype):
    """A fair race: qkv's modifier and the user's materialised one agree (SDPA has no modifier)."""
    spec = {"mod": mod, "dtype": dtype, "i": 48, "h": 2, "mode": "fwd"}
    ours = mechanisms.build({**spec, "impl": "qkv"})()
    theirs = mechanisms.build({**spec, "impl": "materialised"})()
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
    plain = mechanisms.build({**spec, "impl": "sdpa"})()
    assert not torch.allclose(ours.float(), plain.float(), atol=1e-4)  # the modifier changes the result


def test_the_soft_cap_bites_at_the_benchmarks_scale():
    """Logits reach the cap's scale only if they are large: the user's cap equals qkv.SoftCap on them."""
    s = torch.linspace(-200, 200, 11)
    ours, theirs = mechanisms.MODS["softcap"]
    idx = (torch.zeros(()),) * 4
    torch.testing.assert_close(ours(s, *idx), theirs(s, *idx))
    assert float(theirs(s, *idx).abs().max()) < mechanisms.CAP


def test_floor_and_backward_run_on_tiny_inputs():
    for impl in ("qkv", "materialised", "floor", "sdpa"):
        mechanisms.build({"mod": "sine", "dtype": "float32", "i": 40, "h": 1, "mode": "fwdbwd", "impl": impl})()


def test_quick_section_has_both_dtypes_and_targets(monkeypatch):
    monkeypatch.setattr(mechanisms, "QUICK", dict(i=32, h=1, repeats=1, flex=False, memory=False))
    text = mechanisms.section(True, lambda line: None)
    assert "### float32 (i = j = 32" in text and "### bfloat16 (i = j = 32" in text
    assert "soft-cap float32, i = 32, fwd+bwd: time / SDPA (no cap) ≤ 1.5" in text
    assert "sine score_mod bfloat16, i = 32, fwd+bwd: time / SDPA ≤ 3" in text
    assert "(the tile matmuls alone)" in text
    assert SUITES["mechanisms"] == "qkv.bench.mechanisms"
