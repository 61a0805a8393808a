"""``examples/induction_heads.py``: SmolLM2's induction heads found by their cached patterns, and removing them hurts copying."""

import importlib.util
import sys
from pathlib import Path

from packaged_models import smollm2_files

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "induction_heads.py"


def _example():
    spec = importlib.util.spec_from_file_location("induction_heads", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("induction_heads", module)
    spec.loader.exec_module(module)
    return module


def test_top_induction_heads_carry_the_copying(capsys):
    smollm2_files()  # or skip
    found = _example().main(["--tokens", "16", "--batch", "2", "--top", "3"])
    scores, losses = found["scores"], found["losses"]
    assert scores.shape == (30, 9) and float(scores.max()) > 0.5  # a head that attends to the next token's first copy
    assert losses["top"] > losses["none"] + 1 and losses["top"] > losses["random"] + 1
    assert "induction scores" in capsys.readouterr().out
