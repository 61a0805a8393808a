"""Associative recall: find the value stored with a key seen earlier in the sequence.

Shape legend: ``n`` sequences, ``t`` sequence length, ``r`` queries per sequence.

A sequence lists ``n_pairs`` key-value pairs, then (optionally) filler, then a separator
``?`` and ``n_queries`` keys from the list; the target of each query is the value that
followed that key::

    k3 v7 k0 v1 k5 v7 . . ? k0        target v1

Single-query recall is the task of Ba et al. 2016, "Using Fast Weights to Attend to the
Recent Past" (``c9k8j3f1??c`` -> 9); several queries per sequence is the multi-query
associative recall (MQAR) of Arora et al. 2023, "Zoology", where it separates attention
from cheaper sequence mixers. As in Zoology, keys and values come from disjoint halves of
the symbol vocabulary, and keys are distinct within a sequence so every query has one
answer. Attention solves it in one layer given the right positional information:
the query matches its key, and the answer sits one position to the right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int

__all__ = ["RecallTask", "make_recall_task"]

SEPARATOR = "?"
FILLER = "."


@dataclass(frozen=True)
class RecallTask:
    """Train/test splits of associative recall; no sequence occurs in both."""

    train_x: Tensor  # (n, t) long: token ids; every sequence has the same length t
    train_lengths: Tensor  # (n,) long: all equal to t (kept for the same API as other tasks)
    train_y: Tensor  # (n, r) long: vocab id of the value each query should recall
    test_x: Tensor  # (n, t) long
    test_lengths: Tensor  # (n,) long
    test_y: Tensor  # (n, r) long
    query_positions: Tensor  # (r,) long: position in x of each query key (same for all rows)
    vocab: Vocabulary  # keys "k0".., values "v0".., then "?" and "."
    n_pairs: int  # key-value pairs per sequence
    n_keys: int  # distinct key symbols
    n_values: int  # distinct value symbols


def make_recall_task(
    n_train: int = 8000,
    n_test: int = 1000,
    *,
    n_pairs: int = 8,
    vocab_size: int = 64,
    seq_len: int | None = None,
    n_queries: int = 1,
    seed: int = 0,
) -> RecallTask:
    """Generate the associative recall task.

    Args:
        n_train: number of training sequences.
        n_test: number of test sequences.
        n_pairs: key-value pairs per sequence.
        vocab_size: number of key and value symbols together; the first half are keys,
            the rest values (specials, ``?`` and ``.`` come on top).
        seq_len: total sequence length; the gap between the pairs and the queries is
            filled with ``.``. Default: no filler, ``2 * n_pairs + 1 + n_queries``.
        n_queries: distinct keys queried per sequence (1 = Ba et al., more = MQAR).
        seed: seed of the ``torch.Generator`` that draws the sequences.

    Returns:
        A :class:`RecallTask` with ``train_x (n_train, t)`` and ``train_y (n_train, r)``.
    """
    _check_int("n_train", n_train, minimum=1)
    _check_int("n_test", n_test, minimum=1)
    _check_int("n_pairs", n_pairs, minimum=1)
    _check_int("vocab_size", vocab_size, minimum=2)
    _check_int("n_queries", n_queries, minimum=1)
    n_keys = vocab_size // 2
    n_values = vocab_size - n_keys
    if n_pairs > n_keys:
        raise ValueError(
            f"n_pairs: expected at most vocab_size // 2 = {n_keys} (keys are distinct), "
            f"got {n_pairs}"
        )
    if n_queries > n_pairs:
        raise ValueError(f"n_queries: expected at most n_pairs = {n_pairs}, got {n_queries}")
    shortest = 2 * n_pairs + 1 + n_queries
    if seq_len is None:
        seq_len = shortest
    elif isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < shortest:
        raise ValueError(
            f"seq_len: expected an integer >= 2 * n_pairs + 1 + n_queries = {shortest}, "
            f"got {seq_len!r}"
        )

    vocab = Vocabulary(
        [f"k{a}" for a in range(n_keys)] + [f"v{a}" for a in range(n_values)] + [SEPARATOR, FILLER]
    )
    key0, value0 = vocab.id("k0"), vocab.id("v0")
    generator = torch.Generator().manual_seed(seed)

    def draw(count: int) -> tuple[Tensor, Tensor]:
        # Distinct keys per row: the first n_pairs columns of a random permutation.
        keys = torch.rand(count, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]
        values = torch.randint(n_values, (count, n_pairs), generator=generator)
        asked = torch.rand(count, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]
        x = torch.full((count, seq_len), vocab.id(FILLER), dtype=torch.long)
        x[:, 0 : 2 * n_pairs : 2] = keys + key0
        x[:, 1 : 2 * n_pairs : 2] = values + value0
        x[:, seq_len - n_queries - 1] = vocab.id(SEPARATOR)
        x[:, seq_len - n_queries :] = keys.gather(1, asked) + key0
        return x, values.gather(1, asked) + value0

    # Draw with a margin, drop repeated sequences (keeping first occurrences, so the
    # result does not depend on sorting), and draw again if small settings ran short.
    need = n_train + n_test
    seen: dict[tuple[int, ...], int] = {}
    xs, ys = [], []
    for _ in range(20):
        x, y = draw(need + need // 10 + 16)
        keep = []
        for row, key in enumerate(map(tuple, x.tolist())):
            if key not in seen and len(seen) < need:
                seen[key] = len(seen)
                keep.append(row)
        xs.append(x[keep])
        ys.append(y[keep])
        if len(seen) == need:
            break
    else:
        raise ValueError(
            f"n_train + n_test: expected at most the number of distinct sequences these "
            f"settings allow (found {len(seen)}), got {need}"
        )
    x, y = torch.cat(xs), torch.cat(ys)
    lengths = torch.full((need,), seq_len, dtype=torch.long)
    return RecallTask(
        train_x=x[:n_train],
        train_lengths=lengths[:n_train],
        train_y=y[:n_train],
        test_x=x[n_train:],
        test_lengths=lengths[n_train:],
        test_y=y[n_train:],
        query_positions=torch.arange(seq_len - n_queries, seq_len),
        vocab=vocab,
        n_pairs=n_pairs,
        n_keys=n_keys,
        n_values=n_values,
    )
