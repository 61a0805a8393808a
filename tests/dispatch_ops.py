"""Test helpers that watch a computation: the aten ops that ran, the largest storage made, oneDNN's presence."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Ops(TorchDispatchMode):
    """Records the names of the aten ops that run."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def onednn_available():
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


class Largest(TorchDispatchMode):
    """Records the largest storage that any op's output holds, in bytes.

    ``new_only=True`` skips view ops: their output shares an input's storage, which the
    caller may have allocated (a buffer reused across calls), so it says nothing of what
    the op allocated.
    """

    def __init__(self, new_only: bool = False):
        super().__init__()
        self.nbytes = 0
        self.new_only = new_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.new_only and func.is_view):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


class Subnormals(TorchDispatchMode):
    """Counts the subnormal numbers written by each op (outputs, ``out=`` and in-place targets).

    View ops and uninitialised buffers (``empty``) are skipped: they write nothing.
    """

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or "empty" in func.__name__:
            return out
        written = tree_flatten(out)[0] + tree_flatten(kwargs.get("out"))[0]
        if func._schema.name.endswith("_"):
            written += [a for a in args[:1] if isinstance(a, torch.Tensor)]
        for t in written:
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
                a = t.detach().abs()
                count = int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
                if count:
                    self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + count
        return out
