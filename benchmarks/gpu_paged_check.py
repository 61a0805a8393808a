"""The paged serving primitives on a GPU, in one go: parity against float64 on the CPU, and decode-step timings.

Shape legend: ``R`` requests, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``c`` latent
size, ``r`` rotary size, ``P`` page size.

    python benchmarks/gpu_paged_check.py                         # on CUDA: well under a minute
    python benchmarks/gpu_paged_check.py --device cpu --quick    # the same, tiny, on the CPU (the tests run this)

The cases are the serving suite's (``qkv bench --suite serving``), made on the chosen device:

* **decode**: a decoding step of ``R`` requests (lengths 64 to 2048, h = 8, g = 2, d = 64,
  P = 16) through ``qkv.paged_attention``, pages laid out as ``qkv.PagedKVCache`` lays them
  (keys and values in pools of their own: FlashInfer's tuple form); **decode, one-tensor
  cache** the same step on FlashInfer's ``(num_pages, 2, P, g, d)`` form;
* **decode, varlen_attn with a block table**: the same step through ``qkv.varlen_attn``
  (PyTorch's varlen dialect: ``block_table``, ``seqused_k``; float32, so qkv's engines, not
  PyTorch's half-precision kernel);
* **ragged**: 4 prefill chunks of 512 and ``R - 4`` decoding steps in one call;
* **latent**: an MLA decoding step through ``qkv.paged_latent_attention`` (16 heads, c = 512,
  r = 64), the two caches halves of one buffer.

**Parity**: each case in float32 on the device against the same call in float64 on the CPU
(the float64 paths are checked against the attention written out in ``tests/``); the bound is
``1e-4`` of the largest output value (float32 attention over at most 2048 keys). **Timings**
(float32): median milliseconds of the call against a loop of ``F.scaled_dot_product_attention``
over each request's contiguous cache (what one would write without a page table), both on
the device. It prints a markdown table and exits 1 when a parity check fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))  # a checkout, not installed
import qkv  # noqa: E402

H, G, D, P = 8, 2, 64, 16
LATENT_H, C, R_DIM = 16, 512, 64
BOUND = 1e-4


def _layout(lengths: list[int], gen: torch.Generator):
    """Each request's pages consecutive from a block boundary (``PagedKVCache.reserve``): ``(pages per request, pool size)``."""
    counts = [-(-n // P) for n in lengths]
    pages, at = [], 0
    for c in counts:
        pages.append(list(range(at, at + c)))
        at += 16 * -(-c // 16)
    return pages, at


def _table(qo: list[int], lengths: list[int], pages: list[list[int]]):
    last = [n - (len(ps) - 1) * P for n, ps in zip(lengths, pages)]
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()])  # noqa: E731
    return cum(qo), cum([len(ps) for ps in pages]), torch.tensor([p for ps in pages for p in ps]), torch.tensor(last)


def cases(R: int, low: int, high: int, chunk: int, seed: int = 0) -> dict:
    """``{name: (prepare(device, dtype) -> call, loop(device) -> call or None)}`` for each case, from shared
    float64 inputs; a call takes no argument and runs on tensors already on the device."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (R,), generator=gen).tolist()
    pages, size = _layout(lengths, gen)
    kv = torch.randn(size, 2, P, G, D, generator=gen, dtype=torch.float64)
    q = torch.randn(R, H, D, generator=gen, dtype=torch.float64)
    ragged_lengths = [2 * chunk] * 4 + lengths[4:]
    ragged_pages, ragged_size = _layout(ragged_lengths, gen)
    kv_ragged = torch.randn(ragged_size, 2, P, G, D, generator=gen, dtype=torch.float64)
    qo_ragged = [chunk] * 4 + [1] * (R - 4)
    q_ragged = torch.randn(sum(qo_ragged), H, D, generator=gen, dtype=torch.float64)
    latent = torch.randn(size, P, C + R_DIM, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(R, LATENT_H, C, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(R, LATENT_H, R_DIM, generator=gen, dtype=torch.float64)
    scale = (128 + R_DIM) ** -0.5

    def paged(cache, qs, qo, lens, pgs, one_tensor=False):
        def prepare(device, dtype):
            table = [t.to(device) for t in _table(qo, lens, pgs)]
            pools = (cache.to(device, dtype) if one_tensor else
                     (cache[:, 0].to(device, dtype).contiguous(), cache[:, 1].to(device, dtype).contiguous()))  # fmt: skip
            q_ = qs.to(device, dtype)
            return lambda: qkv.paged_attention(q_, pools, *table)

        return prepare

    def loop(cache, qs, lens, pgs):
        def run(device):
            ks = [cache[ps, 0].reshape(-1, G, D)[:n].transpose(0, 1)[None].to(device, torch.float32).contiguous()
                  for ps, n in zip(pgs, lens)]  # fmt: skip
            vs = [cache[ps, 1].reshape(-1, G, D)[:n].transpose(0, 1)[None].to(device, torch.float32).contiguous()
                  for ps, n in zip(pgs, lens)]  # fmt: skip
            q32 = qs.to(device, torch.float32)
            return lambda: [F.scaled_dot_product_attention(q32[r][None, :, None], k, v, enable_gqa=True)
                            for r, (k, v) in enumerate(zip(ks, vs))]  # fmt: skip

        return run

    def latent_call(device, dtype):
        buf = latent.to(device, dtype)
        table = [t.to(device) for t in (torch.arange(R + 1), *_table([1] * R, lengths, pages)[1:3], torch.tensor(lengths))]
        qn, qp = q_nope.to(device, dtype), q_pe.to(device, dtype)
        return lambda: qkv.paged_latent_attention(qn, qp, buf[..., :C], buf[..., C:], *table, sm_scale=scale)

    def latent_loop(device):
        keys = [latent[ps].reshape(-1, C + R_DIM)[:n][None, None].to(device, torch.float32).contiguous()
                for ps, n in zip(pages, lengths)]  # fmt: skip
        q32 = torch.cat((q_nope, q_pe), -1).to(device, torch.float32)
        return lambda: [F.scaled_dot_product_attention(q32[r][None, None], k, k, scale=scale)[..., :C] for r, k in enumerate(keys)]

    def varlen(device, dtype):  # the same step in PyTorch's varlen dialect: a block table and each request's key count
        pools = (kv[:, 0].to(device, dtype).contiguous(), kv[:, 1].to(device, dtype).contiguous())
        width = max(len(ps) for ps in pages)
        table = torch.tensor([ps + [0] * (width - len(ps)) for ps in pages], dtype=torch.int32, device=device)
        used = torch.tensor(lengths, dtype=torch.int32, device=device)
        cu_q, q_ = torch.arange(R + 1, dtype=torch.int32, device=device), q.to(device, dtype)
        return lambda: qkv.varlen_attn(q_, *pools, cu_q, None, 1, max(lengths), window_size=(-1, 0), enable_gqa=True,
                                       seqused_k=used, block_table=table)  # fmt: skip

    return {
        "decode": (paged(kv, q, [1] * R, lengths, pages), loop(kv, q, lengths, pages)),
        "decode, varlen_attn with a block table": (varlen, loop(kv, q, lengths, pages)),
        "decode, one-tensor cache": (paged(kv, q, [1] * R, lengths, pages, one_tensor=True), loop(kv, q, lengths, pages)),
        "ragged": (paged(kv_ragged, q_ragged, qo_ragged, ragged_lengths, ragged_pages), None),
        "latent": (latent_call, latent_loop),
    }


def median_ms(fn, reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="6 requests of 8 to 64 keys, chunks of 16, 2 repeats")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the CPU")
        return 1
    size = dict(R=6, low=8, high=64, chunk=16) if args.quick else dict(R=32, low=64, high=2048, chunk=512)
    reps = 2 if args.quick else args.reps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, {size['R']} requests")
    rows, failed = [], False
    for case, (prepare, loop) in cases(**size).items():
        with torch.no_grad():
            want = prepare(torch.device("cpu"), torch.float64)()
            call = prepare(device, torch.float32)
            got = call().double().cpu()
            err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
            ok = err <= BOUND
            failed |= not ok
            ours = median_ms(call, reps, device)
            theirs = median_ms(loop(device), reps, device) if loop is not None else None
        ratio = "" if theirs is None else f"{ours / theirs:.2f}"
        rows.append(f"| {case} | {'pass' if ok else 'FAIL'} | {err:.1e} | {ours:.2f} | "
                    f"{'' if theirs is None else f'{theirs:.2f}'} | {ratio} |")  # fmt: skip
    print("| case | parity | error / largest value | qkv ms | loop of SDPA ms | qkv / loop |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
