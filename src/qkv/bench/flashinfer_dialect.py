"""Benchmark suite ``flashinfer``: ``qkv.flashinfer``'s wrappers against what a CPU user writes instead.

Shape legend: ``h = 8`` query heads, ``g = 2`` KV heads, ``d = 64``, float32, page size 16.

FlashInfer's kernels are CUDA: on a CPU its wrappers' work would be written with PyTorch's
``F.scaled_dot_product_attention``, or with ``qkv.paged_attention`` / ``qkv.varlen_attention``
directly. Each row times the wrapper's ``run`` (planned once, as a model plans a step and runs
every layer) against those, with the same tensors, interleaved (:func:`qkv.bench.measure.interleaved`),
outputs compared first:

* **decoding step** — ``BatchDecodeWithPagedKVCacheWrapper.run``, 32 requests of random lengths 64
  to 2048, each call from cold caches (``measure.Evict``): against ``qkv.paged_attention`` on the
  same table (the dialect's own cost, target ``≤ 1.05``), a Python loop of SDPA over each request's
  contiguous keys and SDPA over the batch padded to the longest. Twice: each request's pages one
  after another (as ``qkv.PagedKVCache`` reserves them; the serving issue's targets for this work,
  ``≤ 1.0`` and ``≤ 0.6``), and every page in a random order (FlashInfer's tests' tables, the
  worst case on a CPU: no two pages of a request adjacent, so each is copied before the kernel
  reads it; shown, no target against SDPA);
* **ragged prefill** — ``BatchPrefillWithRaggedKVCacheWrapper.run``, 4 causal chunks of 96 to 704
  tokens packed one after another: against ``qkv.varlen_attention`` on the same rows (target
  ``≤ 1.05``) and a Python loop of SDPA, one call a chunk (target ``≤ 1.1``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from ..paged import paged_attention
from ..varlen import varlen_attention
from .measure import evicting, interleaved
from .paged_step import D, G, H, P, decoding_step
from .report import Targets, ms, same_answer, table

NAME = "flashinfer"
DESCRIPTION = "qkv.flashinfer (FlashInfer's wrappers) against SDPA and qkv's own calls for the same work on a CPU"

FULL = dict(requests=32, longest=2048, chunks=[512, 304, 704, 96], repeats=11)
QUICK = dict(requests=3, longest=40, chunks=[16, 8], repeats=1)


def _decoding(cfg: dict, say: Callable[[str], None], targets: Targets, shuffled: bool) -> list[list[str]]:
    step = decoding_step(cfg["requests"], cfg["longest"], shuffled)
    n, lens = len(step.lens), step.lens
    counts = [len(ids) for ids in step.page_ids]
    kv_indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat(step.page_ids)
    last = torch.tensor([length - (c - 1) * P for length, c in zip(lens, counts)], dtype=torch.int32)
    q, K, V = step.q, step.k_pool, step.v_pool
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper.plan(kv_indptr, indices, last, H, G, D, P, q_data_type=torch.float32)
    qo_indptr = torch.arange(n + 1, dtype=torch.int32)
    loop, padded = step.loop, step.padded

    def ours():
        return wrapper.run(q, (K, V))

    def direct():
        return paged_attention(q, (K, V), qo_indptr, kv_indptr, indices, last)

    with torch.no_grad():
        for other, what in ((direct, "qkv.paged_attention"), (loop, "the loop of SDPA"), (padded, "the padded call")):
            same_answer(ours(), other(), "the FlashInfer wrapper", what)
        t = interleaved({"qkv": ours, "paged": direct, "loop": loop, "padded": padded}, cfg["repeats"],
                        before=evicting(cfg is FULL))  # fmt: skip
    name = f"decoding step, {n} requests of {min(lens)}-{max(lens)} keys, pages {'in a random order' if shuffled else 'in order'}"
    ratios = {k: t["qkv"] / t[k] for k in ("paged", "loop", "padded")}
    say(f"  {name}: / paged_attention {ratios['paged']:.3f}, / loop {ratios['loop']:.3f}, / padded {ratios['padded']:.3f}")
    targets.add(f"BatchDecodeWithPagedKVCacheWrapper.run, {name}: time / qkv.paged_attention ≤ 1.05", ratios["paged"], 1.05)
    if not shuffled:
        targets.add(f"BatchDecodeWithPagedKVCacheWrapper.run, {name}: time / loop of SDPA ≤ 1.0", ratios["loop"], 1.0)
        targets.add(f"BatchDecodeWithPagedKVCacheWrapper.run, {name}: time / padded SDPA ≤ 0.6", ratios["padded"], 0.6)
    return [[f"BatchDecodeWithPagedKVCacheWrapper.run, {name}", "qkv.paged_attention", ms(t["paged"]), ms(t["qkv"]),
             f"{ratios['paged']:.3f}"],
            ["", "loop of SDPA", ms(t["loop"]), ms(t["qkv"]), f"{ratios['loop']:.3f}"],
            ["", "SDPA padded to the longest", ms(t["padded"]), ms(t["qkv"]), f"{ratios['padded']:.3f}"]]  # fmt: skip


def _ragged(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[list[str]]:
    gen = torch.Generator().manual_seed(1)
    lens = cfg["chunks"]
    rows = sum(lens)
    q = torch.randn(rows, H, D, generator=gen)
    k, v = torch.randn(rows, G, D, generator=gen), torch.randn(rows, G, D, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    bounds = cu.tolist()
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper.plan(cu, cu, H, G, D, causal=True, q_data_type=torch.float32)

    def ours():
        return wrapper.run(q, k, v)

    def varlen():
        return varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def loop():
        return torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                                         v[a:b].transpose(0, 1)[None], is_causal=True,
                                                         enable_gqa=True)[0].transpose(0, 1)
                          for a, b in zip(bounds, bounds[1:])])  # fmt: skip

    with torch.no_grad():
        same_answer(ours(), varlen(), "the FlashInfer wrapper", "qkv.varlen_attention")
        same_answer(ours(), loop(), "the FlashInfer wrapper", "the loop of SDPA")
        t = interleaved({"qkv": ours, "varlen": varlen, "loop": loop}, cfg["repeats"])
    name = f"ragged prefill, {len(lens)} causal chunks of {min(lens)}-{max(lens)} tokens"
    say(f"  {name}: / varlen {t['qkv'] / t['varlen']:.3f}, / loop {t['qkv'] / t['loop']:.3f}")
    targets.add(f"BatchPrefillWithRaggedKVCacheWrapper.run, {name}: time / qkv.varlen_attention ≤ 1.05",
                t["qkv"] / t["varlen"], 1.05)  # fmt: skip
    targets.add(f"BatchPrefillWithRaggedKVCacheWrapper.run, {name}: time / loop of SDPA ≤ 1.1", t["qkv"] / t["loop"], 1.1)
    return [[f"BatchPrefillWithRaggedKVCacheWrapper.run, {name}", "qkv.varlen_attention", ms(t["varlen"]), ms(t["qkv"]),
             f"{t['qkv'] / t['varlen']:.3f}"],
            ["", "loop of SDPA, one call a chunk", ms(t["loop"]), ms(t["qkv"]), f"{t['qkv'] / t['loop']:.3f}"]]  # fmt: skip


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = _decoding(cfg, say, targets, False) + _decoding(cfg, say, targets, True) + _ragged(cfg, say, targets)
    lines = [
        "## FlashInfer's dialect: `qkv.flashinfer`'s wrappers against the calls written for the same work "
        "(`qkv bench --suite flashinfer`)",
        "",
        f"h = {H} (grouped: {G} KV heads), d = {D}, page size {P}, float32; each wrapper planned once and run; outputs "
        f"compared first; medians of {cfg['repeats']} interleaved rounds; the decoding step's calls each from cold caches.",
        "",
    ]
    lines += table(["call", "against", "their ms", "qkv ms", "qkv / theirs"], rows)
    lines += ["", "The wrappers run `qkv.paged_attention` (the ragged one over pages of one row, read where they lie); "
              "a plan keeps its checked table, so later runs of a step pay only for their keys. Pages in order are read "
              "as views, runs of a request's pages at a time; pages in a random order are copied a tile at a time before "
              "the kernel reads them (no run longer than a page): the copy's reads and writes come on top of the kernel's."]
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
