"""``examples/long_context_lm.py``: sequence parallel x data parallel training equals one process, step by step."""

import math

import pytest
from example_scripts import load

TINY = ["--seq-len", "61", "--pairs", "4", "--queries", "3", "--vocab", "16", "--train", "64", "--batch", "4",
        "--steps", "4", "--dim", "16", "--heads", "2", "--layers", "2", "--dtype", "float64", "--log-every", "0"]  # fmt: skip


def _example():
    return load("long_context_lm")


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


def test_curriculum_takes_one_value_per_phase_or_one_for_all():
    example = _example()
    args = example.arguments(["--seq-len", "16", "64", "--steps", "5", "--batch", "8", "4", "--pairs", "2", "4"])
    phases = example.curriculum(args)
    assert [(p.length, p.steps, p.batch, p.pairs, p.queries, p.train) for p in phases] == [
        (16, 5, 8, 2, 2, 40), (64, 5, 4, 4, 4, 20)]  # fmt: skip

def test_a_list_of_the_wrong_length_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _example().arguments(["--seq-len", "16", "64", "--steps", "5", "--batch", "8", "4", "2"])
    assert "--batch: expected 1 or 2 values (one per --seq-len), got 3" in capsys.readouterr().err


def test_lengths_alone_take_the_default_curriculum_phase_nearest_in_length():
    """``--seq-len 64`` alone once failed (the default's five steps against one phase): the first phase takes the
    default's first (where recall forms), each later one the default phase nearest in length."""
    example = _example()
    phases = example.curriculum(example.arguments(["--seq-len", "64", "1000", "8192"]))
    assert [(p.length, p.steps, p.batch, p.pairs) for p in phases] == [(64, 600, 64, 4), (1000, 100, 8, 8), (8192, 30, 4, 8)]
    default = example.curriculum(example.arguments([]))
    assert [p.steps for p in default] == example.CURRICULUM["steps"]


def test_learning_rate_warms_up_holds_through_the_first_phase_then_decays_to_a_tenth():
    example = _example()
    args = example.arguments(["--seq-len", "16", "64", "--steps", "100", "50", "--batch", "4", "--pairs", "2",
                              "--warmup", "10"])  # fmt: skip
    phases = example.curriculum(args)
    factor = [example.lr_factor(s, args, phases) for s in range(150)]
    assert factor[0] == pytest.approx(0.1) and factor[9] == 1.0 and factor[99] == 1.0
    assert all(a >= b for a, b in zip(factor[100:], factor[101:]))
    assert factor[149] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 49 / 50)))
