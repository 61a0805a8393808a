"""Tests for qkv.tasks.words: the dictionary, Zipf frequencies, <bos>, shapes and determinism."""

from collections import Counter

import pytest
import torch

from qkv.tasks import make_word_stream_task


@pytest.fixture(scope="module")
def task():
    return make_word_stream_task(n_train=300, length=40, n_test=2, test_length=500, n_words=12, letters=6, seed=1)


def _text(task, row):
    return "".join(task.vocabulary.decode(row))


def test_shapes_bos_and_alphabet(task):
    assert task.train.shape == (300, 40) and task.test.shape == (2, 500)
    assert torch.all(task.train[:, 0] == task.vocabulary.bos_id) and torch.all(task.test[:, 0] == task.vocabulary.bos_id)
    assert task.vocabulary.tokens == ("<pad>", "<bos>", "<eos>", "<unk>", *"abcdef", " ")
    assert int(task.train[:, 1:].min()) >= 4  # no special token inside the text


def test_the_text_is_dictionary_words_with_zipf_frequencies(task):
    assert len(set(task.words)) == 12 and all(2 <= len(w) <= 5 and set(w) <= set("abcdef") for w in task.words)
    counts = Counter()
    for row in task.train:
        words = _text(task, row).split(" ")[:-1]  # the last may be cut by the length
        assert all(w in task.words for w in words)
        counts.update(words)
    # weight 1/rank: the most frequent word about twice the second and six times the sixth
    first, second, sixth = (counts[task.words[r]] for r in (0, 1, 5))
    assert 1.6 < first / second < 2.5 and 4.5 < first / sixth < 8


def test_same_seed_same_data_and_arguments_checked():
    a = make_word_stream_task(n_train=5, length=10, seed=3)
    b = make_word_stream_task(n_train=5, length=10, seed=3)
    assert torch.equal(a.train, b.train) and torch.equal(a.test, b.test) and a.words == b.words
    assert not torch.equal(a.train, make_word_stream_task(n_train=5, length=10, seed=4).train)
    with pytest.raises(ValueError, match="length: expected an integer >= 2, got 1"):
        make_word_stream_task(length=1)
    with pytest.raises(ValueError, match="letters: expected at most 26, got 30"):
        make_word_stream_task(letters=30)
