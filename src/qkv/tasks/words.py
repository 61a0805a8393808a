"""A stream of made-up words for language models: text with local structure and no end.

Shape legend: ``n`` sequences, ``t`` sequence length in characters (tokens).

A seeded dictionary of ``n_words`` random letter strings (2 to 5 letters) is drawn once;
the text is those words, separated by spaces, each drawn with Zipf frequencies (the
``r``-th most frequent with weight ``1/r``, as word counts in natural language)::

    <bos> tek qo tek hubsa qo ri tek ...

A language model can learn it from a few hundred short sequences: the first letter of a
word is uncertain (the choice of word), the rest follows from the letters before it, so
the loss falls well below the entropy of the letters and a model that loses its recent
context is seen at once. Every training sequence opens with ``<bos>``; the test streams do
too, and run as long as asked, far past the training length, which is what the demo's
streaming step decodes. Deterministic per ``seed``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int

__all__ = ["WordStreamTask", "make_word_stream_task"]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPACE = " "


@dataclass(frozen=True)
class WordStreamTask:
    vocabulary: Vocabulary  # the letters used, then the space; <bos> is id 1
    words: tuple[str, ...]  # the dictionary, most frequent first
    train: Tensor  # (n_train, length) int64: <bos> and length - 1 characters of text
    test: Tensor  # (n_test, test_length) int64: <bos> and a longer stretch of text


def make_word_stream_task(
    *,
    n_train: int = 1024,
    length: int = 64,
    n_test: int = 4,
    test_length: int = 512,
    n_words: int = 40,
    letters: int = 20,
    seed: int = 0,
) -> WordStreamTask:
    """Draw the dictionary and the training and test sequences; see the module docstring."""
    for name, value, least in (("n_train", n_train, 1), ("length", length, 2), ("n_test", n_test, 1),
                               ("test_length", test_length, 2), ("n_words", n_words, 1), ("letters", letters, 2)):  # fmt: skip
        _check_int(name, value, minimum=least)
    if letters > len(LETTERS):
        raise ValueError(f"letters: expected at most {len(LETTERS)}, got {letters}")
    rng = random.Random(seed)
    alphabet = LETTERS[:letters]
    words: list[str] = []
    while len(words) < n_words:  # distinct words, so each string has one frequency
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5)))
        if word not in words:
            words.append(word)
    weights = [1.0 / rank for rank in range(1, n_words + 1)]
    vocabulary = Vocabulary([*alphabet, SPACE])

    def sequence(size: int) -> list[int]:
        text: list[str] = []
        while len(text) < size - 1:
            text += [*rng.choices(words, weights)[0], SPACE]
        return vocabulary.encode(text[: size - 1], bos=True)

    train = torch.tensor([sequence(length) for _ in range(n_train)])
    test = torch.tensor([sequence(test_length) for _ in range(n_test)])
    return WordStreamTask(vocabulary, tuple(words), train, test)
