"""Test helpers for checking which route a computation took: the aten ops that ran, oneDNN's presence."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
