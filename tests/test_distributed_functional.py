"""``qkv.distributed.attention``: the call's checks, its errors, and the cases the strategy files leave out.

Errors that need no other process run here; the ones that need ranks to disagree run in
the spawned pool (``distributed_pool``), where every rank must raise the same error
(never hang). The large matrix (strategy x layout x mask x bias x score x GQA x lengths x
dtype) is marked slow; the default run keeps at least one case of each kind.
"""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
from distributed_cases import case, check

import qkv.distributed as qd
from qkv import masks
from qkv.scores import Location

TARGET = "distributed_cases:run_cases"


def test_unknown_strategy_and_layout_are_named():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"strategy: expected one of \('ring', 'ulysses', 'hybrid', 'allgather'\), got 'tree'"):
        qd.attention(q, q, q, strategy="tree")
    with pytest.raises(ValueError, match=r"layout: expected one of \('contiguous', 'zigzag'\), got 'striped'"):
        qd.attention(q, q, q, layout="striped")


def test_not_initialised_is_named():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.zeros(1, 2, 3, 4)
    for call in (lambda: qd.attention(q, q, q), lambda: qd.shard(q), lambda: qd.unshard(q), lambda: qd.positions(8)):
        with pytest.raises(RuntimeError, match=r"group: torch.distributed is not initialised; call torch.distributed"):
            call()


def errors(group, _):
    """Each bad call on every rank; returns the messages (every rank must raise, none may hang)."""
    rank = dist.get_rank(group)
    messages = {}

    def catch(key, fn):
        try:
            fn()
            messages[key] = "no error"
        except (ValueError, TypeError, RuntimeError) as err:
            messages[key] = f"{type(err).__name__}: {err}"

    def shards(rows=4, d=8, h=4, g=2):
        return torch.zeros(1, h, rows, d), torch.zeros(1, g, rows, d), torch.zeros(1, g, rows, 5)

    catch("d", lambda: qd.attention(*shards(d=8 + rank), group=group))
    catch("rows", lambda: qd.attention(*shards(rows=3 + 2 * rank), group=group))
    catch("strategy", lambda: qd.attention(*shards(), group=group, strategy=("ring", "allgather")[rank]))
    catch("location", lambda: qd.attention(*shards(), group=group, score=Location(8, 16)))
    catch("ulysses", lambda: qd.attention(*shards(h=3, g=3), group=group, strategy="ulysses"))
    catch("hybrid_one", lambda: qd.attention(*shards(), group=group, strategy="hybrid", ring_group=group))
    catch("hybrid_size", lambda: qd.attention(*shards(), group=group, strategy="hybrid", ring_group=group,
                                              ulysses_group=group))  # fmt: skip
    catch("mask", lambda: qd.attention(*shards(), group=group, mask=torch.ones(5, 8, dtype=torch.bool)))
    catch("unshard", lambda: qd.unshard(torch.zeros(2 + rank, 3, 4), dim=1, group=group))
    catch("lengths_mask", lambda: qd.attention(*shards(), group=group, mask=masks.lengths(torch.tensor([3, 4]))))
    catch("no_heads", lambda: qd.attention(*shards(h=0, g=0), group=group))  # qkv.attention's empty call, not here
    # refused on one rank only: the other must not wait for it in a gather
    catch("one_rank_3d", lambda: qd.attention(*(x[0] if rank == 1 else x for x in shards()), group=group))
    catch("one_rank_dropout", lambda: qd.attention(*shards(), group=group, dropout=1.5 if rank == 0 else 0.0))
    catch("unshard_dims", lambda: qd.unshard(torch.zeros((2,) * (3 + rank)), dim=1, group=group))
    return messages


def test_errors_are_raised_on_every_rank(dist_pool):
    expected = {
        "d": r"ValueError: q: ranks disagree on d: rank \d has \d+, rank \d has \d+",
        "rows": r"ValueError: q: rank 0 holds 3 rows, but a zigzag split of 8 rows over 2 ranks gives it 4; "
        r"split tensors with qkv.distributed.shard",
        "strategy": r"ValueError: strategy: ranks disagree on strategy: rank \d has '\w+', rank \d has '\w+'",
        "location": r"ValueError: score: the location score reads each query's whole row",
        "ulysses": r"ValueError: strategy: Ulysses splits the h=3 query heads over 2 ranks",
        "hybrid_one": r"ValueError: ring_group, ulysses_group: give both groups",
        "hybrid_size": r"ValueError: ring_group, ulysses_group: their sizes 2 x 2 must multiply to the group size 2",
        "mask": r"ValueError: mask: expected shape broadcastable to \(b, h, i, j\) = \(1, 4, 8, 8\), got \(5, 8\)",
        "unshard": r"ValueError: x_local: every dim but dim=1 must match across ranks",
        "lengths_mask": r"ValueError: mask: qkv.masks.lengths got key_lengths of shape \(2,\), one per batch row; the call needs b = 1: "
        r"a mask broadcasts to \(b, h, i, j\) = \(1, 4, 8, 8\)",
        "unshard_dims": r"ValueError: x_local: every rank's part must have the same number of dims; ranks have \[3, 4\]",
        "no_heads": r"ValueError: k: expected at least one KV head to spread over the ranks, got shape \(1, 0, 4, 8\)",
    }
    on_its_own = {  # rank -> the error of the rank that refused its input; the other names it
        "one_rank_3d": (1, r"ValueError: q: expected this rank's shard \(b, heads, rows, size\), got shape \(4, 4, 8\)"),
        "one_rank_dropout": (0, r"ValueError: dropout: expected a probability in \[0, 1\), got 1.5"),
    }
    for rank, messages in enumerate(dist_pool.run("test_distributed_functional:errors", 2)):
        for key, pattern in expected.items():
            assert re.search(pattern, messages[key]), f"{key}: {messages[key]}"
        for key, (refusing, pattern) in on_its_own.items():
            want = pattern if rank == refusing else rf"ValueError: rank {refusing} refused its shards \(its own error says why\)"
            assert re.search(want, messages[key]), f"{key} on rank {rank}: {messages[key]}"


def sharding(group, length):
    """shard/unshard/positions on uneven lengths; unshard's gradient is the sum over ranks."""
    size = dist.get_world_size(group)
    x = torch.arange(2.0 * length * 3).reshape(2, length, 3)
    out = {}
    for layout in ("contiguous", "zigzag"):
        part = qd.shard(x, dim=1, group=group, layout=layout).requires_grad_()
        whole = qd.unshard(part, dim=1, group=group, layout=layout)
        (whole * x).sum().backward()
        positions = qd.positions(length, group=group, layout=layout)
        out[layout] = {
            "round_trip": torch.equal(whole, x),
            "positions": torch.equal(part.detach(), x[:, positions]),
            "grad": torch.equal(part.grad, size * x[:, positions]),
            "rows": part.shape[1],
        }
    return out


@pytest.mark.parametrize(("size", "length"), [(3, 7), (4, 2), (1, 5)])
def test_shard_unshard_positions(dist_pool, size, length):
    results = dist_pool.run("test_distributed_functional:sharding", size, length)
    for layout in ("contiguous", "zigzag"):
        assert sum(r[layout]["rows"] for r in results) == length
        for r in results:
            assert r[layout]["round_trip"] and r[layout]["positions"] and r[layout]["grad"]


# One case of every kind the strategy files do not already run, at P = 3 and 4 (uneven).
DEFAULT = [
    case(strategy="ring", mask="window_both", bias="t5_causal"),
    case(strategy="ring", layout="contiguous", mask="future", g=6),
    case(strategy="ring", mask="causal_lengths", bias="alibi", i=7, j=12, d=5, e=9),
    case(strategy="ring", mask="window_or_dense", dtype="float32"),
    case(strategy="ring", mask="causal", i=2, j=2),  # P = 3, 4: ranks with only padding
    case(strategy="allgather", mask="causal", i=3, j=10, layout="contiguous"),
    case(strategy="ulysses", mask="future", i=4, j=9, bias="t5"),
    case(strategy="ring", mask="causal", score_mod="learned", bias="alibi"),
    case(strategy="allgather", mask="window", score_mod="learned", layout="contiguous"),
    case(strategy="ring", mask="lengths", score_mod="softcap", dtype="float32"),
    case(strategy="ring", mask="documents_causal", layout="contiguous", i=17),
    case(strategy="ring", mask="documents_causal", bias="alibi", i=17),
    case(strategy="ulysses", mask="documents_causal", i=17, j=17, h=6, g=3),
    case(strategy="allgather", mask="documents", i=11, j=15, score_mod="learned"),
]


def test_score_mod_reads_global_indices(dist_pool):
    cases = [case(strategy="ulysses", mask="causal", score_mod="learned", h=6, g=3, i=9, j=11)]
    check(dist_pool.run(TARGET, 3, cases), cases)


@pytest.mark.parametrize("size", [2, 3])
def test_sinks_join_every_rows_denominator_once(dist_pool, size):
    cases = [
        case(strategy="ring", mask="causal", sinks=True, i=9, j=11),
        case(strategy="ring", mask="window", sinks=True, layout="contiguous", dropout=0.2),
        case(strategy="allgather", mask="lengths", sinks=True),
        case(strategy="ulysses", mask="causal", sinks=True, h=6, g=6),
    ]
    check(dist_pool.run(TARGET, size, cases), cases)


def test_a_mask_of_its_own_per_head_is_read_at_each_ranks_heads(dist_pool):
    """Ulysses and hybrid ranks hold some heads of every row: a dense (b, h, i, j) mask or a mask_mod made for h heads
    was given whole (a shape error), now each rank's heads of it."""
    cases = [
        case(strategy="ulysses", mask="dense_heads", h=6, g=3),
        case(strategy="ulysses", mask="program_heads", h=6, g=3, causal=True),
        case(strategy="hybrid", hybrid="local", mask="dense_heads", h=4, g=2),
        case(strategy="hybrid", hybrid="local", mask="program_heads", h=4, g=4, layout="contiguous"),
        case(strategy="ring", mask="program_heads"),
    ]
    check(dist_pool.run(TARGET, 2, cases[:2]), cases[:2])
    check(dist_pool.run(TARGET, 4, cases[2:]), cases[2:])


@pytest.mark.parametrize("size", [3, 4])
def test_remaining_kinds(dist_pool, size):
    cases = [c for c in DEFAULT if not (c["strategy"] == "ulysses" and c["h"] % size)]
    check(dist_pool.run(TARGET, size, cases), cases)


MASKS = ["none", "causal", "window", "window_both", "offsets", "future", "lengths", "dense", "causal_lengths",
         "window_or_dense", "custom"]  # fmt: skip
BIASES = ["none", "alibi", "t5", "t5_causal", "dense"]
SCORES = ["dot", "scaled_dot", "general", "additive"]


def _matrix(size):
    out = []
    combos = itertools.product(("ring", "allgather", "ulysses"), ("zigzag", "contiguous"), MASKS)
    for n, (strategy, layout, mask) in enumerate(combos):
        bias, score = BIASES[n % len(BIASES)], SCORES[n % len(SCORES)]
        h, g = (6, 3) if size != 4 else (8, 4)
        shapes = [dict(i=13, j=13), dict(i=9, j=17, d=5, e=9)][n % 2]  # self and cross, d = e and d != e
        for dtype in ("float64", "float32"):
            out.append(case(strategy=strategy, layout=layout, mask=mask, bias=bias, score=score, h=h,
                            g=g if n % 3 else 1, dtype=dtype, **shapes))  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3, 4])
def test_matrix(dist_pool, size):
    cases = _matrix(size)
    check(dist_pool.run(TARGET, size, cases, timeout=1800), cases)


@pytest.mark.slow
@pytest.mark.parametrize("arrangement", ["u2r2", "u2r2t", "u4r1", "u1r4"])
def test_hybrid_matrix(dist_pool, arrangement):
    cases = [
        case(strategy="hybrid", hybrid=arrangement, layout=layout, mask=mask, bias=bias, h=8, g=g, dtype=dtype)
        for layout in ("zigzag", "contiguous")
        for mask, bias in (("causal", "alibi"), ("window", "t5"), ("lengths", "dense"), ("custom", "none"))
        for g, dtype in ((4, "float64"), (2, "float32"))
    ]
    check(dist_pool.run(TARGET, 4, cases, timeout=1800), cases)


def empty_sequences(group, _):
    """i = j = 0: the output and the gradients exist, empty, on every strategy (ring with sinks too)."""
    results = {}
    for strategy, with_sinks in (("ring", False), ("ring", True), ("allgather", False), ("ulysses", False)):
        sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True) if with_sinks else None
        q, k, v = (qd.shard(torch.randn(1, 2, 0, 4, dtype=torch.float64), group=group).requires_grad_() for _ in range(3))
        out = qd.attention(q, k, v, strategy=strategy, sinks=sinks, group=group)
        out.sum().backward()
        results[(strategy, with_sinks)] = (tuple(out.shape), q.grad is not None and q.grad.shape == q.shape)
    part = qd.shard(torch.zeros(3, 0, 2), dim=1, group=group).requires_grad_()
    whole = qd.unshard(part, dim=1, group=group)
    results["unshard"] = (tuple(whole.shape), whole.requires_grad)
    return results


def test_an_empty_sequence_has_an_output_and_gradients_on_every_strategy(dist_pool):
    for results in dist_pool.run("test_distributed_functional:empty_sequences", 2):
        assert results.pop("unshard") == ((3, 0, 2), True)
        assert all(value == ((1, 2, 0, 4), True) for value in results.values()), results
