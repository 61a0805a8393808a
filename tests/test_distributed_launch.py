"""``run_local``: results in rank order, errors and hangs reported with the rank."""

import pytest

from qkv.distributed.launch import resolve_target, run_local


def echo(rank, world, payload):
    import torch.distributed as dist

    return (rank, world, dist.get_world_size(), payload)


def fail(rank, world, payload):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_run_local_returns_each_ranks_value(tmp_path):
    assert run_local("test_distributed_launch:echo", 2, "x", timeout=120) == [(0, 2, 2, "x"), (1, 2, 2, "x")]


def test_run_local_names_the_failing_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one refuses"):
        run_local("test_distributed_launch:fail", 2, timeout=120)


def test_target_needs_a_function_name():
    with pytest.raises(ValueError, match=r"target: expected 'module:function', got 'os'"):
        resolve_target("os")
