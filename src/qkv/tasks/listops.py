"""ListOps: evaluate nested list operations over single digits.

Shape legend: ``n`` expressions, ``t`` padded expression length in tokens.

Expressions nest four operators over the digits 0-9 (Nangia & Bowman 2018, "ListOps: A
Diagnostic Dataset for Latent Tree Learning"; the long-sequence version is a task of
Tay et al. 2021, "Long Range Arena")::

    [MAX 2 9 [MIN 4 7 ] 0 ]          -> 9
    [SM 3 [MED 1 5 8 2 ] 6 ]         -> 3 + 3 + 6 = 12 -> 2

``MAX``/``MIN`` are the largest/smallest argument, ``SM`` the sum modulo 10 and ``MED``
the median, rounded down when the number of arguments is even (the LRA convention,
``int(np.median(...))``). The answer is always a digit, so the task is 10-way
classification of the whole sequence: the model has to find matching brackets, which is
where attention over long distances is needed. Generator and evaluator are ours.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int

__all__ = ["ListOpsTask", "make_listops_task", "evaluate", "OPERATORS"]

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))


def _apply(operator: str, args: list[int]) -> int:
    if operator == "[MAX":
        return max(args)
    if operator == "[MIN":
        return min(args)
    if operator == "[SM":
        return sum(args) % 10
    ordered = sorted(args)
    middle = len(ordered) // 2
    # Odd: the middle element; even: the mean of the two middle ones, floored.
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2


def evaluate(tokens: list[str] | str) -> int:
    """The value (0-9) of a tokenised expression, or a string of space-separated tokens."""
    if isinstance(tokens, str):
        tokens = tokens.split()
    stack: list[tuple[str, list[int]]] = []
    value = None
    for position, token in enumerate(tokens):
        if value is not None:
            raise ValueError(
                f"tokens: expected one expression, got {token!r} after it at position {position}"
            )
        if token in OPERATORS:
            stack.append((token, []))
        elif token == CLOSE or token in DIGITS:
            if token == CLOSE:
                if not stack or not stack[-1][1]:
                    raise ValueError(f"tokens: unexpected {CLOSE!r} at position {position}")
                operator, args = stack.pop()
                result = _apply(operator, args)
            else:
                result = int(token)
            if stack:
                stack[-1][1].append(result)
            else:
                value = result
        else:
            raise ValueError(f"tokens: expected operators, digits or {CLOSE!r}, got {token!r}")
    if value is None:
        raise ValueError(f"tokens: expected a complete expression, got {' '.join(tokens)!r}")
    return value


@dataclass(frozen=True)
class ListOpsTask:
    """Train/test splits of ListOps; no expression occurs in both."""

    train_x: Tensor  # (n, t) long: token ids, right-padded with vocab.pad_id (no bos/eos)
    train_lengths: Tensor  # (n,) long: tokens in each expression
    train_y: Tensor  # (n,) long: the value, 0-9 (a class index, not a vocab id)
    train_depth: Tensor  # (n,) long: nesting depth (1 = one operator over digits)
    train_expressions: list[str]  # tokens separated by single spaces
    test_x: Tensor  # (n, t) long
    test_lengths: Tensor  # (n,) long
    test_y: Tensor  # (n,) long
    test_depth: Tensor  # (n,) long
    test_expressions: list[str]
    vocab: Vocabulary  # the 4 operators, "]" and the 10 digits


class _TooLong(Exception):
    """Raised inside the generator to abandon a draw as soon as it passes max_length."""


def _expression(
    rng: random.Random, out: list[str], depth: int, limits: tuple[int, int, float, int]
) -> int:
    """Append a random expression (root is an operator) to ``out``; return its depth."""
    max_depth, max_args, branch, max_length = limits
    out.append(rng.choice(OPERATORS))
    deepest = 1
    for _ in range(rng.randint(2, max_args)):
        # Checked as we go: with deep nesting and many arguments a draw can be
        # exponentially long, and most of it would be thrown away.
        if len(out) >= max_length:
            raise _TooLong
        if depth < max_depth and rng.random() < branch:
            deepest = max(deepest, _expression(rng, out, depth + 1, limits) + 1)
        else:
            out.append(rng.choice(DIGITS))
    out.append(CLOSE)
    return deepest


def make_listops_task(
    n_train: int = 8000,
    n_test: int = 1000,
    *,
    max_depth: int = 4,
    max_args: int = 5,
    min_length: int = 1,
    max_length: int = 100,
    branch: float = 0.3,
    seed: int = 0,
) -> ListOpsTask:
    """Generate the ListOps task.

    Args:
        n_train: number of training expressions.
        n_test: number of test expressions.
        max_depth: deepest nesting of operators (1 = a single operator over digits).
        max_args: most arguments an operator takes (at least 2).
        min_length: shortest expression in tokens; shorter draws are rejected.
        max_length: longest expression in tokens; longer draws are rejected.
        branch: probability that an argument is itself an expression (below max_depth).
            LRA's long sequences come from a high ``branch`` and ``max_args``.
        seed: seed of the ``random.Random`` that draws the expressions.

    Returns:
        A :class:`ListOpsTask` with ``train_x (n_train, t)`` and ``train_y (n_train,)``.
    """
    _check_int("n_train", n_train, minimum=1)
    _check_int("n_test", n_test, minimum=1)
    _check_int("max_depth", max_depth, minimum=1)
    _check_int("max_args", max_args, minimum=2)
    _check_int("min_length", min_length, minimum=1)
    # The shortest expression is an operator, two digits and a bracket.
    _check_int("max_length", max_length, minimum=max(4, min_length))
    if not 0.0 <= branch <= 1.0:
        raise ValueError(f"branch: expected a probability in [0, 1], got {branch!r}")

    rng = random.Random(seed)
    need = n_train + n_test
    seen: dict[str, tuple[int, int]] = {}
    # Rejection sampling on length and repeats; the budget turns impossible settings
    # (e.g. min_length beyond what max_depth and max_args can reach) into an error.
    limits = (max_depth, max_args, branch, max_length)
    for _ in range(50 * need + 1000):
        tokens: list[str] = []
        try:
            depth = _expression(rng, tokens, 1, limits)
        except _TooLong:
            continue
        if not min_length <= len(tokens) <= max_length:
            continue
        text = " ".join(tokens)
        if text not in seen:
            seen[text] = (evaluate(tokens), depth)
            if len(seen) == need:
                break
    else:
        raise ValueError(
            f"n_train + n_test: expected at most the number of distinct expressions these "
            f"settings produce (found {len(seen)} in the sampling budget), got {need}"
        )

    vocab = Vocabulary(OPERATORS + (CLOSE,) + DIGITS)
    expressions = list(seen)
    x, lengths = vocab.encode_batch(text.split() for text in expressions)
    y = torch.tensor([seen[text][0] for text in expressions], dtype=torch.long)
    depth = torch.tensor([seen[text][1] for text in expressions], dtype=torch.long)
    # The padded length is the longest expression over both splits, so train and test
    # batches have the same width.
    return ListOpsTask(
        train_x=x[:n_train],
        train_lengths=lengths[:n_train],
        train_y=y[:n_train],
        train_depth=depth[:n_train],
        train_expressions=expressions[:n_train],
        test_x=x[n_train:],
        test_lengths=lengths[n_train:],
        test_y=y[n_train:],
        test_depth=depth[n_train:],
        test_expressions=expressions[n_train:],
        vocab=vocab,
    )
