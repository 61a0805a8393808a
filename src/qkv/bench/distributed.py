"""Benchmark suite ``distributed``: sequence-parallel attention on P = 1, 2, 4 local processes.

Shape legend: ``b`` batch, ``h`` heads, ``g`` KV heads, ``n`` tokens, ``d`` head size, ``P`` ranks.

At ``n = 16384`` (``b = 1``, ``h = g = 8``, ``d = 64``, float32, causal) each configuration
runs one forward and backward of ``qkv.distributed.attention`` in ``P`` fresh gloo
processes on this machine (``qkv.distributed.launch``), and one process runs plain
``qkv.attention`` on the whole tensors as the reference. Per rank:

* peak memory: the peak resident set (``VmHWM``) after the step minus the one before
  building the inputs (after the same call at n = 1024 has loaded the kernels and started
  the threads), so it holds the rank's shards, their gradients and everything the call
  allocated. glibc's mmap threshold is set to its initial 128 KiB in every process (the
  reference too): setting it turns off glibc's habit of raising it after large frees, so
  freed blocks go back to the system and the peak follows live memory, not the
  allocator's reuse pattern;
* bytes sent, counted by the communication layer, forward and backward apart, against
  the formula of the issue (ring: ``(P-1)·2·(n/P)·g·d`` elements forward, Ulysses: four
  all-to-alls of ``(P-1)/P·(n/P)·h·d``);
* work: the query-key pairs of the blocks the rank computed (``blocks.computed``), and
  the max/min across ranks;
* time of a second step (with ``P`` processes sharing this machine's cores), in a heap that
  keeps freed memory (glibc's mmap and trim thresholds raised), as a long-running process's does.

The cost model (``qkv.distributed.cost``) is fitted here (a gloo ping-pong, block timings
on one thread), checked against the measured P = 2 and 4 times, and asked for ring,
Ulysses and hybrid up to P = 1024 on documented links. The check gives the ranks their
share of the cores, ``min(threads, C/P)``, twice: with ``C`` the core count, and with the
cores free just before the run (``cost.available_cores``, measured), on which the target
is read: on a machine that other programs keep busy, the count overstates what the ranks
get (the table says when the load average was above 3).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .measure import _GLIBC_DEFAULT, _M_MMAP_THRESHOLD, _glibc, peak_rss_bytes, steady_heap
from .report import Targets, table

NAME = "distributed"
DESCRIPTION = "sequence parallelism on 1, 2 and 4 local gloo processes: memory, bytes, balance, cost model"
N, H, D = 16384, 8, 64
QUICK_N = 1024
MEMORY_TARGETS = {2: 0.6, 4: 0.35}
BALANCE_TARGET = 1.1
MODEL_TOLERANCE = 0.30


def rank_case(rank: int, world: int, spec: dict) -> dict:
    """One step on one rank (run in a spawned process): memory, bytes, work, time."""
    import qkv
    import qkv.distributed as qd
    from qkv.distributed import blocks, comm

    n, h, d = spec["n"], H, D
    kw = _keywords(spec, h)
    libc = _glibc()
    if libc is not None:  # a fixed mmap threshold: freed blocks go back, peak RSS follows live memory
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT)

    def step(length: int):
        rows = length if spec["strategy"] == "single" else qd.positions(length, layout=spec["layout"]).numel()
        q, k, v = (torch.randn(1, h, rows, d, requires_grad=True) for _ in range(3))
        if spec["strategy"] == "single":
            return q, k, v, qkv.attention(q, k, v, **kw)
        return q, k, v, qd.attention(q, k, v, strategy=spec["strategy"], layout=spec["layout"], **kw)

    # the same call at a small size first: the baseline then holds the kernels' code and the
    # threads' stacks, which every process pays once, whatever the length
    step(min(n, 1024))[3].sum().backward()
    base = peak_rss_bytes()
    blocks.computed["elements"] = 0
    start = time.perf_counter()
    with comm.counting() as forward:
        q, k, v, out = step(n)
    rows = q.shape[-2]
    elements = blocks.computed["elements"]
    with comm.counting() as backward:
        out.backward(torch.ones_like(out))
    peak = peak_rss_bytes() - base
    first = time.perf_counter() - start
    # the time of a second step: the first also pays one-time costs (pages of kernels and buffers)
    # and in a heap that keeps freed memory, as a long-running process's does: the fixed
    # 128 KiB mmap threshold that makes the peak honest also maps and faults in every
    # block's buffers afresh, which cost the P = 2 ring 30% of its time here
    q.grad = k.grad = v.grad = None
    del out
    with steady_heap():
        start = time.perf_counter()
        out = qkv.attention(q, k, v, **kw) if spec["strategy"] == "single" else \
            qd.attention(q, k, v, strategy=spec["strategy"], layout=spec["layout"], **kw)  # fmt: skip
        out.backward(torch.ones_like(out))
        seconds = time.perf_counter() - start
    return {"peak": peak, "forward": dict(forward.sent), "backward": dict(backward.sent),
            "elements": elements, "seconds": seconds, "first": first, "rows": rows}  # fmt: skip


def _keywords(spec: dict, h: int) -> dict:
    from qkv import masks
    from qkv.positional import ALiBi

    kw: dict = {"causal": True}
    if spec["kind"] == "alibi":
        kw["bias"] = ALiBi(h)
    elif spec["kind"] == "window":
        kw["mask"] = masks.window(256)
        kw["causal"] = False
    return kw


def _run(spec: dict, world: int, say) -> list[dict]:
    from qkv.distributed.launch import run_local

    threads = max(1, (os.cpu_count() or 1) // world)
    say(f"  {spec['kind']} {spec['strategy']} {spec['layout']} P={world} ...")
    return run_local("qkv.bench.distributed:rank_case", world, spec, timeout=7200, threads=threads)


def section(quick: bool, say) -> str:
    n = QUICK_N if quick else N
    targets, lines = Targets(), [f"## {NAME}", "", DESCRIPTION + ".", ""]
    lines += [f"n = {n}, b = 1, h = g = {H}, d = {D}, float32; memory and bytes of a first forward + backward, "
              f"time of a second; {os.cpu_count()} cores shared by the P processes (Ulysses splits heads "
              "evenly, so its work column is empty).", ""]  # fmt: skip
    shard = lambda p: n / p * H * D * 4  # noqa: E731 - bytes of one rank's q (or k, or v)
    runs, rows = {}, []
    for kind in ("causal", "alibi", "window"):
        single = _run({"n": n, "kind": kind, "strategy": "single", "layout": "zigzag"}, 1, say)[0]
        runs[kind, "single", 1] = [single]
        rows.append([kind, "one process", 1, _mb(single["peak"]), "1", "-", "-", "-", f"{single['seconds']:.2f}"])
        for strategy, layout in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")):
            if kind != "causal" and strategy == "ulysses":
                continue
            for p in (2, 4):
                checked = (kind, strategy, layout) == ("causal", "ring", "zigzag")  # the cost model's check
                if checked:  # the machine as the run finds it: its free cores and its speed, just before
                    runs["available", p] = _available(say)
                    runs["compute", p] = _compute(say, quick)
                result = _run({"n": n, "kind": kind, "strategy": strategy, "layout": layout}, p, say)
                runs[kind, f"{strategy} {layout}", p] = result
                if checked:
                    runs["load", p] = os.getloadavg()[0]
                peak = max(r["peak"] for r in result)
                work = [r["elements"] for r in result]
                fwd = max(sum(r["forward"].get(x, 0) for x in ("kv", "a2a")) for r in result)
                formula = (p - 1) * 2 * shard(p) if strategy == "ring" else 4 * (p - 1) / p * shard(p)
                balance = max(work) / max(1, min(work)) if strategy == "ring" else float("nan")  # Ulysses: even by heads
                rows.append([kind, f"{strategy} {layout}", p, _mb(peak), f"{peak / single['peak']:.2f}",
                             _mb(fwd), f"{fwd / formula:.2f}", "-" if balance != balance else f"{balance:.2f}",
                             f"{max(r['seconds'] for r in result):.2f}"])  # fmt: skip
                if strategy == "ring" and layout == "zigzag":
                    targets.add(f"{kind}: peak memory per rank / one process, P = {p}", peak / single["peak"],
                                MEMORY_TARGETS[p])  # fmt: skip
                    if kind != "window":
                        targets.add(f"{kind}: work max/min across ranks, zigzag, P = {p}", balance, BALANCE_TARGET)
    lines += table(["mask/bias", "strategy", "P", "peak MB/rank", "x one process", "fwd MB sent/rank",
                    "x formula", "work max/min", "step s"], rows)  # fmt: skip
    lines += ["", "Bytes sent forward are the largest over ranks; ring's formula is (P-1)·2·(n/P)·g·d·4, "
              "Ulysses' 4·(P-1)/P·(n/P)·h·d·4. The ring sends a piece of K/V only to ranks whose queries see "
              "some of it, so under a causal mask it sends less than the formula, and with a window only to "
              "the ranks the window reaches."]  # fmt: skip
    window = [max(r["forward"].get("kv", 0) for r in runs["window", "ring zigzag", p]) for p in (2, 4)]
    lines += ["", f"Window 256, ring zigzag: largest forward K/V bytes of a rank {window[0] / 2**20:.2f} MB at P = 2, "
              f"{window[1] / 2**20:.2f} MB at P = 4: each rank sends only to the ranks the window reaches, so this "
              "is bounded whatever P (the fake-process-group test checks P = 64 and 512 send the same)."]  # fmt: skip
    lines += ["", *_model_section(n, runs, targets, say, quick)]
    lines += ["", "### Targets", "", *targets.lines()]
    return "\n".join(lines) + "\n"


def _compute(say, quick: bool):
    """The block compute's ``c0``, ``γ`` (``cost.fit_compute``) on this machine now."""
    from qkv.distributed import cost

    say("  timing the block compute now ...")
    return cost.fit_compute(sides=(64, 128, 256) if quick else (128, 256, 512))  # (blocks of a ring piece's size)


def _available(say) -> float:
    """Cores free for the ranks right now (``cost.available_cores``): fewer than the count on a busy machine."""
    from qkv.distributed import cost

    say("  measuring the cores free now ...")
    return cost.available_cores()


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _model_section(n: int, runs: dict, targets: Targets, say, quick: bool) -> list[str]:
    from qkv.distributed import cost

    say("  fitting the cost model (gloo ping-pong, block timings) ...")
    link = cost.fit_link()
    compute = _compute(lambda line: None, quick)  # for the extrapolations: this machine's speed at the end
    cores = os.cpu_count() or 1
    shape = cost.Shape(n, H, H, D, D)
    lines = ["### Cost model", "",
             f"Fitted here: gloo α = {link.alpha * 1e6:.0f} µs, β = 1/({link.gbytes_per_s:.2f} GB/s); "
             f"compute {compute.gamma * 1e12:.1f} ps per pair·head·(d+e) on one thread, {compute.c0 * 1e3:.2f} ms "
             "per block call.", ""]  # fmt: skip
    rows, busy = [], []
    for p in (2, 4):
        measured = statistics.median([r["seconds"] for r in runs["causal", "ring zigzag", p]])
        threads = max(1, cores // p)  # as _run starts the ranks
        at_run = runs["compute", p]  # the block compute timed just before this run: the host's speed drifts
        nominal = cost.ring(shape, p, link, at_run, cores=cost.cores_per_rank(p, cores, threads))
        free = runs["available", p]
        predicted = cost.ring(shape, p, link, at_run, cores=cost.cores_per_rank(p, free, threads))
        error = abs(predicted - measured) / measured
        load = runs["load", p]
        busy += [p] if load > 3 else []
        rows.append([p, f"{measured:.2f}", f"{at_run.gamma * 1e12:.1f}", f"{nominal:.2f}",
                     f"{abs(nominal - measured) / measured:.0%}", f"{free:.2f}", f"{predicted:.2f}", f"{error:.0%}",
                     f"{load:.1f}"])  # fmt: skip
        targets.add(f"cost model vs measured ring step, P = {p} (relative error)", error, MODEL_TOLERANCE)
    lines += table(["P", "measured s (median rank)", "γ before the run, ps", f"predicted s ({cores} cores)", "error",
                    "cores free", "predicted s (cores free)", "error", "load"], rows)  # fmt: skip
    lines += ["", f"Each rank computes on min(threads, C/P) cores of the C it shares (time sharing): C = {cores}, "
              "the core count, or the cores free just before the run, measured by running the block kernel in "
              f"{cores} processes at once (cost.available_cores); the target is read on the latter. The block "
              "compute (c0, γ) of each check is timed just before its run, as the free cores are: on a shared "
              "host the speed of a core drifts from minute to minute (γ fitted minutes apart differed by up to "
              "1.6x on the Intel Xeon), which a fit at the end of the suite would count as the model's error. "
              "Load: the 1-minute load average after the run."]  # fmt: skip
    if busy:
        lines += ["", f"The machine was busy (load average > 3 at P = {', '.join(map(str, busy))}): other "
                  "programs shared the cores, so these times are slower than on a quiet machine."]  # fmt: skip
    lines += ["", "Predicted time per layer (forward + backward), causal, h = g = 8, d = 64, float32, one core "
              "per rank at this machine's speed; hybrid = Ulysses over 8 ranks (a node, inner link NDR) x ring:", ""]
    header = ["n", "link", "P", "ring s", "Ulysses s", "hybrid s"]
    rows = []
    for length in (n, 2**20):
        for key, lk in (("fitted", link), *cost.LINKS.items()):
            for p in (1, 8, 64, 1024):
                got = cost.predict(cost.Shape(length), p, lk, compute, cores=1.0, inner=cost.LINKS["IB-NDR"])
                rows.append([length, lk.name, p, *[("-" if got[s] is None else f"{got[s]:.3g}")
                                                  for s in ("ring", "ulysses", "hybrid")]])  # fmt: skip
    lines += table(header, rows)
    lines += ["", "Links: " + "; ".join(f"{lk.name}: {lk.source}" for lk in cost.LINKS.values()) + "."]
    plot = _plot(n, runs, link, compute)
    if plot:
        lines += ["", f"![predicted and measured scaling]({plot})"]
    return lines


def _plot(n: int, runs: dict, link, compute) -> str | None:
    """``distributed_scaling.png`` beside the results file: predicted time per layer against P, measured points on top."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from qkv.distributed import cost

    ps = [2**k for k in range(11)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    for ax, length in zip(axes, (n, 2**20)):
        for key, lk in (("fitted", link), ("IB-EDR", cost.LINKS["IB-EDR"])):
            for strategy, style in (("ring", "-"), ("hybrid", "--")):
                xs, ys = [], []
                for p in ps:
                    got = cost.predict(cost.Shape(length), p, lk, compute, inner=cost.LINKS["IB-NDR"])[strategy]
                    if got is not None:
                        xs.append(p), ys.append(got)
                name = "ring" if strategy == "ring" else "hybrid: Ulysses in 8-rank NDR nodes, ring"
                ax.plot(xs, ys, style, label=f"{name} on {lk.name}")
        if length == n:
            cores = os.cpu_count() or 1
            measured = [(p, statistics.median([r["seconds"] for r in runs["causal", "ring zigzag", p]])) for p in (2, 4)]
            # as the table predicts them: each checked run from the compute timed just before it, on the cores free then
            share = {p: cost.cores_per_rank(p, runs.get(("available", p), cores), max(1, cores // p)) for p in (1, 2, 4)}
            here = [(p, cost.ring(cost.Shape(n), p, link, runs.get(("compute", p), compute), cores=share[p]))
                    for p in (1, 2, 4)]  # fmt: skip
            measured.insert(0, (1, runs["causal", "single", 1][0]["seconds"]))
            ax.plot(*zip(*here), "kx", label=f"predicted here ({cores} cores shared by the P ranks; compute and free "
                    "cores measured before each run)")
            ax.plot(*zip(*measured), "ko", label="measured here (P = 1: qkv.attention in one process)")
        ax.set(xscale="log", yscale="log", xlabel="ranks P (one core each)", ylabel="s per layer (fwd + bwd)",
               title=f"causal, n = {length}, h = 8, d = 64")  # fmt: skip
    # one legend for both panels, below them: inside either it hides the curves
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    from . import figures  # beside the results file this run writes

    path = figures / "distributed_scaling.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
