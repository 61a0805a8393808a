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
