"""``flash_attn.bert_padding``: a padded batch to packed tokens and back, and the row gathers they are made of.

Shape legend: ``b`` batch, ``s`` padded length, ``t`` packed tokens, ``...`` the feature dims.

``unpad_input`` and ``pad_input`` are ``qkv.unpad_input`` and ``qkv.pad_input`` (flash-attn 2.7's five
results). The gathers, differentiable as flash-attn's custom functions are (PyTorch's own
``index_select`` and ``index_copy`` here, whose gradients are the same scatter and gather):

* ``index_first_axis(x (n, ...), indices (t,))`` -> ``x[indices] (t, ...)``;
* ``index_put_first_axis(values (t, ...), indices (t,), n)`` -> ``(n, ...)``, zeros but
  ``values`` at ``indices`` (a row named twice keeps one of its values, as flash-attn's);
* ``unpad_input_for_concatenated_sequences(hidden_states (b, s, ...), attention_mask_in_length
  (b, s))``: each row's leading nonzero entries are the lengths of the samples packed in it
  (``[[2, 3, 0, ...], ...]``: a sample of 2 tokens, then one of 3); returns the packed tokens,
  their flat positions, ``cu_seqlens`` of every sample (int32) and the longest sample.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..varlen import pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]  # fmt: skip


def _rows(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() < 1:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a tensor (rows, ...), got {got}")
    return x


def _indices(indices: object) -> Tensor:
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.dtype.is_floating_point or (
            indices.dtype == torch.bool):  # fmt: skip
        got = f"{tuple(indices.shape)} {indices.dtype}" if isinstance(indices, Tensor) else type(indices).__name__
        raise TypeError(f"indices: expected a 1-d integer tensor, got {got}")
    return indices.long()


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """``input[indices]``: the rows ``indices (t,)`` of ``input (n, ...)``, differentiable."""
    return _rows("input", input).index_select(0, _indices(indices))


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """``(first_axis_dim, ...)`` zeros with ``values (t, ...)`` at rows ``indices (t,)``, differentiable."""
    values = _rows("values", values)
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_copy(0, _indices(indices).to(values.device), values)


def unpad_input_for_concatenated_sequences(hidden_states: Tensor, attention_mask_in_length: Tensor):
    """``(packed (t, ...), indices (t,), cu_seqlens (samples + 1,) int32, max_seqlen)``: see the module docstring."""
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 2:
        raise TypeError("hidden_states: expected a tensor (b, s, ...)")
    lengths = attention_mask_in_length
    if not isinstance(lengths, Tensor) or lengths.shape != hidden_states.shape[:2] or lengths.dtype.is_floating_point:
        got = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"attention_mask_in_length: expected integer lengths {tuple(hidden_states.shape[:2])} (b, s) "
                         f"like hidden_states, got {got}")  # fmt: skip
    total = lengths.sum(-1)  # (b,) the row's real tokens, its samples end to end
    if bool((total > lengths.shape[-1]).any()) or bool((lengths < 0).any()):
        raise ValueError(f"attention_mask_in_length: a row's lengths must be >= 0 and sum to at most its "
                         f"{lengths.shape[-1]} tokens, got row sums {total.tolist()}")  # fmt: skip
    keep = torch.arange(lengths.shape[-1], device=lengths.device) < total[:, None]  # (b, s)
    seqlens = lengths.flatten()[lengths.flatten() != 0].to(torch.int32)
    indices = keep.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    longest = int(seqlens.max()) if seqlens.numel() else 0
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, longest
