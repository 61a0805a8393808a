"""Associative recall: find the value stored with a key seen earlier in the sequence.

Shape legend: ``n`` sequences, ``t`` sequence length, ``r`` queries per sequence.

A sequence lists ``n_pairs`` key-value pairs, a separator ``?`` and ``n_queries`` keys from
the list, with filler ``.`` up to ``seq_len``; the target of each query is the value that
followed that key. Two layouts place the filler:

``"packed"`` (every sequence alike: pairs, then filler, then ``?`` and the queries)::

    k3 v7 k0 v1 k5 v7 . . . ? k0 k5        targets v1 v7

``"scattered"`` (the filler split into random gaps, drawn afresh for every sequence)::

    . k3 v7 . . k0 v1 k5 v7 ? . k0 . k5    targets v1 v7

In the packed layout a key and its value sit at the same positions in every sequence, so a
model that mixes along the sequence with fixed weights (a learned projection of the
positions, means over fixed segments) can pair them without reading the tokens. Scattering
removes that shortcut: the only rule left is "the token right after the matching key", as in
the multi-query associative recall (MQAR) of Arora et al. 2023, "Zoology", whose generator
also puts random gaps of filler between the queries.

Single-query recall is the task of Ba et al. 2016, "Using Fast Weights to Attend to the
Recent Past" (``c9k8j3f1??c`` -> 9); several queries per sequence is Zoology's MQAR, where it
separates attention from cheaper sequence mixers. As in Zoology, keys and values come from
disjoint halves of the symbol vocabulary, and keys are distinct within a sequence so every
query has one answer. Attention solves it in two layers given relative positions (a
previous-token head, then a head that matches the query against the copied keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int

__all__ = ["LAYOUTS", "RecallTask", "make_recall_task"]

SEPARATOR = "?"
FILLER = "."
#: where the filler goes: all between the pairs and the separator, or in random gaps
LAYOUTS = ("packed", "scattered")


@dataclass(frozen=True)
class RecallTask:
    """Train/test splits of associative recall; no sequence occurs in both."""

    train_x: Tensor  # (n, t) long: token ids; every sequence has the same length t
    train_lengths: Tensor  # (n,) long: all equal to t (kept for the same API as other tasks)
    train_y: Tensor  # (n, r) long: vocab id of the value each query should recall
    train_where: Tensor  # (n, r) long: position in train_x of each query key, increasing along r
    test_x: Tensor  # (n, t) long
    test_lengths: Tensor  # (n,) long
    test_y: Tensor  # (n, r) long
    test_where: Tensor  # (n, r) long
    vocab: Vocabulary  # keys "k0".., values "v0".., then "?" and "."
    layout: str  # "packed" or "scattered" (see the module docstring)
    n_pairs: int  # key-value pairs per sequence
    n_keys: int  # distinct key symbols
    n_values: int  # distinct value symbols

    @property
    def query_positions(self) -> Tensor:
        """``(r,)`` positions of the queries, the same in every row: the packed layout only."""
        if self.layout != "packed":
            raise ValueError(
                f"query_positions: only the packed layout has the queries at the same positions in "
                f"every row, this task is {self.layout!r}; use train_where / test_where (n, r)"
            )
        return self.train_where[0]


def _positions(count: int, n_pairs: int, n_queries: int, seq_len: int, layout: str,
               generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Where each row puts its keys ``(n, n_pairs)``, separator ``(n,)`` and queries ``(n, r)``.

    The sequence is a run of units in a fixed order (``n_pairs`` two-token pairs, the
    separator, ``n_queries`` one-token queries) with ``seq_len - shortest`` filler tokens
    between them. Scattered: the units take a uniformly random subset of the
    ``units + filler`` slots (so every way of splitting the filler into gaps is equally
    likely); a unit's position is its slot plus one for every pair before it (a pair is two
    tokens in one slot).
    """
    units = n_pairs + 1 + n_queries
    filler = seq_len - (2 * n_pairs + 1 + n_queries)
    if layout == "packed":
        slots = torch.arange(units).expand(count, units).clone()
        slots[:, n_pairs:] += filler  # all the filler in one gap, just before the separator
    else:
        slots = torch.rand(count, units + filler, generator=generator).argsort(dim=1)[:, :units].sort(dim=1).values
    pairs_before = torch.arange(units).clamp(max=n_pairs)
    start = slots + pairs_before
    return start[:, :n_pairs], start[:, n_pairs], start[:, n_pairs + 1 :]


def make_recall_task(
    n_train: int = 8000,
    n_test: int = 1000,
    *,
    n_pairs: int = 8,
    vocab_size: int = 64,
    seq_len: int | None = None,
    n_queries: int = 1,
    layout: str = "packed",
    seed: int = 0,
) -> RecallTask:
    """Generate the associative recall task.

    Args:
        n_train: number of training sequences.
        n_test: number of test sequences.
        n_pairs: key-value pairs per sequence.
        vocab_size: number of key and value symbols together; the first half are keys,
            the rest values (specials, ``?`` and ``.`` come on top).
        seq_len: total sequence length, the rest filled with ``.``. Default: no filler,
            ``2 * n_pairs + 1 + n_queries``.
        n_queries: distinct keys queried per sequence (1 = Ba et al., more = MQAR).
        layout: ``"packed"`` (the filler in one block before the separator: every row has
            its pairs and queries at the same positions) or ``"scattered"`` (the filler in
            random gaps before, between and after the pairs and queries, drawn per row).
        seed: seed of the ``torch.Generator`` that draws the sequences.

    Returns:
        A :class:`RecallTask` with ``train_x (n_train, t)``, ``train_y (n_train, r)`` and
        the query positions ``train_where (n_train, r)``.
    """
    _check_int("n_train", n_train, minimum=1)
    _check_int("n_test", n_test, minimum=1)
    _check_int("n_pairs", n_pairs, minimum=1)
    _check_int("vocab_size", vocab_size, minimum=2)
    _check_int("n_queries", n_queries, minimum=1)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
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

    def draw(count: int) -> tuple[Tensor, Tensor, Tensor]:
        # Distinct keys per row: the first n_pairs columns of a random permutation.
        keys = torch.rand(count, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]
        values = torch.randint(n_values, (count, n_pairs), generator=generator)
        asked = torch.rand(count, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]
        at_key, at_sep, at_query = _positions(count, n_pairs, n_queries, seq_len, layout, generator)
        x = torch.full((count, seq_len), vocab.id(FILLER), dtype=torch.long)
        x.scatter_(1, at_key, keys + key0)
        x.scatter_(1, at_key + 1, values + value0)
        x.scatter_(1, at_sep[:, None], vocab.id(SEPARATOR))
        x.scatter_(1, at_query, keys.gather(1, asked) + key0)
        return x, values.gather(1, asked) + value0, at_query

    # Draw with a margin, drop repeated sequences (keeping first occurrences, so the
    # result does not depend on sorting), and draw again if small settings ran short.
    need = n_train + n_test
    seen: dict[tuple[int, ...], int] = {}
    xs, ys, wheres = [], [], []
    for _ in range(20):
        x, y, where = draw(need + need // 10 + 16)
        keep = []
        for row, key in enumerate(map(tuple, x.tolist())):
            if key not in seen and len(seen) < need:
                seen[key] = len(seen)
                keep.append(row)
        xs.append(x[keep])
        ys.append(y[keep])
        wheres.append(where[keep])
        if len(seen) == need:
            break
    else:
        raise ValueError(
            f"n_train + n_test: expected at most the number of distinct sequences these "
            f"settings allow (found {len(seen)}), got {need}"
        )
    x, y, where = torch.cat(xs), torch.cat(ys), torch.cat(wheres)
    lengths = torch.full((need,), seq_len, dtype=torch.long)
    return RecallTask(
        train_x=x[:n_train],
        train_lengths=lengths[:n_train],
        train_y=y[:n_train],
        train_where=where[:n_train],
        test_x=x[n_train:],
        test_lengths=lengths[n_train:],
        test_y=y[n_train:],
        test_where=where[n_train:],
        vocab=vocab,
        layout=layout,
        n_pairs=n_pairs,
        n_keys=n_keys,
        n_values=n_values,
    )
