"""Train qkv's causal LM on long-range recall across processes: sequence parallel inside, data parallel across.

Shape legend: ``B`` global batch, ``b`` a data-parallel group's share, ``t`` sequence length,
``t/S`` a rank's rows, ``S`` ranks per sequence-parallel group, ``r`` queries per sequence,
``V`` vocabulary.

The task is associative recall (``qkv.tasks.make_recall_task``, packed layout): 8 key-value
pairs at the start of the sequence, filler, then the 8 keys again as queries at the end, so
each answer lies a whole sequence back (4080 tokens at 4096). 16 keys, 16 values: chance is
1/16 guessing any value, 1/8 guessing among the values in the sequence. The ``W`` processes
form ``W/S`` groups of ``S`` consecutive ranks: each group holds ``b = B·S/W`` sequences,
split along the sequence (``qkv.distributed.shard``, zigzag), and its attention layers run
``qkv.distributed.SequenceParallel`` inside the group; data parallelism
(``DistributedDataParallel`` over all ranks) sums the gradients across groups. RoPE rotates
every row at its global position, so the weights are those of the one-process model and the
loss curve is the same (float64: to about 1e-12 per step here; the test checks 1e-8).

How it learns in minutes. Recall needs an induction circuit (a previous-token head, then a
head that matches the query against the copied keys), which forms suddenly after a plateau,
and the plateau is long when sequences are long (at 2048 tokens from the start, 400 steps
stayed at chance). So a curriculum (``--seq-len``, ``--steps``, ``--batch``, ``--pairs``
take one value per phase): 600 steps on 16-token sequences with 4 pairs, where the circuit
forms within 200-500 steps (8 of 8 seeds by step 500), then 128, 512, 2048 and 4096 tokens
with 8 pairs, a few dozen steps each at the long end. RoPE turns only half of each head's
dims (GPT-NeoX style): the other half compares content alone, at any distance, so the
circuit learned at 16 tokens already finds keys 4000 tokens back before it ever sees such a
sequence (about 40% of queries; in one trial trained at 24 tokens, 0.66 of the queries at
2048 tokens were right with half the dims rotated, 0.41 with all of them). AdamW at 3e-3,
constant through the first phase, cosine to 10% over the others. Measured on a shared
2-core machine (the defaults, float32; held-out accuracy on 32 sequences x 8 queries of
4096 tokens, after each phase; load = the machine's load average during the run):

    torchrun --nproc_per_node 2                0.41  0.47  0.73  0.90  0.992   96 s (load 1-2)
    torchrun --nproc_per_node 4 --sp 2         0.34  0.61  0.82  0.82  0.996  119 s (load 1-4)
    python (one process)                       0.38  0.61  0.68  0.86  0.992   72 s (load 2)

(float32 sums are not repeated bit for bit from run to run or across process counts, so
the runs part after a few hundred steps; in float64 they are the same curve; another
two-process run at load 4 gave 0.988 in 246 s). Training batches reach accuracy 1.0 in each
phase within a few dozen steps; a run ending at 2048 tokens (``--seq-len 24 128 512 2048
--steps 600 100 100 60 --batch 64 32 8 4 --pairs 4 8 8 8``) reached 0.996 there in 79 s on
2 processes.

Gradients: each rank's loss is its own query positions' share of the global mean
(``Σ_local CE / (B·r)``). The true gradient is the sum over all ranks of their gradients,
for the attention's and every other parameter alike; DDP averages over the ``W`` ranks, so
each rank's loss is multiplied by ``W`` before ``backward``.

    torchrun --nproc_per_node 4 examples/long_context_lm.py --sp 2          # 2 x 2 on one machine
    python examples/long_context_lm.py                                      # one process, same batches
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/long_context_lm.py --sp 8                                  # on each of two machines

On GPUs use ``--backend nccl`` (each rank takes ``cuda:LOCAL_RANK``); on CPUs gloo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

import qkv.distributed as qd
from qkv.models import CausalLM, LMConfig
from qkv.positional import Rotary
from qkv.tasks import make_recall_task
from qkv.tasks.recall import LAYOUTS as RECALL_LAYOUTS


#: The default curriculum, one value per phase (see the module docstring).
CURRICULUM = {"seq_len": [16, 128, 512, 2048, 4096], "steps": [600, 100, 100, 40, 30], "batch": [64, 32, 8, 4, 4],
              "pairs": [4, 8, 8, 8, 8]}  # fmt: skip


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=None, help="ranks per sequence-parallel group (default: all)")
    p.add_argument("--strategy", default="ring", choices=qd.STRATEGIES[:2] + ("allgather",))
    p.add_argument("--layout", default="zigzag", choices=qd.LAYOUTS, help="how a sequence is split across ranks")
    # the curriculum: one value per phase, or one value for every phase
    p.add_argument("--seq-len", type=int, nargs="+", default=CURRICULUM["seq_len"], help="tokens per sequence")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="optimiser steps")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="global batch (sequences per step)")
    p.add_argument("--pairs", type=int, nargs="+", default=None, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, nargs="+", default=None, help="queries per sequence (default: --pairs)")
    p.add_argument("--train", type=int, nargs="+", default=None,
                   help="training sequences (default: steps x batch, a fresh batch every step)")  # fmt: skip
    p.add_argument("--test", type=int, default=32, help="held-out sequences at the last length, after each phase")
    p.add_argument("--vocab", type=int, default=32, help="key and value symbols (half each)")
    p.add_argument("--task-layout", default="packed", choices=RECALL_LAYOUTS,
                   help="packed: the pairs first, the queries last (answers a whole sequence back)")  # fmt: skip
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rotary-dim", type=int, default=None, help="RoPE on this many dims of each head (default: half)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print the curve as one JSON line at the end")
    args = p.parse_args(argv)
    try:
        curriculum(args)
    except ValueError as error:  # a usage error, not a traceback
        p.error(str(error))
    return args


@dataclass(frozen=True)
class Phase:
    length: int  # tokens per sequence
    steps: int
    batch: int  # global: sequences per step over all data-parallel groups
    pairs: int
    queries: int
    train: int  # training sequences drawn for the phase


def curriculum(args) -> list[Phase]:
    """The phases: ``--seq-len`` sets their number; every other list has one value or one per phase.

    A list not given comes from the default curriculum: its own where ``--seq-len`` keeps the
    default lengths, else per phase the default phase nearest in length, the first phase always
    the default's first (where the recall circuit forms, so it gets the most steps).
    """
    n = len(args.seq_len)
    lengths = CURRICULUM["seq_len"]
    nearest = [0] + [min(range(1, len(lengths)), key=lambda i: abs(math.log(lengths[i] / max(1, t))))
                     for t in args.seq_len[1:]]  # fmt: skip

    def each(name: str, values):
        if values is None:
            return list(CURRICULUM[name]) if list(args.seq_len) == lengths else [CURRICULUM[name][i] for i in nearest]
        if len(values) == 1:
            return list(values) * n
        if len(values) != n:
            raise ValueError(f"--{name.replace('_', '-')}: expected 1 or {n} values (one per --seq-len), got {len(values)}")
        return list(values)

    steps, batch, pairs = each("steps", args.steps), each("batch", args.batch), each("pairs", args.pairs)
    queries = pairs if args.queries is None else each("queries", args.queries)
    train = [s * b for s, b in zip(steps, batch)] if args.train is None else each("train", args.train)
    return [Phase(*row) for row in zip(args.seq_len, steps, batch, pairs, queries, train)]


def lr_factor(step: int, args, phases: list[Phase]) -> float:
    """Linear warm-up, constant through the first phase, then a cosine to 10% over the others.

    The first phase is where the recall circuit forms (suddenly, after a plateau), so the rate
    stays up until the end of it; the longer phases only stretch the circuit's reach.
    """
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    first, total = phases[0].steps, sum(p.steps for p in phases)
    if step < first or total == first:
        return warm
    done = (step - first) / (total - first)
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def groups(sp: int):
    """``(sequence group, data-parallel index, data-parallel groups)``: groups of ``sp`` consecutive ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp:
        raise ValueError(f"--sp: expected a divisor of the world size {world}, got {sp}")
    mine = None
    for start in range(0, world, sp):  # every rank creates every group (new_group is collective)
        g = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = g
    return mine, rank // sp, world // sp


def build(args, vocab: int, sequence_group=None) -> CausalLM:
    """The model; with a group, every attention layer runs sequence-parallel over it.

    RoPE on part of each head's dims (GPT-NeoX style): the rotated dims carry the relative
    position the previous-token head needs, the others compare content alone, at any
    distance, so the matching head learned on short sequences still finds its key thousands
    of tokens back.
    """
    torch.manual_seed(args.seed)
    config = LMConfig(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, positional="rotary",
                      max_len=max(args.seq_len))  # fmt: skip
    model = CausalLM(config).to(getattr(torch, args.dtype))
    dim_head = args.dim // args.heads
    rotary_dim = 2 * (dim_head // 4) if args.rotary_dim is None else args.rotary_dim
    for layer in model.blocks.layers:  # the mechanism and RoPE hold no weights: the state dict is unchanged
        layer.self_attn.positional = Rotary(dim_head, rotary_dim=rotary_dim)
        if sequence_group is not None:
            layer.self_attn.attention = qd.SequenceParallel(args.strategy, args.layout, sequence_group)
    return model


def batch_rows(args, step: int, phase: Phase) -> torch.Tensor:
    """The global batch of ``step``: ``(B,)`` training rows of its phase, the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    return torch.randint(phase.train, (phase.batch,), generator=gen)


def query_loss(logits: torch.Tensor, y: torch.Tensor, where: torch.Tensor, positions: torch.Tensor,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(Σ CE, number right)`` over the queries whose positions are among this rank's rows.

    ``logits (b, t/S, V)`` at global ``positions (t/S,)`` of a sequence of ``length``; ``y``,
    ``where (b, r)``: answers and query positions (the logits at a query key predict its value).
    """
    local = torch.full((length,), -1, dtype=torch.long, device=logits.device)
    local[positions] = torch.arange(positions.numel(), device=logits.device)
    row = local[where]  # (b, r): this rank's row of each query, -1 if another rank has it
    here = row >= 0
    picked = logits[torch.nonzero(here, as_tuple=True)[0], row[here]]
    right = (picked.argmax(-1) == y[here]).sum()
    return nn.functional.cross_entropy(picked, y[here], reduction="sum"), right


class Setup:
    """Groups, device and the rows of a sequence this rank holds."""

    def __init__(self, args):
        self.distributed = dist.is_initialized()
        self.world = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        sp = self.world if args.sp is None else args.sp
        self.group, self.dp_index, self.dp_groups = groups(sp) if self.distributed else (None, 0, 1)
        self.cuda = args.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.layout = args.layout

    def positions(self, length: int) -> torch.Tensor:
        """``(t/S,)`` global positions of this rank's rows of a sequence of ``length``."""
        if self.group is None:
            return torch.arange(length, device=self.device)
        return qd.positions(length, group=self.group, layout=self.layout).to(self.device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x if self.group is None else qd.shard(x, dim=1, group=self.group, layout=self.layout)

    def total(self, *values: torch.Tensor) -> list[float]:
        """Sums over all ranks (each query is counted on the one rank that holds its row)."""
        summed = torch.stack([v.detach().double() for v in values])
        if self.distributed:
            summed = summed.to(self.device)
            dist.all_reduce(summed)
        return summed.tolist()


def make_task(args, phase: Phase, index: int, n_test: int):
    return make_recall_task(phase.train, max(1, n_test), n_pairs=phase.pairs, vocab_size=args.vocab,
                            seq_len=phase.length, n_queries=phase.queries, layout=args.task_layout,
                            seed=args.seed + 7919 * index)  # fmt: skip


@torch.no_grad()
def accuracy(model: nn.Module, task, setup: Setup, batch: int) -> float:
    """Held-out accuracy: each data-parallel group answers its share of the test sequences."""
    n, length = task.test_x.shape
    mine = torch.arange(n)[setup.dp_index :: setup.dp_groups]
    right = torch.zeros((), dtype=torch.long, device=setup.device)
    positions = setup.positions(length)
    for rows in mine.split(max(1, batch)):
        x, y, where = (t[rows].to(setup.device) for t in (task.test_x, task.test_y, task.test_where))
        right = right + query_loss(model(setup.shard(x)), y, where, positions, length)[1]
    (total,) = setup.total(right)
    return total / task.test_y.numel()


def train(args, record: dict | None = None) -> list[float]:
    """Losses per step; distributed when ``torch.distributed`` is initialised, else one process.

    Prints the curve (loss and accuracy on each logged step's batch, the learning rate) and,
    after each phase, the accuracy on held-out sequences of the last phase's length.
    ``record`` (a dict) receives the lists ``"accuracy"`` (per step) and ``"held_out"`` (per phase).
    """
    record = {} if record is None else record
    record.update(accuracy=[], held_out=[])
    phases = curriculum(args)
    setup = Setup(args)
    for phase in phases:
        if phase.batch % setup.dp_groups:
            raise ValueError(f"--batch: expected multiples of the {setup.dp_groups} data-parallel groups, "
                             f"got {phase.batch}")  # fmt: skip
    tasks = [make_task(args, phase, k, 0) for k, phase in enumerate(phases)]
    final = make_task(args, replace(phases[-1], train=1), len(phases), args.test)  # held out: its test rows
    vocab = tasks[0].vocab
    model = build(args, len(vocab), setup.group).to(setup.device)
    inner = model
    if setup.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args, phases))
    talk = setup.rank == 0 and args.log_every
    if talk:
        values = tasks[0].n_values
        print(f"recall: {args.vocab // 2} keys, {values} values; chance {1 / values:.3f} guessing any value, "
              f"1/pairs guessing among those in the sequence", flush=True)  # fmt: skip
    losses, start, step = [], time.perf_counter(), 0
    for k, (phase, task) in enumerate(zip(phases, tasks)):
        if talk:
            print(f"phase {k + 1}: {phase.length} tokens, {phase.pairs} pairs, {phase.queries} queries, "
                  f"batch {phase.batch}, {phase.steps} steps", flush=True)  # fmt: skip
        per_group = phase.batch // setup.dp_groups
        positions = setup.positions(phase.length)
        count = phase.batch * phase.queries
        for s in range(phase.steps):
            rows = batch_rows(args, step, phase)[setup.dp_index * per_group : (setup.dp_index + 1) * per_group]
            x, y, where = (t[rows].to(setup.device) for t in (task.train_x, task.train_y, task.train_where))
            total, right = query_loss(model(setup.shard(x)), y, where, positions, phase.length)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.zero_grad()
            (total * setup.world / count).backward()  # DDP averages: scale to the sum
            optimizer.step()
            schedule.step()
            loss, right = setup.total(total, right)
            losses.append(loss / count)
            record["accuracy"].append(right / count)
            if talk and (s % args.log_every == 0 or s == phase.steps - 1):
                print(f"step {step:4d}  t={phase.length:5d}  loss {losses[-1]:.4f}  acc {right / count:.3f}  "
                      f"lr {lr:.1e}  {time.perf_counter() - start:6.1f} s", flush=True)  # fmt: skip
            step += 1
        if args.test:
            held = accuracy(inner, final, setup, phases[-1].batch)
            record["held_out"].append(held)
            if talk:
                print(f"held-out accuracy at {phases[-1].length} tokens: {held:.3f} "
                      f"(chance {1 / final.n_values:.3f}; 1/pairs {1 / phases[-1].pairs:.3f})", flush=True)  # fmt: skip
    return losses


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(args.backend)
    start = time.perf_counter()
    record: dict = {}
    losses = train(args, record)
    if not dist.is_initialized() or dist.get_rank() == 0:
        held = f", held-out accuracy {record['held_out'][-1]:.3f}" if record["held_out"] else ""
        print(f"{len(losses)} steps in {time.perf_counter() - start:.1f} s, last loss {losses[-1]:.4f}{held}")
        if args.json:
            print(json.dumps({"loss": losses, **record}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
