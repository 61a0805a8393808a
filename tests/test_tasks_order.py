"""Tests for qkv.tasks.order: labels, the bag-of-words guarantee, splits and negation positions."""

from collections import Counter, defaultdict

import pytest
import torch

from qkv.tasks.order import BAD, BETTER, GOOD, NEGATORS, SUBJECTS, TEMPLATES, WORSE, make_order_task


@pytest.fixture(scope="module")
def task():
    return make_order_task(n_train=2000, n_test=600, seed=3)


# Every template once, with the generic fillers "good"/"bad", "better"/"worse" and the
# target "this S" against "that one", labelled by hand (not by the generator).
HAND_LABELLED = {
    "the S was good , not bad": 1,
    "the S was bad , not good": 0,
    "the S was not good but bad": 0,
    "the S was not bad but good": 1,
    "the S was not good , it was bad": 0,
    "the S was not bad , it was good": 1,
    "the S is never good , always bad": 0,
    "the S is never bad , always good": 1,
    "i expected the S to be good but it was bad": 0,
    "i expected the S to be bad but it was good": 1,
    "good , not bad , is how i would describe the S": 1,
    "bad , not good , is how i would describe the S": 0,
    "the S was good rather than bad": 1,
    "the S was bad rather than good": 0,
    "they said the S would be good , yet it was bad": 0,
    "they said the S would be bad , yet it was good": 1,
    "not good at all , the S was bad": 0,
    "not bad at all , the S was good": 1,
    "the S looked good but was actually bad": 0,
    "the S looked bad but was actually good": 1,
    "this S is better than that one": 1,
    "that one is better than this S": 0,
    "this S is worse than that one": 0,
    "that one is worse than this S": 1,
    "compared with that one , this S is better": 1,
    "compared with this S , that one is better": 0,
    "compared with that one , this S is worse": 0,
    "compared with this S , that one is worse": 1,
    "i found this S better than that one": 1,
    "i found that one better than this S": 0,
    "i found this S worse than that one": 0,
    "i found that one worse than this S": 1,
}


def _canonical(sentence: str) -> str:
    words = []
    for word in sentence.split():
        word = "S" if word in SUBJECTS else word
        word = "good" if word in GOOD else "bad" if word in BAD else word
        word = "better" if word in BETTER else "worse" if word in WORSE else word
        words.append(word)
    text = " ".join(words)
    for phrase, same in (("the new S", "this S"), ("our S", "this S"), ("the old one", "that one"),
                         ("theirs", "that one")):
        text = text.replace(phrase, same)
    return text


def test_shapes_and_dtypes(task):
    n, t = task.train_x.shape
    assert n == 2000 and task.test_x.shape[0] == 600
    for name in ("lengths", "y", "negation", "negated", "template"):
        assert getattr(task, f"train_{name}").shape == (2000,)
        assert getattr(task, f"test_{name}").shape == (600,)
        assert getattr(task, f"train_{name}").dtype == torch.long
    assert task.train_x.dtype == torch.long
    assert int(task.train_lengths.max()) == t
    assert len(task.train_sentences) == 2000 and len(task.test_sentences) == 600
    assert task.label_names == ("negative", "positive")


def test_ids_decode_to_the_sentences(task):
    for x, length, sentence in zip(task.test_x, task.test_lengths, task.test_sentences):
        assert task.vocab.decode(x) == sentence.split()
        assert int(length) == len(sentence.split())
        assert task.vocab.unk_id not in x.tolist()


def test_labels_match_hand_labelled_templates(task):
    assert len({_canonical(text) for text, _, _ in TEMPLATES}) == len(TEMPLATES)
    for sentences, labels in ((task.train_sentences, task.train_y), (task.test_sentences, task.test_y)):
        seen = set()
        for sentence, label in zip(sentences, labels.tolist()):
            key = _canonical(sentence)
            assert HAND_LABELLED[key] == label, sentence
            seen.add(key)
        assert len(seen) == len(HAND_LABELLED)  # every template and order is used


def test_bag_of_words_is_ambiguous_for_every_sentence(task):
    for sentences, labels in ((task.train_sentences, task.train_y), (task.test_sentences, task.test_y)):
        by_bag = defaultdict(list)
        for sentence, label in zip(sentences, labels.tolist()):
            by_bag[frozenset(Counter(sentence.split()).items())].append(label)
        # Each bag occurs exactly twice, once per label, so any function of the bag scores 50%.
        assert all(sorted(group) == [0, 1] for group in by_bag.values())
        assert float(labels.float().mean()) == 0.5


def test_a_trained_bag_of_words_classifier_is_at_chance(task):
    def counts(x):
        bags = torch.zeros(len(x), len(task.vocab))
        bags.scatter_add_(1, x, torch.ones_like(x, dtype=torch.float))
        bags[:, task.vocab.pad_id] = 0
        return bags

    # A least-squares linear classifier on word counts (plus a bias column), fitted in
    # closed form: the best a linear bag-of-words model can do on the training set.
    def design(x):
        return torch.cat([counts(x), torch.ones(len(x), 1)], dim=1).double()

    targets = task.train_y.double() * 2 - 1
    weights = torch.linalg.lstsq(design(task.train_x), targets[:, None]).solution
    predicted = (design(task.test_x) @ weights).squeeze(1) > 0
    accuracy = (predicted.long() == task.test_y).float().mean()
    assert float(accuracy) == 0.5


def test_train_and_test_do_not_overlap(task):
    train, test = set(task.train_sentences), set(task.test_sentences)
    assert len(train) == 2000 and len(test) == 600
    assert not train & test


def test_negation_positions_point_at_the_negator_and_its_adjective(task):
    for x, negation, negated, label in zip(task.test_x, task.test_negation, task.test_negated, task.test_y):
        words = task.vocab.decode(x)
        if not set(words) & set(NEGATORS):
            assert int(negation) == int(negated) == -1
            continue
        assert words[int(negation)] in NEGATORS
        adjective = words[int(negated)]
        # The negated adjective is the sentiment the sentence denies.
        assert adjective in (BAD if int(label) == 1 else GOOD)
    assert (task.test_negation >= 0).float().mean() > 0.3


def test_same_seed_same_data_and_other_seed_other_data():
    a, b = make_order_task(200, 100, seed=7), make_order_task(200, 100, seed=7)
    assert a.train_sentences == b.train_sentences and a.test_sentences == b.test_sentences
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    c = make_order_task(200, 100, seed=8)
    assert c.train_sentences != a.train_sentences
    assert c.vocab == a.vocab  # the vocabulary does not depend on the sample


def test_small_requests_still_cover_both_labels():
    tiny = make_order_task(2, 2, seed=0)
    assert sorted(tiny.train_y.tolist()) == [0, 1] and sorted(tiny.test_y.tolist()) == [0, 1]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n_train: expected an integer >= 1, got 0"):
        make_order_task(0, 10)
    with pytest.raises(ValueError, match=r"n_test: expected an integer >= 1, got -2"):
        make_order_task(10, -2)
    with pytest.raises(ValueError, match=r"n_train: expected an even number .* got 11"):
        make_order_task(11, 10)
    with pytest.raises(ValueError, match=r"n_train \+ n_test: expected at most \d+ sentences .* got 1000000"):
        make_order_task(999_990, 10)
