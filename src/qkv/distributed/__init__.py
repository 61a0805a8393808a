"""Sequence parallelism: exact attention over a sequence split across processes and machines.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size, ``P`` ranks in the group.

    import qkv.distributed as qd
    q_local = qd.shard(q)                                     # this rank's rows (zigzag)
    out_local = qd.attention(q_local, k_local, v_local, causal=True, strategy="ring")
    out = qd.unshard(out_local)                               # the whole output, every rank
    mha = qkv.MultiHeadAttention(dim, heads, attention=qd.SequenceParallel("ring"))  # (b, i/P, dim) shards

Every score (dot, scaled dot, general, additive), lazy mask (causal, windows, offsets,
lengths, their ``&``/``|``), bias (dense, ALiBi, T5 buckets), ``score_mod``, attention sink
and dropout of ``qkv.attention`` is evaluated at global positions, and the result equals
the single-process call (float64 within 1e-10, float32 within 1e-5, forward and
gradients). Strategies: ring, Ulysses, hybrid (Ulysses inside groups, ring across) and
all-gather. Built on ``torch.distributed``: gloo on CPUs, nccl on GPUs.

Gradients of parameters (projections, learned scores, T5 tables, score_mod tensors,
sinks, a dense bias) are each rank's share for its own rows; the true gradient is their
sum over the sequence-parallel group. ``DistributedDataParallel`` averages over its ranks,
so scale each rank's loss by the number of ranks (or all-reduce the gradients with a
sum); ``examples/long_context_lm.py`` shows both levels, sequence and data parallel.
"""

from .functional import STRATEGIES, attention
from .layout import LAYOUTS
from .module import SequenceParallel
from .sharding import positions, shard, unshard

__all__ = ["LAYOUTS", "STRATEGIES", "SequenceParallel", "attention", "positions", "shard", "unshard"]
