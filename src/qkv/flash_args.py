"""flash-attn's scalar arguments read as its bindings read them: flags, numbers, integers and the window pair.

flash-attn 2.8 hands its calls' scalars to a ``torch.library`` custom op (``flash_attn_func``,
the varlen call) or to pybind11 (``flash_attn_with_kvcache``), and both convert what a Python
caller commonly holds: numpy scalars (``np.bool_``, ``np.float32``, ``np.int64``) and 0-d
tensors. So do these; a value such a binding refuses (a string, a tensor of several numbers) is
a ``TypeError`` naming the argument. Messages use flash-attn's names (``softmax_scale``,
``dropout_p``), not ``qkv.attention``'s (``scale=``, ``dropout=``).
"""

from __future__ import annotations

import math
import numbers
import operator

import torch
from torch import Tensor

from ._args import probability


def as_int(x: object) -> int | None:
    """``x`` as an int where flash-attn's C++ ``int`` would take it, else None.

    Python and numpy ints and 0-d integer tensors pass (transformers hands flash-attn
    ``position_ids.max() + 1``, a tensor; flash-attn's tests pass ``window_size`` as
    ``torch.randint(0, seqlen_k, (2,))``); floats, bools and tensors of several numbers do not.
    """
    if isinstance(x, bool) or (isinstance(x, Tensor) and (x.dim() or x.dtype == torch.bool)):
        return None
    try:
        return operator.index(x)  # (a 0-d tensor: one read, a sync on a GPU)
    except TypeError:
        return None


def flag(name: str, x: object) -> bool:
    """A flag: a bool, numpy's ``bool_``, or a 0-d bool tensor (as a custom op's ``bool`` argument takes them)."""
    if isinstance(x, bool):
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"):  # (numpy 2 names it bool)
        return bool(x)
    if isinstance(x, Tensor) and x.dim() == 0 and x.dtype == torch.bool:
        return bool(x)
    got = f"a tensor of shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
    raise TypeError(f"{name}: expected a bool (or numpy's bool_, a 0-d bool tensor), got {got}")


def real(name: str, x: object) -> float:
    """A number: a Python or numpy real, or a 0-d tensor that records no gradient (one a caller learns would stop
    learning silently when read as its value)."""
    if isinstance(x, Tensor) and x.dim() == 0 and not x.requires_grad and not x.dtype.is_complex:
        return float(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        got = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a number (or a 0-d tensor without grad), got {got}")
    return float(x)


def scalars(deterministic: object, return_attn_probs: object, softcap: object, softmax_scale: object,
            dropout_p: object) -> tuple[bool, bool, float, float | None, float]:  # fmt: skip
    """flash-attn's flags and numbers, read and checked: ``(deterministic, return_attn_probs, softcap,
    softmax_scale, dropout_p)``."""
    deterministic, return_attn_probs = flag("deterministic", deterministic), flag("return_attn_probs", return_attn_probs)
    softcap = real("softcap", softcap)
    if not softcap >= 0 or math.isinf(softcap):
        raise ValueError(f"softcap: expected a finite number >= 0 (0: no cap), got {softcap!r}")
    if softmax_scale is not None:
        softmax_scale = real("softmax_scale", softmax_scale)
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale: expected a finite number or None, got {softmax_scale!r}")
    return deterministic, return_attn_probs, softcap, softmax_scale, probability("dropout_p", real("dropout_p", dropout_p))


def window(window_size: object, causal: object) -> tuple[int | None, int | None]:
    """``(left, right)`` of each sequence's window (None: unbounded); ``causal`` (:func:`flag`) sets ``right = 0``.

    ``window_size`` is any pair of integers (:func:`as_int`): a tuple, a list, a tensor or array of two.
    """
    causal = flag("causal", causal)
    try:  # (a set or a mapping has no order; a 0-d tensor no items)
        items = [] if isinstance(window_size, (str, bytes, set, frozenset, dict)) else list(window_size)
    except TypeError:
        items = []
    pair = [as_int(w) for w in items]
    if len(pair) != 2 or any(w is None or w < -1 for w in pair):
        raise ValueError(f"window_size: expected (left, right), ints >= -1 (-1: unbounded), got {window_size!r}")
    left, right = (None if w == -1 else w for w in pair)
    return left, 0 if causal else right
