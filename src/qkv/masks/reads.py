"""What a mask program reads besides its arguments, as a fingerprint that changes when that does.

A ``mask_mod`` such as ``lambda b, h, q, kv: ids[q] == ids[kv]`` reads tensors it captured
(closure cells) or names it looks up (module globals). Its answer for a tile is fixed while
those stay the same objects with the same contents; a tensor changed in place bumps its
version counter (``Tensor._version``), and rebinding a name changes the object found. The
fingerprint lists, for every tensor reached, the tensor itself (compared by identity, and held:
its id cannot pass to another tensor while the fingerprint is kept) and its version, and for every plain
value its value; it is None when the program reaches anything whose changes cannot be seen
that way (a list, a dict, a module of weights): then nothing may be remembered between calls.
A module's attributes that the program's code names (``cfg.ids``) are read like globals.
:func:`reads_argument` tells whether a program reads one of its own arguments (a block mask made
without ``B`` may be handed to flex as it is only if its program never reads ``b``).
Writes that bypass the version counter (through ``.data``, or a NumPy view of the tensor)
cannot be seen: after such a write, make a new block mask.
"""

from __future__ import annotations

import dis
import functools
import types

import torch
from torch import Tensor

from .._trace import version

_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)
_STATIC = (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType)


def fingerprint(fn: object) -> tuple | None:
    """A tuple that equals an earlier one only if ``fn`` reads the same values; None when that cannot be told."""
    found: list = []
    seen: set[int] = set()
    stack = [fn]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Tensor):
            changes = version(x)
            if changes is None:
                return None  # a tensor of torch.inference_mode: its in-place changes cannot be seen
            found.append(("tensor", _Same(x), changes))
        elif isinstance(x, _PLAIN):
            found.append(("value", x))
        elif isinstance(x, tuple):
            stack.extend(x)
        elif isinstance(x, functools.partial):
            stack.extend((x.func, *x.args, *x.keywords.values()))
        elif isinstance(x, types.FunctionType):
            found.append(("function", id(x)))
            stack.extend(_free_values(x))
        elif isinstance(x, _STATIC):
            continue  # modules, classes and builtins: what they compute does not change between calls
        else:
            return None  # a list, a dict, an nn.Module, an object: contents that change unseen
    return tuple(found)


class _Same:
    """A tensor a program reads, equal to another only if it is the same tensor: held, so that its id cannot pass to a
    new tensor while a fingerprint naming it is kept (an id alone was reused by the next batch's tensor)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.tensor is self.tensor

    def __hash__(self) -> int:
        return id(self.tensor)


def reads_argument(fn: object, index: int) -> bool:
    """Whether ``fn`` may read its argument ``index`` (``b`` is 0, ``h`` 1 in a mask_mod): False only for a Python
    function whose code never loads it; a callable object or a partial may read anything."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount <= index:
        return True
    return _code_reads(code, code.co_varnames[index])


@functools.lru_cache(maxsize=256)
def _code_reads(code: types.CodeType, name: str) -> bool:
    if name in code.co_cellvars:  # a function defined inside reads it
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST")):
            if ins.argval == name or (isinstance(ins.argval, tuple) and name in ins.argval):
                return True
    return False


def _free_values(fn: types.FunctionType) -> list:
    """The values ``fn`` reaches beyond its arguments: closure cells, the globals its code names, its
    defaults (keyword-only too), and the attributes its code names on a module it reaches (``cfg.ids``)."""
    values = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    # co_names also holds attribute names (x.shape); only those bound in the globals are variables
    names = _names(fn.__code__)
    values += [fn.__globals__[name] for name in names if name in fn.__globals__]
    values.extend(fn.__defaults__ or ())
    values.extend((fn.__kwdefaults__ or {}).values())
    # a module is static, but what its attributes hold may not be: those the code names are read
    # (``torch.where`` is a builtin, static; ``cfg.ids`` a tensor, fingerprinted; ``a.b.ids`` reached too)
    modules = [x for x in values if isinstance(x, types.ModuleType)]
    seen = {id(m) for m in modules}
    while modules:
        module = modules.pop()
        for name in names:
            attribute = getattr(module, name, None)
            if attribute is None:
                continue
            values.append(attribute)
            if isinstance(attribute, types.ModuleType) and id(attribute) not in seen:
                seen.add(id(attribute))
                modules.append(attribute)
    return values


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:  # functions defined inside: their names are looked up in the same globals
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a name assigned later in the enclosing function)
        return False
    return True
