"""A pool of 4 spawned gloo processes that stays up for the whole test session.

Spawning a process costs an interpreter and an ``import torch`` (seconds on a busy
machine), so the distributed tests do not spawn per case. The pool's processes form one
gloo world of 4 and build the groups of ranks ``0 .. P-1`` for P = 1, 2, 3, 4 once; a test
sends ``(target, P, payload)`` and ranks ``< P`` run ``target(group, payload)`` while the
others skip. Every wait has a deadline (and every collective gloo's own timeout), so a
hang fails the test in seconds; after any failure the pool is torn down and the next test
starts a fresh one.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from qkv.distributed.launch import resolve_target

WORLD = 4
#: Seconds a collective may wait inside a worker, and a command in the parent (per rank).
TIMEOUT = 90.0


def _worker(rank: int, rendezvous: str, commands, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT)
    )
    groups = {p: dist.new_group(list(range(p))) for p in range(1, WORLD)}  # every rank creates every group
    groups[WORLD] = dist.group.WORLD
    _hybrid_groups(rank)
    while True:
        command = commands.get()
        if command is None:
            break
        target, size, payload = command
        if rank >= size:
            results.put((rank, "skip", None))
            continue
        try:
            torch.manual_seed(0)
            results.put((rank, "ok", resolve_target(target)(groups[size], payload)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


#: Hybrid arrangements by name -> (ring_group, ulysses_group) of this rank (set in each worker).
HYBRID: dict = {}
#: name -> (ring groups, Ulysses groups) as rank lists; "u2r2" = Ulysses over pairs of neighbours.
ARRANGEMENTS = {
    "u2r2": ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    "u2r2t": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "u4r1": ([[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    "u1r4": ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    "u2r1": ([[0], [1]], [[0, 1]]),
    "u1r2": ([[0, 1]], [[0], [1]]),
    "u1r3": ([[0, 1, 2]], [[0], [1], [2]]),
}


def _hybrid_groups(rank: int) -> None:
    for name, (rings, ulysses) in ARRANGEMENTS.items():
        mine = []
        for ranks_lists in (rings, ulysses):
            found = None
            for ranks in ranks_lists:  # new_group is collective: every rank creates every group
                g = dist.new_group(ranks)
                if rank in ranks:
                    found = g
            mine.append(found)
        HYBRID[name] = tuple(mine)


class Pool:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        rendezvous = "file://" + os.path.join(self._tmp.name, "rendezvous")
        self.commands = [ctx.Queue() for _ in range(WORLD)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, rendezvous, self.commands[r], self.results), daemon=True)
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, target: str, size: int, payload=None, timeout: float = TIMEOUT) -> list:
        """``[target(group, payload) on rank r for r < size]``; raises on any rank's error or a timeout."""
        for q in self.commands:
            q.put((target, size, payload))
        got, deadline = {}, time.monotonic() + timeout
        try:
            while len(got) < WORLD:
                try:
                    rank, status, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue_module.Empty:
                    if time.monotonic() >= deadline:
                        missing = sorted(set(range(WORLD)) - set(got))
                        raise TimeoutError(f"{target} on P={size}: ranks {missing} did not answer in {timeout} s")
                    if not self.alive:
                        raise RuntimeError(f"{target} on P={size}: a worker process died")
                    continue
                if status == "error":
                    raise RuntimeError(f"{target} on P={size}: rank {rank} failed:\n{value}")
                got[rank] = value
        except BaseException:
            self.close()
            raise
        return [got[r] for r in range(size)]

    def close(self) -> None:
        for q in self.commands:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(2)
            if p.is_alive():
                p.terminate()
                p.join(2)
        self._tmp.cleanup()


class Pools:
    """The session's pool, restarted after a failure."""

    def __init__(self):
        self.pool: Pool | None = None

    def run(self, target: str, size: int, payload=None, timeout: float = TIMEOUT) -> list:
        if self.pool is None or not self.pool.alive:
            self.pool = Pool()
        try:
            return self.pool.run(target, size, payload, timeout)
        except BaseException:
            self.pool = None
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
