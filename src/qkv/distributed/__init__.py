"""Sequence parallelism: exact attention over a sequence split across processes and machines.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size, ``P`` ranks in the group.

    import qkv.distributed as qd
    q_local = qd.shard(q)                                     # this rank's rows (zigzag)
    out_local = qd.attention(q_local, k_local, v_local, causal=True, strategy="ring")
    out = qd.unshard(out_local)                               # the whole output, every rank
    mha = qkv.MultiHeadAttention(dim, heads, attention=qd.SequenceParallel("ring"))  # (b, i/P, dim) shards

Every score (dot, scaled dot, general, additive), lazy mask (causal, windows, offsets,
lengths, their ``&``/``|``) and bias (dense, ALiBi, T5 buckets) of ``qkv.attention`` is
evaluated at global positions, and the result equals the single-process call. Built on
``torch.distributed``: gloo on CPUs, nccl on GPUs.
"""

from .functional import STRATEGIES, attention
from .layout import LAYOUTS
from .module import SequenceParallel
from .sharding import positions, shard, unshard

__all__ = ["LAYOUTS", "STRATEGIES", "SequenceParallel", "attention", "positions", "shard", "unshard"]
