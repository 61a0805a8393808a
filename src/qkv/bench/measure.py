"""Measuring tools for the benchmark suites: interleaved timing, peak memory, machine description.

Timing. A shared machine's speed drifts while a benchmark runs, so contenders are never
timed one after the other. :func:`interleaved` runs one call of each contender per round,
rotating the order every round, and keeps the median per contender; what is reported is
the ratio of medians taken in the same rounds.

Memory. The peak resident set of a process only ever grows, so each measurement runs in a
fresh ``python -m qkv.bench --case ...`` process (:func:`peak_memory`): it builds the
inputs, notes its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), makes one call, notes
the peak again and prints both. The difference is the memory the call needed above its
inputs.

Heap. glibc hands every block of 32 MiB or more (and, after a free, the top of its heap)
back to the kernel, so a method whose output is that large pays for faulting fresh pages
in on every call. :func:`steady_heap` keeps freed memory in the process for a suite's
timing, the steady state of a long-running process or of jemalloc/tcmalloc (which the
PyTorch CPU tuning guide recommends); exact SDPA at 16K faults nothing either way.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

#: ``ru_maxrss`` unit: KiB on Linux, bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def interleaved(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                before: Callable[[], object] | None = None) -> dict[str, float]:  # fmt: skip
    """Median seconds per call of each contender, over ``repeats`` rounds run in rotating order.

    ``before`` runs, untimed, before every timed call: :class:`Evict` starts each from cold
    caches, so that no contender reads what the one before it left in the cache."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before()
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


class Evict:
    """Writes a buffer larger than any CPU's last-level cache, evicting what a call before left there.

    A memory-bound contender that runs right after another reading the same memory finds it
    in cache: a paged decoding step timed after a first call over the same pages ran 0.5-0.8 ms
    (15-25%) faster than after a call over other memory. In a model each layer reads its own
    cache, cold, so contenders of such suites are timed from cold caches alike.
    """

    BYTES = 256 * 2**20  # last-level caches of the CPUs met: 32 MiB (AMD EPYC) to 105 MiB (Intel Xeon)

    def __init__(self):
        self._buffer = torch.ones(self.BYTES // 4)

    def __call__(self) -> None:
        self._buffer.add_(1.0)


def evicting(on: bool) -> Evict | None:
    """An :class:`Evict` to pass as :func:`interleaved`'s ``before`` where ``on`` (a full run), else None (a quick one)."""
    return Evict() if on else None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
_GLIBC_DEFAULT = 128 * 1024  # both thresholds' initial values


def call_or_step(fn: Callable[[], Tensor], grad: bool, cot: Tensor, inputs: tuple[Tensor, ...]) -> Callable[[], object]:
    """A contender's timed call: ``fn()`` under ``no_grad``, or ``fn()`` with a backward of ``cot``
    (the inputs' gradients cleared after, so every step does the same work)."""
    if not grad:
        def call():
            with torch.no_grad():
                return fn()
        return call

    def step():
        fn().backward(cot)
        for x in inputs:
            x.grad = None
    return step


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (musl and others have no such symbol)
    except (OSError, AttributeError):
        return None
    return libc


@contextmanager
def steady_heap(enabled: bool = True) -> Iterator[bool]:
    """Inside, freed memory stays in this process's heap (glibc's mmap and trim thresholds at 1 GiB).

    Yields whether that took effect (False off glibc or when not ``enabled``). On exit the
    thresholds go back to glibc's initial 128 KiB (fixed: glibc's own growth of the mmap
    threshold after large frees does not restart) and the heap is trimmed.
    """
    libc = _glibc() if enabled else None
    if libc is None:
        yield False
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT)
        libc.malloc_trim(0)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    On Linux ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` survives ``exec``, so a child
    started by a large parent (subprocess forks/vforks) reports the parent's size as its own.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


def peak_memory(suite: str, case: dict, timeout: float = 1800.0) -> dict[str, float]:
    """Run one case in a fresh process; ``{"inputs": bytes, "peak": bytes, "extra": bytes}``.

    ``extra`` is the peak during the call minus the peak after building its inputs.
    """
    spec = json.dumps({"suite": suite, **case})
    cmd = [sys.executable, "-m", "qkv.bench", "--case", spec]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory case {spec} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["extra"] = max(0, result["peak"] - result["inputs"])
    return result


def run_case(spec: dict) -> dict[str, int]:
    """Child side of :func:`peak_memory`: build the case, call it once, report peak RSS."""
    from . import suite_module

    module = suite_module(spec["suite"])
    call = module.build(spec)
    inputs = peak_rss_bytes()
    call()
    return {"inputs": inputs, "peak": peak_rss_bytes()}


#: Environment variables that change which kernels run: instruction-set caps of PyTorch,
#: oneDNN and MKL (set to emulate another CPU), a preloaded library (e.g. one that makes MKL
#: take its Intel code path on an AMD CPU) and qkv's own route setting. A run under any of
#: them is filed as a CPU of its own.
KERNEL_SETTINGS = (
    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
    "LD_PRELOAD", "QKV_ROUTE",
)  # fmt: skip


def libraries() -> dict[str, str]:
    """``{"cpu capability", "BLAS", "oneDNN"}``: the kernels PyTorch picked on this CPU and its BLAS."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    name = blas.group(1) if blas else "unknown"
    if name == "mkl":
        version = re.search(r"Math Kernel Library Version ([\w.]+)", config)
        name = "MKL" + (f" {version.group(1)}" if version else "")
    elif name in ("open", "openblas"):
        name = "OpenBLAS"
    onednn = re.search(r"(?:MKL-DNN|oneDNN) v([\d.]+)", config)
    return {
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "BLAS": name,
        "oneDNN": (onednn.group(1) if onednn else "not built") if torch.backends.mkldnn.is_available() else "not available",
    }


def machine() -> dict[str, str]:
    """What the figures were measured on (see :mod:`qkv.bench.results` for how runs are filed by CPU)."""
    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    generation = ({"cpu family, model": f"{fields['cpu family']}, {fields['model']}"}
                  if "cpu family" in fields and "model" in fields else {})  # fmt: skip
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    caps = ", ".join(f"{name}={os.environ[name]}" for name in KERNEL_SETTINGS if os.environ.get(name))
    return {
        "cpu": cpu,
        **generation,
        **({"kernels set by": caps} if caps else {}),
        **libraries(),
        "cores": str(cores),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load average at start (1, 5, 15 min)": load,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MiB"
