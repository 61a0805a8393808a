"""Benchmark suite ``padded``: a padded causal batch through qkv's lazy masks against SDPA with the mask built.

Shape legend: ``b`` batch rows, ``h`` heads, ``L`` tokens a row (padded), ``d`` head size.

A language-model batch of sequences of different lengths, padded to the longest, ``h = 8``,
``d = 64``, causal: ``b = 4`` rows of ``L = 1024`` positions holding 1024, 800, 600 and 300
real tokens, and ``b = 32`` short rows of ``L = 256`` holding 256 down to 132. What a user of
PyTorch writes: ``F.scaled_dot_product_attention`` with the ``(b, 1, L, L)`` bool mask
``keep & tril`` (SDPA takes no ``is_causal`` with a mask), built in the timed call from the
batch's lengths, as a training step builds it for each batch. With qkv:
``qkv.attention(q, k, v, mask=qkv.masks.lengths(n), causal=True)`` (right padding) or
``mask=qkv.masks.starts(L - n)`` (left padding, what ``generate`` pads), no ``(L, L)``
tensor: each long row one call over its own real keys, short rows in groups whose mask SDPA
takes built (``backends.segments``). Forward under ``no_grad`` and forward + backward,
float32 and bfloat16, timed interleaved; the outputs are compared first (the padding rows'
outputs included: each side's is defined the same). Target per row: ``≤ 1.0`` (no slower
than the mask it replaces).

Then a decoding step over a **static cache** (a cache allocated for its longest request and
filled in place): one query a row, ``b = 4`` rows, 8 query heads on 2 KV heads, a cache of
4096 slots filled to 256 or 1024 tokens a row (a few rows a little short), inference. What a
user of PyTorch writes: SDPA with the ``(b, 1, 1, S)`` bool mask over the whole cache; qkv's
``lengths(n)`` reads the keys up to the longest row only. Target at a quarter filled:
``≤ 0.5`` (the filled part, not the cache, is what a step reads).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..functional import attention
from ..masks import lengths, starts
from .measure import call_or_step, interleaved
from .report import Targets, table

NAME = "padded"
DESCRIPTION = "a padded causal batch: qkv's lazy lengths/starts masks vs SDPA with the dense (b, 1, L, L) mask"

FULL = dict(batches=(("4 rows of 1024", (1024, 800, 600, 300)), ("32 rows of 256", tuple(range(256, 128, -4)))),
            h=8, d=64, repeats=7, dtypes=("float32", "bfloat16"), cache=4096, fills=(256, 1024), step_repeats=200)
QUICK = dict(batches=(("2 rows of 64", (64, 40)),), h=2, d=16, repeats=1, dtypes=("float32",), cache=64, fills=(16,),
             step_repeats=2)
#: A static cache's target: the step's time over SDPA's on the whole cache, where a quarter of the cache is filled.
STATIC_TARGET = 0.5


def contenders(cfg: dict, real: tuple[int, ...], side: str, dtype: torch.dtype,
               grad: bool) -> dict[str, Callable[[], object]]:  # fmt: skip
    """``{"qkv": ..., "SDPA": ...}``: one call each (a step with ``grad``) over rows holding ``real`` tokens,
    padded to the longest on ``side`` ("right" or "left")."""
    L, n = max(real), torch.tensor(real)
    gen = torch.Generator().manual_seed(0)
    q, k, v, cot = (torch.randn(len(n), cfg["h"], L, cfg["d"], generator=gen).to(dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(grad)
    cols, tril = torch.arange(L), torch.ones(L, L, dtype=torch.bool).tril()

    def theirs():  # the mask built from the batch's lengths, as a training step does for each batch
        keep = cols[None, :] < n[:, None] if side == "right" else cols[None, :] >= (L - n)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] & tril)

    def ours():
        return attention(q, k, v, mask=lengths(n) if side == "right" else starts(L - n), causal=True)

    with torch.no_grad():
        a, b = ours(), theirs()
    # a left-padded row's first queries see no key: qkv gives 0 there, SDPA's CPU kernel too
    if not torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2):
        raise AssertionError(f"qkv and SDPA differ by {(a.float() - b.float()).abs().max():.2e}")
    return {"qkv": call_or_step(ours, grad, cot, (q, k, v)), "SDPA": call_or_step(theirs, grad, cot, (q, k, v))}


def static_cache(cfg: dict, fill: int) -> dict[str, Callable[[], object]]:
    """``{"qkv": ..., "SDPA": ...}``: one decoding step each over a cache of ``cfg["cache"]`` slots filled to about
    ``fill`` tokens a row (the unfilled slots hold whatever was there: random here)."""
    gen = torch.Generator().manual_seed(1)
    S, d, h = cfg["cache"], cfg["d"], cfg["h"]
    n = torch.tensor([fill - 10, fill, fill - 50, fill]).clamp(min=1)
    q = torch.randn(len(n), h, 1, d, generator=gen)
    k, v = (torch.randn(len(n), max(1, h // 4), S, d, generator=gen) for _ in range(2))
    keep = (torch.arange(S)[None, :] < n[:, None])[:, None, None, :]
    mask = lengths(n)

    def theirs():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    def ours():
        return attention(q, k, v, mask=mask, causal=True)

    with torch.no_grad():
        a, b = ours(), theirs()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"qkv and SDPA differ by {(a - b).abs().max():.2e}")
    return {"qkv": call_or_step(ours, False, None, ()), "SDPA": call_or_step(theirs, False, None, ())}


def _static_part(cfg: dict, say: Callable[[str], None], targets: Targets) -> list[str]:
    rows = []
    for fill in cfg["fills"]:
        t = interleaved(static_cache(cfg, fill), cfg["step_repeats"], warmup=5)
        ratio = t["qkv"] / t["SDPA"]
        say(f"  static cache of {cfg['cache']}, filled to {fill}: SDPA {t['SDPA'] * 1e3:.3f} ms, qkv / SDPA {ratio:.3f}")
        rows.append([str(cfg["cache"]), str(fill), f"{t['SDPA'] * 1e3:.3f}", f"{t['qkv'] * 1e3:.3f}", f"{ratio:.3f}"])
        if fill * 4 == cfg["cache"]:
            targets.add(f"decoding step, static cache of {cfg['cache']} filled to {fill}: qkv / SDPA over the whole "
                        f"cache ≤ {STATIC_TARGET}", ratio, STATIC_TARGET)  # fmt: skip
    lines = ["", f"A decoding step over a static cache (b = 4, {cfg['h']} heads on {max(1, cfg['h'] // 4)}, float32, "
             "inference): SDPA with the `(b, 1, 1, S)` bool mask over the whole cache, qkv with `lengths(n)`; "
             f"medians of {cfg['step_repeats']} interleaved calls.", ""]  # fmt: skip
    return lines + table(["cache slots", "filled to", "SDPA ms", "qkv ms", "qkv / SDPA"], rows)


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    for batch, real in cfg["batches"]:
        for name in cfg["dtypes"]:
            for side in ("right", "left"):
                for mode in ("fwd", "fwd+bwd"):
                    fns = contenders(cfg, real, side, getattr(torch, name), mode == "fwd+bwd")
                    t = interleaved(fns, cfg["repeats"], warmup=2)
                    ratio = t["qkv"] / t["SDPA"]
                    say(f"  {batch}, {name}, {side} padding, {mode}: SDPA {t['SDPA'] * 1e3:.1f} ms, qkv / SDPA {ratio:.3f}")
                    rows.append([batch, name, side, mode, f"{t['SDPA'] * 1e3:.1f}", f"{t['qkv'] * 1e3:.1f}", f"{ratio:.3f}"])
                    targets.add(f"padded causal batch, {batch}, {side} padding, {name}, {mode}: qkv / SDPA with the "
                                "dense mask ≤ 1.0", ratio, 1.0)  # fmt: skip
    lines = [
        "## Padded batches: lazy padding masks against SDPA with the mask built (`qkv bench --suite padded`)",
        "",
        "; ".join(f"{batch}: {real[0]} down to {real[-1]} real tokens" for batch, real in cfg["batches"])
        + f"; h = {cfg['h']}, d = {cfg['d']}, causal. SDPA gets the `(b, 1, L, L)` bool mask `keep & tril`, "
        "built from the lengths in each call; qkv gets `lengths(n)` (right padding) or `starts(L - n)` (left) "
        f"and `causal=True`. Medians of {cfg['repeats']} interleaved rounds.",
        "",
    ]
    lines += table(["batch", "dtype", "padding", "mode", "SDPA ms", "qkv ms", "qkv / SDPA"], rows)
    lines += _static_part(cfg, say, targets)
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
