"""``examples/induction_heads.py``: SmolLM2's induction heads found by their cached patterns, and removing them hurts copying."""

from example_scripts import load
from packaged_models import smollm2_files


def test_top_induction_heads_carry_the_copying(capsys):
    smollm2_files()  # or skip
    found = load("induction_heads").main(["--tokens", "16", "--batch", "2", "--top", "3"])
    scores, losses = found["scores"], found["losses"]
    assert scores.shape == (30, 9) and float(scores.max()) > 0.5  # a head that attends to the next token's first copy
    assert losses["top"] > losses["none"] + 1 and losses["top"] > losses["random"] + 1
    assert "induction scores" in capsys.readouterr().out
