"""Peak heap in use during a computation, sampled after every aten op (glibc's ``mallinfo2``).

PyTorch's CPU tensors come from ``malloc``; glibc's ``mallinfo2`` reports the bytes in use
(arena blocks plus mmapped ones). Sampling it after each op that the computation runs
gives the peak of live memory within one op's granularity, independent of what the
process held before (the baseline is subtracted). Linux/glibc only: ``available()``.
"""

import ctypes
import sys

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def available() -> bool:
    return _LIBC is not None


def in_use() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class HeapPeak(TorchDispatchMode):
    """``with HeapPeak() as h: ...`` then ``h.peak``: bytes above the heap in use at entry."""

    def __enter__(self):
        self.base = in_use()
        self.peak = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use() - self.base)
        return out
