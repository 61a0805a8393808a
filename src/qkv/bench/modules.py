"""Benchmark suite ``modules``: ``qkv.MultiHeadAttention`` against ``nn.MultiheadAttention``.

Shape legend: ``b`` batch, ``i`` sequence length, ``dim`` model size. Self-attention,
``dim = 512``, 8 heads, float32, ``b · i = 4096`` tokens per step, both modules batch-first
with the same weights (``MultiHeadAttention.from_torch``).

Contenders, per length ``i``:

* training step (forward + backward): ours vs ``nn.MultiheadAttention(need_weights=False)``
  (its fast path) and vs the call most code makes, with the defaults (weights computed and
  averaged over heads);
* inference (forward under ``no_grad``, module in eval mode): ours vs
  ``need_weights=False``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..attention import MultiHeadAttention
from .measure import interleaved
from .report import Targets, table

NAME = "modules"
DESCRIPTION = "qkv.MultiHeadAttention vs nn.MultiheadAttention (training step and inference)"

FULL = dict(lengths=(128, 256, 512, 1024, 2048), tokens=4096, repeats=15)
QUICK = dict(lengths=(32,), tokens=128, repeats=2)
DIM, HEADS = 512, 8


def build(spec: dict) -> Callable[[], object]:
    """One training step or inference call of one contender."""
    torch.manual_seed(spec.get("seed", 0))
    i, b = spec["i"], spec["tokens"] // spec["i"]
    ref = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
    x = torch.randn(b, i, DIM, generator=torch.Generator().manual_seed(1))
    impl, mode = spec["impl"], spec["mode"]
    if impl == "qkv":
        module = MultiHeadAttention.from_torch(ref)
        fn = lambda: module(x)  # noqa: E731
    elif impl == "torch_fast":
        module = ref
        fn = lambda: ref(x, x, x, need_weights=False)[0]  # noqa: E731
    else:  # the default call: weights computed (averaged over heads) and returned
        module = ref
        fn = lambda: ref(x, x, x)[0]  # noqa: E731
    if mode == "inference":
        module.eval()

        def infer():
            with torch.no_grad():
                return fn()

        return infer
    module.train()
    params = list(module.parameters())

    def step():
        fn().sum().backward()
        for p in params:
            p.grad = None

    return step


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    for i in cfg["lengths"]:
        base = {"i": i, "tokens": cfg["tokens"]}
        train = interleaved({impl: build({**base, "impl": impl, "mode": "train"}) for impl in ("qkv", "torch_fast", "torch_default")}, cfg["repeats"])
        infer = interleaved({impl: build({**base, "impl": impl, "mode": "inference"}) for impl in ("qkv", "torch_fast")}, cfg["repeats"])
        r_fast, r_default = train["qkv"] / train["torch_fast"], train["qkv"] / train["torch_default"]
        r_inf = infer["qkv"] / infer["torch_fast"]
        say(f"  MHA i={i}: train/fast {r_fast:.3f}, train/default {r_default:.3f}, inference {r_inf:.3f}")
        rows.append([i, cfg["tokens"] // i, f"{train['qkv'] * 1e3:.1f}", f"{r_fast:.3f}", f"{r_default:.3f}", f"{infer['qkv'] * 1e3:.1f}", f"{r_inf:.3f}"])
        targets.add(f"MHA training step, i = {i}: time / nn.MultiheadAttention(need_weights=False) ≤ 1.0", r_fast, 1.0)
        if i == 128:
            targets.add("MHA training step, i = 128: time / nn.MultiheadAttention(need_weights=False) ≤ 0.8", r_fast, 0.8)
        targets.add(f"MHA training step, i = {i}: time / nn.MultiheadAttention (defaults) ≤ 0.7", r_default, 0.7)
        targets.add(f"MHA inference, i = {i}: time / nn.MultiheadAttention(need_weights=False) ≤ 1.0", r_inf, 1.0)
    parts = [f"## Modules: MultiHeadAttention (dim {DIM}, {HEADS} heads, b · i = {cfg['tokens']} tokens)", ""]
    parts += table(["i", "b", "qkv train ms", "train / torch need_weights=False", "train / torch defaults",
                    "qkv inference ms", "inference / torch need_weights=False"], rows)  # fmt: skip
    parts += ["", "### Targets", ""] + targets.lines()
    return "\n".join(parts)
