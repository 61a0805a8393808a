"""Cases for the distributed tests, run inside the ranks of ``distributed_pool``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i``/``j`` the global query/key
lengths, ``d`` query/key size, ``e`` value size.

A case is a small dict (picklable, so the parent sends it to the ranks). Every rank builds
the same whole tensors from the case's seed, computes single-process ``qkv.attention`` on
them (the oracle), then the sharded call on its shards, and returns the largest errors of
the output and of the gradients of q, k, v and of the learned parameters (summed over the
ranks with an all-reduce, as a data-parallel step would). Errors are relative to the
largest value of the oracle (at least 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd
from qkv import masks
from qkv.positional import ALiBi, RelativePositionBias
from qkv.scores import Additive, Bilinear

DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Largest error allowed, by dtype (the issue's exactness rule).
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}

BASE = {"strategy": "allgather", "layout": "zigzag", "b": 2, "h": 6, "g": 3, "i": 13, "j": None, "d": 11,
        "e": 7, "dtype": "float64", "mask": "none", "bias": "none", "score": "scaled_dot", "causal": False,
        "grad": True, "seed": 0, "dropout": 0.0, "hybrid": None, "score_mod": "none", "sinks": False}  # fmt: skip


def case(**kw) -> dict:
    unknown = set(kw) - set(BASE)
    if unknown:
        raise KeyError(f"unknown case keys {unknown}")
    c = {**BASE, **kw}
    c["j"] = c["i"] if c["j"] is None else c["j"]
    return c


def name(c: dict) -> str:
    diff = [f"{k}={v}" for k, v in c.items() if BASE.get(k) != v and k != "j" or (k == "j" and v != c["i"])]
    return ",".join(diff) or "base"


def build(c: dict):
    """The whole inputs and keywords of a case, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    dt = DTYPES[c["dtype"]]
    b, h, g, i, j, d, e = (c[x] for x in "bhgijde")
    dq = d
    q = torch.randn(b, h, i, dq, generator=gen, dtype=torch.float64).to(dt)
    k = torch.randn(b, g, j, d, generator=gen, dtype=torch.float64).to(dt)
    v = torch.randn(b, g, j, e, generator=gen, dtype=torch.float64).to(dt)
    w = torch.randn(b, h, i, e, generator=gen, dtype=torch.float64).to(dt)  # loss weights
    kw: dict = {"causal": c["causal"], "dropout": c["dropout"]}
    torch.manual_seed(2000 + c["seed"])  # parameter initialisation
    score = c["score"]
    if score == "general":
        score = Bilinear(d, d).to(dt)
    elif score == "additive":
        score = Additive(d, d, hidden=5).to(dt)
    kw["score"] = score
    kw["mask"] = _mask(c["mask"], b, h, i, j, gen)
    kw["bias"] = _bias(c["bias"], b, h, i, j, gen, dt)
    kw["score_mod"] = _score_mod(c["score_mod"], h, gen, dt)
    if c["sinks"]:  # learned per-head sink logits (GPT-OSS)
        kw["sinks"] = torch.randn(h, generator=gen, dtype=torch.float64).to(dt).requires_grad_()
    return q, k, v, w, kw


def _score_mod(kind: str, h, gen, dt):
    if kind == "none":
        return None
    if kind == "softcap":
        return qkv.SoftCap(2.0)
    if kind == "learned":  # reads every index: global rows, keys and heads must reach it
        weight = (0.5 * torch.randn(h, generator=gen, dtype=torch.float64)).to(dt).requires_grad_()

        def fn(score, b, head, q_idx, kv_idx):
            return score + weight[head] * torch.sin(0.3 * (q_idx - 2 * kv_idx)) + 0.1 * b

        fn.weight = weight
        return fn
    raise KeyError(kind)


def _documents(b: int, n: int) -> torch.Tensor:
    """Sorted document ids ``(b, n)``: row r has documents of about ``n / (r + 3)`` tokens (different rows, different cuts)."""
    return torch.stack([torch.arange(n) * (r + 3) // n for r in range(b)])


def _mask(kind: str, b, h, i, j, gen):
    lengths = torch.tensor([j, max(1, j // 2)] + [j] * (b - 2))[:b]
    dense = torch.rand(b, 1, i, j, generator=gen) > 0.3
    docs = masks.documents(_documents(b, i), _documents(b, j))
    return {
        "documents": docs,
        "documents_causal": docs & masks.causal(),
        "none": None,
        "causal": masks.causal(),
        "window": masks.window(4),
        "window_both": masks.window(3, 2),
        "offsets": masks.offsets(-5, -1),
        "future": masks.offsets(1, 3),
        "lengths": masks.lengths(lengths),
        "dense": dense,
        "causal_lengths": masks.causal() & masks.lengths(lengths),
        "window_or_dense": masks.window(2) | masks.Dense(dense),
        "custom": _Stripes(),
        # a pattern of its own per head: Ulysses' ranks hold some heads of every row, and must read theirs
        "dense_heads": torch.rand(b, h, i, j, generator=gen) > 0.3,
        "program_heads": masks.from_mask_mod(lambda bb, hh, q_idx, kv_idx: (q_idx + kv_idx + hh) % 3 != 0, None, h),
    }[kind]


class _Stripes(masks.Mask):
    """A mask qkv does not know: keys whose global index is even, or the query's own offset."""

    def tile(self, t):
        return (t.cols[None, :] % 2 == 0) | (t.diagonal == 0)


def _bias(kind: str, b, h, i, j, gen, dt):
    if kind == "none":
        return None
    if kind == "alibi":
        return ALiBi(h).to(dt)
    if kind == "t5":
        t5 = RelativePositionBias(h, buckets=8, max_distance=6).to(dt)
        with torch.no_grad():
            t5.embedding.weight.normal_(0, 0.5, generator=gen)
        return t5
    if kind == "t5_causal":
        return RelativePositionBias(h, buckets=8, max_distance=6, bidirectional=False).to(dt)
    if kind == "dense":
        return (0.5 * torch.randn(1, h, i, j, generator=gen, dtype=torch.float64)).to(dt).requires_grad_()
    raise KeyError(kind)


def _params(kw) -> list[tuple[str, torch.Tensor]]:
    out = []
    if isinstance(kw["score"], torch.nn.Module):
        out += [(f"score.{n}", p) for n, p in kw["score"].named_parameters()]
    if isinstance(kw["bias"], torch.nn.Module):
        out += [(f"bias.{n}", p) for n, p in kw["bias"].named_parameters()]
    elif isinstance(kw["bias"], torch.Tensor):
        out.append(("bias", kw["bias"]))
    if kw.get("sinks") is not None:
        out.append(("sinks", kw["sinks"]))
    if hasattr(kw.get("score_mod"), "weight"):
        out.append(("score_mod.weight", kw["score_mod"].weight))
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    scale = max(1.0, float(want.abs().max()))
    return float((got.double() - want.double()).abs().max()) / scale


def run_case(group, c: dict) -> dict:
    """Errors of one case on this rank: ``{"out": .., "dq": .., "dk": .., "dv": .., "param:..": ..}``."""
    q, k, v, w, kw = build(c)
    grad = c["grad"]
    leaves = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    params = _params(kw)
    for _, p in params:
        p.grad = None
    if c["dropout"] > 0:  # the same seed for both calls: the sharded mask must be the whole call's
        kw["generator"] = torch.Generator().manual_seed(5)
    want = qkv.attention(*leaves, **kw)
    want_grads = {}
    if grad:
        (want * w).sum().backward()
        want_grads = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
        want_grads.update({f"param:{n}": p.grad.clone() for n, p in params})
        for _, p in params:
            p.grad = None
    lay = c["layout"]
    local = [qd.shard(x, group=group, layout=lay).detach().requires_grad_(grad) for x in (q, k, v)]
    if c["dropout"] > 0:
        kw["generator"] = torch.Generator().manual_seed(5)
    if c["hybrid"] == "local":  # torchrun's LOCAL_WORLD_SIZE: Ulysses on each "machine" of 2 ranks
        import os

        os.environ["LOCAL_WORLD_SIZE"] = "2"
    elif c["hybrid"] is not None:
        from distributed_pool import HYBRID

        kw["ring_group"], kw["ulysses_group"] = HYBRID[c["hybrid"]]
    got = qd.attention(*local, strategy=c["strategy"], layout=lay, group=group, **kw)
    errors = {"out": _err(qd.unshard(got.detach(), group=group, layout=lay), want.detach())}
    if grad:
        (got * qd.shard(w, group=group, layout=lay)).sum().backward()
        for key, x in zip(("dq", "dk", "dv"), local):
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            errors[key] = _err(qd.unshard(g, group=group, layout=lay), want_grads[key])
        for n, p in params:
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)
            errors[f"param:{n}"] = _err(g, want_grads[f"param:{n}"])
    return errors


def run_cases(group, cases: list[dict]) -> dict:
    """``{name(case): errors}`` for every case, on this rank."""
    return {name(c): run_case(group, c) for c in cases}


def check(results: list[dict], cases: list[dict]) -> None:
    """Assert every rank's errors are within the case's tolerance (parent side)."""
    bad = []
    for c in cases:
        tol = TOLERANCE[c["dtype"]]
        for rank, per_rank in enumerate(results):
            for key, err in per_rank[name(c)].items():
                if not err <= tol:
                    bad.append(f"{name(c)} rank {rank} {key}: {err:.3g} > {tol:g}")
    assert not bad, "\n".join(bad)
