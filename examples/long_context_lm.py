"""Train qkv's causal LM on long-range recall across processes: sequence parallel inside, data parallel across.

Shape legend: ``B`` global batch, ``b`` a data-parallel group's share, ``t`` sequence length,
``t/S`` a rank's rows, ``S`` ranks per sequence-parallel group, ``r`` queries per sequence,
``V`` vocabulary.

The task is associative recall (``qkv.tasks.make_recall_task``) at a few thousand tokens:
key-value pairs scattered through filler, then queries whose answers are the values stored
with their keys, thousands of positions back. The ``W`` processes form ``W/S`` groups of
``S`` consecutive ranks: each group holds ``b = B·S/W`` sequences, split along the sequence
(``qkv.distributed.shard``, zigzag), and its attention layers run
``qkv.distributed.SequenceParallel`` inside the group; data parallelism (``DistributedDataParallel``
over all ranks) sums the gradients across groups. RoPE rotates every row at its global
position, so the weights are those of the one-process model and the loss curve is the
same (float64: to about 1e-12 per step here; the test checks 1e-8).

The task is hard for a small LM: the lookup needs an induction circuit (a previous-token
head, then a matching head), which forms slowly. Measured on a busy 2-core machine: at
2048 tokens, 400 steps stayed at chance (ln 32 = 3.47); at 256 tokens the loss was 3.38
after 500 steps. Run thousands of steps (on many processes: that is the point) to see it
solve the task; the loss curve is the one-process curve at every step.

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
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import qkv.distributed as qd
from qkv.models import CausalLM, LMConfig
from qkv.tasks import make_recall_task


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=None, help="ranks per sequence-parallel group (default: all)")
    p.add_argument("--strategy", default="ring", choices=qd.STRATEGIES[:2] + ("allgather",))
    p.add_argument("--layout", default="zigzag", choices=qd.LAYOUTS)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--pairs", type=int, default=16, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=8, help="queries per sequence")
    p.add_argument("--vocab", type=int, default=64, help="key and value symbols")
    p.add_argument("--train", type=int, default=4096, help="training sequences")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print the losses as one JSON line at the end")
    return p.parse_args(argv)


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
    """The model; with a group, every attention layer runs sequence-parallel over it."""
    torch.manual_seed(args.seed)
    config = LMConfig(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, positional="rotary",
                      max_len=args.seq_len)  # fmt: skip
    model = CausalLM(config).to(getattr(torch, args.dtype))
    if sequence_group is not None:
        for layer in model.blocks.layers:  # the mechanism only: weights and state dict are unchanged
            layer.self_attn.attention = qd.SequenceParallel(args.strategy, args.layout, sequence_group)
    return model


def batch_rows(args, step: int) -> torch.Tensor:
    """The global batch of ``step``: ``(B,)`` training rows, the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    return torch.randint(args.train, (args.batch,), generator=gen)


def query_loss(logits: torch.Tensor, y: torch.Tensor, where: torch.Tensor, positions: torch.Tensor,
               length: int) -> torch.Tensor:  # fmt: skip
    """``Σ CE`` over the queries whose positions are among this rank's rows.

    ``logits (b, t/S, V)`` at global ``positions (t/S,)`` of a sequence of ``length``; ``y``,
    ``where (b, r)``: answers and query positions (the logits at a query key predict its value).
    """
    local = torch.full((length,), -1, dtype=torch.long, device=logits.device)
    local[positions] = torch.arange(positions.numel(), device=logits.device)
    row = local[where]  # (b, r): this rank's row of each query, -1 if another rank has it
    here = row >= 0
    picked = logits[torch.nonzero(here, as_tuple=True)[0], row[here]]
    return nn.functional.cross_entropy(picked, y[here], reduction="sum")


def train(args) -> list[float]:
    """Losses per step; distributed when ``torch.distributed`` is initialised, else one process."""
    task = make_recall_task(args.train, 16, n_pairs=args.pairs, vocab_size=args.vocab, seq_len=args.seq_len,
                            n_queries=args.queries, layout="scattered", seed=args.seed)  # fmt: skip
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    sp = world if args.sp is None else args.sp
    sequence_group, dp_index, dp_groups = groups(sp) if distributed else (None, 0, 1)
    if args.batch % dp_groups:
        raise ValueError(f"--batch: expected a multiple of the {dp_groups} data-parallel groups, got {args.batch}")
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    model = build(args, len(task.vocab), sequence_group).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    per_group = args.batch // dp_groups
    positions = torch.arange(args.seq_len)
    if sequence_group is not None:
        positions = qd.positions(args.seq_len, group=sequence_group, layout=args.layout)
    positions = positions.to(device)
    losses = []
    for step in range(args.steps):
        rows = batch_rows(args, step)[dp_index * per_group : (dp_index + 1) * per_group]
        x, y, where = (t[rows].to(device) for t in (task.train_x, task.train_y, task.train_where))
        if sequence_group is not None:
            x = qd.shard(x, dim=1, group=sequence_group, layout=args.layout)
        total = query_loss(model(x), y, where, positions, args.seq_len)
        optimizer.zero_grad()
        (total * world / (args.batch * args.queries)).backward()  # DDP averages: scale to the sum
        optimizer.step()
        summed = total.detach().clone()
        if distributed:
            dist.all_reduce(summed)
        losses.append(float(summed) / (args.batch * args.queries))
        if (not distributed or dist.get_rank() == 0) and args.log_every and step % args.log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(args.backend)
    start = time.perf_counter()
    losses = train(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{len(losses)} steps in {time.perf_counter() - start:.1f} s, last loss {losses[-1]:.4f}")
        if args.json:
            print(json.dumps(losses))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
