"""Benchmark suite ``flash-attn``: ``qkv.flash_attn``'s calls against what a CPU user writes instead.

Shape legend: ``b`` batch, ``s`` length, ``h = 8`` query heads, ``g = 2`` KV heads, ``d = 64``,
float32.

flash-attn's kernels are CUDA: on a CPU its calls would be written with PyTorch's
``F.scaled_dot_product_attention``. Each row times the dialect's call against that, with the
same tensors, interleaved (:func:`qkv.bench.measure.interleaved`), outputs compared first:

* **batched** — ``flash_attn_func(q, k, v, causal=True)`` on ``(b, s, h, d)`` tensors against
  SDPA over their ``(b, h, s, d)`` views with ``enable_gqa`` and the output made contiguous
  in flash-attn's layout; forward and forward + backward; a long batch and many short
  sequences. Target ``≤ 1.05`` (no slower, within the medians' noise);
* **decoding step** — ``flash_attn_with_kvcache`` over a contiguous cache ``(32, 2048, g, d)``,
  requests of random lengths 64 to 2048, one new token each written into the cache and
  attended (causal): against a Python loop of SDPA over each request's filled part of its
  row, and against SDPA over the whole padded cache with a bool key mask. Each call starts
  from cold caches (``measure.Evict``), as a model's layer finds its own. Targets: the serving
  issue's, ``≤ 1.0`` of the loop and ``≤ 0.6`` of the padded call. The same step with left
  padding (``cache_leftpad``), which cannot be read as pages, runs one call a request: shown
  against the loop.
"""

from __future__ import annotations

import random
from typing import Callable

import torch
import torch.nn.functional as F

from ..flash_attn import flash_attn_func, flash_attn_with_kvcache
from .measure import call_or_step, evicting, interleaved
from .report import Targets, ms, same_answer, table

NAME = "flash-attn"
DESCRIPTION = "qkv.flash_attn (flash-attn's calls) against SDPA written for the same work on a CPU"

FULL = dict(batched=[(4, 1024), (64, 64)], requests=32, longest=2048, capacity=2048, repeats=11)
QUICK = dict(batched=[(2, 32)], requests=3, longest=40, capacity=48, repeats=1)
H, G, D = 8, 2, 64


def _batched(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[list[str]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for b, s in cfg["batched"]:
        q = torch.randn(b, s, H, D, generator=gen)
        k, v = torch.randn(b, s, G, D, generator=gen), torch.randn(b, s, G, D, generator=gen)

        def sdpa(q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)  # fmt: skip
            return out.transpose(1, 2).contiguous()

        def ours(q=q, k=k, v=v):
            return flash_attn_func(q, k, v, causal=True)

        same_answer(ours(), sdpa(), "flash_attn_func", "SDPA")
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            for x in (q, k, v):
                x.requires_grad_(grad)
            cot = torch.randn(b, s, H, D, generator=gen)
            t = interleaved({"qkv": call_or_step(ours, grad, cot, (q, k, v)),
                             "SDPA": call_or_step(sdpa, grad, cot, (q, k, v))}, cfg["repeats"])  # fmt: skip
            ratio = t["qkv"] / t["SDPA"]
            name = f"flash_attn_func, causal, b = {b}, s = {s}"
            say(f"  {name} {mode}: / SDPA {ratio:.3f}")
            rows.append([name, mode, ms(t["SDPA"]), ms(t["qkv"]), f"{ratio:.3f}"])
            targets.add(f"{name}, {mode}: time / SDPA on the same tensors ≤ 1.05", ratio, 1.05)
    return rows


def _decoding(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[list[str]]:
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    n, S = cfg["requests"], cfg["capacity"]
    lens = [rnd.randint(min(64, cfg["longest"] - 1), cfg["longest"] - 1) for _ in range(n)]
    k_cache, v_cache = torch.randn(n, S, G, D, generator=gen), torch.randn(n, S, G, D, generator=gen)
    q = torch.randn(n, 1, H, D, generator=gen)
    k, v = torch.randn(n, 1, G, D, generator=gen), torch.randn(n, 1, G, D, generator=gen)
    seqlens, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(n)
    at = torch.tensor(lens)
    k_rows, v_rows = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (n, g, S, d) views
    keep = (torch.arange(S)[None, :] <= at[:, None])[:, None, None, :]  # (n, 1, 1, S), built once as the cache is

    def loop():
        outs = []
        for r, length in enumerate(lens):
            k_cache[r, length], v_cache[r, length] = k[r, 0], v[r, 0]
            outs.append(F.scaled_dot_product_attention(q[r : r + 1].transpose(1, 2), k_rows[r : r + 1, :, : length + 1],
                                                       v_rows[r : r + 1, :, : length + 1], enable_gqa=True))  # fmt: skip
        return torch.cat(outs).transpose(1, 2)

    def padded():
        k_cache[rows, at], v_cache[rows, at] = k[:, 0], v[:, 0]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_rows, v_rows, attn_mask=keep, enable_gqa=True)
        return out.transpose(1, 2)

    def ours():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    def leftpad(pads=torch.ones(n, dtype=torch.int32)):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_leftpad=pads, causal=True)

    with torch.no_grad():
        same_answer(ours(), loop(), "flash_attn_with_kvcache", "SDPA")
        same_answer(padded(), loop(), "the padded call", "SDPA")
        t = interleaved({"qkv": ours, "qkv, left padding": leftpad, "loop": loop, "padded": padded}, cfg["repeats"],
                        before=evicting(cfg is FULL))  # fmt: skip
    name = f"decoding step, {n} requests of {min(lens)}-{max(lens) + 1} keys, cache {S}"
    say(f"  {name}: / loop {t['qkv'] / t['loop']:.3f}, / padded {t['qkv'] / t['padded']:.3f}")
    targets.add(f"flash_attn_with_kvcache {name}: time / loop of SDPA ≤ 1.0", t["qkv"] / t["loop"], 1.0)
    targets.add(f"flash_attn_with_kvcache {name}: time / padded SDPA ≤ 0.6", t["qkv"] / t["padded"], 0.6)
    return [[f"flash_attn_with_kvcache, {name}", ms(t["loop"]), ms(t["padded"]), ms(t["qkv"]),
             f"{t['qkv'] / t['loop']:.3f}", f"{t['qkv'] / t['padded']:.3f}"],
            ["the same with cache_leftpad = 1 (one call a request)", ms(t["loop"]), ms(t["padded"]),
             ms(t["qkv, left padding"]), f"{t['qkv, left padding'] / t['loop']:.3f}",
             f"{t['qkv, left padding'] / t['padded']:.3f}"]]  # fmt: skip


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    batched = _batched(cfg, say, targets)
    decoding = _decoding(cfg, say, targets)
    lines = [
        "## flash-attn's dialect: `qkv.flash_attn` against SDPA written for the same work (`qkv bench --suite flash-attn`)",
        "",
        f"h = {H} (grouped: {G} KV heads), d = {D}, float32; outputs compared first; medians of {cfg['repeats']} "
        "interleaved rounds; the decoding step's calls each from cold caches.",
        "",
    ]
    lines += table(["call", "mode", "SDPA ms", "qkv ms", "qkv / SDPA"], batched) + [""]
    lines += table(["call", "loop of SDPA ms", "padded SDPA ms", "qkv ms", "qkv / loop", "qkv / padded"], decoding)
    lines += ["", "A contiguous cache whose capacity a page size divides is read as pages (views) by the paged "
              "engine, every request in one pass of the fused kernel over items of 256 keys; left padding cannot be "
              "pages, and runs one kernel call a request, as the loop does."]
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
