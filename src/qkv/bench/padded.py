"""Benchmark suite ``padded``: a padded causal batch through qkv's lazy masks against SDPA with the mask built.

Shape legend: ``b`` batch rows, ``h`` heads, ``L`` tokens a row (padded), ``d`` head size.

A language-model batch of sequences of different lengths, padded to the longest: ``b = 4``
rows of ``L = 1024`` positions holding 1024, 800, 600 and 300 real tokens, ``h = 8``,
``d = 64``, causal. What a user of PyTorch writes: ``F.scaled_dot_product_attention`` with the
``(b, 1, L, L)`` bool mask ``keep & tril`` (SDPA takes no ``is_causal`` with a mask). With
qkv: ``qkv.attention(q, k, v, mask=qkv.masks.lengths(n), causal=True)`` (right padding) or
``mask=qkv.masks.starts(L - n)`` (left padding, what ``generate`` pads), no ``(L, L)``
tensor, each row one call over its own real keys (``backends.segments``). Forward under
``no_grad`` and forward + backward, float32 and bfloat16, timed interleaved; the outputs
are compared first (the padding rows' outputs included: each side's is defined the same).
Target per row: ``≤ 1.0`` (no slower than the mask it replaces).
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

FULL = dict(lengths=(1024, 800, 600, 300), L=1024, h=8, d=64, repeats=7, dtypes=("float32", "bfloat16"))
QUICK = dict(lengths=(64, 40), L=64, h=2, d=16, repeats=1, dtypes=("float32",))


def contenders(cfg: dict, side: str, dtype: torch.dtype, grad: bool) -> dict[str, Callable[[], object]]:
    """``{"qkv": ..., "SDPA": ...}``: one call each (a step with ``grad``), padding on ``side`` ("right" or "left")."""
    L, n = cfg["L"], torch.tensor(cfg["lengths"])
    gen = torch.Generator().manual_seed(0)
    q, k, v, cot = (torch.randn(len(n), cfg["h"], L, cfg["d"], generator=gen).to(dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(grad)
    cols = torch.arange(L)
    keep = cols[None, :] < n[:, None] if side == "right" else cols[None, :] >= (L - n)[:, None]
    dense = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    lazy = lengths(n) if side == "right" else starts(L - n)
    ours = lambda: attention(q, k, v, mask=lazy, causal=True)  # noqa: E731
    theirs = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
    with torch.no_grad():
        a, b = ours(), theirs()
    # a left-padded row's first queries see no key: qkv gives 0 there, SDPA's CPU kernel too
    if not torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2):
        raise AssertionError(f"qkv and SDPA differ by {(a.float() - b.float()).abs().max():.2e}")
    return {"qkv": call_or_step(ours, grad, cot, (q, k, v)), "SDPA": call_or_step(theirs, grad, cot, (q, k, v))}


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    for name in cfg["dtypes"]:
        for side in ("right", "left"):
            for mode in ("fwd", "fwd+bwd"):
                t = interleaved(contenders(cfg, side, getattr(torch, name), mode == "fwd+bwd"), cfg["repeats"], warmup=2)
                ratio = t["qkv"] / t["SDPA"]
                say(f"  {name} {side} padding {mode}: SDPA {t['SDPA'] * 1e3:.1f} ms, qkv / SDPA {ratio:.3f}")
                rows.append([name, side, mode, f"{t['SDPA'] * 1e3:.1f}", f"{t['qkv'] * 1e3:.1f}", f"{ratio:.3f}"])
                targets.add(f"padded causal batch, {side} padding, {name}, {mode}: qkv / SDPA with the dense mask ≤ 1.0",
                            ratio, 1.0)  # fmt: skip
    lines = [
        "## Padded batches: lazy padding masks against SDPA with the mask built (`qkv bench --suite padded`)",
        "",
        f"b = {len(cfg['lengths'])} rows of L = {cfg['L']} positions holding {', '.join(map(str, cfg['lengths']))} real "
        f"tokens, h = {cfg['h']}, d = {cfg['d']}, causal. SDPA gets the `(b, 1, L, L)` bool mask `keep & tril`; qkv "
        "gets `lengths(n)` (right padding) or `starts(L - n)` (left) and `causal=True`. Medians of "
        f"{cfg['repeats']} interleaved rounds.",
        "",
    ]
    lines += table(["dtype", "padding", "mode", "SDPA ms", "qkv ms", "qkv / SDPA"], rows)
    lines += ["", "### Targets", ""] + targets.lines()
    return "\n".join(lines)
