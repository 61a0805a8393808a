"""Tests for qkv.tasks.recall: both layouts, answers found by scanning, splits and errors.

The answers are checked by reading each sequence left to right (a key, then its value),
independently of how the generator placed them; the scattered layout is checked to move
the pairs and queries from row to row, which is the point of it.
"""

import pytest
import torch

from qkv.tasks.recall import FILLER, SEPARATOR, make_recall_task


@pytest.fixture(scope="module")
def task():
    return make_recall_task(3000, 500, n_pairs=6, vocab_size=20, seq_len=20, n_queries=2, seed=4)


@pytest.fixture(scope="module")
def scattered():
    return make_recall_task(3000, 500, n_pairs=4, vocab_size=16, seq_len=24, n_queries=3, layout="scattered", seed=4)


def _read(tokens: list[str]) -> tuple[dict[str, str], list[int]]:
    """Scan a sequence: the value written right after each key before ``?``, and where the queries are."""
    sep = tokens.index(SEPARATOR)
    memory = {}
    for p in range(sep):
        if tokens[p].startswith("k"):
            assert tokens[p] not in memory  # keys are distinct: one answer per query
            memory[tokens[p]] = tokens[p + 1]
    queries = [p for p in range(sep + 1, len(tokens)) if tokens[p] != FILLER]
    return memory, queries


def _check_rows(t) -> None:
    for x, y, where in zip(torch.cat([t.train_x, t.test_x]), torch.cat([t.train_y, t.test_y]),
                           torch.cat([t.train_where, t.test_where])):  # fmt: skip
        tokens = t.vocab.decode(x)
        memory, queries = _read(tokens)
        assert len(memory) == t.n_pairs and all(v.startswith("v") for v in memory.values())
        assert tokens.count(SEPARATOR) == 1
        assert queries == where.tolist()  # every query found where the task says, nothing else after "?"
        asked = [tokens[p] for p in queries]
        assert len(set(asked)) == len(asked) and all(q in memory for q in asked)
        assert t.vocab.decode(y) == [memory[q] for q in asked]


def test_shapes_and_packed_layout(task):
    assert task.train_x.shape == (3000, 20) and task.test_x.shape == (500, 20)
    assert task.train_y.shape == (3000, 2) and task.test_y.dtype == torch.long
    assert task.train_where.shape == (3000, 2) and task.test_where.shape == (500, 2)
    assert task.train_lengths.tolist() == [20] * 3000
    assert task.layout == "packed" and task.query_positions.tolist() == [18, 19]
    assert (task.train_where == torch.tensor([18, 19])).all() and (task.test_where == torch.tensor([18, 19])).all()
    assert (task.n_pairs, task.n_keys, task.n_values) == (6, 10, 10)
    tokens = task.vocab.decode(task.train_x[0])
    assert all(t.startswith("k") for t in tokens[0:12:2])
    assert all(t.startswith("v") for t in tokens[1:12:2])
    assert tokens[12:17] == [FILLER] * 5 and tokens[17] == SEPARATOR


def test_packed_targets_are_the_values_stored_with_the_queried_keys(task):
    _check_rows(task)


def test_scattered_targets_are_the_values_stored_with_the_queried_keys(scattered):
    assert scattered.train_x.shape == (3000, 24) and scattered.train_where.shape == (3000, 3)
    _check_rows(scattered)


def test_scattered_moves_pairs_and_queries_from_row_to_row(scattered):
    x = scattered.train_x[:500]
    sep = (x == scattered.vocab.id(SEPARATOR)).float().argmax(dim=1)
    is_key = torch.tensor([[t.startswith("k") for t in scattered.vocab.decode(row)] for row in x])
    pair_key = is_key & (torch.arange(x.shape[1]) < sep[:, None])  # the queries come after "?"
    # Most positions hold a pair's key in some rows and not in others: no fixed position belongs
    # to the pairs, so a fixed mixing along the sequence cannot pair a key with its value.
    share = pair_key.float().mean(dim=0)
    assert ((share > 0.02) & (share < 0.5)).sum() >= 15
    assert len(set(pair_key.float().argmax(dim=1).tolist())) >= 5  # where the first pair starts
    assert len(set(sep.tolist())) >= 8
    assert len({tuple(w) for w in scattered.train_where[:500].tolist()}) >= 100
    # a key's neighbour is always its value (checked above), but the gap to the next pair varies
    gaps = set()
    for row in pair_key.tolist():
        at = [p for p, key in enumerate(row) if key]
        gaps |= {b - a - 2 for a, b in zip(at, at[1:])}
    assert {0, 1, 2, 3} <= gaps
    with pytest.raises(ValueError, match=r"query_positions: only the packed layout .* 'scattered'"):
        scattered.query_positions


def test_train_and_test_do_not_overlap(task, scattered):
    for t, n_train, n_test in ((task, 3000, 500), (scattered, 3000, 500)):
        train = {tuple(row) for row in t.train_x.tolist()}
        test = {tuple(row) for row in t.test_x.tolist()}
        assert len(train) == n_train and len(test) == n_test
        assert not train & test


def test_default_length_has_no_filler_and_single_query():
    for layout in ("packed", "scattered"):
        plain = make_recall_task(50, 10, n_pairs=4, vocab_size=16, layout=layout, seed=0)
        assert plain.train_x.shape == (50, 10) and plain.train_y.shape == (50, 1)
        assert FILLER not in plain.vocab.decode(plain.train_x[0])
        assert (plain.train_where == 9).all()  # no filler: both layouts are the same sequence shape


def test_same_seed_same_data_and_other_seed_other_data():
    for layout in ("packed", "scattered"):
        a = make_recall_task(100, 20, seq_len=30, layout=layout, seed=1)
        b = make_recall_task(100, 20, seq_len=30, layout=layout, seed=1)
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
        assert torch.equal(a.train_where, b.train_where)
        assert not torch.equal(a.train_x, make_recall_task(100, 20, seq_len=30, layout=layout, seed=2).train_x)


def test_scattered_keeps_the_symbols_of_packed_and_moves_them():
    # The layout changes only where the tokens go, not which keys, values and queries are drawn
    # (the pair symbols come from the generator first), so one seed gives the same recall problems.
    packed = make_recall_task(40, 10, n_pairs=3, vocab_size=12, seq_len=16, n_queries=2, seed=3)
    moved = make_recall_task(40, 10, n_pairs=3, vocab_size=12, seq_len=16, n_queries=2, layout="scattered", seed=3)
    assert torch.equal(packed.train_y, moved.train_y)
    no_filler = [[i for i in row if i != packed.vocab.id(FILLER)] for row in packed.train_x.tolist()]
    assert no_filler == [[i for i in row if i != moved.vocab.id(FILLER)] for row in moved.train_x.tolist()]
    assert not torch.equal(packed.train_x, moved.train_x)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n_train: expected an integer >= 1, got 0"):
        make_recall_task(0, 10)
    with pytest.raises(ValueError, match=r"n_pairs: expected at most vocab_size // 2 = 4 .* got 5"):
        make_recall_task(10, 10, n_pairs=5, vocab_size=8)
    with pytest.raises(ValueError, match=r"n_queries: expected at most n_pairs = 2, got 3"):
        make_recall_task(10, 10, n_pairs=2, n_queries=3)
    with pytest.raises(ValueError, match=r"seq_len: expected an integer >= .* = 18, got 10"):
        make_recall_task(10, 10, n_pairs=8, seq_len=10)
    with pytest.raises(ValueError, match=r"layout: expected one of \('packed', 'scattered'\), got 'random'"):
        make_recall_task(10, 10, layout="random")
    with pytest.raises(ValueError, match=r"n_train \+ n_test: expected at most the number of distinct"):
        make_recall_task(20, 10, n_pairs=1, vocab_size=4)
