"""Benchmark suite ``engine``: the backends against what a user would call instead.

Shape legend: ``b`` batch, ``h`` heads, ``i = j`` sequence length, ``d = e`` head size,
``n`` the additive score's hidden size. float32 (bfloat16 in the bf16 part), batch 1,
inputs drawn from a seeded generator.

Cases (each timed forward, under ``no_grad``, and forward + backward):

* **dot** — dot, scaled dot and bilinear scores, ``h = 8, d = 64``, ``i = 1024, 4096``,
  against ``F.scaled_dot_product_attention`` (on ``q W`` for the bilinear score).
* **bias** — ALiBi and T5 relative-position buckets, ``i = 4096, h = 8, d = 64``, against
  SDPA without a bias (the target's yardstick), SDPA with the dense ``(h, i, j)`` bias
  (what a user does today), ``flex_attention`` compiled with the bias as a ``score_mod``
  (forward only: it has no CPU backward) and the materialised reference backend.
* **window** — a 256-key sliding window, ``i = 16384, h = 4``, against SDPA with the
  window as a dense bool mask (full cost) and SDPA with ``is_causal``.
* **bf16** — the dot (scaled, the longest ``i``), bias (ALiBi, T5; forward + backward) and
  window cases on bfloat16 inputs, against ``F.scaled_dot_product_attention`` on the same
  bfloat16 inputs, with the float32 time of the same qkv call beside them.
* **additive** — ``vᵀ tanh(W_q q + W_k k)``, ``n = 128, h = 1``, ``i = 2048``, chunked
  against the materialised path; ``i = 8192`` chunked alone, for its peak memory.
* **layouts** — ALiBi, causal, ``i = 4096``, forward + backward, on inputs without a batch
  dim ``(h, i, d)``, with an extra leading dim ``(x, b, h, i, d)`` and without a head axis
  ``(i, d)``, each against the same call on its ``(b, h, i, d)`` equivalent: every layout is
  reshaped once to ``(b, h, i, d)``, so each must run the same engine at the same speed.

Peak memory of the chosen cases is measured in a fresh process each (``measure``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .. import positional, scores
from ..functional import attention
from ..masks import Tile, window
from .measure import call_or_step, interleaved, mib, peak_memory
from .report import Targets, table

NAME = "engine"
DESCRIPTION = "backends (sdpa, chunked, local) vs F.scaled_dot_product_attention, flex_attention, materialised"

#: Sizes and repeats of the full run and of --quick.
#: The dot-family lines compare one kernel call with the same call (their targets sit 5% from
#: 1.0), so they take more rounds: on the shared benchmark machine a median of 5 rounds at
#: i = 1024 and of 3 at 4096 moved by up to 0.2 between runs of unchanged code.
FULL = dict(dot=(1024, 4096), bias=4096, window=16384, window_heads=4, additive=2048, additive_big=8192,
            repeats=15, big_repeats=3, dot_repeats=7, bias_repeats=7, flex=True, memory=True)  # fmt: skip
#: --quick: a smoke run of every case (tiny sizes, one repeat, one memory subprocess).
QUICK = dict(dot=(64,), bias=128, window=640, window_heads=1, additive=64, additive_big=128,
             repeats=1, big_repeats=1, dot_repeats=1, bias_repeats=1, flex=False, memory=False)  # fmt: skip


def _inputs(spec: dict, grad: bool):
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    h, i, d = spec["h"], spec["i"], spec.get("d", 64)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    q, k, v = (torch.randn(1, h, i, d, generator=gen).to(dtype) for _ in range(3))
    if grad:
        for x in (q, k, v):
            x.requires_grad_()
    return q, k, v, torch.randn(1, h, i, d, generator=gen).to(dtype)


def _flex(bias, i: int):
    """``flex_attention`` compiled, with the bias as a score_mod reading an ``(h, 2i - 1)`` table by offset."""
    from torch.nn.attention.flex_attention import flex_attention

    with torch.no_grad():  # offsets -(i-1) .. i-1 along one row (see qkv.backends.tiling.tiles)
        table = bias.tile(Tile(0, 1, 0, 2 * i - 1, 1, i))[:, 0, :].float()  # ALiBi's tiles are float64

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + i - 1]

    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod)


def build(spec: dict) -> Callable[[], object]:
    """One call of one contender (see the module docstring); ``spec`` is JSON-able."""
    grad = spec["mode"] == "fwdbwd"
    q, k, v, cot = _inputs(spec, grad)
    case, impl, i = spec["case"], spec["impl"], spec["i"]
    torch.manual_seed(0)
    if case == "dot":
        score = scores.Bilinear(q.shape[-1]) if spec["score"] == "general" else spec["score"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if spec["score"] == "scaled_dot" else 1.0
        if impl == "qkv":
            fn = lambda: attention(q, k, v, score=score, scale=scale)  # noqa: E731
        elif impl == "qkv_float32":  # the same call on float32 copies: what bf16 gains
            q32, k32, v32 = (x.detach().float().requires_grad_(grad) for x in (q, k, v))
            q, k, v, cot = q32, k32, v32, cot.float()
            fn = lambda: attention(q, k, v, score=score, scale=scale)  # noqa: E731
        else:
            fn = lambda: F.scaled_dot_product_attention(q @ score.weight if spec["score"] == "general" else q, k, v, scale=scale)  # noqa: E731
    elif case == "bias":
        bias = positional.ALiBi(spec["h"]) if spec["bias"] == "alibi" else positional.RelativePositionBias(spec["h"], 32, 128)
        bias = bias.to(q.dtype)
        if impl == "qkv":
            fn = lambda: attention(q, k, v, bias=bias)  # noqa: E731
        elif impl == "qkv_float32":  # the same call on float32 copies: what bf16 gains
            q32, k32, v32 = (x.detach().float().requires_grad_(grad) for x in (q, k, v))
            q, k, v, cot, bias32 = q32, k32, v32, cot.float(), bias.float()
            fn = lambda: attention(q, k, v, bias=bias32)  # noqa: E731
        elif impl == "sdpa_no_bias":
            fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        elif impl == "sdpa_dense_bias":
            # ALiBi is a constant: built once (its tiles are float64: cast to the logits' dtype)
            fixed = bias.dense(i, i).detach().to(q.dtype) if spec["bias"] == "alibi" else None
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fixed if fixed is not None else bias.dense(i, i))  # noqa: E731
        elif impl == "flex":
            flex = _flex(bias, i)
            fn = lambda: flex(q, k, v)  # noqa: E731
        else:
            fn = lambda: attention(q, k, v, bias=bias, backend="reference")  # noqa: E731
    elif case == "window":
        mask = window(spec["window"])
        if impl == "qkv":
            fn = lambda: attention(q, k, v, mask=mask)  # noqa: E731
        elif impl == "qkv_float32":  # the same call on float32 copies: what bf16 gains
            q32, k32, v32 = (x.detach().float().requires_grad_(grad) for x in (q, k, v))
            q, k, v, cot = q32, k32, v32, cot.float()
            fn = lambda: attention(q, k, v, mask=mask)  # noqa: E731
        elif impl == "sdpa_dense_mask":
            dense = mask.dense(i, i)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
        else:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif case == "layout":
        q, k, v, cot = _layout(spec["layout"], q, k, v, cot)
        bias = positional.ALiBi(q.shape[-3] if q.dim() > 2 else 1)
        fn = lambda: attention(q, k, v, bias=bias, causal=True)  # noqa: E731
    elif case == "additive":
        score = scores.Additive(q.shape[-1], q.shape[-1], spec["hidden"])
        backend = "chunked" if impl == "qkv" else "reference"
        fn = lambda: attention(q, k, v, score=score, backend=backend)  # noqa: E731
    else:
        raise ValueError(f"case: expected dot, bias, window, layout or additive, got {case!r}")
    return call_or_step(fn, grad, cot, (q, k, v))


#: The layouts of the layouts part: each as its (b, h, i, d) equivalent sees it.
LAYOUTS = {"(b, h, i, d)": "b h i d", "(h, i, d)": "h i d", "(x, b, h, i, d)": "x b h i d",
           "(b, h, i, d), h = 1": "b 1 i d", "(i, d)": "i d"}  # fmt: skip


def _layout(layout: str, *tensors):
    """``(1, h, i, d)`` inputs (and cotangent) in ``layout``: leaves of their own, so each call differentiates them."""
    grad = tensors[0].requires_grad

    def cut(x):
        x = x.detach()
        x = {"b h i d": x, "h i d": x[0], "x b h i d": x[None], "b 1 i d": x[:, :1], "i d": x[0, 0]}[layout]
        return x.contiguous().requires_grad_(grad)

    q, k, v = (cut(x) for x in tensors[:3])
    cot = {"b h i d": tensors[3], "h i d": tensors[3][0], "x b h i d": tensors[3][None], "b 1 i d": tensors[3][:, :1],
           "i d": tensors[3][0, 0]}[layout].contiguous()  # fmt: skip
    return q, k, v, cot


def _time(say, label: str, base: dict, impls: list[str], repeats: int) -> dict[str, float]:
    fns = {impl: build({**base, "impl": impl}) for impl in impls}
    result = interleaved(fns, repeats)
    say(f"  {label}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in result.items()))
    return result


def _extra(extra: float, bias_bytes: int) -> str:
    if extra != extra:  # nan: not measured
        return "not measured (quick)"
    return f"{mib(extra)} above SDPA without bias ({100 * extra / bias_bytes:.1f}% of the {mib(bias_bytes)} bias)"


def _dot(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    rows = []
    for i in cfg["dot"]:
        reps = cfg["repeats"] if i <= 1024 else cfg["dot_repeats"]
        for score in ("dot", "scaled_dot", "general"):
            for mode in ("fwd", "fwdbwd"):
                base = {"case": "dot", "score": score, "i": i, "h": 8, "mode": mode}
                t = _time(say, f"dot {score} i={i} {mode}", base, ["qkv", "sdpa"], reps)
                ratio = t["qkv"] / t["sdpa"]
                rows.append([score, i, mode, f"{t['qkv'] * 1e3:.1f}", f"{t['sdpa'] * 1e3:.1f}", f"{ratio:.3f}"])
                if i in (1024, 4096):
                    targets.add(f"dot family ({score}), i = {i}, {mode}: time / SDPA ≤ 1.05", ratio, 1.05)
    parts = ["### Dot-family scores (h = 8, d = 64, b = 1)", ""]
    return parts + table(["score", "i", "mode", "qkv ms", "SDPA ms", "qkv / SDPA"], rows) + [""]


def _bias(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    i = cfg["bias"]
    rows = []
    bias_bytes = 8 * i * i * 4
    for bias in ("alibi", "t5"):
        base = {"case": "bias", "bias": bias, "i": i, "h": 8}
        fwd_impls = ["qkv", "sdpa_no_bias", "sdpa_dense_bias", "reference"] + (["flex"] if cfg["flex"] else [])
        # more rounds than the other large cases: these targets sit near their limits, and a
        # median of 3 moved by ±0.15 (fwd+bwd) and ±0.4 (flex / qkv) between runs
        t = _time(say, f"bias {bias} fwd", {**base, "mode": "fwd"}, fwd_impls, cfg["bias_repeats"])
        tb = _time(say, f"bias {bias} fwdbwd", {**base, "mode": "fwdbwd"}, ["qkv", "sdpa_no_bias", "sdpa_dense_bias"],
                   cfg["bias_repeats"])  # fmt: skip
        extra = float("nan")
        if cfg["memory"]:
            mem_q = peak_memory(NAME, {**base, "mode": "fwdbwd", "impl": "qkv"})
            mem_s = peak_memory(NAME, {**base, "mode": "fwdbwd", "impl": "sdpa_no_bias"})
            extra = mem_q["peak"] - mem_s["peak"]
        flex_ratio = t["flex"] / t["qkv"] if "flex" in t else float("nan")
        rows.append([bias, "fwd", f"{t['qkv'] * 1e3:.0f}", f"{t['qkv'] / t['sdpa_no_bias']:.2f}", f"{t['qkv'] / t['sdpa_dense_bias']:.2f}",
                     f"{flex_ratio:.2f}" if "flex" in t else "not run (quick)", f"{t['qkv'] / t['reference']:.2f}", ""])  # fmt: skip
        rows.append([bias, "fwd+bwd", f"{tb['qkv'] * 1e3:.0f}", f"{tb['qkv'] / tb['sdpa_no_bias']:.2f}", f"{tb['qkv'] / tb['sdpa_dense_bias']:.2f}",
                     "no CPU backward", "", _extra(extra, bias_bytes)])  # fmt: skip
        targets.add(f"{bias}, i = {i}, fwd+bwd: time / SDPA without bias ≤ 1.3", tb["qkv"] / tb["sdpa_no_bias"], 1.3)
        if cfg["memory"]:
            targets.add(f"{bias}, i = {i}: peak memory above unbiased SDPA ≤ 10% of the (h, i, j) bias", 100 * extra / bias_bytes, 10.0, unit="%")
        if "flex" in t:
            targets.add(f"{bias}, i = {i}, fwd: compiled flex_attention time / qkv ≥ 2", flex_ratio, 2.0, higher=True)
    parts = [f"### Positional biases (i = j = {i}, h = 8, d = 64, b = 1)", ""]
    return parts + table(["bias", "mode", "qkv ms", "/ SDPA no bias", "/ SDPA dense bias", "flex (compiled) / qkv",
                          "/ materialised", "peak memory (fwd+bwd)"], rows) + [""]  # fmt: skip


def _window(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    i, hw = cfg["window"], cfg["window_heads"]
    rows = []
    for mode in ("fwd", "fwdbwd"):
        base = {"case": "window", "window": 256, "i": i, "h": hw, "mode": mode}
        t = _time(say, f"window i={i} {mode}", base, ["qkv", "sdpa_dense_mask", "sdpa_causal"], cfg["big_repeats"])
        speedup = t["sdpa_dense_mask"] / t["qkv"]
        rows.append([mode, f"{t['qkv'] * 1e3:.0f}", f"{speedup:.1f}", f"{t['sdpa_causal'] / t['qkv']:.1f}"])
        targets.add(f"window 256, i = {i}, {mode}: full SDPA time / qkv ≥ 10", speedup, 10.0, higher=True)
    parts = [f"### Sliding window 256 (i = j = {i}, h = {hw}, d = 64, b = 1; `local` backend)", ""]
    return parts + table(["mode", "qkv ms", "SDPA with the dense window mask / qkv", "SDPA is_causal / qkv"], rows) + [""]


def _additive(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    i = cfg["additive"]
    rows = []
    base = {"case": "additive", "hidden": 128, "i": i, "h": 1}
    for mode in ("fwd", "fwdbwd"):
        t = _time(say, f"additive i={i} {mode}", {**base, "mode": mode}, ["qkv", "materialised"], cfg["big_repeats"])
        rows.append([i, mode, f"{t['qkv'] * 1e3:.0f}", f"{t['qkv'] / t['materialised']:.2f}", ""])
        targets.add(f"additive, i = {i}, {mode}: time / materialised ≤ 1.0", t["qkv"] / t["materialised"], 1.0)
    if cfg["memory"]:
        mem_q = peak_memory(NAME, {**base, "mode": "fwdbwd", "impl": "qkv"})
        mem_m = peak_memory(NAME, {**base, "mode": "fwdbwd", "impl": "materialised"})
        frac = mem_q["extra"] / max(1, mem_m["extra"])
        rows.append([i, "fwd+bwd memory", "", "", f"{mib(mem_q['extra'])} vs {mib(mem_m['extra'])} materialised ({frac:.3f}×)"])
        targets.add(f"additive, i = {i}: peak memory (above inputs) / materialised ≤ 1/8", frac, 1 / 8)
    big = cfg["additive_big"]
    mem_big = peak_memory(NAME, {**base, "i": big, "mode": "fwdbwd", "impl": "qkv"})
    rows.append([big, "fwd+bwd memory", "", "", f"peak RSS {mib(mem_big['peak'])} (whole process)"])
    targets.add(f"additive, i = {big}, fwd+bwd: whole-process peak RSS ≤ 2 GiB", mem_big["peak"] / 2**30, 2.0, unit=" GiB")
    parts = ["### Additive score (n = 128, h = 1, d = 64, b = 1; `chunked` backend)", ""]
    return parts + table(["i", "mode", "qkv ms", "qkv / materialised", "memory"], rows) + [""]


def _bf16(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    """The dot, bias and window cases in bfloat16, against PyTorch's SDPA in bfloat16.

    "qkv float32 / bf16" is the same qkv call on float32 copies of the inputs, timed in the
    same rounds: how much bfloat16 gains on this CPU (on CPUs with AMX it is several times).
    """
    rows = []
    i = cfg["dot"][-1]
    for mode in ("fwd", "fwdbwd"):
        base = {"case": "dot", "score": "scaled_dot", "i": i, "h": 8, "mode": mode, "dtype": "bfloat16"}
        t = _time(say, f"bf16 dot i={i} {mode}", base, ["qkv", "sdpa", "qkv_float32"], cfg["dot_repeats"])
        rows.append([f"dot (scaled), i = {i}", mode, f"{t['qkv'] * 1e3:.0f}", "SDPA", f"{t['qkv'] / t['sdpa']:.2f}",
                     f"{t['qkv_float32'] / t['qkv']:.2f}"])  # fmt: skip
        targets.add(f"bf16 dot, i = {i}, {mode}: time / bf16 SDPA ≤ 1.05", t["qkv"] / t["sdpa"], 1.05)
    i = cfg["bias"]
    for bias in ("alibi", "t5"):
        base = {"case": "bias", "bias": bias, "i": i, "h": 8, "mode": "fwdbwd", "dtype": "bfloat16"}
        t = _time(say, f"bf16 bias {bias} fwdbwd", base, ["qkv", "sdpa_no_bias", "qkv_float32"], cfg["big_repeats"])
        ratio = t["qkv"] / t["sdpa_no_bias"]
        rows.append([f"{bias}, i = {i}", "fwd+bwd", f"{t['qkv'] * 1e3:.0f}", "SDPA without bias", f"{ratio:.2f}",
                     f"{t['qkv_float32'] / t['qkv']:.2f}"])  # fmt: skip
        targets.add(f"bf16 {bias}, i = {i}, fwd+bwd: time / bf16 SDPA without bias ≤ 1.3", ratio, 1.3)
    i, hw = cfg["window"], cfg["window_heads"]
    for mode in ("fwd", "fwdbwd"):
        base = {"case": "window", "window": 256, "i": i, "h": hw, "mode": mode, "dtype": "bfloat16"}
        t = _time(say, f"bf16 window i={i} {mode}", base, ["qkv", "sdpa_dense_mask", "sdpa_causal", "qkv_float32"],
                  cfg["big_repeats"])  # fmt: skip
        speedup = t["sdpa_dense_mask"] / t["qkv"]
        rows.append([f"window 256, i = {i}, h = {hw}", mode, f"{t['qkv'] * 1e3:.0f}", "SDPA with the dense mask",
                     f"{1 / speedup:.3f}", f"{t['qkv_float32'] / t['qkv']:.2f}"])  # fmt: skip
        rows.append([f"window 256, i = {i}, h = {hw}", mode, "", "SDPA is_causal (the whole lower triangle)",
                     f"{t['qkv'] / t['sdpa_causal']:.3f}", ""])  # fmt: skip
        targets.add(f"bf16 window 256, i = {i}, {mode}: full bf16 SDPA time / qkv ≥ 10", speedup, 10.0, higher=True)
    parts = ["### bfloat16 (b = 1, d = 64; errors within 2× of bf16 SDPA's, tested)", ""]
    header = ["case", "mode", "qkv ms", "bf16 yardstick", "qkv / yardstick", "qkv float32 / bf16"]
    return parts + table(header, rows) + [""]


def _layouts(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    """ALiBi, causal, forward + backward in every input layout against its ``(b, h, i, d)`` equivalent."""
    i = cfg["bias"]
    fns = {}
    for name, layout in LAYOUTS.items():
        fns[name] = build({"case": "layout", "impl": "qkv", "layout": layout, "i": i, "h": 8, "mode": "fwdbwd"})
    t = interleaved(fns, cfg["bias_repeats"])
    say("  layouts: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items()))
    rows = []
    for name, base in (("(h, i, d)", "(b, h, i, d)"), ("(x, b, h, i, d)", "(b, h, i, d)"), ("(i, d)", "(b, h, i, d), h = 1")):
        ratio = t[name] / t[base]
        rows.append([name, base, f"{t[name] * 1e3:.0f}", f"{t[base] * 1e3:.0f}", f"{ratio:.3f}"])
        targets.add(f"ALiBi causal, i = {i}, fwd+bwd, {name} inputs: time / {base} ≤ 1.15", ratio, 1.15)
    parts = [f"### Input layouts (ALiBi, causal, i = j = {i}, h = 8, d = 64, fwd+bwd)", ""]
    return parts + table(["layout", "against", "ms", "equivalent ms", "ratio"], rows) + [""]


#: The parts of this suite, each also registered alone as ``engine-NAME`` (see ``qkv.bench``).
PARTS = {"dot": _dot, "bias": _bias, "window": _window, "additive": _additive, "bf16": _bf16, "layouts": _layouts}


def section(quick: bool, say: Callable[[str], None], parts: tuple[str, ...] | None = None) -> str:
    """The markdown section of the chosen ``parts`` (default all), with its targets."""
    cfg = QUICK if quick else FULL
    targets = Targets()
    names = tuple(PARTS) if parts is None else parts
    title = "Engine: backends against PyTorch" + ("" if parts is None else f" ({', '.join(names)})")
    lines = [f"## {title}", ""]
    for name in names:
        lines += PARTS[name](cfg, say, targets)
    lines += ["### Targets", ""] + targets.lines()
    return "\n".join(lines)
