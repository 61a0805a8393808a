"""Input checks shared by the models: token ids, lengths and batch sizes.

Shape legend: ``b`` batch, ``t`` sequence length (source, target or history).

Each check raises ``TypeError`` for a wrong kind of value and ``ValueError`` for a wrong
shape or range, naming the argument and printing what was expected and what was got.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._trace import concrete


def check_ids(name: str, ids: object, vocab_size: int, *, dims: int = 2) -> Tensor:
    """``ids`` if it is an integer tensor of ``dims`` dims with values in ``[0, vocab_size)``.

    Raises ``TypeError`` for a non-tensor or non-integer dtype and ``ValueError`` for a
    wrong number of dims or an id out of range, naming the argument.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name}: expected a tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of token ids, got {ids.dtype}")
    if ids.dim() != dims:
        layout = {1: "(b,)", 2: "(b, length)"}.get(dims, f"{dims} dims")
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(ids.shape)}")
    if ids.numel() and concrete(ids):  # values are not readable while tracing or on meta tensors
        low, high = (int(x) for x in torch.aminmax(ids))  # one pass: this runs on every decoding step
        if low < 0 or high >= vocab_size:
            raise ValueError(f"{name}: expected token ids in [0, {vocab_size}), got values in [{low}, {high}]")
    return ids


def check_tokens(name: str, ids: Tensor, why: str) -> Tensor:
    """``ids (b, t)`` if every row holds at least one token; ``why`` says what reads the first one.

    For models whose output is undefined without a token (an RNN encoding, a mean over the
    tokens): an empty sequence is a ``ValueError`` naming the argument, never a crash inside.
    """
    if ids.shape[-1] == 0:
        raise ValueError(f"{name}: expected at least one token per row ({why}), got shape {tuple(ids.shape)}")
    return ids


def check_rows(name: str, x: Tensor) -> Tensor:
    """``x`` if it has at least one batch row: a loss is a mean over rows, and a mean over none is NaN."""
    if x.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one batch row (a loss is a mean over them), got shape {tuple(x.shape)}")
    return x


def check_lengths(name: str, lengths: object, batch: int, longest: int, *, minimum: int = 1) -> Tensor:
    """``lengths`` as a long ``(b,)`` tensor with ``minimum <= lengths <= longest``."""
    if not isinstance(lengths, Tensor):
        raise TypeError(f"{name}: expected an integer tensor of shape ({batch},), got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},) (one length per batch row), got {tuple(lengths.shape)}")
    if batch and concrete(lengths) and (int(lengths.min()) < minimum or int(lengths.max()) > longest):
        raise ValueError(
            f"{name}: expected lengths in [{minimum}, {longest}] (the padded length), got {lengths.tolist()}"
        )
    return lengths.long()


def check_batch(**tensors: Tensor | None) -> None:
    """Every given tensor has the same batch size (dim 0)."""
    given = {name: t.shape[0] for name, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        sizes = ", ".join(f"{name} {size}" for name, size in given.items())
        raise ValueError(f"batch: expected the same batch size for every input, got {sizes}")
