"""The CUDA path on a GPU, in one go: dispatch, parity against the reference backend, and timings against SDPA.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` head size; every case is b = 2, h = 8, d = 64 at i = j = 4096 unless it says
otherwise (one shape per case: each flex configuration is compiled once, for both its
parity check and its timings).

    python benchmarks/gpu_check.py            # meant to take under 3 minutes on an H100
    python benchmarks/gpu_check.py --quick    # dispatch and parity only, no timings
    python benchmarks/gpu_check.py --cases ALiBi,documents    # only the cases whose names hold these
    python benchmarks/gpu_check.py --cases "decoding,hidden keys"    # and the check of padding holding nan

Most of the time is torch.compile building flex's kernels (about ten configurations,
forward and backward; a second run reads inductor's on-disk cache). Each case prints its
seconds as it finishes.

What it checks, per case (``CASES``):

* **dispatch**: ``qkv.explain`` on the real CUDA tensors names the backend the table in
  ``qkv.backends`` promises (``sdpa`` / ``flex`` / ``chunked``); the cases marked ``lane``
  (plain causal, causal with ``i < j``, padded decoding steps) must take ``qkv.attention``'s
  plain-call lane, no request built (``qkv.backends.sdpa_plain``);
* **hidden keys** (:func:`hidden_keys_check`): nan and inf in padding reach no output or
  gradient, through the lane and through flex;
* **parity**, forward and backward (the output, the log-sum-exp where asked, and the
  gradients of q, k, v and of every learned tensor: T5's table, a dense bias, sinks, a
  score_mod's captured table), against ``backend="reference"`` in float64 on the same
  rounded inputs. The bound follows ``tests/test_backends_bf16.py``: at most twice as far
  off as the yardstick (ten times in float32, PyTorch's own factor for flex_attention), eager PyTorch attention on the same low-precision inputs (qkv's
  reference backend in that dtype: float32 logits, the softmax, ``@ v``), plus one rounding
  of the result's largest value (``2^-8`` in bfloat16, ``8 · 2^-24`` in float32). float64
  calls (which flex declines: they run the chunked engines' public ops on CUDA) must agree
  to ``1e-9`` of the largest value;
* **timings** (bfloat16): median milliseconds of the forward (with gradients enabled, as in
  training) and of forward + backward, against ``F.scaled_dot_product_attention`` given
  the same call the way one would write it without qkv: the bias and the mask materialised
  as one additive ``attn_mask`` (a score_mod or sinks, which SDPA cannot express, left
  out: the row says "w/o"), the causal flag, or ``causal_lower_right``. Block masks are
  cached per mask and lengths, as across the layers of a model: the cold build is timed
  apart (``mask ms``). "graphs compiled while timing" should be 0: the calls reuse the
  kernels their parity check compiled (a nonzero count means a guard fails call after call).

It prints the device and a markdown table, and exits 1 when any dispatch or parity check
fails (an exception in a case counts as a failure and is printed). The dynamo recompile
limit is raised here: the cases are eight flex configurations in one process, torch's
default limit for one function, past which flex falls back to its unfused eager path.

First run on an NVIDIA H200 (torch 2.11.0+cu130): every check passed, about a minute in
all; its table is in ``benchmarks/RESULTS.md`` under that GPU.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import qkv  # noqa: E402
from qkv.backends.tiling import flex_lowering  # noqa: E402

DEV = "cuda"
B, H, G, I, D = 2, 8, 2, 4096, 64
#: How much further off than the yardstick a result may be: 2 in low precision; 10 in float32,
#: PyTorch's own factor for flex_attention in float32 (its online softmax and GQA's summed
#: dk/dv rounding differently from one float32 matmul).
FUDGE = {torch.float32: 10.0}
SLACK = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 8 * 2.0**-24}


# --------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """One kind of call: its kwargs (made per dtype from float64 masters), the path it should take, SDPA's version."""

    name: str
    expect: str  # the backend qkv.explain must name (the head line, up to its kernel in brackets)
    kwargs: Callable  # (dtype, reference: bool) -> (kwargs of qkv.attention, learned leaves)
    sdpa: str | None = "mask"  # SDPA's call: "mask" (bias and mask as one attn_mask), "flag" (is_causal),
    #                            "lower_right" (causal_lower_right), None (not timed against SDPA)
    sdpa_note: str = ""  # what SDPA's call leaves out ("w/o soft cap")
    i: int = I
    j: int = I
    heads: tuple[int, int] = (H, G)
    fp32: bool = False  # also check float32 parity (each dtype compiles flex anew)
    dtypes: tuple = (torch.bfloat16,)
    also: tuple[str, ...] = ()  # other backends to check and time on the same call (forced)
    lane: bool = False  # qkv.attention's plain-call lane must take it (no request built: backends.sdpa_plain)


def master(shape, seed, scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=DEV, dtype=torch.float64) * scale


def leaf(x64, dtype, reference):
    """``x64`` rounded to ``dtype``; in float64 again for the reference (the same values): a leaf that wants its gradient."""
    x = x64.to(dtype)
    return (x.double() if reference else x).detach().requires_grad_()


def lengths_b():
    return torch.tensor([1000, I], device=DEV)


def documents():
    sizes = torch.tensor([1500, 700, 1200, 696], device=DEV)  # sums to 4096
    return torch.repeat_interleave(torch.arange(4, device=DEV), sizes)


def alibi_causal(dtype, reference):
    return {"bias": qkv.ALiBi(H).to(DEV), "causal": True}, []


def t5_lengths(dtype, reference):
    torch.manual_seed(11)
    t5 = qkv.RelativePositionBias(H, 32, 128).to(DEV).double()
    with torch.no_grad():
        t5.embedding.weight.mul_(20)  # a bias that matters against logits of order 1
    t5 = copy.deepcopy(t5).to(dtype)
    t5 = t5.double() if reference else t5
    return {"bias": t5, "mask": qkv.masks.lengths(lengths_b())}, list(t5.parameters())


def softcap_documents(dtype, reference):
    return {"score_mod": qkv.SoftCap(5.0), "mask": qkv.masks.documents(documents()), "causal": True}, []


def table_window(dtype, reference):
    rel = leaf(master((2 * I,), 12, 0.5), dtype, reference)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + I]

    return {"score_mod": relative, "mask": qkv.masks.window(256)}, [rel]


def sinks_bias_lse(dtype, reference):
    sinks = leaf(master((H,), 13), dtype, reference)
    bias = leaf(master((1, 1, I, I), 14, 0.5), dtype, reference)
    return {"sinks": sinks, "bias": bias, "causal": True, "return_lse": True}, [sinks, bias]


def documents_only(dtype, reference):
    return {"mask": qkv.masks.documents(documents()), "causal": True}, []


def causal(dtype, reference):
    return {"causal": True}, []


def decode(dtype, reference):
    return {"mask": qkv.masks.lengths(lengths_b()), "causal": True}, []


def decode_left_padded(dtype, reference):
    """Left padding, a row of padding only (its start at j: it sees no key, its output 0) beside one that starts at 100."""
    return {"mask": qkv.masks.starts(torch.tensor([I, 100], device=DEV)), "causal": True}, []


CASES = [
    Case("causal", "backend: sdpa", causal, sdpa="flag", lane=True),
    Case("causal, i < j (i = 1024)", "backend: sdpa", causal, sdpa="lower_right", i=1024, heads=(H, H),
         dtypes=(torch.bfloat16, torch.float32), lane=True),
    Case("ALiBi, causal, GQA 8/2", "backend: flex", alibi_causal, fp32=True),
    Case("T5 buckets (learned), lengths", "backend: flex", t5_lengths),
    Case("SoftCap, documents & causal", "backend: flex", softcap_documents, sdpa_note="w/o soft cap"),
    Case("score_mod table (learned), window 256", "backend: flex", table_window, sdpa_note="w/o score_mod"),
    Case("sinks, dense bias (learned), causal, lse", "backend: flex", sinks_bias_lse, sdpa_note="w/o sinks", fp32=True),
    Case("documents & causal (mask only)", "backend: flex", documents_only, also=("segments",)),
    Case("decoding step, lengths (i = 1)", "backend: sdpa", decode, i=1, lane=True),
    Case("decoding step, starts, a row with no key (i = 1)", "backend: sdpa", decode_left_padded, i=1, lane=True,
         sdpa=None),
    Case("ALiBi, causal, float64", "backend: chunked", alibi_causal, sdpa=None, i=1024, j=1024, dtypes=(torch.float64,)),
]  # fmt: skip


def full_mask(kw: dict) -> qkv.masks.Mask | None:
    mask = kw.get("mask")
    if kw.get("causal"):
        mask = qkv.masks.causal() if mask is None else mask & qkv.masks.causal()
    return mask


def sdpa_kwargs(case: Case, kw: dict, dtype) -> dict | None:
    """``F.scaled_dot_product_attention``'s version of the call (besides q, k, v), as one would write it without qkv."""
    if case.sdpa == "flag":
        return {"is_causal": True}
    if case.sdpa == "lower_right":
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(case.i, case.j)}
    if case.sdpa != "mask":
        return None
    bias, mask = kw.get("bias"), full_mask(kw)
    add = torch.zeros((), device=DEV, dtype=dtype)
    if bias is not None:
        with torch.no_grad():
            add = (bias.dense(case.i, case.j, DEV) if isinstance(bias, qkv.positional.LazyBias) else bias).to(dtype) + add
    if mask is not None:
        add = add.masked_fill(~mask.dense(case.i, case.j, DEV), float("-inf"))
    return {"attn_mask": add.detach()}


# --------------------------------------------------------------------------- parity


def results(case: Case, dtype, reference: bool, backend: str) -> tuple[list, list]:
    """``(outputs, gradients)`` of one call: inputs rounded to ``dtype`` (in float64 again for the reference).

    Outputs are the output (and the log-sum-exp); gradients those of q, k, v and every
    learned tensor, for fixed cotangents rounded to ``dtype`` as the inputs are.
    """
    h, g = case.heads
    x64 = [master((B, h, case.i, D), 1), master((B, g, case.j, D), 2), master((B, g, case.j, D), 3)]
    q, k, v = (leaf(x, dtype, reference) for x in x64)
    kw, params = case.kwargs(dtype, reference)
    got = qkv.attention(q, k, v, backend=backend, **kw)
    outs = list(got) if isinstance(got, tuple) else [got]
    cots = [master(o.shape, 99 + n).to(dtype).to(o.dtype) for n, o in enumerate(outs)]
    cots = [torch.where(torch.isfinite(o), c, 0) for o, c in zip(outs, cots)]  # rows with lse = -inf: no gradient
    grads = torch.autograd.grad(outs, [q, k, v, *params], cots)
    return [o.detach() for o in outs], list(grads)


def max_err(a, b) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return math.inf  # a NaN, or an -inf (a row with no key) in one only
    return float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0


def largest(x) -> float:
    finite = torch.isfinite(x)
    return float(x[finite].abs().max()) if bool(finite.any()) else 0.0


def parity(case: Case, dtype, backend: str) -> tuple[bool, str]:
    """``(passed, "worst error / bound (which)")`` over the outputs and every gradient."""
    exact_outs, exact_grads = results(case, dtype, True, "reference")
    outs, grads = results(case, dtype, False, backend)
    labels = ["out", "lse"][: len(outs)] + ["dq", "dk", "dv"] + [f"d(learned {n})" for n in range(len(grads) - 3)]
    got, exact = outs + grads, exact_outs + exact_grads
    if dtype == torch.float64:
        bounds = [1e-9 * max(1.0, largest(b)) for b in exact]
    else:
        yard_outs, yard_grads = results(case, dtype, False, "reference")
        factor = FUDGE.get(dtype, 2.0)
        bounds = [factor * max_err(y, b) + SLACK[dtype] * largest(b) for y, b in zip(yard_outs + yard_grads, exact)]
    ratios = [max_err(a, b) / bound if bound > 0 else (0.0 if max_err(a, b) == 0 else math.inf)
              for a, b, bound in zip(got, exact, bounds)]  # fmt: skip
    n = max(range(len(ratios)), key=ratios.__getitem__)
    return ratios[n] <= 1.0, f"{ratios[n]:.2f} ({labels[n]})"


def hidden_keys_check(failures: list) -> str:
    """Padding holding nan and inf (a cache made by ``torch.empty``) never reaches an output or a gradient.

    bfloat16, right padding of ``lengths_b()``: a decoding step (the plain-call lane) and a
    causal prefill (flex), each against the same call on finite padding. The output must be
    equal bit for bit (the hidden keys are zeroed before the kernel on a GPU); the gradients
    within one bfloat16 rounding of their largest value, a margin for a backward whose sums
    may run in no fixed order: in one run of four on an H200 the first version of this check
    (the output and the gradients bit for bit, together) failed on the decoding step with
    every value finite, which tensor differed unrecorded, and not in the runs before or after
    it. Two runs on finite padding are compared too, to show how far the kernel's own runs
    differ.
    """
    said = []
    for name, i in (("decoding step", 1), ("prefill", I)):
        x64 = [master((B, H, i, D), 21), master((B, G, I, D), 22), master((B, G, I, D), 23)]
        hidden = ~qkv.masks.lengths(lengths_b()).dense(1, I, DEV)[:, :, 0, :, None]  # (b, 1, j, 1)
        runs = []
        for spoil in (False, True, False):  # the last: the first again, how far two runs of one call differ
            q, k, v = (x.to(torch.bfloat16) for x in x64)
            if spoil:
                k, v = torch.where(hidden, float("nan"), k), torch.where(hidden, float("inf"), v)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = qkv.attention(q, k, v, mask=qkv.masks.lengths(lengths_b()), causal=True)
            grads = torch.autograd.grad(out, [q, k, v], master(out.shape, 24).to(out.dtype))
            runs.append([out.detach(), *grads])
        finite = all(bool(torch.isfinite(x).all()) for x in runs[1])
        off = [float((a.double() - b.double()).abs().max()) / max(largest(b), 1e-30) for a, b in zip(*runs[:2])]
        again = max(float((a.double() - b.double()).abs().max()) / max(largest(b), 1e-30) for a, b in zip(runs[0], runs[2]))
        same = finite and off[0] == 0 and max(off[1:]) <= 2.0**-8
        said.append(f"{name} {'ok' if same else 'FAILED'} (gradients off by {max(off[1:]):.1e} of their largest; "
                    f"two runs on finite padding by {again:.1e})")  # fmt: skip
        if not same:
            failures.append(f"hidden keys ({name}): nan/inf padding changed the output or a gradient "
                            f"(finite: {finite}; off by, as a fraction of the largest value: out, dq, dk, dv = "
                            f"{', '.join(f'{x:.1e}' for x in off)})")  # fmt: skip
    return ", ".join(said)


# --------------------------------------------------------------------------- timings


def median_ms(fn: Callable[[], None], reps: int) -> float:
    for _ in range(3):  # warm-up: compiles (if parity has not), fills the block-mask cache
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def timings(case: Case, reps: int, backend: str = "auto") -> dict:
    """Median ms of qkv's forward and forward + backward (bf16), SDPA's, and the cold block-mask build."""
    dtype = torch.bfloat16
    h, g = case.heads
    q, k, v = (leaf(x, dtype, False) for x in (master((B, h, case.i, D), 1), master((B, g, case.j, D), 2), master((B, g, case.j, D), 3)))
    kw, _ = case.kwargs(dtype, False)
    cot = master((B, h, case.i, D), 4).to(dtype)

    def qkv_fwd():
        qkv.attention(q, k, v, backend=backend, **kw)

    def qkv_fwd_bwd():
        out = qkv.attention(q, k, v, backend=backend, **kw)
        (out[0] if isinstance(out, tuple) else out).backward(cot)

    before = compiled_graphs()
    row = {"qkv fwd": median_ms(qkv_fwd, reps), "qkv fwd+bwd": median_ms(qkv_fwd_bwd, reps)}
    row["graphs"] = compiled_graphs() - before  # parity compiled this call already: 0 unless a guard fails per call
    skw = sdpa_kwargs(case, kw, dtype) if backend == "auto" else None
    if skw is not None:
        gqa = h != g

        def sdpa_fwd():
            F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **skw)

        def sdpa_fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **skw).backward(cot)

        row["sdpa fwd"], row["sdpa fwd+bwd"] = median_ms(sdpa_fwd, reps), median_ms(sdpa_fwd_bwd, reps)
    mask = full_mask(kw)
    if mask is not None and backend == "auto" and qkv.explain(q, k, v, **kw).startswith("backend: flex"):
        req = qkv.checks.request(q, k, v, score="scaled_dot", mask=mask, bias=None, causal=False, scale=None,
                                 dropout=0.0, return_weights=False)  # fmt: skip
        mod = flex_lowering.mask_mod(req)

        def cold():
            flex_lowering.clear_cache()
            flex_lowering.block_mask(req, mod)

        row["mask ms"] = median_ms(cold, max(3, reps // 4))
    return row


# --------------------------------------------------------------------------- the run


def environment() -> list[str]:
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return [
        f"device: {props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton_version}, "
        f"float32 matmul precision {torch.get_float32_matmul_precision()}",
        f"qkv.backends.flex_gpu.environment: {qkv.backends.flex_gpu.environment(torch.device(DEV)) or 'ready'}",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16 parity and dispatch only, no timings")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median)")
    parser.add_argument("--all-fp32", action="store_true", help="float32 parity for every case (more compiles)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names to run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU path (the CPU one is tests/)")
        return 2
    warnings.simplefilter("ignore")
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 512
    for line in environment():
        print(line)
    print()
    started = time.perf_counter()
    failures, rows = [], []
    wanted = [s.strip() for s in args.cases.split(",") if s.strip()]
    for case in CASES:
        if wanted and not any(w in case.name for w in wanted):
            continue
        t0 = time.perf_counter()
        row = {"case": case.name}
        rows.append(row)
        try:
            h, g = case.heads
            probe_dtype = case.dtypes[0]
            q = torch.empty(B, h, case.i, D, device=DEV, dtype=probe_dtype)
            kv = torch.empty(B, g, case.j, D, device=DEV, dtype=probe_dtype)
            kw, _ = case.kwargs(probe_dtype, False)
            said = qkv.explain(q, kv, kv, **kw)
            row["path"] = said.splitlines()[0].removeprefix("backend: ")
            if not said.startswith(case.expect):
                failures.append(f"{case.name}: expected {case.expect!r}, qkv.explain says:\n{said}")
            if case.lane and qkv.backends.sdpa_plain.plan(q, kv, kv, "scaled_dot", kw.get("causal", False), None,
                                                          kw.get("mask")) is None:  # fmt: skip
                failures.append(f"{case.name}: the plain-call lane declined it")
            row["path"] += " [plain-call lane]" if case.lane else ""
            backend = case.expect.removeprefix("backend: ")
            dtypes = list(case.dtypes)
            if (case.fp32 or args.all_fp32) and torch.float32 not in dtypes and backend == "flex":
                dtypes.append(torch.float32)
            row["parity (err / bound)"] = check(case, dtypes, backend, failures)
            if not args.quick and torch.bfloat16 in case.dtypes:
                row.update(timings(case, args.reps))
            for other in case.also:
                extra = {"case": f"{case.name} [{other} forced]", "path": other}
                extra["parity (err / bound)"] = check(case, [torch.bfloat16], other, failures)
                if not args.quick:
                    extra.update(timings(case, args.reps, backend=other))
                rows.append(extra)
        except Exception as error:  # noqa: BLE001 (reported, and the run goes on to the next case)
            failures.append(f"{case.name}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
            row["parity (err / bound)"] = f"ERROR {type(error).__name__}"
        row["s"] = time.perf_counter() - t0
        print(f"  {case.name}: {row.get('path', '?')}, {row.get('parity (err / bound)', '')} ({row['s']:.0f} s)", flush=True)
    if not wanted or "hidden keys" in wanted:
        try:
            print(f"  hidden keys holding nan/inf: {hidden_keys_check(failures)}", flush=True)
        except Exception as error:  # noqa: BLE001 (reported as a failure)
            failures.append(f"hidden keys: {type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
    print()
    print(table(rows, case_notes={c.name: c.sdpa_note for c in CASES}))
    small = qkv.backends.flex_gpu._small_tiles
    print(f"\nkinds of flex call run with small tiles (dtype, d, grad, score_mod, learned, short): "
          f"{', '.join(map(str, sorted(small, key=str))) or 'none'}")
    print(f"total {time.perf_counter() - started:.0f} s")
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("\nall dispatch and parity checks passed")
    return 0


def check(case: Case, dtypes, backend: str, failures: list) -> str:
    """Parity in each dtype, as ``"bfloat16 0.41 (dq), float32 ..."``; failures noted."""
    said = []
    for dtype in dtypes:
        ok, worst = parity(case, dtype, backend)
        said.append(f"{str(dtype).removeprefix('torch.')} {worst}")
        if not ok:
            failures.append(f"{case.name} [{backend}]: {dtype} parity off: worst error / bound = {worst}")
    return ", ".join(said)


def table(rows: list[dict], case_notes: dict) -> str:
    def ms(row, key):
        return f"{row[key]:.2f}" if key in row else ""

    def ratio(row, a, b):
        return f"{row[a] / row[b]:.2f}" if a in row and b in row and row[b] > 0 else ""

    lines = [
        "| case | qkv path | parity bf16/fp32/fp64 (worst err / bound) | fwd qkv ms | fwd SDPA ms | qkv / SDPA "
        "| fwd+bwd qkv ms | fwd+bwd SDPA ms | qkv / SDPA | mask ms | graphs compiled while timing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        note = case_notes.get(row["case"], "")
        sdpa_label = f" ({note})" if note and "sdpa fwd" in row else ""
        lines.append(
            f"| {row['case']} | {row.get('path', '')} | {row.get('parity (err / bound)', '')} | {ms(row, 'qkv fwd')} "
            f"| {ms(row, 'sdpa fwd')}{sdpa_label} | {ratio(row, 'qkv fwd', 'sdpa fwd')} | {ms(row, 'qkv fwd+bwd')} "
            f"| {ms(row, 'sdpa fwd+bwd')} | {ratio(row, 'qkv fwd+bwd', 'sdpa fwd+bwd')} | {ms(row, 'mask ms')} "
            f"| {row.get('graphs', '')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
