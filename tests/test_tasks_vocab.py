"""Tests for qkv.tasks.vocab: ids, round trips, padding and argument errors."""

import pytest
import torch

from qkv.tasks.vocab import Vocabulary, _check_int


def test_specials_come_first_and_tokens_keep_their_order():
    vocab = Vocabulary(["b", "a", "b", "c"])
    assert vocab.tokens == ("<pad>", "<bos>", "<eos>", "<unk>", "b", "a", "c")
    assert (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3)
    assert len(vocab) == 7
    assert "a" in vocab and "z" not in vocab
    assert vocab.id("a") == 5 and vocab.token(5) == "a"


def test_string_is_encoded_as_characters_and_round_trips():
    vocab = Vocabulary("abc")
    ids = vocab.encode("cab", bos=True, eos=True)
    assert ids == [1, 6, 4, 5, 2]
    assert "".join(vocab.decode(ids)) == "cab"
    assert vocab.decode(ids, keep_special=True) == ["<bos>", "c", "a", "b", "<eos>"]


def test_unknown_tokens_map_to_unk():
    vocab = Vocabulary(["hello"])
    assert vocab.encode(["hello", "world"]) == [4, vocab.unk_id]
    assert vocab.decode([4, 3]) == ["hello", "<unk>"]


def test_decode_stops_at_eos_and_skips_padding():
    vocab = Vocabulary("ab")
    assert vocab.decode(torch.tensor([1, 4, 0, 5, 2, 4, 4])) == ["a", "b"]


def test_pad_returns_long_ids_and_lengths():
    vocab = Vocabulary("abc")
    ids, lengths = vocab.encode_batch(["ab", "", "cabc"], eos=True)
    assert ids.dtype == torch.long and lengths.dtype == torch.long
    assert ids.shape == (3, 5)
    assert lengths.tolist() == [3, 1, 5]
    assert ids[0].tolist() == [4, 5, 2, 0, 0]
    assert ids[1].tolist() == [2, 0, 0, 0, 0]
    assert [("".join(row)) for row in vocab.decode_batch(ids)] == ["ab", "", "cabc"]


def test_pad_to_a_fixed_length():
    vocab = Vocabulary("ab")
    ids, lengths = vocab.pad([[4], [5, 4]], length=4)
    assert ids.tolist() == [[4, 0, 0, 0], [5, 4, 0, 0]]
    assert lengths.tolist() == [1, 2]
    empty, _ = vocab.pad([])
    assert empty.shape == (0, 0)


def test_equal_vocabularies_compare_equal():
    assert Vocabulary("abc") == Vocabulary(["a", "b", "c", "a"])
    assert Vocabulary("abc") != Vocabulary("acb")
    assert hash(Vocabulary("ab")) == hash(Vocabulary("ab"))
    assert "Vocabulary(6 tokens" in repr(Vocabulary("ab"))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"tokens: expected no special tokens .* got '<pad>'"):
        Vocabulary(["a", "<pad>"])
    with pytest.raises(TypeError, match=r"tokens: expected strings, got int 3"):
        Vocabulary(["a", 3])
    with pytest.raises(ValueError, match=r"index: expected an id in \[0, 6\), got 9"):
        Vocabulary("ab").token(9)
    with pytest.raises(ValueError, match=r"length: expected at least the longest sequence \(3\), got 2"):
        Vocabulary("ab").pad([[4, 4, 4]], length=2)
    with pytest.raises(ValueError, match=r"ids: expected a 2-D \(n, t\) tensor, got shape \(3,\)"):
        Vocabulary("ab").decode_batch(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"ids: expected a 1-D tensor, got shape \(1, 2\)"):
        Vocabulary("ab").decode(torch.tensor([[4, 5]]))


def test_check_int_rejects_bools_floats_and_small_values():
    assert _check_int("n", 3, minimum=1) == 3
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"n: expected an integer >= 1, got "):
            _check_int("n", bad, minimum=1)
