"""The generation suite's machinery on a tiny model: it runs, checks agreement, reports ratios.

No timing assertions: only that the figures are measured, positive and reported.
"""

import pytest

from qkv.bench.generation import QUICK, GenerationSetup, run


def test_quick_run_measures_both_variants_and_writes_a_section():
    setup = GenerationSetup(tokens=(4, 8), dim=32, heads=2, vocab=32, repeats=1)
    lines = []
    result = run(setup, progress=lines.append)
    assert set(result.cached) == set(result.recompute) == {4, 8}
    assert all(t > 0 for t in [*result.cached.values(), *result.recompute.values()])
    assert len(lines) == 2 and "recompute / cached" in lines[0]
    section = result.markdown()
    assert section.startswith("## Generation: KV cache vs recomputing the prefix")
    assert f"{result.ratio(8):.1f}" in section
    assert "≥ 10× faster" not in section  # the target row only appears when 512 tokens were run


def test_quick_setup_is_small():
    assert max(QUICK.tokens) <= 64 and QUICK.dim <= 64


@pytest.mark.parametrize(
    "kwargs, message",
    [({"tokens": ()}, r"tokens: expected at least one length"), ({"dim": 0}, r"dim: expected a positive int")],
)
def test_bad_setup_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationSetup(**kwargs)
