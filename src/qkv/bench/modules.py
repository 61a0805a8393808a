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

The two modules do the same arithmetic (four ``dim × dim`` projections and the fused
attention kernel) through different matmul libraries: qkv's projections run on oneDNN
when ``qkv.projection`` takes its convolution route, PyTorch's on BLAS. The section says
which route ran, since on CPUs where MKL is slow (AMD) most of the difference comes from there.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import projection
from ..attention import MultiHeadAttention
from .measure import interleaved
from .report import Targets, table

NAME = "modules"
DESCRIPTION = "qkv.MultiHeadAttention vs nn.MultiheadAttention (training step and inference)"

FULL = dict(lengths=(128, 256, 512, 1024, 2048), tokens=4096, repeats=15)
QUICK = dict(lengths=(32,), tokens=128, repeats=2)
DIM, HEADS = 512, 8


def call(spec: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The module of one contender and its forward call on the suite's input ``(b, i, dim)``.

    Every contender gets the same ``x`` and the same weights (ours is
    ``MultiHeadAttention.from_torch`` of the PyTorch module), both batch-first; PyTorch's
    module is called as self-attention code calls it, ``mha(x, x, x, ...)``.
    """
    torch.manual_seed(spec.get("seed", 0))
    i, b = spec["i"], spec["tokens"] // spec["i"]
    ref = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
    x = torch.randn(b, i, DIM, generator=torch.Generator().manual_seed(1))
    impl = spec["impl"]
    if impl == "qkv":
        module = MultiHeadAttention.from_torch(ref)
        return module, lambda: module(x)
    if impl == "torch_fast":
        return ref, lambda: ref(x, x, x, need_weights=False)[0]
    # the default call: weights computed (averaged over heads) and returned
    return ref, lambda: ref(x, x, x)[0]


def build(spec: dict) -> Callable[[], object]:
    """One training step or inference call of one contender."""
    module, fn = call(spec)
    mode = spec["mode"]
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
    x, w = torch.empty(cfg["tokens"], DIM), torch.empty(DIM, DIM, requires_grad=True)
    with torch.no_grad():
        routes = {"inference": projection.uses_convolution(x, w)}
    routes["training"] = projection.uses_convolution(x, w)  # forward and backward timed
    # the training step's bound at i = 128: 0.8 where oneDNN's products beat BLAS's (qkv runs
    # them, nn.MultiheadAttention cannot), 0.95 where both modules multiply on the same BLAS
    bound = 0.8 if routes["training"] else 0.95
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
            route = "oneDNN" if routes["training"] else "BLAS, as PyTorch's"
            targets.add(f"MHA training step, i = 128, projections on {route}: time / nn.MultiheadAttention(need_weights=False) ≤ {bound}", r_fast, bound)  # fmt: skip
        targets.add(f"MHA training step, i = {i}: time / nn.MultiheadAttention (defaults) ≤ 0.7", r_default, 0.7)
        targets.add(f"MHA inference, i = {i}: time / nn.MultiheadAttention(need_weights=False) ≤ 1.0", r_inf, 1.0)
    parts = [f"## Modules: MultiHeadAttention (dim {DIM}, {HEADS} heads, b · i = {cfg['tokens']} tokens)", ""]
    named = {mode: "oneDNN (1×1 convolutions)" if onednn else "BLAS (F.linear)" for mode, onednn in routes.items()}
    parts += [f"qkv's four projections ran on {named['training']} in training and on {named['inference']} in "
              "inference (`qkv.projection`, chosen on this CPU by timing both once per shape and mode); "
              "PyTorch's run on F.linear.", ""]  # fmt: skip
    parts += table(["i", "b", "qkv train ms", "train / torch need_weights=False", "train / torch defaults",
                    "qkv inference ms", "inference / torch need_weights=False"], rows)  # fmt: skip
    parts += ["", "### Targets", ""] + targets.lines()
    return "\n".join(parts)
