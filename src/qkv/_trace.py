"""Whether a tensor's values can be read on the host here, or only its shape (tracing, meta).

Imports nothing from qkv, so every layer may use it.

Reading a value on the host (``bool(t)``, ``int(t)``, ``.item()``) is a synchronisation in
eager mode and impossible while ``torch.compile`` or ``torch.export`` trace a call (the
tensors are fakes with a shape and no data), under ``torch.vmap`` (a value per batch entry),
or for ``meta`` tensors; under ``torch.jit.trace`` the value read would be frozen into the
trace. Code that branches on a value to save work at run time (skipping tiles no key of a
padded batch reaches) asks :func:`concrete` first and takes its branch-free formulation
otherwise; both give the same result.
"""

from __future__ import annotations

import torch
from torch import Tensor


#: Why a path that reads values on the host or runs private kernels declines a call while :func:`tracing`.
TRACED = "torch.compile, torch.export, torch.jit.trace or a torch.func transform runs the call (traced graphs use public ops)"


def tracing() -> bool:
    """True while ``torch.compile``, ``torch.export`` or ``torch.jit.trace`` trace the current call,
    or a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jvp``) runs it.

    ``torch.jit.trace`` runs on real tensors, but what it records is the ops: a value read on
    the host would be frozen into the trace as a constant, a custom autograd function or a
    one-time probe run inside it breaks the recording (PyTorch's ``unordered_map::at``, a
    crash), so a traced call takes the public ops there too. Under a ``torch.func`` transform
    the tensors are wrappers: ``vmap``'s hold a value per batch entry, none to read (``.item()``
    raises), and a probe's random draw is refused inside it, so a transformed call takes the
    public ops as well.
    """
    compiler = torch.compiler
    return bool(compiler.is_compiling() or (hasattr(compiler, "is_exporting") and compiler.is_exporting())
                or torch._C._get_tracing_state() is not None or _transformed())  # fmt: skip


def opaque_functions_refused() -> bool:
    """True where qkv's custom autograd functions must not run: under ``torch.jit.trace`` or a ``torch.func`` transform.

    ``torch.jit.trace`` records such a function as one opaque op whose arguments other than
    tensors are constants of the trace, and the chunked engines' request object carries the
    call's tensors: the trace replayed the example's q, k and v at every later call (the
    example's answer, silently, for any input). ``torch.func`` refuses an autograd function
    without ``setup_context``. ``torch.compile`` and ``torch.export`` trace into them: not these.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._get_tracing_state() is not None or _transformed()


def _transformed() -> bool:
    # a torch.func transform is active (its interpreter stack is empty otherwise): ~0.1 µs
    return torch._C._functorch.peek_interpreter_stack() is not None


def version(x: Tensor) -> int | None:
    """``x._version`` (every in-place change bumps it), or None where ``x`` keeps no such counter.

    Tensors made under ``torch.inference_mode`` keep none (reading it raises): a cache keyed on
    the version must then not keep its answer, since an in-place change would go unseen.
    """
    try:
        return x._version
    except RuntimeError:
        return None


def concrete(*tensors: Tensor) -> bool:
    """True when every tensor holds real data that may be read on the host (eager, not meta, not fake)."""
    if tracing():
        return False
    for x in tensors:
        if x.device.type == "meta" or _fake(x):
            return False
    return True


def _fake(x: Tensor) -> bool:
    # FakeTensor (torch.export's non-strict mode, FakeTensorMode) and functional wrappers of it
    if type(x) is Tensor or isinstance(x, torch.nn.Parameter) and type(x.data) is Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake  # only for tensor subclasses: rare

    return bool(is_fake(x))
