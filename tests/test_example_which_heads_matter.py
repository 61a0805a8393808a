"""The head-importance example on the packaged MiniLM: its table, and one removal read back from it."""

import importlib.util
import sys
from pathlib import Path

import pytest

from qkv.integrations import packaged

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or packaged.minilm() is None,
    reason="transformers or the packaged all-MiniLM-L6-v2 missing",
)


def test_importance_table_and_removals(capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    try:
        import which_heads_matter as example
    finally:
        sys.path.pop(0)
    result = example.main(["--layers", "2", "--top", "3"])
    assert tuple(result["table"].shape) == (2, 12)
    assert len(result["top"]) == 3 and all(layer < 2 for layer, _ in result["top"])
    assert "most important heads" in capsys.readouterr().out
    assert abs(result["base"]) > 0.1  # paraphrases are closer than mismatched pairs
