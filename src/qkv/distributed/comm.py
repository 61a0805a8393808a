"""The communication layer: process groups, counted collectives, and their autograd rules.

Shape legend: ``P`` ranks in a group; other dims are whatever the caller sends.

Everything that crosses between ranks goes through this file, for two reasons. First, the
bytes each rank sends are counted here (:data:`traffic`), which is how the tests and the
benchmark check the communication volume against its formula. Second, autograd: the
collectives below are ``torch.autograd.Function`` s whose backward is the adjoint
collective (the adjoint of an all-gather is a reduce-scatter, of an all-to-all the reverse
all-to-all), so ``loss.backward()`` on every rank gives each rank the gradient of the sum
of all ranks' losses, the convention of ``torch.distributed.nn``.

Bytes sent per rank are counted as the standard algorithms send them: an all-gather of
``n`` bytes per rank sends ``(P - 1)·n`` (ring all-gather), an all-to-all or a
reduce-scatter of an ``N``-byte input ``(P - 1)/P·N``, a point-to-point send its size.
Sends and receives go in pairs through ``batch_isend_irecv``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

_gather_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Traffic:
    """Bytes this process has sent, by kind (``"kv"``, ``"grad"``, ``"a2a"``, ``"meta"``, ...)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += int(nbytes)
        self.messages[kind] += 1

    def total(self, *kinds: str) -> int:
        return sum(v for k, v in self.sent.items() if not kinds or k in kinds)

    def reset(self) -> None:
        self.sent.clear()
        self.messages.clear()


#: Bytes sent by this process since the last ``traffic.reset()``.
traffic = Traffic()


@contextlib.contextmanager
def counting():
    """``with counting() as t:`` counts the bytes sent inside the block in a fresh :class:`Traffic`."""
    global traffic
    saved, traffic = traffic, Traffic()
    try:
        yield traffic
    finally:
        traffic = saved


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


@dataclass(frozen=True)
class Group:
    """A resolved process group: the handle, its size ``P`` and this process's rank in it."""

    handle: object  # dist.ProcessGroup
    size: int
    rank: int

    @property
    def fake(self) -> bool:
        """The "fake" backend (``FakeStore``): nothing is communicated, shapes and counts only."""
        return dist.get_backend(self.handle) == "fake"

    @property
    def device(self) -> torch.device:
        """Where this group's small messages live: the current GPU under nccl, else the CPU."""
        if self.handle is not None and dist.get_backend(self.handle) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def resolve(group: object, name: str = "group") -> Group:
    """Check that ``torch.distributed`` is initialised and this process is in ``group``."""
    if not dist.is_available():
        raise RuntimeError(f"{name}: torch.distributed is not available in this build of PyTorch")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group() first "
            "(torchrun sets its environment: backend 'gloo' on CPUs, 'nccl' on GPUs)"
        )
    handle = dist.group.WORLD if group is None else group
    if not isinstance(handle, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(handle)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group")
    return Group(handle, dist.get_world_size(handle), rank)


def all_gather_ints(values: list[int], group: Group, kind: str = "meta") -> Tensor:
    """``(P, len(values))`` long: every rank's ``values`` (one small collective, no autograd).

    Under the fake backend nothing arrives, so every row is this rank's own values.
    """
    mine = torch.tensor(values, dtype=torch.int64)
    out = mine.repeat(group.size, 1)
    if group.size > 1 and not group.fake:
        device = group.device
        mine, out = mine.to(device), out.to(device)
        _gather_op(out.view(-1), mine, group=group.handle)
        out = out.cpu()
    traffic.add(kind, (group.size - 1) * _nbytes(mine))
    return out


def _gather(x: Tensor, group: Group, kind: str) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))
    if group.size == 1:
        out[0] = x
    else:  # flat buffers: gloo wants the output as the concatenation along dim 0
        _gather_op(out.view(-1), x.view(-1), group=group.handle)
        traffic.add(kind, (group.size - 1) * _nbytes(x))
    return out


def _reduce_scatter(x: Tensor, group: Group, kind: str) -> Tensor:
    """``(P, ...)`` on every rank -> ``(...)``: the sum over ranks of their row ``rank``."""
    if group.size == 1:
        return x[0]
    x = x.contiguous()
    out = x.new_empty(x.shape[1:])
    _reduce_scatter_op(out.view(-1), x.view(-1), group=group.handle)
    traffic.add(kind, _nbytes(x) * (group.size - 1) // group.size)
    return out


def _all_to_all(x: Tensor, group: Group, kind: str) -> Tensor:
    """``(P, ...)``: row ``p`` goes to rank ``p``; row ``p`` of the result came from rank ``p``."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group.handle)
    traffic.add(kind, _nbytes(x) * (group.size - 1) // group.size)
    return out


class AllGather(torch.autograd.Function):
    """``x (...) -> (P, ...)`` every rank's ``x``; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        ctx.group, ctx.kind = group, kind
        return _gather(x, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.group, "grad"), None, None


class AllToAll(torch.autograd.Function):
    """``x (P, ...)`` -> ``(P, ...)``, row ``p`` to rank ``p``; the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        ctx.group, ctx.kind = group, kind
        return _all_to_all(x, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group, "grad"), None, None


def all_gather(x: Tensor, group: Group, kind: str = "kv") -> Tensor:
    return AllGather.apply(x, group, kind)


def all_to_all(x: Tensor, group: Group, kind: str = "a2a") -> Tensor:
    return AllToAll.apply(x, group, kind)


class Exchange:
    """Paired point-to-point sends and receives of one step, posted together, waited for later.

    ``sends``/``recvs`` are ``(tensor, peer)`` with ``peer`` a rank of the group. Every send
    has a matching receive on its peer because both sides derive them from the same table,
    so posting them with ``batch_isend_irecv`` cannot deadlock.
    """

    def __init__(self, group: Group, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], kind: str,
                 tag: int = 0):  # fmt: skip
        self.works = []
        self.keep = None  # a buffer that must outlive the sends (the caller may set it)
        ops = [dist.P2POp(dist.isend, t, group=group.handle, group_peer=p, tag=tag) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, group=group.handle, group_peer=p, tag=tag) for t, p in recvs]
        for t, _ in sends:
            traffic.add(kind, _nbytes(t))
        if ops and not group.fake:
            self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        self.keep = None


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, *others: Tensor) -> Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, *(torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.shapes)


def attach(out: Tensor, *others: Tensor) -> Tensor:
    """``out``, made to depend on ``others`` with a zero gradient.

    A rank whose blocks are all empty (only padding, or a mask that hides every key from
    its rows) computes nothing from the tensors that came through a collective; without
    this, its backward would skip the adjoint collective that the other ranks wait in.
    """
    others = tuple(t for t in others if t.requires_grad)
    if not torch.is_grad_enabled() or not others:
        return out
    return _Attach.apply(out, *others)
