"""``backends.tiling.threads``: tile tasks dealt to threads, each with one intra-op thread.

Closed forms of the deal; every task run once; state per thread; the caller's modes and
thread setting kept; errors raised in the caller.
"""

import threading

import pytest
import torch

from qkv.backends.tiling import threads as workers


def test_deal_is_a_balanced_snake():
    # costs 9 8 7 6 5 4 3 2 on 3 threads: 9 | 8 | 7, then back 6 on thread 2, 5 on 1, 4 on 0, ...
    groups = workers.deal([9, 8, 7, 6, 5, 4, 3, 2], 3)
    assert groups == [[0, 5, 6], [1, 4, 7], [2, 3]]
    assert sorted(sum(groups, [])) == list(range(8))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_task_runs_once_with_its_own_state(monkeypatch, threads):
    monkeypatch.setattr(workers, "THREADS", threads)
    monkeypatch.setattr(workers, "MIN_WORK", 0)
    seen, lock = [], threading.Lock()

    def work(task, state):
        state.append(task)
        with lock:
            seen.append((task, torch.get_num_threads(), torch.is_grad_enabled()))

    with torch.no_grad():
        states = workers.run(list(range(10)), [1.0] * 10, work, list)
    assert sorted(t for t, _, _ in seen) == list(range(10))
    assert len(states) == min(threads, 10) and sorted(sum(states, [])) == list(range(10))
    if threads > 1:
        assert all(n == 1 and not grad for _, n, grad in seen)  # one intra-op thread each; no_grad held
    assert torch.get_num_threads() >= 1  # the caller's setting is its own


def test_small_work_runs_inline(monkeypatch):
    monkeypatch.setattr(workers, "THREADS", 4)
    caller = threading.get_ident()
    idents = []
    workers.run([0, 1], [1.0, 1.0], lambda task, state: idents.append(threading.get_ident()), list)
    assert idents == [caller, caller]


def test_an_error_in_a_thread_is_raised_in_the_caller(monkeypatch):
    monkeypatch.setattr(workers, "THREADS", 2)
    monkeypatch.setattr(workers, "MIN_WORK", 0)

    def work(task, state):
        if task == 3:
            raise ValueError("task 3 failed")

    with pytest.raises(ValueError, match="task 3 failed"):
        workers.run(list(range(4)), [1.0] * 4, work, list)
