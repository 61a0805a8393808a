"""Tests for qkv.tasks.listops: values checked by an independent evaluator, limits, splits."""

import statistics

import pytest
import torch

from qkv.tasks.listops import evaluate, make_listops_task


@pytest.fixture(scope="module")
def task():
    return make_listops_task(3000, 500, max_depth=4, max_args=5, max_length=80, seed=6)


def _python_value(expression: str) -> int:
    """Evaluate by rewriting the expression as Python calls: '[MAX 2 [MIN 3 4 ] ]' -> MAX(2,MIN(3,4,),)."""
    operations = {
        "MAX": lambda *a: max(a),
        "MIN": lambda *a: min(a),
        "SM": lambda *a: sum(a) % 10,
        "MED": lambda *a: int(statistics.median(a)),  # LRA: int(np.median(...))
    }
    parts = []
    for token in expression.split():
        parts.append(token[1:] + "(" if token.startswith("[") else token + ",")
    source = "".join(parts).replace("]", ")")
    return eval(source.rstrip(","), {"__builtins__": {}}, operations)  # noqa: S307 - our own tokens


def _depth(expression: str) -> int:
    depth = deepest = 0
    for token in expression.split():
        depth += token.startswith("[")
        depth -= token == "]"
        deepest = max(deepest, depth)
    return deepest


def test_closed_form_values():
    assert evaluate("[MAX 2 9 [MIN 4 7 ] 0 ]") == 9
    assert evaluate("[SM 3 [MED 1 5 8 2 ] 6 ]") == 2  # median of 1 2 5 8 is 3.5 -> 3
    assert evaluate("[MED 1 2 3 4 ]") == 2
    assert evaluate("[SM 9 9 ]") == 8
    assert evaluate(["[MIN", "7", "[MAX", "1", "8", "]", "]"]) == 7


def test_labels_agree_with_an_independent_evaluator(task):
    for expressions, labels in ((task.train_expressions, task.train_y), (task.test_expressions, task.test_y)):
        assert [_python_value(e) for e in expressions] == labels.tolist()
    assert set(task.train_y.tolist()) == set(range(10))


def test_depth_and_length_limits(task):
    for expressions, depths, lengths in (
        (task.train_expressions, task.train_depth, task.train_lengths),
        (task.test_expressions, task.test_depth, task.test_lengths),
    ):
        assert [_depth(e) for e in expressions] == depths.tolist()
        assert [len(e.split()) for e in expressions] == lengths.tolist()
    assert int(task.train_depth.max()) == 4 and int(task.train_lengths.max()) <= 80
    assert task.train_x.shape[1] == task.test_x.shape[1] == int(
        torch.cat([task.train_lengths, task.test_lengths]).max()
    )


def test_ids_decode_to_the_expressions(task):
    for x, expression in zip(task.test_x, task.test_expressions):
        assert " ".join(task.vocab.decode(x)) == expression
    assert len(task.vocab) == 4 + 15


def test_train_and_test_do_not_overlap(task):
    train, test = set(task.train_expressions), set(task.test_expressions)
    assert len(train) == 3000 and len(test) == 500
    assert not train & test


def test_long_sequences_respect_min_length():
    long = make_listops_task(100, 20, max_depth=8, max_args=8, branch=0.25, min_length=150,
                             max_length=400, seed=0)
    assert int(long.train_lengths.min()) >= 150 and int(long.train_lengths.max()) <= 400


def test_same_seed_same_data_and_other_seed_other_data():
    a, b = make_listops_task(200, 50, seed=3), make_listops_task(200, 50, seed=3)
    assert a.train_expressions == b.train_expressions and torch.equal(a.test_x, b.test_x)
    assert make_listops_task(200, 50, seed=4).train_expressions != a.train_expressions


def test_malformed_expressions_are_rejected():
    with pytest.raises(ValueError, match=r"tokens: unexpected '\]' at position 0"):
        evaluate("] 3")
    with pytest.raises(ValueError, match=r"tokens: expected operators, digits or '\]', got '\[FOO'"):
        evaluate("[FOO 1 2 ]")
    with pytest.raises(ValueError, match=r"tokens: expected a complete expression"):
        evaluate("[MAX 1 2")
    with pytest.raises(ValueError, match=r"tokens: expected one expression, got '3' after it at position 4"):
        evaluate("[MAX 1 2 ] 3")


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n_train: expected an integer >= 1, got 0"):
        make_listops_task(0, 10)
    with pytest.raises(ValueError, match=r"max_args: expected an integer >= 2, got 1"):
        make_listops_task(10, 10, max_args=1)
    with pytest.raises(ValueError, match=r"max_length: expected an integer >= 4, got 3"):
        make_listops_task(10, 10, max_length=3)
    with pytest.raises(ValueError, match=r"branch: expected a probability in \[0, 1\], got 1.5"):
        make_listops_task(10, 10, branch=1.5)
    with pytest.raises(ValueError, match=r"n_train \+ n_test: expected at most the number of distinct"):
        make_listops_task(10, 10, max_depth=1, max_args=2, min_length=5)
