"""Benchmark suite ``packing``: packed documents against a loop over them, and the memory of programmable masks.

Shape legend: ``T`` packed tokens, ``h`` heads, ``d`` head size; documents of ``n`` tokens.

Cases (float32 and bfloat16; forward under ``no_grad`` and forward + backward):

* **varlen** — 16 causal documents of 512 (8192 tokens), ``h = 8``, ``d = 64``:
  ``qkv.varlen_attention`` against the ideal, a Python loop of
  ``F.scaled_dot_product_attention(is_causal=True)`` over the documents (what a user
  writes who knows where they are), and SDPA with the dense ``(T, T)`` block-diagonal mask
  (what a user writes who does not);
* **documents** — the same batch through ``qkv.attention(mask=documents(ids) & causal())``
  and through ``qkv.flex_attention`` with a ``create_block_mask`` document mask;
* **mixed** — random lengths 1 to 2048 adding up to 16384 tokens, causal, ``varlen``
  against the loop;
* **memory** — the extra peak memory of ``varlen`` (fresh process) against the dense
  mask's bytes, and ``from_mask_mod`` of a causal document mask at 32768 × 32768,
  forward: peak above inputs and outputs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..flex import flex_attention
from ..functional import attention
from ..masks import causal, documents, from_mask_mod
from ..varlen import varlen_attention
from .measure import call_or_step, interleaved, mib, peak_memory
from .report import Targets, table

NAME = "packing"
DESCRIPTION = "packed documents (varlen, documents mask, flex BlockMask) vs a per-document SDPA loop"

FULL = dict(docs=16, length=512, mixed=16384, longest=2048, big=32768, repeats=5, dtypes=("float32", "bfloat16"), memory=True)
QUICK = dict(docs=3, length=32, mixed=128, longest=48, big=512, repeats=1, dtypes=("float32",), memory=False)


def _lengths(spec: dict) -> list[int]:
    if spec["case"] != "mixed":
        return [spec["length"]] * spec["docs"]
    gen = torch.Generator().manual_seed(0)
    lengths, left = [], spec["mixed"]
    while left > 0:
        n = min(left, int(torch.randint(1, spec["longest"] + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def build(spec: dict) -> Callable[[], object]:
    """One call of one contender; ``spec`` is JSON-able (``case``, ``impl``, ``mode``, ``dtype`` and sizes)."""
    if spec["case"] == "mask_mod":
        return _mask_mod_call(spec)
    grad = spec["mode"] == "fwdbwd"
    dtype = getattr(torch, spec["dtype"])
    lengths = _lengths(spec)
    total, h, d = sum(lengths), 8, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v, cot = (torch.randn(total, h, d, generator=gen).to(dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(grad)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    q4, k4, v4, cot4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, cot))  # (1, h, T, d) views
    impl = spec["impl"]
    if impl == "varlen":
        fn = lambda: varlen_attention(q, k, v, cu, cu, causal=True)  # noqa: E731
        return call_or_step(fn, grad, cot, (q, k, v))
    if impl == "loop":  # the ideal: one SDPA per document, outputs put back in place
        starts = cu.tolist()

        def fn():
            outs = [F.scaled_dot_product_attention(q4[..., a:b, :], k4[..., a:b, :], v4[..., a:b, :], is_causal=True)
                    for a, b in zip(starts, starts[1:])]  # fmt: skip
            return torch.cat(outs, dim=2)

        return call_or_step(fn, grad, cot4, (q, k, v))
    if impl == "dense":  # SDPA with the whole block-diagonal causal mask
        allowed = (ids[:, None] == ids[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        fn = lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed)  # noqa: E731
        return call_or_step(fn, grad, cot4, (q, k, v))
    if impl == "documents":
        mask = documents(ids) & causal()
        fn = lambda: attention(q4, k4, v4, mask=mask)  # noqa: E731
        return call_or_step(fn, grad, cot4, (q, k, v))
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(lambda b, hh, qi, kv: (ids[qi] == ids[kv]) & (qi >= kv), None, None, total, total, device="cpu")
        fn = lambda: flex_attention(q4, k4, v4, block_mask=block_mask)  # noqa: E731
        return call_or_step(fn, grad, cot4, (q, k, v))
    raise ValueError(f"impl: expected varlen, loop, dense, documents or flex, got {impl!r}")


def _mask_mod_call(spec: dict) -> Callable[[], object]:
    """``from_mask_mod`` of a causal document mask (documents of 2048) at ``big`` tokens, forward, float32."""
    total, h, d = spec["big"], 1, 64
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, total, d, generator=gen) for _ in range(3))
    ids = torch.arange(total) // max(1, total // 16)
    mask = from_mask_mod(lambda b, hh, qi, kv: (ids[qi] == ids[kv]) & (qi >= kv))

    def call():
        with torch.no_grad():
            return attention(q, k, v, mask=mask)

    return call


def _times(cfg: dict, say, case: str, dtype: str, mode: str, impls: list[str]) -> dict[str, float]:
    base = {"case": case, "docs": cfg["docs"], "length": cfg["length"], "mixed": cfg["mixed"], "longest": cfg["longest"],
            "dtype": dtype, "mode": mode}  # fmt: skip
    fns = {impl: build({**base, "impl": impl}) for impl in impls}
    t = interleaved(fns, cfg["repeats"])
    say(f"  {case} {dtype} {mode}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items()))
    return t


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    tokens = cfg["docs"] * cfg["length"]
    for dtype in cfg["dtypes"]:
        for mode in ("fwd", "fwdbwd"):
            impls = ["varlen", "loop", "documents", "flex"] + (["dense"] if mode == "fwd" else [])
            t = _times(cfg, say, "equal", dtype, mode, impls)
            dense = f"{t['dense'] / t['varlen']:.1f}" if "dense" in t else ""
            rows.append([f"{cfg['docs']} × {cfg['length']}", dtype, mode, f"{t['loop'] * 1e3:.0f}", f"{t['varlen'] / t['loop']:.2f}",
                         f"{t['documents'] / t['loop']:.2f}", f"{t['flex'] / t['loop']:.2f}", dense])  # fmt: skip
            targets.add(f"varlen, {cfg['docs']} × {cfg['length']}, {dtype}, {mode}: time / per-document SDPA loop ≤ 1.3", t["varlen"] / t["loop"], 1.3)
            targets.add(f"documents & causal, {dtype}, {mode}: time / loop ≤ 1.5", t["documents"] / t["loop"], 1.5)
            targets.add(f"flex_attention with a document BlockMask, {dtype}, {mode}: time / loop ≤ 1.5", t["flex"] / t["loop"], 1.5)
        for mode in ("fwd", "fwdbwd"):
            t = _times(cfg, say, "mixed", dtype, mode, ["varlen", "loop"])
            rows.append([f"mixed 1–{cfg['longest']}, {cfg['mixed']} tokens", dtype, mode, f"{t['loop'] * 1e3:.0f}",
                         f"{t['varlen'] / t['loop']:.2f}", "", "", ""])  # fmt: skip
            targets.add(f"varlen, mixed lengths, {dtype}, {mode}: time / loop ≤ 1.3", t["varlen"] / t["loop"], 1.3)
    lines = ["## Packing: packed documents against a per-document loop", "",
             "### Causal documents, h = 8, d = 64 (times relative to the loop of SDPA over the documents)", ""]  # fmt: skip
    lines += table(["batch", "dtype", "mode", "loop ms", "varlen / loop", "documents mask / loop", "flex BlockMask / loop",
                    "dense-mask SDPA / varlen"], rows) + [""]  # fmt: skip
    if cfg["memory"]:
        base = {"suite": NAME, "case": "equal", "docs": cfg["docs"], "length": cfg["length"], "mixed": cfg["mixed"],
                "longest": cfg["longest"], "dtype": "float32", "mode": "fwd"}  # fmt: skip
        varlen_mem = peak_memory(NAME, {**base, "impl": "varlen"})
        loop_mem = peak_memory(NAME, {**base, "impl": "loop"})
        dense_bytes = tokens * tokens  # the bool (T, T) mask
        extra = max(0, varlen_mem["extra"] - loop_mem["extra"])
        big = peak_memory(NAME, {"suite": NAME, "case": "mask_mod", "big": cfg["big"]})
        out_bytes = cfg["big"] * 64 * 4
        mask_mod_extra = max(0, big["extra"] - out_bytes)
        lines += ["### Memory (forward, float32, fresh process per case)", ""]
        lines += table(["case", "peak above inputs", "against"], [
            [f"varlen, {tokens} tokens", mib(varlen_mem["extra"]), f"loop {mib(loop_mem['extra'])}; dense bool mask {mib(dense_bytes)}"],
            [f"from_mask_mod causal documents, {cfg['big']}²", mib(big["extra"]), f"output {mib(out_bytes)}"],
        ]) + [""]  # fmt: skip
        targets.add(f"varlen, {tokens} tokens: extra memory over the loop ≤ 1/16 of the dense mask", extra / dense_bytes, 1 / 16)
        targets.add(f"from_mask_mod causal documents at {cfg['big']}², forward: peak above inputs and output ≤ 64 MiB",
                    mask_mod_extra / 2**20, 64.0, unit=" MiB")  # fmt: skip
    lines += ["### Targets", ""] + targets.lines()
    return "\n".join(lines)
