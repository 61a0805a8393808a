"""Benchmark suite ``sdpa``: ``qkv.scaled_dot_product_attention`` against ``F.scaled_dot_product_attention``, call for call.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``L`` queries, ``S`` keys,
``d`` head size.

The drop-in takes PyTorch's arguments and gives PyTorch's results (``qkv.torch_sdpa``); code
moves over by changing an import, so the user's alternative is the call they had. Each row
is one such call made both ways with the same tensors, timed interleaved
(:func:`qkv.bench.measure.interleaved`), forward under ``no_grad`` and forward + backward:

* no mask; ``is_causal`` on a square; ``is_causal`` with grouped heads (``enable_gqa``);
  ``is_causal`` with fewer queries than keys (PyTorch aligns it top-left);
* a bool key-padding mask ``(b, 1, 1, S)`` (right padding: the rows keep 70% to all of
  the keys), the same shape with scattered keys, a dense bool mask ``(b, 1, L, S)`` and a
  float mask ``(b, 1, L, S)`` added to the scores;
* decoding steps (one query, forward only: inference) with grouped heads: SmolLM2's 9
  heads on 3 over 64 keys, with and without a left-padding mask, and 8 heads on 2 over
  1024 keys.

The outputs are compared before timing (float32: within 1e-5). Target per row: the drop-in
no slower than the call it replaces, read as ``≤ 1.05``: medians of interleaved rounds on a
shared machine move by a few percent between runs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..torch_sdpa import scaled_dot_product_attention
from .measure import call_or_step, interleaved
from .report import Targets, table

NAME = "sdpa"
DESCRIPTION = "qkv.scaled_dot_product_attention against F.scaled_dot_product_attention: the same calls side by side"

FULL = dict(b=2, h=8, g=2, L=1024, d=64, repeats=15)
QUICK = dict(b=1, h=2, g=1, L=64, d=16, repeats=1)
#: How much slower than the call it replaces the drop-in may measure: the noise of the medians.
TOLERANCE = 1.05


def cases(cfg: dict) -> dict[str, tuple[dict, dict]]:
    """``{name: (shapes, keywords)}``: the keys' length and KV heads of each call, and its SDPA keywords."""
    b, L = cfg["b"], cfg["L"]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(0.7 * L, L, b).long()  # right padding: each row's keys a prefix, 70% to all
    padding = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
    scattered = torch.rand(b, 1, 1, L, generator=gen) > 0.25
    scattered[..., 0] = True
    dense = torch.rand(b, 1, L, L, generator=gen) > 0.3
    additive = torch.randn(b, 1, L, L, generator=gen) * 0.5
    return {
        "no mask": ({}, {}),
        "is_causal": ({}, {"is_causal": True}),
        "is_causal, grouped heads": ({"g": cfg["g"]}, {"is_causal": True, "enable_gqa": True}),
        "is_causal, S = 2L (top-left)": ({"S": 2 * L}, {"is_causal": True}),
        "bool padding (b, 1, 1, S)": ({}, {"attn_mask": padding}),
        "bool (b, 1, 1, S), scattered": ({}, {"attn_mask": scattered}),
        "bool (b, 1, L, S)": ({}, {"attn_mask": dense}),
        "float (b, 1, L, S)": ({}, {"attn_mask": additive}),
        # a decoding step (one query) with grouped heads: the kernel's one-row problems (enable_gqa) or rows of a
        # KV head, whichever this CPU runs faster (qkv.backends.grouped_rows); each call tens of µs, so more rounds
        "decoding step, 9 heads on 3, S = 64": ({"L": 1, "h": 9, "g": 3, "S": 64, "rounds": 20}, {"enable_gqa": True}),
        "decoding step, 9 heads on 3, S = 64, bool padding": (
            {"L": 1, "h": 9, "g": 3, "S": 64, "rounds": 20}, {"enable_gqa": True, "attn_mask": step_padding(b, 64)}),
        "decoding step, 8 heads on 2, S = 1024": ({"L": 1, "h": 8, "g": 2, "S": 1024, "rounds": 5}, {"enable_gqa": True}),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 1e-3 else f"{seconds * 1e3:.3f}"


def step_padding(b: int, S: int) -> torch.Tensor:
    """A decoding step's left padding ``(b, 1, 1, S)``: row ``r`` of ``b`` starts ``r · S / (4b)`` keys in."""
    starts = torch.arange(b) * S // (4 * b)
    return (torch.arange(S)[None, :] >= starts[:, None])[:, None, None, :]


def _inputs(cfg: dict, shapes: dict, grad: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    b, d = cfg["b"], cfg["d"]
    h, L = shapes.get("h", cfg["h"]), shapes.get("L", cfg["L"])
    g, S = shapes.get("g", h), shapes.get("S", L)
    q = torch.randn(b, h, L, d, generator=gen)
    k, v = torch.randn(b, g, S, d, generator=gen), torch.randn(b, g, S, d, generator=gen)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _times(cfg: dict, shapes: dict, kw: dict, grad: bool) -> dict[str, float]:
    q, k, v = _inputs(cfg, shapes, grad)
    with torch.no_grad():
        want, got = F.scaled_dot_product_attention(q, k, v, **kw), scaled_dot_product_attention(q, k, v, **kw)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"the drop-in differs from F.scaled_dot_product_attention by {(got - want).abs().max():.2e}")
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    fns: dict[str, Callable[[], object]] = {
        "qkv": call_or_step(lambda: scaled_dot_product_attention(q, k, v, **kw), grad, cot, (q, k, v)),
        "SDPA": call_or_step(lambda: F.scaled_dot_product_attention(q, k, v, **kw), grad, cot, (q, k, v)),
    }
    return interleaved(fns, cfg["repeats"] * shapes.get("rounds", 1), warmup=2)


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for name, (shapes, kw) in cases(cfg).items():
            if mode == "fwd+bwd" and shapes.get("L") == 1:
                continue  # a decoding step is inference
            t = _times(cfg, shapes, kw, grad=mode == "fwd+bwd")
            ratio = t["qkv"] / t["SDPA"]
            say(f"  {mode} {name}: SDPA {_ms(t['SDPA'])} ms, drop-in / SDPA {ratio:.3f}")
            rows.append([name, mode, _ms(t["SDPA"]), _ms(t["qkv"]), f"{ratio:.3f}"])
            targets.add(f"{name}, {mode}: qkv.scaled_dot_product_attention / F.scaled_dot_product_attention ≤ {TOLERANCE}",
                        ratio, TOLERANCE)  # fmt: skip
    b, h, g, L, d = (cfg[x] for x in ("b", "h", "g", "L", "d"))
    lines = [
        "## SDPA's dialect: the drop-in against the call it replaces (`qkv bench --suite sdpa`)",
        "",
        f"b = {b}, h = {h} (grouped: {g} KV heads), L = S = {L} unless named, d = {d}, float32; the same "
        f"tensors both ways, outputs compared first; medians of {cfg['repeats']} interleaved rounds (decoding steps: "
        "20× as many, 5× at 1024 keys). "
        f"Target: ≤ {TOLERANCE} (no slower, within the medians' noise).",
        "",
    ]
    lines += table(["call", "mode", "SDPA ms", "drop-in ms", "drop-in / SDPA"], rows)
    lines += ["", "A decoding step's call takes tens of µs, so what the drop-in adds in Python shows: PyTorch's argument "
              "checks (its own run in C++), a bool `attn_mask` read afresh at every call as SDPA reads it, and the "
              "output checked for values a hidden key could have brought (a nan in a cache's unfilled slot). Over "
              "longer keys its grouped heads run as query rows of their KV head where this CPU runs that faster "
              "(timed once per size class)."]
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
