"""``examples/long_context_lm.py``: sequence parallel x data parallel training equals one process, step by step."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "long_context_lm.py"
TINY = ["--seq-len", "61", "--pairs", "4", "--queries", "3", "--vocab", "16", "--train", "64", "--batch", "4",
        "--steps", "4", "--dim", "16", "--heads", "2", "--layers", "2", "--dtype", "float64", "--log-every", "0"]  # fmt: skip


def _example():
    spec = importlib.util.spec_from_file_location("long_context_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("long_context_lm", module)
    spec.loader.exec_module(module)
    return module


def run_example(group, argv):
    """In each pool rank (the pool's world of 4 is the example's world)."""
    example = _example()
    return example.train(example.arguments(argv))


@pytest.mark.parametrize("sp", ["2", "4"])
def test_sharded_training_has_the_single_process_loss_curve(dist_pool, sp):
    example = _example()
    single = example.train(example.arguments(TINY))
    for losses in dist_pool.run("test_example_long_context_lm:run_example", 4, TINY + ["--sp", sp]):
        assert len(losses) == len(single)
        assert max(abs(a - b) for a, b in zip(losses, single)) < 1e-8, (losses, single)
    assert len(set(single)) == len(single)  # every step changed the weights
