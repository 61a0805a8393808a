"""Tests of the learning check (qkv.bench.learning).

The suite runs end to end on tiny sizes and produces its table (the figures themselves are
measured by ``qkv bench --suite learning``, not here); training is seeded; which models are
trained causally and which bidirectionally; checkpoint evaluations leave training as it
was; errors name the argument.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qkv.bench import learning
from qkv.tasks import make_recall_task


def test_learning_suite_tiny_produces_the_table():
    setup = replace(learning.QUICK, steps=2)
    result = learning.run(setup)
    assert list(result.accuracy) == learning.runs(setup)
    assert all(0.0 <= a <= 1.0 for a in result.accuracy.values())
    text = result.markdown()
    assert "| mechanism | attention | test accuracy (final) | final training loss | training time (s) |" in text
    assert "| exact | causal |" in text and "| exact | bidirectional |" in text
    assert "| Linformer | bidirectional |" in text and "| Nyström | bidirectional |" in text
    assert "Chance: 12.5% guessing any value, 25.0% guessing among the values present" in text
    assert torch.get_num_threads() >= 1  # threads restored (run sets 1 while training)


def test_runs_causal_unless_the_mechanism_cannot_be():
    setup = learning.LearningSetup()
    assert learning.runs(setup) == [("exact", True), ("reformer_lsh", True), ("performer", True), ("linear", True),
                                    ("exact", False), ("linformer", False), ("nystrom", False)]  # fmt: skip
    # exact bidirectional is added only as the comparator of a bidirectional mechanism
    assert learning.runs(replace(setup, methods=("exact", "linear"))) == [("exact", True), ("linear", True)]
    assert learning.runs(replace(setup, methods=("linformer",))) == [("exact", False), ("linformer", False)]
    assert learning.runs(replace(setup, causal=False, methods=("exact", "linear"))) == [("exact", False),
                                                                                        ("linear", False)]  # fmt: skip


def test_model_is_causal_when_asked():
    # Causal: changing the last token changes no earlier output; bidirectional: it does.
    setup = replace(learning.QUICK, seq_len=12, n_pairs=2, n_queries=2)
    ids = torch.randint(10, (1, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % 10
    where = torch.arange(12)
    for causal in (True, False):
        torch.manual_seed(0)
        model = learning.RecallModel(18, setup, None, causal=causal).eval()
        a, b = model(ids, where), model(other, where)
        assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) == causal


def test_checkpoints_are_shown_and_do_not_change_training():
    # The checkpoint evaluations run inside the training loop; Reformer LSH draws its hashes
    # from the global generator, so an evaluation that consumed random numbers would show here.
    setup = replace(learning.QUICK, steps=4, checkpoints=(2, 3, 4, 9), methods=("reformer_lsh", "exact"))
    assert setup.shown == (2, 3)  # the last step is the final accuracy; later ones never come
    watched = learning.run(setup)
    plain = learning.run(replace(setup, checkpoints=()))
    assert watched.accuracy == plain.accuracy and watched.loss == plain.loss
    assert all(set(early) == {2, 3} for early in watched.early.values())
    text = watched.markdown()
    assert ("| mechanism | attention | test accuracy after 2 steps | test accuracy after 3 steps | "
            "test accuracy (final) | final training loss | training time (s) |") in text  # fmt: skip
    assert "|---|---|---|---|---|---|---|" in text


def test_learning_is_seeded():
    setup = replace(learning.QUICK, steps=3, methods=("exact", "linear"))
    a, b = learning.run(setup), learning.run(setup)
    assert a.accuracy == b.accuracy and a.loss == b.loss


def test_learning_errors_name_the_argument():
    with pytest.raises(ValueError, match="methods: expected names from"):
        learning.LearningSetup(methods=("exact", "flash"))
    task = make_recall_task(8, 4, n_pairs=2, vocab_size=8, seed=0)
    with pytest.raises(ValueError, match="causal: linformer cannot be causal"):
        learning.train_one("linformer", task, learning.QUICK, causal=True)
