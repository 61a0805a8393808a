"""``SequenceParallel`` inside ``MultiHeadAttention``: sharded equals unsharded with the same state dict."""

import copy

import pytest
import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd
from qkv.positional import ALiBi, RelativePositionBias, Rotary
from qkv.scores import Bilinear

DIM, HEADS, KV = 24, 6, 3


def _mha(positional, attention=None, score=None):
    torch.manual_seed(3)
    pos = {"rotary": lambda: Rotary(DIM // HEADS), "alibi": lambda: ALiBi(HEADS),
           "t5": lambda: RelativePositionBias(HEADS, buckets=8, max_distance=6, bidirectional=False)}[positional]()
    kw = {} if attention is None else {"attention": attention}
    return qkv.MultiHeadAttention(DIM, HEADS, kv_heads=KV, positional=pos, **kw).double()


def run_mha(group, cases):
    """Per case: largest errors of the output and of every parameter's gradient (summed over ranks)."""
    results = {}
    for positional, strategy, layout, length, score in cases:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(2, length, DIM, generator=gen, dtype=torch.float64)
        w = torch.randn(2, length, DIM, generator=gen, dtype=torch.float64)
        whole = _mha(positional)
        if score == "general":  # a learned score: the unsharded model keeps it in attention.score
            torch.manual_seed(4)
            whole.attention = qkv.Attention(Bilinear(DIM // HEADS).double())
        sp = qd.SequenceParallel(strategy, layout, group, score=copy.deepcopy(whole.attention.score))
        sharded = _mha(positional, attention=sp)
        sharded.load_state_dict(whole.state_dict())  # the unsharded weights load as they are
        y = whole(x, causal=True)
        (y * w).sum().backward()
        x_local = qd.shard(x, dim=1, group=group, layout=layout)
        y_local = sharded(x_local, causal=True)
        (y_local * qd.shard(w, dim=1, group=group, layout=layout)).sum().backward()
        errors = {"out": float((qd.unshard(y_local.detach(), dim=1, group=group, layout=layout) - y).abs().max())}
        grads = dict(sharded.named_parameters())
        for name, p in whole.named_parameters():
            g = grads[name].grad.clone()
            dist.all_reduce(g, group=group)
            errors[name] = float((g - p.grad).abs().max())
        results[(positional, strategy, layout, length, score)] = errors
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_mha_equals_unsharded(dist_pool, size):
    cases = [
        ("rotary", "ring", "zigzag", 17, "scaled_dot"),
        ("alibi", "ulysses", "contiguous", 13, "scaled_dot"),
        ("t5", "ring", "contiguous", 16, "general"),
        ("rotary", "allgather", "zigzag", 11, "scaled_dot"),
    ]
    if size == 3:  # Ulysses needs P to divide the heads and KV heads (6, 3)
        cases[1] = ("alibi", "ulysses", "zigzag", 13, "scaled_dot")
    for rank_result in dist_pool.run("test_distributed_module:run_mha", size, cases):
        for case, errors in rank_result.items():
            bad = {k: e for k, e in errors.items() if not e <= 1e-10}
            assert not bad, f"{case}: {bad}"


def test_state_dict_has_no_keys_of_its_own():
    plain = qkv.MultiHeadAttention(DIM, HEADS, positional=ALiBi(HEADS))
    sp = qkv.MultiHeadAttention(DIM, HEADS, positional=ALiBi(HEADS), attention=qd.SequenceParallel())
    assert list(sp.state_dict()) == list(plain.state_dict())


def test_copies_share_groups_and_copy_scores():
    sp = qd.SequenceParallel("ulysses", score=Bilinear(4))
    clone = copy.deepcopy(sp)
    assert clone.score.weight is not sp.score.weight
    assert clone._groups is sp._groups


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"strategy: expected one of .* got 'tree'"):
        qd.SequenceParallel("tree")
    with pytest.raises(ValueError, match=r"layout: expected one of .* got 'striped'"):
        qd.SequenceParallel(layout="striped")
    with pytest.raises(ValueError, match=r"return_weights: sequence-parallel attention does not return"):
        qd.SequenceParallel()(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4),
                              return_weights=True)  # fmt: skip
