"""How to install an optional part of qkv, in one phrase for error messages.

qkv is installed from its clone (``pip install .``), so ``pip install "qkv[viz]"`` would ask
a package index for a ``qkv`` it may not hold: the phrase names the clone's form first.
"""

from __future__ import annotations


def install(extra: str) -> str:
    """``pip install ".[extra]"`` in qkv's folder, or the index form, quoted for zsh."""
    return f'pip install ".[{extra}]" in qkv\'s folder (or "qkv[{extra}]" from a package index)'
