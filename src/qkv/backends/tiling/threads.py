"""Independent tile tasks on Python threads, each running its PyTorch ops on one intra-op thread.

A tile loop written with PyTorch operations issues a dozen or more operations per tile.
Left to PyTorch's intra-op parallelism, every one of them is an OpenMP parallel region
whose end waits for all its threads: on a machine whose cores are shared, each such wait
can last a scheduler time slice, and thousands of them add up. Measured on the 2-core
benchmark machine under load: 20 tile-sized ``exp`` calls took 327 ms with 2 intra-op
threads, 52 ms as two Python threads of 10 calls each with one intra-op thread apiece. So,
as fused kernels do (FlashAttention partitions its grid among workers), the parallelism
is over tiles: ``torch.get_num_threads()`` Python threads (PyTorch releases the GIL inside
its operations), each with ``torch.set_num_threads(1)``, which is per thread.

Tasks are dealt to the threads statically, heaviest first in a snake order (0, 1, …, n-1,
n-1, …, 0, …), so that the work is balanced and each thread's share, and so every sum a
thread accumulates, is the same from run to run.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
S = TypeVar("S")

#: Total work (tile elements summed over tasks) below which tasks run inline on the calling
#: thread: threads cost tens of microseconds to start, and a small call gains nothing.
MIN_WORK = 2**21
#: Threads to use; None: ``torch.get_num_threads()`` (the intra-op setting this replaces).
THREADS: int | None = None


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """``torch.set_num_threads(1)`` for the duration of a ``with`` block, as each tile task runs (the setting is
    per thread): what times a tile's work (``tile_math``'s probes, the cost model's blocks) times it so."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def deal(costs: Sequence[float], n: int) -> list[list[int]]:
    """Task indices per thread: heaviest first, in a snake order; each thread's list in task order."""
    order = sorted(range(len(costs)), key=lambda t: (-costs[t], t))
    groups: list[list[int]] = [[] for _ in range(n)]
    for rank, task in enumerate(order):
        lap, pos = divmod(rank, n)
        groups[pos if lap % 2 == 0 else n - 1 - pos].append(task)
    return [sorted(g) for g in groups]


def run(tasks: Sequence[T], costs: Sequence[float], work: Callable[[T, S], None], make_state: Callable[[], S]) -> list[S]:
    """Run ``work(task, state)`` for every task; one ``state`` per thread, returned in thread order.

    ``work`` must only write what its task owns (or its thread's ``state``). Grad mode and
    inference mode of the caller hold inside the threads. An exception in a thread is
    raised here once all threads have stopped.
    """
    n = min(torch.get_num_threads() if THREADS is None else THREADS, len(tasks))
    if n <= 1 or sum(costs) < MIN_WORK:
        state = make_state()
        for task in tasks:
            work(task, state)
        return [state]
    groups = deal(costs, n)
    states = [make_state() for _ in range(n)]
    errors: list[BaseException] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def body(w: int) -> None:
        try:
            torch.set_num_threads(1)  # this thread's OpenMP setting only
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                for index in groups[w]:
                    work(tasks[index], states[w])
        except BaseException as error:  # noqa: BLE001 (re-raised in the caller)
            errors.append(error)

    threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return states
