"""Run a function on ``P`` local processes joined by gloo: tests, benchmarks, quick experiments.

Training across machines is started by ``torchrun`` (see the README); this is the
single-machine stand-in used by qkv's own tests and benchmarks. Each process is spawned
fresh (no fork of a parent that already runs OpenMP threads), joins a gloo group through a
``file://`` rendezvous in a temporary directory (no port to race for), runs
``target(rank, world, payload)`` and sends back its return value. Every wait has a
deadline: a hang becomes a ``TimeoutError`` naming the ranks that did not answer, and the
processes are terminated.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def resolve_target(target: str):
    """``"package.module:function"`` -> the function."""
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"target: expected 'module:function', got {target!r}")
    return getattr(importlib.import_module(module), name)


def init(rank: int, world: int, rendezvous: str, timeout: float, threads: int | None) -> None:
    """Join the gloo group (called inside each spawned process)."""
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )


def _entry(target: str, rank: int, world: int, rendezvous: str, payload: Any, results, timeout: float,
           threads: int | None) -> None:  # fmt: skip
    try:
        init(rank, world, rendezvous, timeout, threads)
        value = resolve_target(target)(rank, world, payload)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(target: str, world: int, payload: Any = None, *, timeout: float = 120.0,
              threads: int | None = 1) -> list[Any]:  # fmt: skip
    """``[target(rank, world, payload) for rank in range(world)]``, each rank its own process.

    Args:
        target: ``"module:function"``, importable in a fresh interpreter.
        world: the number of processes ``P``.
        payload: any picklable value handed to every rank.
        timeout: seconds for the whole run, and for each collective inside it.
        threads: ``torch.set_num_threads`` in each process (None: torch's default).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = "file://" + os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(target, r, world, rendezvous, payload, results, timeout, threads),
                        daemon=True)  # fmt: skip
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world:
                left = deadline - time.monotonic()
                try:
                    rank, status, value = results.get(timeout=max(0.1, min(left, 5.0)))
                except queue_module.Empty:
                    missing = sorted(set(range(world)) - set(got))
                    dead = [r for r in missing if not procs[r].is_alive() and results.empty()]
                    if dead:  # killed, or crashed below Python (no traceback came back)
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(f"run_local: ranks {dead} of {world} exited without a result (exit codes {codes})")
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"run_local: ranks {missing} of {world} did not finish within {timeout} s")
                    continue
                if status == "error":
                    raise RuntimeError(f"run_local: rank {rank} of {world} failed:\n{value}")
                got[rank] = value
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
    return [got[r] for r in range(world)]
