"""Benchmark suite ``mechanisms``: score modifiers against what a user would run instead.

Shape legend: ``b`` batch, ``h`` heads, ``i = j`` sequence length, ``d = e`` head size.
``i = 4096, h = 8, d = 64``, batch 1, causal, float32 and bfloat16, inputs from a seeded
generator.

Two modifiers (``score_mod=``), each timed forward (under ``no_grad``) and forward + backward:

* **soft-cap** — Gemma 2's ``50 · tanh(s / 50)``, as ``qkv.SoftCap(50)``;
* **sine** — an arbitrary modifier, ``s + 0.1 · sin(q_idx - kv_idx)``, run through autograd.

Memory targets: the soft cap's peak above SDPA within 10% of one ``(h, i, j)`` float32
tensor; the arbitrary modifier's "bounded by a tile", checked by its growth from ``i/2`` to
``i`` (what holds ``(i, j)``-sized state quadruples, what holds tiles and ``O(i·d)``
accumulators at most doubles).

Contenders: ``F.scaled_dot_product_attention`` with ``is_causal`` and no modifier (the
yardstick), ``flex_attention`` compiled with the same modifier and a causal block mask
(forward only: it raises ``NotImplementedError`` for a backward on CPU, which the suite
checks rather than assumes), and the materialised path a user writes (logits, modifier,
mask, softmax, ``@ v`` in plain PyTorch). A last line measures the floor of any eager tile
loop: the seven batched matmuls of the engine's tiles alone (two forward, five backward),
against SDPA. Peak memory is measured per case in a fresh process (``measure``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..backends.engines import mod_tiles
from ..backends.tiling import threads, tile_math
from ..functional import attention
from ..masks import Tile
from ..score_mods import SoftCap, apply
from .measure import call_or_step, interleaved, mib, peak_memory
from .report import Targets, table

NAME = "mechanisms"
DESCRIPTION = "score modifiers (soft-cap, an arbitrary score_mod) vs SDPA, compiled flex_attention, materialised"

#: Sizes and repeats of the full run and of --quick.
FULL = dict(i=4096, h=8, repeats=3, flex=True, memory=True)
#: --quick: a smoke run of every case (tiny sizes, one repeat, no compilation, no subprocesses).
QUICK = dict(i=256, h=2, repeats=1, flex=False, memory=False)
DTYPES = ("float32", "bfloat16")
#: Gemma 2's attention soft cap.
CAP = 50.0


def sine(score, b, h, q_idx, kv_idx):
    """The arbitrary modifier of the issue: ``score + 0.1 · sin(q_idx - kv_idx)``."""
    return score + 0.1 * torch.sin((q_idx - kv_idx).to(score.dtype))


def softcap_mod(score, b, h, q_idx, kv_idx):
    """Soft-capping written as a user would for ``flex_attention`` and the materialised path."""
    return CAP * torch.tanh(score / CAP)


MODS = {"softcap": (SoftCap(CAP), softcap_mod), "sine": (sine, sine)}


def _inputs(spec: dict, grad: bool):
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    dtype = getattr(torch, spec["dtype"])
    h, i = spec["h"], spec["i"]
    q, k, v, cot = (torch.randn(1, h, i, 64, generator=gen).to(dtype) for _ in range(4))
    if grad:
        for x in (q, k, v):
            x.requires_grad_()
    return q, k, v, cot


def _flex(mod, i: int):
    """``flex_attention`` compiled, with ``mod`` and a causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, i, i, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, score_mod=mod, block_mask=block_mask)


def _materialised(q, k, v, mod):
    """What a user writes without a kernel: the ``(b, h, i, j)`` logits in memory."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    i, j = s.shape[-2:]
    s = apply(mod, s, Tile.whole(i, j, s.device))
    causal = torch.ones(i, j, dtype=torch.bool, device=s.device).tril(j - i)
    return torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v


def _floor(q, k, v, cot, grad: bool):
    """The engine's tile matmuls alone, run as its tiles are (``backends.tiling.threads``): the floor of the loop.

    Forward: per block of query rows, ``S = Q Kᵀ`` and ``S V`` on each causal tile; backward:
    per block of keys, ``S`` again, ``dV += Sᵀ dO``, ``dP = dO Vᵀ``, ``dQ += dP K``, ``dK += dPᵀ Q``.
    As in the engine, the forward's products, ``S`` and ``dP`` are float32 and the backward's
    others run in ``tile_math.matmul_dtype`` (bfloat16 where this CPU's bfloat16 products are
    faster).
    """
    rows, cols = mod_tiles.TILE_ROWS, mod_tiles.TILE_COLS
    i = q.shape[-2]
    mm, acc = tile_math.matmul_dtype(q.dtype, q.device), torch.promote_types(q.dtype, torch.float32)
    q3, k3, v3, o3 = (x.detach().flatten(0, 1) for x in (q, k, v, cot))
    qs, ks, vs, os_ = (x.to(acc) for x in (q3, k3, v3, o3))  # the logits' and dP's operands
    q3, k3, v3, o3 = (x.to(mm) for x in (q3, k3, v3, o3))
    dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)

    def forward(i0, state):
        i1 = min(i0 + rows, i)
        for j0 in range(0, i1, cols):  # causal: key tiles up to the diagonal
            j1 = min(j0 + cols, i)
            torch.bmm(torch.bmm(qs[:, i0:i1], ks[:, j0:j1].transpose(1, 2)), vs[:, j0:j1])

    def backward(j0, dq):  # dq: this thread's accumulator
        j1 = min(j0 + cols, i)
        for i0 in range(j0 // rows * rows, i, rows):
            i1 = min(i0 + rows, i)
            qt, ot = q3[:, i0:i1], o3[:, i0:i1]
            s = torch.bmm(qs[:, i0:i1], ks[:, j0:j1].transpose(1, 2)).to(mm)
            dv[:, j0:j1].baddbmm_(s.transpose(1, 2), ot)
            ds = torch.bmm(os_[:, i0:i1], vs[:, j0:j1].transpose(1, 2)).to(mm)
            dq[:, i0:i1].baddbmm_(ds, k3[:, j0:j1])
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qt)

    work = q3.shape[0] * i * i // 2
    starts = list(range(0, i, rows))
    threads.run(starts, [work / len(starts)] * len(starts), forward, lambda: None)
    if grad:
        starts = list(range(0, i, cols))
        threads.run(starts, [work / len(starts)] * len(starts), backward, lambda: torch.zeros_like(q3))


def build(spec: dict) -> Callable[[], object]:
    """One call of one contender (see the module docstring); ``spec`` is JSON-able."""
    grad = spec["mode"] == "fwdbwd"
    q, k, v, cot = _inputs(spec, grad)
    ours, theirs = MODS[spec["mod"]]
    impl = spec["impl"]
    if impl == "qkv":
        fn = lambda: attention(q, k, v, causal=True, score_mod=ours)  # noqa: E731
    elif impl == "sdpa":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif impl == "flex":
        flex = _flex(theirs, spec["i"])
        fn = lambda: flex(q, k, v)  # noqa: E731
    elif impl == "materialised":
        fn = lambda: _materialised(q, k, v, theirs)  # noqa: E731
    elif impl == "floor":
        return lambda: _floor(q, k, v, cot, grad)
    else:
        raise ValueError(f"impl: expected qkv, sdpa, flex, materialised or floor, got {impl!r}")
    return call_or_step(fn, grad, cot, (q, k, v))


def _flex_backward(spec: dict) -> str:
    """What a forward + backward through compiled ``flex_attention`` does on this machine, in a few words."""
    try:
        build({**spec, "i": 128, "h": 1, "impl": "flex", "mode": "fwdbwd"})()
    except NotImplementedError:
        return "no CPU backward"
    except Exception as error:  # noqa: BLE001 (reported, not hidden)
        return f"failed: {type(error).__name__}"
    return "runs (not timed)"


def _memory(spec: dict, impls: list[str]) -> dict[str, float]:
    return {impl: peak_memory(NAME, {**spec, "impl": impl, "mode": "fwdbwd"})["peak"] for impl in impls}


def _dtype_part(cfg: dict, dtype: str, say: Callable[[str], None], targets: Targets) -> list[str]:
    i, h = cfg["i"], cfg["h"]
    hij = h * i * i * 4  # one (h, i, j) float32 tensor
    tile = h * mod_tiles.TILE_ROWS * mod_tiles.TILE_COLS * 4
    rows = []
    flex_bwd = _flex_backward({"mod": "softcap", "dtype": dtype, "seed": 0}) if cfg["flex"] else "not run (quick)"
    sdpa_peak = None
    for mod in MODS:
        base = {"mod": mod, "dtype": dtype, "i": i, "h": h}
        for mode in ("fwd", "fwdbwd"):
            impls = ["qkv", "sdpa", "materialised"] + (["flex"] if cfg["flex"] and mode == "fwd" else [])
            fns = {impl: build({**base, "impl": impl, "mode": mode}) for impl in impls}
            t = interleaved(fns, cfg["repeats"])
            say(f"  {mod} {dtype} {mode}: " + ", ".join(f"{n} {x * 1e3:.0f} ms" for n, x in t.items()))
            over_sdpa, vs_mat = t["qkv"] / t["sdpa"], t["materialised"] / t["qkv"]
            flex = f"{t['flex'] / t['qkv']:.2f}" if "flex" in t else (flex_bwd if mode == "fwdbwd" else "not run (quick)")
            memory = ""
            if mode == "fwdbwd" and cfg["memory"]:
                if sdpa_peak is None:
                    sdpa_peak = _memory(base, ["sdpa"])["sdpa"]
                extra = _memory(base, ["qkv"])["qkv"] - sdpa_peak
                memory = f"{mib(extra)} ({100 * extra / hij:.1f}% of an (h, i, j) tensor; a tile is {mib(tile)})"
                if mod == "softcap":
                    targets.add(f"soft-cap {dtype}, fwd+bwd: peak memory above SDPA ≤ 10% of an (h, i, j) float32 tensor",
                                100 * extra / hij, 10.0, unit="%")  # fmt: skip
                else:  # bounded by a tile: what grows with i·j would quadruple from i/2 to i; O(i·d) doubles
                    half = {**base, "i": i // 2}
                    extra_half = _memory(half, ["qkv"])["qkv"] - _memory(half, ["sdpa"])["sdpa"]
                    growth = extra / max(extra_half, 1)
                    memory += f"; {mib(extra_half)} at i = {i // 2}: × {growth:.2f}"
                    targets.add(f"{mod} {dtype}, fwd+bwd: peak memory above SDPA from i = {i // 2} to {i} grows ≤ 2.5× "
                                "(bounded by a tile: an (i, j) term would grow 4×)", growth, 2.5)  # fmt: skip
            mode_name = "fwd" if mode == "fwd" else "fwd+bwd"
            rows.append([mod, mode_name, f"{t['qkv'] * 1e3:.0f}", f"{over_sdpa:.2f}", flex, f"{vs_mat:.2f}", memory])
            if mod == "softcap" and mode == "fwdbwd":
                targets.add(f"soft-cap {dtype}, i = {i}, fwd+bwd: time / SDPA (no cap) ≤ 1.5", over_sdpa, 1.5)
                targets.add(f"soft-cap {dtype}, i = {i}, fwd+bwd: materialised time / qkv ≥ 2", vs_mat, 2.0, higher=True)
            if mod == "softcap" and "flex" in t:
                targets.add(f"soft-cap {dtype}, i = {i}, fwd: compiled flex_attention time / qkv ≥ 2", t["flex"] / t["qkv"], 2.0, higher=True)
            if mod == "sine" and mode == "fwdbwd":
                targets.add(f"sine score_mod {dtype}, i = {i}, fwd+bwd: time / SDPA ≤ 3", over_sdpa, 3.0)
    floor = interleaved({n: build({"mod": "softcap", "dtype": dtype, "i": i, "h": h, "impl": n, "mode": "fwdbwd"})
                         for n in ("floor", "sdpa")}, cfg["repeats"])  # fmt: skip
    say(f"  matmul floor {dtype}: " + ", ".join(f"{n} {x * 1e3:.0f} ms" for n, x in floor.items()))
    rows.append(["(the tile matmuls alone)", "fwd+bwd", f"{floor['floor'] * 1e3:.0f}", f"{floor['floor'] / floor['sdpa']:.2f}", "", "", ""])
    parts = [f"### {dtype} (i = j = {i}, h = {h}, d = 64, b = 1, causal)", ""]
    header = ["modifier", "mode", "qkv ms", "qkv / SDPA (no modifier)", "flex (compiled) / qkv", "materialised / qkv",
              "peak memory above SDPA (fwd+bwd)"]  # fmt: skip
    return parts + table(header, rows) + [""]


def section(quick: bool, say: Callable[[str], None]) -> str:
    """The markdown section of this suite, with its targets."""
    cfg = QUICK if quick else FULL
    targets = Targets()
    lines = ["## Mechanisms: score modifiers", ""]
    lines += ["The last row of each table is no contender: it times the seven batched matmuls of the engine's tiles",
              "alone, the floor of any tile loop written with PyTorch operations, against SDPA's fused kernel.", ""]  # fmt: skip
    for dtype in DTYPES:
        lines += _dtype_part(cfg, dtype, say, targets)
    lines += ["### Targets", ""] + targets.lines()
    return "\n".join(lines)


__all__ = ["CAP", "DESCRIPTION", "MODS", "NAME", "build", "section", "sine"]
