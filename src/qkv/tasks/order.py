""""Order matters": sentiment classification that a bag of words cannot solve.

Shape legend: ``n`` sentences, ``t`` padded sentence length in words.

Every sentence is drawn from a template with two swappable slots, and comes with its
mirror image: the same sentence with the two slot fillers exchanged, which has exactly the
same multiset of words and the opposite label::

    the food was good , not bad        positive
    the food was bad , not good        negative
    this pizza is better than that one positive
    that one is better than this pizza negative

A sentence and its mirror always land in the same split, so on the test set every bag of
words occurs once with each label and any bag-of-words classifier scores exactly 50%.
Only a model that uses word order (which adjective the negation precedes, which noun is
the subject of the comparison) can do better. The idea is the classic argument for word
order in sentiment (Socher et al. 2013, "Recursive Deep Models for Semantic
Compositionality", where bag-of-words models fail on negation and "X but Y" contrast);
the templates are ours.

For the demo's heatmaps each sentence records the position of its negation word
(``not``/``never``) and of the adjective it negates, or -1 when it has none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int

__all__ = ["OrderTask", "make_order_task", "NEGATORS", "TEMPLATES"]

SUBJECTS = (
    "food service movie book hotel room staff music coffee pizza show game phone camera car "
    "trip concert meal wine beer bread soup app course lecture album play view beach flight"
).split()
GOOD = (
    "good great excellent wonderful lovely fantastic superb pleasant delightful brilliant "
    "amazing perfect fine nice splendid charming"
).split()
BAD = (
    "bad awful terrible poor horrible dreadful mediocre disappointing boring bland nasty "
    "dull lousy unpleasant weak sloppy"
).split()
BETTER = "better nicer finer greater".split()
WORSE = "worse poorer weaker duller".split()
# The praised side of a comparison is always the first phrase of a pair (the fixed target:
# "this" / "our" / "the new"); the sentence's label is the sentiment towards it.
TARGETS = (("this {S}", "that one"), ("our {S}", "theirs"), ("the new {S}", "the old one"))
NEGATORS = ("not", "never")

# (text, kind, label when A holds the good adjective / the target phrase and C is "better").
# {A} and {Z} are the swappable slots; a template's mirror exchanges their fillers.
TEMPLATES: tuple[tuple[str, str, int], ...] = (
    ("the {S} was {A} , not {Z}", "adj", 1),
    ("the {S} was not {A} but {Z}", "adj", 0),
    ("the {S} was not {A} , it was {Z}", "adj", 0),
    ("the {S} is never {A} , always {Z}", "adj", 0),
    ("i expected the {S} to be {A} but it was {Z}", "adj", 0),
    ("{A} , not {Z} , is how i would describe the {S}", "adj", 1),
    ("the {S} was {A} rather than {Z}", "adj", 1),
    ("they said the {S} would be {A} , yet it was {Z}", "adj", 0),
    ("not {A} at all , the {S} was {Z}", "adj", 0),
    ("the {S} looked {A} but was actually {Z}", "adj", 0),
    ("{A} is {C} than {Z}", "cmp", 1),
    ("compared with {Z} , {A} is {C}", "cmp", 1),
    ("i found {A} {C} than {Z}", "cmp", 1),
)
LABELS = ("negative", "positive")


@dataclass(frozen=True)
class OrderTask:
    """Train/test splits of the order-matters task (no sentence occurs in both)."""

    train_x: Tensor  # (n, t) long: word ids, right-padded with vocab.pad_id (no bos/eos)
    train_lengths: Tensor  # (n,) long: number of words
    train_y: Tensor  # (n,) long: 1 = positive, 0 = negative (see label_names)
    train_negation: Tensor  # (n,) long: position of "not"/"never" in the sentence, -1 if none
    train_negated: Tensor  # (n,) long: position of the adjective it negates, -1 if none
    train_template: Tensor  # (n,) long: index into TEMPLATES
    train_sentences: list[str]  # raw sentences, words separated by single spaces
    test_x: Tensor  # (n, t) long
    test_lengths: Tensor  # (n,) long
    test_y: Tensor  # (n,) long
    test_negation: Tensor  # (n,) long
    test_negated: Tensor  # (n,) long
    test_template: Tensor  # (n,) long
    test_sentences: list[str]
    vocab: Vocabulary  # word vocabulary, the same for every seed and size
    label_names: tuple[str, ...] = LABELS  # label_names[y] is the class name


def _capacity(kind: str) -> int:
    """Number of distinct mirrored pairs a template can produce."""
    if kind == "adj":
        return len(SUBJECTS) * len(GOOD) * len(BAD)
    return len(SUBJECTS) * len(TARGETS) * (len(BETTER) + len(WORSE))


def _fill(template: int, index: int) -> list[tuple[list[str], int]]:
    """The two sentences (words, label) of pair ``index`` of ``template``; the mirror is second."""
    text, kind, label = TEMPLATES[template]
    # Mixed-radix decode of index -> one choice per slot, so every index is a distinct pair.
    if kind == "adj":
        index, bad = divmod(index, len(BAD))
        subject, good = divmod(index, len(GOOD))
        a, z, c = GOOD[good], BAD[bad], ""
    else:
        comparatives = BETTER + WORSE
        index, which = divmod(index, len(comparatives))
        subject, target = divmod(index, len(TARGETS))
        c = comparatives[which]
        a, z = TARGETS[target]
        # "worse" turns praise of the target into criticism.
        label = label if which < len(BETTER) else 1 - label
    subj = SUBJECTS[subject]
    out = []
    for first, second, lab in ((a, z, label), (z, a, 1 - label)):
        sentence = text.format(A=first, Z=second, C=c, S="{S}").format(S=subj)
        out.append((sentence.split(), lab))
    return out


def _negation(words: list[str]) -> tuple[int, int]:
    """Positions of the negation word and the word it negates (the next one), or (-1, -1)."""
    for position, word in enumerate(words):
        if word in NEGATORS:
            # Every template puts the negated adjective right after the negator.
            return position, position + 1
    return -1, -1


def _allocate(n_pairs: int, capacities: list[int]) -> list[int]:
    """Spread ``n_pairs`` over templates as evenly as their capacities allow."""
    counts = [0] * len(capacities)
    remaining = n_pairs
    order = sorted(range(len(capacities)), key=lambda k: capacities[k])
    for done, k in enumerate(order):
        counts[k] = min(capacities[k], remaining // (len(order) - done))
        remaining -= counts[k]
    # Floor division leaves a remainder of fewer pairs than templates; hand it out.
    for k in order[::-1]:
        extra = min(remaining, capacities[k] - counts[k])
        counts[k] += extra
        remaining -= extra
    return counts


def _vocabulary() -> Vocabulary:
    words: list[str] = []
    for text, _, _ in TEMPLATES:
        words += [w for w in text.split() if not w.startswith("{")]
    for a, z in TARGETS:
        words += [w for w in f"{a} {z}".split() if not w.startswith("{")]
    return Vocabulary(words + SUBJECTS + GOOD + BAD + BETTER + WORSE)


def _split(pairs: list[tuple[int, int]], vocab: Vocabulary, rng: random.Random) -> dict:
    rows = [sentence for t, index in pairs for sentence in _fill(t, index)]
    templates = [t for t, _ in pairs for _ in range(2)]
    order = list(range(len(rows)))
    # Shuffle so a sentence and its mirror are not neighbours in a batch.
    rng.shuffle(order)
    words = [rows[k][0] for k in order]
    x, lengths = vocab.encode_batch(words)
    negation = [_negation(w) for w in words]
    return {
        "x": x,
        "lengths": lengths,
        "y": torch.tensor([rows[k][1] for k in order], dtype=torch.long),
        "negation": torch.tensor([p for p, _ in negation], dtype=torch.long),
        "negated": torch.tensor([q for _, q in negation], dtype=torch.long),
        "template": torch.tensor([templates[k] for k in order], dtype=torch.long),
        "sentences": [" ".join(w) for w in words],
    }


def make_order_task(n_train: int = 4000, n_test: int = 1000, *, seed: int = 0) -> OrderTask:
    """Generate the order-matters task.

    Args:
        n_train: number of training sentences; even, because sentences come in mirrored
            pairs with the same words and opposite labels.
        n_test: number of test sentences; even for the same reason.
        seed: seed of the ``random.Random`` that picks and shuffles the sentences.

    Returns:
        An :class:`OrderTask`; ``train_x (n_train, t)``, ``test_x (n_test, t)`` and the
        per-sentence ``(n,)`` tensors described there. Labels are balanced exactly.
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        _check_int(name, value, minimum=1)
        if value % 2:
            raise ValueError(
                f"{name}: expected an even number (sentences come in mirrored pairs), got {value}"
            )
    capacities = [_capacity(kind) for _, kind, _ in TEMPLATES]
    n_pairs = (n_train + n_test) // 2
    if n_pairs > sum(capacities):
        raise ValueError(
            f"n_train + n_test: expected at most {2 * sum(capacities)} sentences "
            f"(all the templates can make), got {n_train + n_test}"
        )
    rng = random.Random(seed)
    pairs = [
        (t, index)
        for t, (cap, count) in enumerate(zip(capacities, _allocate(n_pairs, capacities)))
        # Sampling indices without replacement makes every pair, hence every sentence, distinct.
        for index in rng.sample(range(cap), count)
    ]
    rng.shuffle(pairs)
    vocab = _vocabulary()
    train = _split(pairs[: n_train // 2], vocab, rng)
    test = _split(pairs[n_train // 2 :], vocab, rng)
    return OrderTask(
        **{f"train_{key}": value for key, value in train.items()},
        **{f"test_{key}": value for key, value in test.items()},
        vocab=vocab,
    )
