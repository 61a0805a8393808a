"""Tests for qkv.tasks.recall: layout, answers found by scanning, splits and errors."""

import pytest
import torch

from qkv.tasks.recall import FILLER, SEPARATOR, make_recall_task


@pytest.fixture(scope="module")
def task():
    return make_recall_task(3000, 500, n_pairs=6, vocab_size=20, seq_len=20, n_queries=2, seed=4)


def _answers(tokens: list[str], n_pairs: int) -> list[str]:
    """The value after each queried key, found by reading the sequence left to right."""
    memory = {}
    for key, value in zip(tokens[0 : 2 * n_pairs : 2], tokens[1 : 2 * n_pairs : 2]):
        memory[key] = value
    queries = tokens[tokens.index(SEPARATOR) + 1 :]
    return [memory[query] for query in queries]


def test_shapes_and_layout(task):
    assert task.train_x.shape == (3000, 20) and task.test_x.shape == (500, 20)
    assert task.train_y.shape == (3000, 2) and task.test_y.dtype == torch.long
    assert task.train_lengths.tolist() == [20] * 3000
    assert task.query_positions.tolist() == [18, 19]
    assert (task.n_pairs, task.n_keys, task.n_values) == (6, 10, 10)
    tokens = task.vocab.decode(task.train_x[0])
    assert all(t.startswith("k") for t in tokens[0:12:2])
    assert all(t.startswith("v") for t in tokens[1:12:2])
    assert tokens[12:17] == [FILLER] * 5 and tokens[17] == SEPARATOR


def test_targets_are_the_values_stored_with_the_queried_keys(task):
    for x, y in zip(torch.cat([task.train_x, task.test_x]), torch.cat([task.train_y, task.test_y])):
        tokens = task.vocab.decode(x)
        keys = tokens[0:12:2]
        assert len(set(keys)) == len(keys)  # one answer per query
        queries = [tokens[p] for p in task.query_positions.tolist()]
        assert len(set(queries)) == len(queries)
        assert task.vocab.decode(y) == _answers(tokens, task.n_pairs)


def test_train_and_test_do_not_overlap(task):
    train = {tuple(row) for row in task.train_x.tolist()}
    test = {tuple(row) for row in task.test_x.tolist()}
    assert len(train) == 3000 and len(test) == 500
    assert not train & test


def test_default_length_has_no_filler_and_single_query():
    plain = make_recall_task(50, 10, n_pairs=4, vocab_size=16, seed=0)
    assert plain.train_x.shape == (50, 10) and plain.train_y.shape == (50, 1)
    assert FILLER not in plain.vocab.decode(plain.train_x[0])


def test_same_seed_same_data_and_other_seed_other_data():
    a, b = make_recall_task(100, 20, seed=1), make_recall_task(100, 20, seed=1)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, make_recall_task(100, 20, seed=2).train_x)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n_train: expected an integer >= 1, got 0"):
        make_recall_task(0, 10)
    with pytest.raises(ValueError, match=r"n_pairs: expected at most vocab_size // 2 = 4 .* got 5"):
        make_recall_task(10, 10, n_pairs=5, vocab_size=8)
    with pytest.raises(ValueError, match=r"n_queries: expected at most n_pairs = 2, got 3"):
        make_recall_task(10, 10, n_pairs=2, n_queries=3)
    with pytest.raises(ValueError, match=r"seq_len: expected an integer >= .* = 18, got 10"):
        make_recall_task(10, 10, n_pairs=8, seq_len=10)
    with pytest.raises(ValueError, match=r"n_train \+ n_test: expected at most the number of distinct"):
        make_recall_task(20, 10, n_pairs=1, vocab_size=4)
