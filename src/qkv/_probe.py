"""Choosing between oneDNN and BLAS for one product shape by timing both once, at first use.

Shape legend: none of its own; a shape class is a tuple of sizes chosen by the caller.

Why: which library is faster depends on the CPU, not on the code. In the x86 PyTorch wheels
BLAS is MKL, which takes a generic code path on AMD CPUs (on the AMD EPYC benchmark machine
a ``(4096 × 512)·(512 × 512)`` product ran at 20-27 GFLOP/s on one core, the same product
through oneDNN's convolution at 45-55) and its AVX-512 kernels on Intel Xeons, where the
two are close or MKL wins. A constant tuned on one machine is wrong on the next, so each
caller (:mod:`qkv.projection`, :func:`qkv.approx._common.grouped_matmul`) asks
:meth:`Probe.prefers_onednn` with a shape class and two ways to compute that product: the
first time a class is seen both run on fresh inputs of its size, a warm-up and three
rounds interleaved, and the oneDNN route is kept only if its best time beats BLAS's best
by :data:`MARGIN`; the answer is cached for the process. A probe costs a few products of
the class's size (capped by the callers at a few thousand rows), once.

The route can be fixed instead (:func:`set_route`, or the ``QKV_ROUTE`` environment
variable): ``"blas"`` never takes the oneDNN routes (only public ``torch`` ops run),
``"onednn"`` takes them wherever they apply (the behaviour before probes, and what the
tests use so that they do not depend on timing). While ``torch.compile`` traces, an
unprobed class runs BLAS (a trace cannot time anything).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

ROUTES = ("auto", "blas", "onednn")
#: oneDNN must be this much faster than BLAS to be chosen: near-ties go to the public op,
#: and a probe disturbed by other work on the machine rarely flips a clear answer.
MARGIN = 1.1
#: Timed rounds per probe (after one warm-up call of each route).
ROUNDS = 3

_route = os.environ.get("QKV_ROUTE", "auto")
if _route not in ROUTES:
    raise ValueError(f"QKV_ROUTE: expected one of {ROUTES}, got {_route!r}")


def set_route(route: str) -> str:
    """Fix how oneDNN-or-BLAS choices are made: ``"auto"`` (probe), ``"blas"`` or ``"onednn"``; returns the previous."""
    global _route
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {ROUTES}, got {route!r}")
    previous, _route = _route, route
    return previous


def get_route() -> str:
    """The current setting of :func:`set_route`."""
    return _route


@contextmanager
def route(name: str) -> Iterator[None]:
    """:func:`set_route` for the duration of a ``with`` block."""
    previous = set_route(name)
    try:
        yield
    finally:
        set_route(previous)


def _clock() -> float:
    return time.perf_counter()


class Probe:
    """One family of choices (one caller), cached per shape class."""

    def __init__(self, name: str):
        self.name = name
        self.choices: dict[tuple, bool] = {}  # shape class -> oneDNN chosen
        self.times: dict[tuple, tuple[float, float]] = {}  # shape class -> (BLAS, oneDNN) best seconds

    def prefers_onednn(self, key: tuple, routes: Callable[[], tuple[Callable[[], object], Callable[[], object]]]) -> bool:
        """Whether the oneDNN route is taken for shape class ``key``.

        ``routes()`` builds the class's inputs and returns ``(blas, onednn)``, two
        argument-less calls computing the same product; it runs only when a probe is needed.
        """
        if _route != "auto":
            return _route == "onednn"
        chosen = self.choices.get(key)
        if chosen is not None:
            return chosen
        if torch.compiler.is_compiling():
            return False
        with torch.no_grad():
            best = best_times(*routes())
        chosen = best[1] * MARGIN < best[0]
        self.choices[key], self.times[key] = chosen, (best[0], best[1])
        return chosen

    def report(self) -> list[str]:
        """One line per probed class: its key, both times and the choice."""
        return [
            f"{self.name} {key}: BLAS {t[0] * 1e3:.3g} ms, oneDNN {t[1] * 1e3:.3g} ms -> "
            f"{'oneDNN' if self.choices[key] else 'BLAS'}"
            for key, t in self.times.items()
        ]


def best_times(*calls: Callable[[], object], rounds: int = ROUNDS) -> list[float]:
    """The best time in seconds of each argument-less call: a warm-up call of each, then interleaved rounds.

    The one timing routine of every probe in qkv (oneDNN or BLAS here, ALiBi's column or
    masked kernel, bfloat16 or float32 tile products): the order alternates between rounds
    so that neither call always runs on a warmer cache, and the best of the rounds is
    kept, the time least disturbed by other work on a shared machine. Runs outside
    inference mode, since the first call may come from a decoding loop and a probe may
    time a backward.
    """
    best = [float("inf")] * len(calls)
    with torch.inference_mode(False):
        for fn in calls:
            fn()  # warm-up: kernels are built and buffers allocated for this shape on the first call
        for round_ in range(rounds):
            order = range(len(calls)) if round_ % 2 == 0 else reversed(range(len(calls)))
            for n in order:
                start = _clock()
                calls[n]()
                best[n] = min(best[n], _clock() - start)
    return best


def bucket(n: int, cap: int) -> int:
    """``n`` rounded down to a power of two, at most ``cap``: the size class a probe is timed at."""
    return min(cap, 1 << max(0, n.bit_length() - 1))
