"""The edits suite's machinery: its quick section on the packaged SmolLM2 (skipped without it)."""

import pytest

from qkv.bench import edits


def test_the_reset_of_the_high_water_mark_never_raises():
    edits._reset_peak()


@pytest.mark.slow
@pytest.mark.skipif(edits.missing() is not None, reason="transformers, gguf, accelerate or the packaged SmolLM2 missing")
def test_quick_section_measures_memory_and_time():
    said = []
    text = edits.section(True, said.append)
    assert "recording 2 heads of one layer" in text and "ablating 2 heads in 3 layers" in text
    assert "hook_z hook functions (qkv.hooks)" in text and "one layer's hook_pattern: time / eager" in text
    assert "every layer's hook_pattern: time / eager with output_attentions" in text
    assert any(line.startswith("  memory:") for line in said)
