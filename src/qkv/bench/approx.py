"""Benchmark: approximate attention against exact attention, and against the peer packages.

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length (self-attention, ``j = i``),
``d`` query/key size (``e = d``), ``dim = h · d`` model size (peer modules with projections).

For each sequence length ``i`` in ``setup.sizes`` every method runs on the same structured
inputs (:mod:`qkv.bench.inputs`, family ``setup.family``), forward only, float32, under
``torch.inference_mode``:

- **time**: median of ``repeats`` calls (fewer at the large sizes, see :class:`ApproxSetup`),
  taken round-robin over the methods with the order rotated each round, so drifting machine
  load falls on every method alike (the procedure of :func:`qkv.bench.measure.interleaved`,
  with fewer calls for the slow contenders at the large sizes and the first output kept for
  the error); one warm-up call per method at each size (exact attention only at
  ``i <= big``: above that a call takes seconds and its first call is no slower);
- **peak memory**: the peak RSS of a fresh process that builds the inputs and makes one
  call (:func:`qkv.bench.measure.peak_memory` with :func:`build`), and how much of it came
  after the inputs were built;
- **error**: ``‖out − exact‖_F / ‖exact‖_F`` of the first timed call. Reformer's LSH
  attention shares queries and keys (``k = q/|q|``) and never attends to itself, so it gets
  its queries rescaled (:func:`lsh_queries`) and its reference is exact attention with
  those keys and the diagonal masked, built only at ``i <= lsh_error_max`` (the dense mask
  is ``i²``);
- **scaling exponent**: the least-squares slope of ``log time`` against ``log i`` over the
  sizes in ``[4096, 32768]`` (:func:`fit_exponent`).

A second table gives the error of each method at ``i = error_size`` on every input
family, with how spread the exact rows are (:func:`qkv.bench.inputs.effective_keys`).

**Peers**: the same computation in performer-pytorch, linformer, nystrom-attention and
reformer-pytorch, timed side by side with ours, is :mod:`qkv.bench.peers`; :func:`run` calls
it at ``setup.peer_sizes`` and its table ends this suite's section.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..functional import attention
from .approx_setup import (
    ApproxSetup,
    inputs,
    is_lsh,
    label,
    lsh_bucket_count,
    methods,
    lsh_queries,
    lsh_reference,
    lsh_spread,
    mechanism,
    size_label,
    timed,
)
from .inputs import FAMILIES, effective_keys, relative_error
from .measure import steady_heap
from .peers import compare_peers, render_peers
from .report import Targets

NAME = "approx"
DESCRIPTION = ("approximate attention (Linformer, Reformer LSH, Performer, linear, Nyström) vs exact "
               "and vs peer packages")
TARGET_SPEEDUP = 20.0  # at i = 16384, exact time / method time
TARGET_EXPONENT = 1.15  # log-log slope of time between 4K and 32K


def _routes() -> list[str]:
    """What the first-use probes chose on this CPU for the products they were asked about."""
    from .. import projection
    from ..approx import _common

    lines = projection.PROBE.report() + _common.GROUPED_PROBE.report()
    if projection.get_route() != "auto":
        return [f"oneDNN routes fixed to `{projection.get_route()}` (`QKV_ROUTE`).", ""]
    if not lines:
        return []
    return ["oneDNN or BLAS for the float32 products, chosen on this CPU by timing both once per shape "
            "class (key = sizes): " + "; ".join(lines) + ".", ""]


def fit_exponent(sizes: list[int], seconds: list[float], lo: int = 4096, hi: int = 32768) -> float:
    """Least-squares slope of ``log seconds`` against ``log size`` over the sizes in ``[lo, hi]``."""
    pts = [(math.log(s), math.log(t)) for s, t in zip(sizes, seconds, strict=True) if lo <= s <= hi]
    if len(pts) < 2:
        raise ValueError(f"sizes: expected at least two sizes in [{lo}, {hi}] to fit a slope, got {sizes}")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


@dataclass
class ApproxResult:
    setup: ApproxSetup
    times: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (method, i) -> seconds per call
    errors: dict[tuple[str, int], float] = field(default_factory=dict)  # (method, i) -> relative error
    rss: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (method, i) -> (peak, added) MiB
    family_errors: dict[tuple[str, str], float] = field(default_factory=dict)  # (method, family) -> error
    spread: dict = field(default_factory=dict)  # family, or ("reformer_lsh", family) -> effective keys per row
    peers: list[dict] = field(default_factory=list)  # rows of the peer table
    threads: int = 1
    steady_heap: bool = False  # whether the timing ran with freed memory kept in the process
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at start and end
    seconds: float = 0.0  # wall time of the whole suite

    def median(self, method: str, i: int) -> float:
        return statistics.median(self.times[method, i])

    def speedup(self, method: str, i: int) -> float:
        return self.median("exact", i) / self.median(method, i)

    def exponent(self, method: str) -> float:
        sizes = [s for s in self.setup.sizes if (method, s) in self.times]
        return fit_exponent(sizes, [self.median(method, s) for s in sizes], *self.setup.fit_range)

    def markdown(self) -> str:
        return render(self)


def run(setup: ApproxSetup | None = None, *, progress: Callable[[str], None] | None = None) -> ApproxResult:
    """Run the whole suite; ``progress`` receives a line of text after each step."""
    setup = ApproxSetup() if setup is None else setup
    say = progress or (lambda _line: None)
    import os

    result = ApproxResult(setup, threads=torch.get_num_threads(), load=(os.getloadavg()[0], 0.0))
    start = time.perf_counter()
    with steady_heap(setup.steady_heap) as result.steady_heap:
        with torch.inference_mode():
            _time_all(setup, result, say)
            _family_errors(setup, result, say)
        if setup.peer_sizes:
            result.peers = compare_peers(setup, say)
    if setup.memory:
        for i in setup.sizes:
            for method in methods(setup):
                result.rss[method, i] = peak_memory(method, i, setup)
            say(f"memory i={i}: " + ", ".join(f"{m} {result.rss[m, i][0]:.0f} MiB" for m in methods(setup)))
    result.load = (result.load[0], os.getloadavg()[0])
    result.seconds = time.perf_counter() - start
    return result


def _time_all(setup: ApproxSetup, result: ApproxResult, say: Callable[[str], None]) -> None:
    """Time every (method, size), round-robin over sizes as well as methods.

    Interleaving the sizes too puts every size under the same drift of machine load, which
    matters for the scaling exponent (a ratio of times at different sizes).
    """
    cases, names = {}, methods(setup)
    for i in setup.sizes:
        q, k, v = inputs(i, setup)
        cases[i] = (q, k, v, {m: mechanism(m, i, setup) for m in names})
        for m, fn in cases[i][3].items():
            if i <= setup.big or m != "exact":  # one warm-up call; exact's cost seconds above big
                fn(lsh_queries(q, setup) if is_lsh(m) else q, k, v)
    outs: dict[tuple[str, int], Tensor] = {}
    rounds = max(setup.repeats_for(m, i) for m in names for i in setup.sizes)
    for r in range(rounds):
        for i in setup.sizes:
            q, k, v, fns = cases[i]
            lq = lsh_queries(q, setup)
            for m in names[r % len(names):] + names[: r % len(names)]:
                if len(result.times.setdefault((m, i), [])) < setup.repeats_for(m, i):
                    qm = lq if is_lsh(m) else q
                    seconds, out = timed(lambda fn=fns[m], qm=qm: fn(qm, k, v))
                    result.times[m, i].append(seconds)
                    outs.setdefault((m, i), out)
        say(f"timing round {r + 1}/{rounds} done")
    for i in setup.sizes:
        q, _, v, _ = cases[i]
        for m in names[1:]:
            if not is_lsh(m):
                result.errors[m, i] = relative_error(outs[m, i], outs["exact", i])
            elif i <= setup.lsh_error_max:
                result.errors[m, i] = relative_error(outs[m, i], lsh_reference(lsh_queries(q, setup), v))
        say(f"i={i}: " + ", ".join(f"{m} {result.median(m, i):.3g}s" for m in names))


def _family_errors(setup: ApproxSetup, result: ApproxResult, say: Callable[[str], None]) -> None:
    i = setup.error_size
    for family in FAMILIES:
        q, k, v = inputs(i, setup, family)
        result.spread[family] = effective_keys(q, k)
        exact = attention(q, k, v)
        lq = lsh_queries(q, setup)
        result.spread["reformer_lsh", family] = lsh_spread(lq)
        for m in methods(setup)[1:]:
            out = mechanism(m, i, setup)(lq if is_lsh(m) else q, k, v)
            ref = lsh_reference(lq, v) if is_lsh(m) else exact
            result.family_errors[m, family] = relative_error(out, ref)
        say(f"errors on {family}: " + ", ".join(f"{m} {result.family_errors[m, family]:.3g}" for m in methods(setup)[1:]))


def build(spec: dict) -> Callable[[], Tensor]:
    """One memory case for :func:`qkv.bench.measure.peak_memory`: inputs built, one call to make.

    ``spec``: ``method``, ``i``, ``batch``, ``heads``, ``dim_head``, ``family``, ``seed``.
    """
    setup = ApproxSetup(sizes=(spec["i"],), batch=spec["batch"], heads=spec["heads"], dim_head=spec["dim_head"],
                        family=spec["family"], seed=spec["seed"])  # fmt: skip
    q, k, v = inputs(spec["i"], setup)
    fn = mechanism(spec["method"], spec["i"], setup)

    if is_lsh(spec["method"]):
        q = lsh_queries(q, setup)

    def call() -> Tensor:
        with torch.inference_mode():
            return fn(q, k, v)

    return call


def peak_memory(method: str, i: int, setup: ApproxSetup) -> tuple[float, float]:
    """``(peak RSS, RSS added by the call)`` in MiB of one call in a fresh process."""
    from .measure import peak_memory as measure_peak  # noqa: PLC0415

    case = dict(method=method, i=i, batch=setup.batch, heads=setup.heads, dim_head=setup.dim_head,
                family=setup.family, seed=setup.seed)  # fmt: skip
    got = measure_peak(NAME, case)
    return got["peak"] / 2**20, got["extra"] / 2**20


# ---------------------------------------------------------------- report

def _buckets(count: int | tuple[int, int]) -> str:
    return str(count) if isinstance(count, int) else "×".join(map(str, count))


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def render(res: ApproxResult) -> str:
    """The markdown section of ``benchmarks/RESULTS.md``."""
    s = res.setup
    large = [size_label(x) for x in s.sizes if x > s.big] or ["—"]
    lines = [
        "### Approximate attention vs exact (`qkv bench --suite approx`)",
        "",
        f"b={s.batch}, h={s.heads}, d=e={s.dim_head}, self-attention, float32, forward only under "
        f"`torch.inference_mode`, {res.threads} torch threads; inputs: `{s.family}` "
        f"(`qkv.bench.inputs`). Methods: Linformer k={s.linformer_k} (random projections, untrained); "
        f"Reformer LSH {', '.join(map(str, s.lsh_rounds))} rounds, chunk {s.lsh_chunk}, i/{s.lsh_chunk} "
        f"buckets, as two factors above {s.lsh_factorise_above} ("
        + ", ".join(f"{size_label(i)}: {_buckets(lsh_bucket_count(i, s))}" for i in s.sizes) + "); Performer "
        f"m={s.nb_features} orthogonal features; linear attention elu+1; Nyström {s.landmarks} landmarks, "
        f"6 pinv iterations. Time: median of {s.repeats} calls at i ≤ {size_label(s.big)}; above that "
        f"{', '.join(map(str, s.large_repeats))} calls for the approximations and "
        f"{', '.join(map(str, s.exact_large_repeats))} for exact attention at {', '.join(large)}; calls "
        f"interleaved round-robin"
        + ("; freed memory kept in the process while timing (glibc's mmap and "
           "trim thresholds at 1 GiB, as in a long-running process or with jemalloc), so a call's fresh output is "
           "not faulted in page by page" if res.steady_heap else "")
        + ". Peak RSS: a fresh process per case (default heap). Error: ‖out − exact‖_F / ‖exact‖_F; "
        f"Reformer's against "
        f"exact shared-QK attention without self-attention, only at i ≤ {size_label(s.lsh_error_max)}. "
        f"Machine load (1-min average) {res.load[0]:.1f} at start, {res.load[1]:.1f} at end, on 2 cores; "
        f"whole suite {res.seconds / 60:.1f} min.",
        "",
        *_routes(),
        "| method | i | time (s) | × faster than exact | peak RSS (MiB) | RSS added by the call (MiB) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for i in s.sizes:
        for m in methods(s):
            peak, added = res.rss.get((m, i), (None, None))
            speed = "1" if m == "exact" else f"{res.speedup(m, i):.1f}"
            lines.append(f"| {label(m)} | {size_label(i)} | {res.median(m, i):.3g} | {speed} | {_fmt(peak, '.0f')} | "
                         f"{_fmt(added, '.0f')} | {_fmt(res.errors.get((m, i)))} |")  # fmt: skip
    lo, hi = s.fit_range
    target = max((x for x in s.sizes if x <= 16384), default=s.sizes[-1])
    targets = Targets()
    exponents = {m: res.exponent(m) for m in methods(s)}
    for m in methods(s)[1:]:
        targets.add(f"{label(m)}: × faster than exact at i = {size_label(target)}", res.speedup(m, target),
                    TARGET_SPEEDUP, higher=True, unit="×")  # fmt: skip
        targets.add(f"{label(m)}: time exponent {size_label(lo)}–{size_label(hi)}", exponents[m], TARGET_EXPONENT)
    lines += ["", f"Scaling exponent (least-squares log-log slope of time, {size_label(lo)}–{size_label(hi)}): "
              + ", ".join(f"{label(m)} {exponents[m]:.2f}" for m in methods(s)) + ".", "", *targets.lines()]
    lines += ["", f"Error by input family at i = {size_label(s.error_size)} (effective keys per row = exp(entropy) of "
              "exact attention, averaged over 256 rows: i for uniform rows, 1 for one-hot):", "",
              "| method | " + " | ".join(f"`{f}` ({res.spread[f]:.0f} keys)" for f in FAMILIES) + " |",
              "|---" * (len(FAMILIES) + 1) + "|"]  # fmt: skip
    for m in methods(s)[1:]:
        lines.append(f"| {label(m)} | " + " | ".join(f"{res.family_errors[m, f]:.3g}" for f in FAMILIES) + " |")
    lines += ["", "Reformer's reference is exact shared-QK attention (keys q/|q|, no self-attention) on its "
              f"queries rescaled to norm {s.lsh_norm:g}·√d (`lsh_queries`: with the inputs' own norms the "
              "shared-QK softmax is nearly uniform); effective keys of that reference: "
              + ", ".join(f"`{f}` {res.spread['reformer_lsh', f]:.0f}" for f in FAMILIES) + "."]

    lines += render_peers(res.peers, s)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m qkv.bench.approx [--quick]``: run and print the markdown section."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qkv.bench.approx", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="i = 256, 512, 1024; no memory; a smoke run")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else ApproxSetup()
    print(run(setup, progress=print).markdown())
    return 0


#: a smoke-sized setup (seconds, not minutes), used by ``--quick`` and the tests
QUICK = ApproxSetup(sizes=(256, 512, 1024), repeats=2, large_repeats=(1,), reformer_peer_max=512, big=256,
                    fit_range=(256, 1024), error_size=256, lsh_error_max=1024, memory=False, peer_sizes=(512,), steady_heap=False,
                    peer_repeats=1,
                    linformer_k=32, nb_features=32, landmarks=16, lsh_chunk=32)  # fmt: skip

if __name__ == "__main__":
    raise SystemExit(main())
