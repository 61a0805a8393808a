"""Benchmark suite ``varlen``: ``qkv.varlen_attn`` (PyTorch's ``torch.nn.attention.varlen``) against what a CPU user writes.

Shape legend: ``T`` packed tokens, ``h = 8`` query heads, ``g = 2`` KV heads, ``d = 64``,
float32; ``P = 16`` page size.

PyTorch's ``varlen_attn`` runs only on CUDA; on a CPU the same work is a Python loop of
``F.scaled_dot_product_attention`` over the sequences, or one SDPA call over the batch padded
to its longest sequence with a bool mask (``keep & window``, built in the call as a model
builds it from its lengths). Each row times the dialect's call against both, with the same
tensors, interleaved (:func:`qkv.bench.measure.interleaved`), outputs compared first:

* **packed prefill** — 8 sequences of 64 to 1024 tokens, causal (``window_size=(-1, 0)``)
  and a sliding window of 256 keys (``(256, 0)``), forward and forward + backward. Targets:
  ``≤ 1.05`` of the loop (no slower, within the medians' noise) and ``≤ 1.0`` of the padded call;
* **decoding step over pages** — the FlashInfer suite's step (:mod:`.paged_step`: 32 requests
  of 64 to 2048 keys, one query each, pages of 16 tokens in a pool in order), as ``block_table``
  and ``seqused_k``, each call from cold caches as a layer finds its own: against the loop over
  each request's contiguous keys and the padded call.
  Targets: the serving issue's, ``≤ 1.0`` of the loop and ``≤ 0.6`` of the padded call.
"""

from __future__ import annotations

import random
from typing import Callable

import torch
import torch.nn.functional as F

from ..torch_varlen import varlen_attn
from .measure import call_or_step, evicting, interleaved
from .paged_step import decoding_step
from .report import Targets, ms, same_answer, table

NAME = "varlen"
DESCRIPTION = "qkv.varlen_attn (PyTorch's varlen_attn, CUDA-only there) against SDPA written for the same work"

FULL = dict(sequences=8, shortest=64, longest=1024, windows=[(-1, 0), (256, 0)], requests=32, cache=2048, repeats=9)
QUICK = dict(sequences=3, shortest=8, longest=24, windows=[(-1, 0)], requests=3, cache=40, repeats=1)
H, G, D = 8, 2, 64


def _prefill(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[list[str]]:
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    lens = [rnd.randint(cfg["shortest"], cfg["longest"]) for _ in range(cfg["sequences"])]
    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(total, H, D, generator=gen), torch.randn(total, G, D, generator=gen), torch.randn(total, G, D, generator=gen)
    cot = torch.randn(total, H, D, generator=gen)
    where = [(a, n) for a, n in zip(cu.tolist(), lens)]
    rows = []
    for left, right in cfg["windows"]:
        def ours(left=left, right=right):
            return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(left, right), enable_gqa=True)

        def loop(left=left):
            outs = []
            for a, n in where:
                qs, ks, vs = (x[a : a + n].transpose(0, 1)[None] for x in (q, k, v))
                mask = None if left < 0 else _band(n, left)
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                           enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
            return torch.cat(outs)

        def padded(left=left):
            qs, ks, vs = (_pad(x, where, longest).transpose(1, 2) for x in (q, k, v))
            keep = torch.arange(longest)[None, :] < torch.tensor(lens)[:, None]
            mask = keep[:, None, None, :] & (_band(longest, left) if left >= 0 else torch.ones(longest, longest).tril().bool())
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True).transpose(1, 2)
            return torch.cat([out[s, :n] for s, n in enumerate(lens)])

        with torch.no_grad():
            same_answer(ours(), loop(), "qkv.varlen_attn", "the loop of SDPA")
            same_answer(padded(), loop(), "the padded call", "the loop of SDPA")
        name = f"{len(lens)} sequences of {min(lens)}-{longest} tokens, " + ("causal" if left < 0 else f"window ({left}, 0)")
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            for x in (q, k, v):
                x.requires_grad_(grad)
            t = interleaved({n: call_or_step(f, grad, cot, (q, k, v)) for n, f in
                             (("qkv", ours), ("loop", loop), ("padded", padded))}, cfg["repeats"])  # fmt: skip
            r_loop, r_pad = t["qkv"] / t["loop"], t["qkv"] / t["padded"]
            say(f"  {name} {mode}: / loop {r_loop:.3f}, / padded {r_pad:.3f}")
            rows.append([name, mode, ms(t["loop"]), ms(t["padded"]), ms(t["qkv"]), f"{r_loop:.3f}", f"{r_pad:.3f}"])
            targets.add(f"varlen_attn, {name}, {mode}: time / loop of SDPA ≤ 1.05", r_loop, 1.05)
            targets.add(f"varlen_attn, {name}, {mode}: time / padded SDPA ≤ 1.0", r_pad, 1.0)
    return rows


def _decoding(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[list[str]]:
    step = decoding_step(cfg["requests"], cfg["cache"], shuffled=False)  # the FlashInfer suite's step, pages in order
    n, lens, table_ = len(step.lens), step.lens, step.block_table()
    cu_q, used = torch.arange(n + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    loop, padded = step.loop, step.padded

    def ours():
        return varlen_attn(step.q, step.k_pool, step.v_pool, cu_q, None, 1, max(lens), window_size=(-1, 0),
                           enable_gqa=True, seqused_k=used, block_table=table_)  # fmt: skip

    with torch.no_grad():
        same_answer(ours(), loop(), "qkv.varlen_attn", "the loop of SDPA")
        same_answer(padded(), loop(), "the padded call", "the loop of SDPA")
        t = interleaved({"qkv": ours, "loop": loop, "padded": padded}, cfg["repeats"], before=evicting(cfg is FULL))
    name = f"decoding step over pages, {n} requests of {min(lens)}-{max(lens)} keys"
    r_loop, r_pad = t["qkv"] / t["loop"], t["qkv"] / t["padded"]
    say(f"  {name}: / loop {r_loop:.3f}, / padded {r_pad:.3f}")
    targets.add(f"varlen_attn, {name}: time / loop of SDPA ≤ 1.0", r_loop, 1.0)
    targets.add(f"varlen_attn, {name}: time / padded SDPA ≤ 0.6", r_pad, 0.6)
    return [[name, "fwd", ms(t["loop"]), ms(t["padded"]), ms(t["qkv"]), f"{r_loop:.3f}", f"{r_pad:.3f}"]]


def _band(n: int, left: int) -> torch.Tensor:
    """``(n, n)`` bool: query ``r`` sees keys ``r - left .. r``."""
    r, c = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (c <= r) & (c >= r - left)


def _pad(x: torch.Tensor, where: list[tuple[int, int]], longest: int) -> torch.Tensor:
    """Packed ``(T, heads, d)`` -> ``(b, longest, heads, d)``, zeros after each sequence (a copy, as a model pads)."""
    out = x.new_zeros(len(where), longest, *x.shape[1:])
    for s, (a, n) in enumerate(where):
        out[s, :n] = x[a : a + n]
    return out


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    prefill = _prefill(cfg, say, targets)
    decoding = _decoding(cfg, say, targets)
    lines = [
        "## PyTorch's varlen dialect: `qkv.varlen_attn` against SDPA written for the same work (`qkv bench --suite varlen`)",
        "",
        f"h = {H} (grouped: {G} KV heads, `enable_gqa=True`), d = {D}, float32; outputs compared first; medians of "
        f"{cfg['repeats']} interleaved rounds; the decoding step's calls each from cold caches. The padded call pads "
        "q, k and v and builds its `(b, 1, L, L)` mask in the call, as a model does from its lengths.",
        "",
    ]
    lines += table(["call", "mode", "loop of SDPA ms", "padded SDPA ms", "qkv ms", "qkv / loop", "qkv / padded"],
                   prefill + decoding)  # fmt: skip
    lines += ["", "PyTorch's own `varlen_attn` runs flash attention's CUDA kernel only (`NotImplementedError` on a "
              "CPU). qkv runs each sequence as its own call of its engines (a causal square is the fused kernel's "
              "causal call), and a `block_table` through the paged engine, a request's run of pages read where it lies."]
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
