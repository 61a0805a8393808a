"""Tests of the learning check (qkv.bench.learning).

The suite runs end to end on tiny sizes and produces its table (the figures themselves are
measured by ``qkv bench --suite learning``, not here) and a text that describes the set-up it
ran; training is seeded; which models are trained causally and which bidirectionally; the
model reads each row's own query positions and embeds the previous token without breaking
causality; checkpoint evaluations leave training as it was; errors name the argument.
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
    assert "(`qkv.tasks.make_recall_task`, layout `scattered`)" in text and "random gaps" in text
    assert "embedding of the previous token" in text and "Packed layout" not in text
    assert torch.get_num_threads() >= 1  # threads restored (run sets 1 while training)


def test_quick_mode_runs(capsys):
    # ``python -m qkv.bench.learning --quick`` and ``qkv bench --suite learning --quick`` both use QUICK
    assert learning.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "exact (causal): test accuracy" in out and "nystrom (bidirectional): test accuracy" in out
    assert f"{learning.QUICK.steps} AdamW steps of {learning.QUICK.batch} sequences" in out
    assert "| Nyström | bidirectional |" in out and "layout `scattered`" in out


def test_quick_mode_runs_through_qkv_bench(tmp_path):
    from qkv import bench

    threads = torch.get_num_threads()
    out = tmp_path / "results.md"
    try:
        assert bench.main(["--suite", "learning", "--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # --threads sets it for the whole process
    text = out.read_text()
    assert "<!-- suite: learning -->" in text and "<!-- end: learning -->" in text
    assert "| exact | bidirectional |" in text and "Read each row against exact attention with the same mask" in text


def test_text_follows_the_setup():
    # The description is built from the set-up, so a packed run without the previous-token
    # embedding, every model bidirectional, says so and drops the sentences that no longer hold.
    setup = replace(learning.QUICK, steps=2, layout="packed", previous_token=False, causal=False,
                    methods=("exact", "linear"))  # fmt: skip
    text = learning.run(setup).markdown()
    assert "layout `packed`" in text and "Packed layout: the pairs sit at the same positions" in text
    assert "previous token" not in text and "previous-token" not in text and "random gaps" not in text
    assert "Every model is bidirectional." in text and "| linear (elu+1) | bidirectional |" in text


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
    # The previous-token embedding is on (the default), so it must not leak the future either.
    setup = replace(learning.QUICK, seq_len=12, n_pairs=2, n_queries=2)
    assert setup.previous_token
    ids = torch.randint(10, (1, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % 10
    where = torch.arange(12)
    for causal in (True, False):
        torch.manual_seed(0)
        model = learning.RecallModel(18, setup, None, causal=causal).eval()
        a, b = model(ids, where), model(other, where)
        assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) == causal


def test_previous_token_embedding_sees_the_token_one_step_back():
    setup = replace(learning.QUICK, seq_len=7)
    model = learning.RecallModel(18, setup, None).eval()
    seen = []
    model.previous.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 5, 13, 6, 14, 7, 15]])
    model(ids, torch.tensor([6]))
    assert seen[0].tolist() == [[0, 5, 6, 7, 8, 9, 10], [0, 12, 5, 13, 6, 14, 7]]  # id 0 (<pad>) before the start
    assert learning.RecallModel(18, replace(setup, previous_token=False), None).previous is None


def test_model_reads_each_rows_own_query_positions():
    setup = replace(learning.QUICK, seq_len=9)
    torch.manual_seed(0)
    model = learning.RecallModel(18, setup, None, causal=False).eval()
    ids = torch.randint(4, 18, (3, 9), generator=torch.Generator().manual_seed(1))
    where = torch.tensor([[1, 4], [8, 0], [5, 5]])
    every = model(ids, torch.arange(9))  # (b, t, vocab): the read-out at every position
    picked = model(ids, where)
    assert picked.shape == (3, 2, 18)
    for row in range(3):
        assert torch.allclose(picked[row], every[row, where[row]], atol=1e-6)
    # one (r,) vector of positions serves every row (the packed layout's query_positions)
    assert torch.allclose(model(ids, torch.tensor([8, 2])), every[:, [8, 2]], atol=1e-6)


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
    with pytest.raises(ValueError, match=r"layout: expected one of \('packed', 'scattered'\), got 'shuffled'"):
        learning.LearningSetup(layout="shuffled")
    task = make_recall_task(8, 4, n_pairs=2, vocab_size=8, seed=0)
    with pytest.raises(ValueError, match="causal: linformer cannot be causal"):
        learning.train_one("linformer", task, learning.QUICK, causal=True)
