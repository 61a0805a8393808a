"""``shard``, ``unshard`` and ``positions``: a rank's part of a whole tensor and back.

Shape legend: ``n`` the length of the sharded dim, ``P`` ranks, ``rows`` this rank's part.

``shard`` needs no communication (every rank holds the whole tensor and keeps its part);
``unshard`` gathers the parts: one all-gather of the row counts (so that ranks may hold
different numbers of rows), one of the padded parts. Its backward is a reduce-scatter, so
a loss computed from the whole tensor on every rank sends each rank the sum of all
ranks' gradients for its rows (the convention of ``torch.distributed.nn``).
"""

from __future__ import annotations


from torch import Tensor

from .comm import all_gather, all_gather_ints, resolve
from .layout import Layout, check_layout


def _dim(name: str, x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected an int in [{-x.dim()}, {x.dim()}) for shape {tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def shard(x: Tensor, dim: int = -2, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's part of the whole tensor ``x`` along ``dim``, in ``layout``.

    ``"contiguous"``: rank ``r`` holds the ``r``-th of ``P`` equal slices; ``"zigzag"``: chunks
    ``r`` and ``2P - 1 - r`` of ``2P``. Slices have ``ceil(n / chunks)`` rows, so when ``P`` (or
    ``2P``) does not divide ``n`` the last ones are shorter and some ranks may hold none.
    Differentiable (a gather of rows).
    """
    check_layout(layout)
    dim = _dim("x", x, dim)
    grp = resolve(group)
    return Layout(layout, x.shape[dim], grp.size).take(x, dim, grp.rank)


def unshard(x_local: Tensor, dim: int = -2, group=None, layout: str = "zigzag") -> Tensor:
    """The whole tensor, in global order, on every rank, from each rank's part ``x_local``.

    Every dim but ``dim`` must be equal on all ranks. Differentiable.
    """
    check_layout(layout)
    grp = resolve(group)
    # the number of dims first, alone: the shapes' gather needs one length on every rank
    ranks_dims = all_gather_ints([x_local.dim() if isinstance(x_local, Tensor) else -1], grp)[:, 0].tolist()
    if len(set(ranks_dims)) > 1:
        raise ValueError(f"x_local: every rank's part must have the same number of dims; ranks have {ranks_dims}")
    dim = _dim("x_local", x_local, dim)
    shapes = all_gather_ints([x_local.dim(), *x_local.shape], grp)
    rows = shapes[:, 1 + dim].tolist()
    ours = shapes[grp.rank].tolist()
    for rank in range(grp.size):
        theirs = shapes[rank].tolist()
        if theirs[0] != ours[0] or theirs[1 : 1 + dim] + theirs[2 + dim :] != ours[1 : 1 + dim] + ours[2 + dim :]:
            raise ValueError(
                f"x_local: every dim but dim={dim} must match across ranks; rank {grp.rank} has shape "
                f"{tuple(ours[1:])}, rank {rank} has {tuple(theirs[1:])}"
            )
    lay = Layout(layout, sum(rows), grp.size)
    for rank, n in enumerate(rows):
        if n != lay.rows(rank):
            raise ValueError(
                f"x_local: rank {rank} holds {n} rows, but a {layout} split of {sum(rows)} rows over {grp.size} "
                f"ranks gives it {lay.rows(rank)}; make the parts with qkv.distributed.shard(x, layout={layout!r})"
            )
    return lay.assemble(all_gather(lay.pad(x_local, dim, grp.rank), grp, "unshard"), dim)


def positions(length: int, group=None, layout: str = "zigzag") -> Tensor:
    """``(rows,)`` long: the global positions of this rank's rows of a sequence of ``length``."""
    check_layout(layout)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length: expected a non-negative int, got {length!r}")
    grp = resolve(group)
    return Layout(layout, length, grp.size).positions(grp.rank)


