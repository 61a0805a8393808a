"""Benchmark suite ``generation``: greedy decoding with a KV cache against recomputing the
prefix for every token.

Shape legend: ``b`` batch, ``i`` prompt length, ``n`` generated tokens, ``dim`` model size.

A decoder-only LM (``qkv.models.CausalLM``: 2 layers, ``dim = 256``, 4 heads, learned
positions) generates ``n`` tokens greedily in two ways, timed side by side:

* **cached** — the prompt is run once, then each token attends to a ``qkv.cache`` of the
  earlier keys and values: one position goes through every projection per step;
* **recompute** — every step reruns the whole sequence so far (``generate(...,
  use_cache=False)``): step ``t`` pushes ``i + t`` positions through every projection,
  O(n²) positions in total.

Both must produce the same tokens (checked; a figure for different outputs would be
meaningless). Timing uses :func:`qkv.bench.measure.interleaved` (one call of each per
round, order rotated, median per contender) on whole ``generate`` calls, after a short
warm-up of each. Reported per length: the median times relative to cached and the ratio
recompute / cached. Target: ≥ 10× at ``n = 512``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from .._args import positive_int
from ..models import CausalLM, LMConfig
from .measure import interleaved
from .report import Targets, table

NAME = "generation"
DESCRIPTION = "KV-cached vs recomputed greedy generation of a 2-layer dim-256 LM"
TARGET_TOKENS = 512  # the length the target is checked at
TARGET_SPEEDUP = 10.0  # recompute time / cached time at TARGET_TOKENS


@dataclass(frozen=True)
class GenerationSetup:
    tokens: tuple[int, ...] = (128, 512)  # new tokens generated per run, one row each
    prompt: int = 8  # prompt length
    batch: int = 1  # sequences generated at once
    dim: int = 256  # model size
    layers: int = 2  # depth
    heads: int = 4  # attention heads
    vocab: int = 256  # vocabulary size
    repeats: int = 5  # timed rounds per length (the median is reported)
    seed: int = 0  # weights and prompt

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("tokens: expected at least one length, got ()")
        for n in self.tokens:
            positive_int("tokens", n)
        for name, value in asdict(self).items():
            if name not in ("seed", "tokens"):
                positive_int(name, value)


#: ``qkv bench --suite generation --quick``: tiny sizes, a smoke test of the machinery.
QUICK = GenerationSetup(tokens=(16, 32), dim=64, repeats=2)


@dataclass(frozen=True)
class GenerationResult:
    setup: GenerationSetup  # what was run
    cached: dict[int, float] = field(default_factory=dict)  # tokens -> median seconds, cached
    recompute: dict[int, float] = field(default_factory=dict)  # tokens -> median seconds, recomputing
    threads: int = 1  # torch.get_num_threads() during the run
    load: float = 0.0  # 1-minute load average when the run started

    def ratio(self, tokens: int) -> float:
        """median(recompute) / median(cached) at ``tokens``: how many times faster the cache is."""
        return self.recompute[tokens] / self.cached[tokens]

    def markdown(self) -> str:
        """The suite's section of ``benchmarks/RESULTS.md``."""
        s = self.setup
        lines = [
            "## Generation: KV cache vs recomputing the prefix",
            "",
            f"`qkv.models.CausalLM`: {s.layers} layers, dim {s.dim}, {s.heads} heads, vocabulary {s.vocab}, "
            f"learned positions; batch {s.batch}, prompt {s.prompt} tokens, greedy. Median of {s.repeats} "
            f"interleaved rounds per length; {self.threads} torch thread(s); load average {self.load:.1f} at the "
            "start. Cached and recomputed generation produced identical tokens at every length.",
            "",
        ]
        rows = [[n, "1.0", f"{self.ratio(n):.1f}"] for n in s.tokens]
        lines += table(["new tokens", "cached (relative time)", "recompute the prefix (relative time)"], rows)
        if TARGET_TOKENS in s.tokens:
            targets = Targets()
            targets.add(f"cached ≥ {TARGET_SPEEDUP:g}× faster at {TARGET_TOKENS} tokens", self.ratio(TARGET_TOKENS),
                        TARGET_SPEEDUP, higher=True, unit="×")  # fmt: skip
            lines += [""] + targets.lines()
        return "\n".join(lines) + "\n"


def _model(setup: GenerationSetup) -> tuple[CausalLM, torch.Tensor]:
    torch.manual_seed(setup.seed)
    config = LMConfig(vocab=setup.vocab, dim=setup.dim, heads=setup.heads, layers=setup.layers,
                      max_len=setup.prompt + max(setup.tokens))  # fmt: skip
    model = CausalLM(config).eval()
    prompt = torch.randint(0, setup.vocab, (setup.batch, setup.prompt))
    return model, prompt


def run(setup: GenerationSetup | None = None, *, progress=None) -> GenerationResult:
    """Time both variants at every length of ``setup.tokens`` and check that they agree.

    ``progress`` is an optional callable receiving a line of text after each length.
    """
    setup = GenerationSetup() if setup is None else setup
    say = progress or (lambda _line: None)
    model, prompt = _model(setup)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    # warm-up at a small length: the first calls allocate and pick kernels
    for use_cache in (True, False):
        model.generate(prompt, min(8, min(setup.tokens)), use_cache=use_cache)
    cached, recompute = {}, {}
    for n in setup.tokens:
        outputs: dict[bool, torch.Tensor] = {}

        def call(use_cache: bool, n: int = n, outputs: dict = outputs):
            outputs[use_cache] = model.generate(prompt, n, use_cache=use_cache)

        times = interleaved({"cached": lambda: call(True), "recompute": lambda: call(False)}, setup.repeats, warmup=0)
        if not torch.equal(outputs[True], outputs[False]):
            raise RuntimeError(f"generation: cached and recomputed greedy generation differ at {n} tokens")
        cached[n], recompute[n] = times["cached"], times["recompute"]
        say(f"{n} tokens: recompute / cached = {recompute[n] / cached[n]:.1f}")
    return GenerationResult(setup, cached, recompute, torch.get_num_threads(), load)
