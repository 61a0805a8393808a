"""Reading the mask functions transformers composes: the variables an inner function closed over.

transformers builds a layer's mask as nested closures (``and_masks``, ``sliding_window_overlay``,
``packed_sequence_mask_function``, ...). Recognising one by its qualified name and reading
what it closed over lets the integration rebuild it as a lazy qkv mask instead of evaluating
it on every ``(i, j)`` pair. Both readers of those closures (the masks and the packing
modules beside this file) use this one function.
"""

from __future__ import annotations

from collections.abc import Callable


def closure(fn: Callable, qualname: str) -> dict:
    """The closure variables of ``fn`` if it is transformers' inner function ``qualname``, else {}."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__qualname__", None) != qualname:
        return {}
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return {}
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
