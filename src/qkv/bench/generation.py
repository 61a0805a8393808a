"""Benchmark: generation with a KV cache against recomputing the prefix for every token.

Shape legend: ``b`` batch, ``i`` prompt length, ``n`` generated tokens, ``dim`` model size.

A decoder-only LM (``qkv.models.CausalLM``, 2 layers, ``dim = 256`` by default) generates
``n = 512`` tokens greedily, twice per repeat, side by side:

* **cached** — the prompt is run once, then each token attends to a ``qkv.cache`` of the
  earlier keys and values: one position through every projection per step;
* **recompute** — each step reruns the whole sequence so far (``use_cache=False``): step
  ``t`` pushes ``i + t`` positions through every projection, O(n²) in total.

The two runs must produce the same tokens (checked each repeat; the figure is meaningless
otherwise). Reported: the median time of each over the repeats and their ratio
(recompute / cached), plus the range of the per-repeat ratios. Times are taken with
``time.perf_counter`` around whole ``generate`` calls, after one warm-up call of each.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .._args import positive_int
from ..models import CausalLM, LMConfig

NAME = "generation"
DESCRIPTION = "KV-cached vs recomputed greedy generation of a 2-layer dim-256 LM"


@dataclass(frozen=True)
class GenerationSetup:
    tokens: int = 512  # new tokens generated per run
    prompt: int = 8  # prompt length
    batch: int = 1  # sequences generated at once
    dim: int = 256  # model size
    layers: int = 2  # depth
    heads: int = 4  # attention heads
    vocab: int = 256  # vocabulary size
    repeats: int = 5  # timed runs of each variant (the median is reported)
    seed: int = 0  # weights and prompt

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name != "seed":
                positive_int(name, value)


@dataclass(frozen=True)
class GenerationResult:
    setup: GenerationSetup  # what was run
    cached: list[float] = field(default_factory=list)  # seconds per cached run
    recompute: list[float] = field(default_factory=list)  # seconds per recomputing run
    threads: int = 1  # torch.get_num_threads() during the run

    @property
    def ratio(self) -> float:
        """median(recompute) / median(cached): how many times faster the cache is."""
        return statistics.median(self.recompute) / statistics.median(self.cached)

    @property
    def ratio_range(self) -> tuple[float, float]:
        """Smallest and largest ratio of one repeat's pair of runs."""
        ratios = [r / c for r, c in zip(self.recompute, self.cached, strict=True)]
        return min(ratios), max(ratios)

    def markdown(self) -> str:
        """A short section for ``benchmarks/RESULTS.md``."""
        s = self.setup
        lo, hi = self.ratio_range
        return "\n".join(
            [
                f"### Generation: KV cache vs recompute ({s.tokens} tokens)",
                "",
                f"`CausalLM` with {s.layers} layers, dim {s.dim}, {s.heads} heads, vocabulary {s.vocab}; "
                f"batch {s.batch}, prompt {s.prompt} tokens, greedy; {s.repeats} repeats side by side, "
                f"{self.threads} torch thread(s). Both variants produced identical tokens in every repeat.",
                "",
                "| variant | median time relative to cached |",
                "|---|---|",
                "| cached (`qkv.cache`) | 1.0 |",
                f"| recompute the prefix per token | {self.ratio:.1f} |",
                "",
                f"**Cached generation is {self.ratio:.1f}× faster** (median over repeats; per-repeat ratios "
                f"{lo:.1f}–{hi:.1f}).",
            ]
        )


def _model(setup: GenerationSetup) -> tuple[CausalLM, torch.Tensor]:
    torch.manual_seed(setup.seed)
    config = LMConfig(vocab=setup.vocab, dim=setup.dim, heads=setup.heads, layers=setup.layers,
                      max_len=setup.prompt + setup.tokens)  # fmt: skip
    model = CausalLM(config).eval()
    prompt = torch.randint(0, setup.vocab, (setup.batch, setup.prompt))
    return model, prompt


def _timed(model: CausalLM, prompt: torch.Tensor, tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model.generate(prompt, tokens, use_cache=use_cache)
    return time.perf_counter() - start, out


def run(setup: GenerationSetup | None = None, *, progress=None) -> GenerationResult:
    """Time both variants ``setup.repeats`` times, alternating, and check they agree.

    ``progress`` is an optional callable receiving a line of text after each repeat.
    """
    setup = GenerationSetup() if setup is None else setup
    model, prompt = _model(setup)
    # warm-up: first calls allocate and pick kernels
    _timed(model, prompt, min(8, setup.tokens), True)
    _timed(model, prompt, min(8, setup.tokens), False)
    cached, recompute = [], []
    for r in range(setup.repeats):
        # alternate the order so that drifting machine load does not favour one variant
        order = (True, False) if r % 2 == 0 else (False, True)
        outs = {}
        for use_cache in order:
            seconds, outs[use_cache] = _timed(model, prompt, setup.tokens, use_cache)
            (cached if use_cache else recompute).append(seconds)
        if not torch.equal(outs[True], outs[False]):
            raise RuntimeError("generation: cached and recomputed greedy generation produced different tokens")
        if progress is not None:
            progress(f"repeat {r + 1}/{setup.repeats}: recompute/cached = {recompute[-1] / cached[-1]:.1f}")
    return GenerationResult(setup, cached, recompute, torch.get_num_threads())


def main(argv: list[str] | None = None) -> int:
    """``python -m qkv.bench.generation [--quick]``: run and print the markdown section."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qkv.bench.generation", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="64 tokens, 3 repeats (a smoke run)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to generate (default 512)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each variant (default 5)")
    args = parser.parse_args(argv)
    kwargs = dict(tokens=64, repeats=3) if args.quick else {}
    if args.tokens is not None:
        kwargs["tokens"] = args.tokens
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    result = run(GenerationSetup(**kwargs), progress=print)
    print(result.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
