"""Benchmark: can a small model learn with each approximate mechanism? (issue 6, learning check)

Shape legend: ``b`` batch, ``t`` sequence length, ``r`` queries per sequence, ``dim`` model
size, ``h`` heads, ``d`` head size.

Task: multi-query associative recall (:func:`qkv.tasks.make_recall_task`, layout
``"scattered"``; Arora et al. 2023 "Zoology"): ``n_pairs`` key-value pairs, a separator and
``n_queries`` keys, with filler tokens in random gaps between them, drawn afresh for every
sequence; the answer to each query is the value stored right after that key. The pairs sit at
different positions in every sequence, so nothing but the tokens says which value belongs to
which key: the mechanism has to find the matching key by content, wherever it is.

Why scattered. In the packed layout (every pair at the same positions in every row) a mixer
along the sequence with fixed weights, Linformer's learned projections E, F or Nyström's
segment-mean landmarks, can pair each key with the value beside it by position alone. So
they solved bidirectional recall that exact attention did not, and the comparison said
nothing about attention (measured before this layout: packed, 4 pairs in 24 tokens, 1500
steps, no previous-token embedding: Linformer 100%, Nyström 99.8%, exact bidirectional 41.6%).

Model, the same for every mechanism: token embedding + an embedding of the previous token +
learned absolute positions, RoPE on half of each head's dims (Su et al. 2021; applied to q
and k before the mechanism), a 2-layer pre-norm :class:`qkv.blocks.Encoder` whose attention
is the mechanism, and a linear read-out at the query positions. Trained with AdamW for a
fixed number of steps on the same seeded batches; reported: accuracy on the held-out test
sequences (every query counts), beside chance levels (``1 / n_values`` guessing any value,
``1 / n_pairs`` guessing among the values present in the sequence).

Why the previous-token embedding. Attention solves recall with an induction circuit: one
layer copies each key into the value after it (a previous-token head), the next matches the
query against those copies and reads the value. Under a causal mask the previous-token head
forms at once (a value early in the sequence sees few tokens, its key among them).
Bidirectionally it did not form in our trials: every position starts by attending to the
same bag of tokens, and training stalls at "some value present in the sequence" (measured on
the scattered layout without the embedding, 4 pairs in 24 tokens, exact attention, 1500
steps: 41.5% with half RoPE and learned positions, 41.1% with RoPE on every dim and no
learned positions, 41.8% the same with RoPE base 100; the packed layout stalled the same
way). Embedding the token at ``t - 1`` beside the token at ``t``, a width-2 convolution over
the tokens (the role of the shift SSM in H3, Fu et al. 2023, and of the short convolutions
in Based, Arora et al. 2024, both built for recall), does the previous-token head's job for
every mechanism alike; what is left to learn is the lookup, query against the stored keys,
which is what the approximations differ in. It reads only position ``t - 1``, so a causal
model stays causal.

Why 8 pairs. With the embedding, 4 pairs in 24 tokens no longer told the mechanisms apart
(a development run of this suite, 1500 steps: every row 99.9-100%); 8 pairs in 32 tokens
with 16 keys and 16 values does (trials, 1000 steps: exact 100% causal and bidirectional,
linear 100%, Performer 41%, Linformer 25%), in 1000 steps instead of 1500, so the suite
costs no more than before.

Which models (:func:`runs`). Every mechanism that can be causal is trained causally (MQAR as
Zoology poses it, an autoregressive model). Linformer and Nyström cannot be (they mix the
whole sequence, :data:`NOT_CAUSAL`): they are trained bidirectionally, beside exact attention
trained bidirectionally. Each row is read against exact attention with the same mask.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import approx
from .._args import positive_int
from ..blocks import Encoder
from ..positional import Rotary
from ..tasks import RecallTask, make_recall_task
from ..tasks.recall import LAYOUTS

NAME = "learning"
DESCRIPTION = "2-layer model on associative recall with each attention mechanism, fixed training budget"
METHODS = ("exact", "linformer", "reformer_lsh", "performer", "linear", "nystrom")
#: mechanisms that mix the whole sequence and raise on ``causal=True``: trained bidirectionally
NOT_CAUSAL = ("linformer", "nystrom")
LABELS = {"exact": "exact", "linformer": "Linformer", "reformer_lsh": "Reformer LSH", "performer": "Performer",
          "linear": "linear (elu+1)", "nystrom": "Nyström"}  # fmt: skip


#: how the markdown describes each layout of the task
_LAYOUT_TEXT = {
    "scattered": "the filler in random gaps around the pairs and queries, drawn afresh for every sequence",
    "packed": "every sequence laid out alike (the pairs, then filler, the separator and the queries)",
}


@dataclass(frozen=True)
class LearningSetup:
    steps: int = 1000  # optimiser steps per model (exact attention, either mask, was at 100% after 200 in trials)
    checkpoints: tuple[int, ...] = (200, 500)  # test accuracy also measured after these steps (how fast it learns)
    batch: int = 32  # sequences per step
    lr: float = 3e-3  # AdamW learning rate (linear warm-up over 5% of steps, then cosine decay)
    dim: int = 64  # model size
    heads: int = 4  # attention heads (head size dim / heads)
    layers: int = 2  # encoder layers
    rotary: bool = True  # RoPE on half of each head's dims, besides learned absolute positions
    previous_token: bool = True  # add an embedding of the token one step back (see the module docstring)
    causal: bool = True  # causal self-attention (see the module docstring); NOT_CAUSAL ones run bidirectional
    n_pairs: int = 8  # key-value pairs per sequence
    n_queries: int = 4  # queries per sequence
    vocab_size: int = 32  # key and value symbols (half each)
    seq_len: int = 32  # tokens per sequence (pairs, filler, separator, queries)
    layout: str = "scattered"  # where the filler goes (qkv.tasks.recall.LAYOUTS): random gaps per sequence
    n_train: int = 10000  # training sequences
    n_test: int = 1000  # held-out sequences
    linformer_k: int = 8  # Linformer projected length
    landmarks: int = 8  # Nyström landmarks (segments of 4 tokens)
    nb_features: int = 32  # Performer random features
    lsh_buckets: int = 4  # Reformer buckets per round
    lsh_hashes: int = 2  # Reformer rounds
    lsh_chunk: int = 8  # Reformer chunk size
    methods: tuple[str, ...] = METHODS  # which mechanisms to train
    threads: int = 1  # torch threads while training (see run)
    seed: int = 0  # data, weights and batch order

    def __post_init__(self):
        for name in ("steps", "batch", "dim", "heads", "layers", "n_pairs", "n_queries", "seq_len"):
            positive_int(name, getattr(self, name))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"methods: expected names from {METHODS}, got {sorted(unknown)}")

    @property
    def dim_head(self) -> int:
        return self.dim // self.heads

    @property
    def shown(self) -> tuple[int, ...]:
        """The checkpoints before the last step, in order (the last step is the final accuracy)."""
        return tuple(sorted(c for c in set(self.checkpoints) if 0 < c < self.steps))


def mechanism(method: str, setup: LearningSetup) -> Callable[[], nn.Module] | None:
    """A zero-argument factory of the mechanism (None: exact attention), one instance per layer."""
    s, d = setup, setup.dim_head
    factories = {
        "exact": None,
        "linformer": lambda: approx.Linformer(s.seq_len, s.linformer_k),
        "reformer_lsh": lambda: approx.LSHAttention(d, n_buckets=s.lsh_buckets, n_hashes=s.lsh_hashes,
                                                    chunk_size=s.lsh_chunk),  # fmt: skip
        "performer": lambda: approx.Performer(d, nb_features=s.nb_features),
        "linear": lambda: approx.LinearAttention(),
        "nystrom": lambda: approx.NystromAttention(s.landmarks),
    }
    return factories[method]


class RecallModel(nn.Module):
    """Embeddings, an :class:`Encoder` with the given mechanism, and a read-out at the queries."""

    def __init__(self, vocab: int, setup: LearningSetup, attention: Callable[[], nn.Module] | None, *,
                 causal: bool = True):  # fmt: skip
        super().__init__()
        self.causal = bool(causal)
        self.embed = nn.Embedding(vocab, setup.dim)
        # The token one step back, embedded on its own: a width-2 convolution over the tokens (as
        # H3's shift SSM / Based's short convolution). Position 0 sees id 0 (<pad>, never in the data).
        self.previous = nn.Embedding(vocab, setup.dim) if setup.previous_token else None
        self.position = nn.Parameter(torch.randn(setup.seq_len, setup.dim) * 0.02)
        # Partial RoPE (GPT-NeoX style): relative position on half of each head's dims, content
        # alone on the other half.
        rope = Rotary(setup.dim_head, rotary_dim=2 * (setup.dim_head // 4)) if setup.rotary else None
        self.encoder = Encoder(setup.layers, setup.dim, setup.heads, norm_first=True, positional=rope,
                               attention=attention)  # fmt: skip
        self.out = nn.Linear(setup.dim, vocab)

    def forward(self, ids: Tensor, where: Tensor) -> Tensor:
        """``ids (b, t)``, query positions ``where (b, r)`` (or ``(r,)`` for every row) -> logits ``(b, r, vocab)``."""
        x = self.embed(ids) + self.position[: ids.shape[1]]
        if self.previous is not None:
            x = x + self.previous(F.pad(ids[:, :-1], (1, 0)))  # only t - 1: causal models stay causal
        h = self.encoder(x, causal=self.causal)
        where = where.expand(ids.shape[0], -1) if where.dim() == 1 else where
        return self.out(h.gather(1, where[..., None].expand(-1, -1, h.shape[-1])))


def runs(setup: LearningSetup) -> list[tuple[str, bool]]:
    """The ``(method, causal)`` models to train: the causal ones, then the bidirectional ones.

    With ``setup.causal``, a method of :data:`NOT_CAUSAL` is trained bidirectionally, and then
    exact attention is trained bidirectionally too, so that it has its like to be read against.
    """
    if not setup.causal:
        return [(m, False) for m in setup.methods]
    causal = [(m, True) for m in setup.methods if m not in NOT_CAUSAL]
    apart = [(m, False) for m in setup.methods if m in NOT_CAUSAL]
    return causal + ([("exact", False)] + apart if apart else [])


@dataclass
class LearningResult:
    setup: LearningSetup
    accuracy: dict[tuple[str, bool], float] = field(default_factory=dict)  # (method, causal) -> test accuracy
    early: dict[tuple[str, bool], dict[int, float]] = field(default_factory=dict)  # -> {checkpoint step: accuracy}
    loss: dict[tuple[str, bool], float] = field(default_factory=dict)  # -> mean training loss, last 5% of steps
    seconds: dict[tuple[str, bool], float] = field(default_factory=dict)  # -> training wall time
    chance_values: float = 0.0  # 1 / n_values
    chance_pairs: float = 0.0  # 1 / n_pairs
    threads: int = 1
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at start and end

    def markdown(self) -> str:
        s = self.setup
        total = sum(self.seconds.values())
        lines = [
            "### Learning check: associative recall (`qkv bench --suite learning`)",
            "",
            f"Multi-query associative recall (`qkv.tasks.make_recall_task`, layout `{s.layout}`): {s.n_pairs} "
            f"key-value pairs, a separator and {s.n_queries} queries in sequences of {s.seq_len} tokens, "
            f"{_LAYOUT_TEXT[s.layout]}; {s.vocab_size // 2} keys and {s.vocab_size - s.vocab_size // 2} values; "
            f"{s.n_train} training and {s.n_test} test sequences. Model: token embeddings"
            f"{' + an embedding of the previous token' if s.previous_token else ''} + learned positions"
            f"{' + RoPE on half of each head' if s.rotary else ''}, "
            f"{s.layers}-layer pre-norm `qkv.blocks.Encoder`, dim {s.dim}, {s.heads} heads (d={s.dim_head}), "
            f"linear read-out at the queries. {s.steps} AdamW steps of {s.batch} sequences, lr {s.lr:g} "
            f"(warm-up, cosine), seed {s.seed}, the same batches for every model. Mechanisms: Linformer "
            f"k={s.linformer_k}; Reformer LSH {s.lsh_buckets} buckets, {s.lsh_hashes} rounds, chunk "
            f"{s.lsh_chunk} (fresh hashes every step); Performer m={s.nb_features}; linear elu+1; Nyström "
            f"{s.landmarks} landmarks. {self.threads} torch threads, load (1-min average) {self.load[0]:.1f} at "
            f"start, {self.load[1]:.1f} at end, on 2 cores; {total / 60:.1f} min of training in all.",
            "",
            f"| mechanism | attention | {' | '.join(f'test accuracy after {c} steps' for c in s.shown)}"
            f"{' | ' if s.shown else ''}test accuracy (final) | final training loss | training time (s) |",
            "|---|---|" + "---|" * (len(s.shown) + 3),
        ]
        for key in runs(s):
            m, causal = key
            early = "".join(f"{self.early[key][c]:.1%} | " for c in s.shown)
            lines.append(f"| {LABELS[m]} | {'causal' if causal else 'bidirectional'} | {early}{self.accuracy[key]:.1%} | "
                         f"{self.loss[key]:.3f} | {self.seconds[key]:.0f} |")  # fmt: skip
        lines += ["", f"Chance: {self.chance_values:.1%} guessing any value, {self.chance_pairs:.1%} guessing "
                  f"among the values present in the sequence. {_notes(s)}"]  # fmt: skip
        return "\n".join(lines)


def _notes(s: LearningSetup) -> str:
    """The paragraph under the table: what was run and how to read it, built from the set-up."""
    notes = [
        "Every model is bidirectional." if not s.causal else
        "Mechanisms that can be causal are trained causally (MQAR as Zoology poses it, an autoregressive model); "
        "Linformer and Nyström cannot be (they mix the whole sequence), so they are trained bidirectionally, and "
        "exact attention is trained bidirectionally beside them.",
        "Read each row against exact attention with the same mask.",
    ]  # fmt: skip
    mixers = "a mechanism that mixes along the sequence with fixed weights (Linformer's projection, Nyström's " \
             "segment-mean landmarks)"  # fmt: skip
    if s.layout == "scattered":
        notes.append(f"The pairs move from sequence to sequence, so {mixers} cannot pair a key with its value by "
                     "position alone; it has to match the query by content, like the others.")  # fmt: skip
    else:
        notes.append(f"Packed layout: the pairs sit at the same positions in every sequence, so {mixers} can pair a "
                     "key with its value by position alone.")  # fmt: skip
    if s.previous_token:
        notes.append("The previous-token embedding (a width-2 convolution over the tokens, as H3's shift SSM and "
                     "Based's short convolution) hands every model the key before each value, the "
                     "job of an induction circuit's first head, which bidirectional exact attention did not learn "
                     "in development runs without it (scattered layout, 4 pairs in 24 tokens, 1500 steps: 41-42%, "
                     "stuck at a value present in the sequence; see `qkv.bench.learning`).")  # fmt: skip
    notes.append("The accuracies at the checkpoints are of the same runs (the schedule spans every step), so they "
                 "show how fast each model learns. A fixed-budget check, not a ranking.")
    return " ".join(notes)


def _schedule(step: int, steps: int) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


def evaluate(model: RecallModel, task: RecallTask) -> float:
    """Accuracy of ``model`` on the test sequences, every query counted (the model left in eval mode)."""
    model.eval()
    hits = 0
    with torch.inference_mode():
        for b0 in range(0, task.test_x.shape[0], 250):
            pred = model(task.test_x[b0 : b0 + 250], task.test_where[b0 : b0 + 250]).argmax(-1)
            hits += int((pred == task.test_y[b0 : b0 + 250]).sum())
    return hits / task.test_y.numel()


def train_one(method: str, task: RecallTask, setup: LearningSetup, *,
              causal: bool = True) -> tuple[float, float, float, dict[int, float]]:  # fmt: skip
    """Train a model with ``method``; return ``(test accuracy, final loss, seconds, {checkpoint: accuracy})``.

    ``seconds`` is the training time alone: the evaluations at the checkpoints are left out.
    """
    if causal and method in NOT_CAUSAL:
        raise ValueError(f"causal: {method} cannot be causal (it mixes the whole sequence); pass causal=False")
    torch.manual_seed(setup.seed)
    model = RecallModel(len(task.vocab), setup, mechanism(method, setup), causal=causal)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, setup.steps))
    order = torch.Generator().manual_seed(setup.seed)
    tail: list[float] = []
    early: dict[int, float] = {}
    seconds = 0.0
    start = time.perf_counter()
    model.train()
    for step in range(setup.steps):
        idx = torch.randint(task.train_x.shape[0], (setup.batch,), generator=order)
        logits = model(task.train_x[idx], task.train_where[idx])
        loss = F.cross_entropy(logits.flatten(0, 1), task.train_y[idx].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step >= setup.steps - max(1, setup.steps // 20):
            tail.append(loss.item())
        if step + 1 in setup.shown:
            seconds += time.perf_counter() - start
            with torch.random.fork_rng(devices=[]):  # LSH hashes draw from it: training goes on as if unobserved
                early[step + 1] = evaluate(model, task)
            model.train()
            start = time.perf_counter()
    seconds += time.perf_counter() - start
    return evaluate(model, task), sum(tail) / len(tail), seconds, early


def run(setup: LearningSetup | None = None, *, progress: Callable[[str], None] | None = None) -> LearningResult:
    """Train one model per entry of :func:`runs`; ``progress`` gets a line after each."""
    setup = LearningSetup() if setup is None else setup
    # Tiny matrices: on a shared 2-core machine, two threads spend their time waiting for
    # each other (measured under load ~10: 2.5 s per step with 2 threads, 0.21 s with 1).
    previous = torch.get_num_threads()
    torch.set_num_threads(setup.threads)
    try:
        return _run(setup, progress)
    finally:
        torch.set_num_threads(previous)


def _run(setup: LearningSetup, progress: Callable[[str], None] | None) -> LearningResult:
    task = make_recall_task(setup.n_train, setup.n_test, n_pairs=setup.n_pairs, vocab_size=setup.vocab_size,
                            seq_len=setup.seq_len, n_queries=setup.n_queries, layout=setup.layout,
                            seed=setup.seed)  # fmt: skip
    result = LearningResult(setup, chance_values=1 / task.n_values, chance_pairs=1 / task.n_pairs,
                            threads=torch.get_num_threads(), load=(os.getloadavg()[0], 0.0))  # fmt: skip
    for key in runs(setup):
        m, causal = key
        acc, loss, seconds, early = train_one(m, task, setup, causal=causal)
        result.accuracy[key], result.loss[key], result.seconds[key], result.early[key] = acc, loss, seconds, early
        if progress is not None:
            kind = "causal" if causal else "bidirectional"
            progress(f"{m} ({kind}): test accuracy {acc:.1%}, final loss {loss:.3f}, {seconds:.0f} s")
    result.load = (result.load[0], os.getloadavg()[0])
    return result


#: a smoke-sized setup (seconds), used by ``--quick`` and the tests
QUICK = LearningSetup(steps=5, batch=8, dim=32, heads=2, n_pairs=4, n_queries=2, vocab_size=16, seq_len=32,
                      n_train=64, n_test=32, linformer_k=8, landmarks=4, nb_features=8, lsh_buckets=2,
                      lsh_chunk=8, checkpoints=(3,))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m qkv.bench.learning [--quick] [--steps N] [--methods a,b] [--bidirectional]``: print the section."""
    import argparse
    from dataclasses import replace

    parser = argparse.ArgumentParser(prog="python -m qkv.bench.learning", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="a few steps on tiny data (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per model")
    parser.add_argument("--methods", default=None, help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--bidirectional", action="store_true", help="every model bidirectional (the old set-up)")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else LearningSetup()
    if args.steps is not None:
        setup = replace(setup, steps=args.steps)
    if args.methods:
        setup = replace(setup, methods=tuple(args.methods.split(",")))
    if args.bidirectional:
        setup = replace(setup, causal=False)
    print(run(setup, progress=print).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
