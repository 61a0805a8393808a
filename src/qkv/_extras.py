"""How to install an optional part of qkv, in one phrase for error messages.

qkv is installed from its clone (``pip install .``), so ``pip install "qkv[viz]"`` would ask
a package index for a ``qkv`` it does not hold: the phrase names the clone's form only.
"""

from __future__ import annotations


def install(extra: str) -> str:
    """``pip install ".[extra]"`` in qkv's folder, quoted for zsh (qkv is not on a package index: the
    index form would fail, or install another project of that name)."""
    return f'pip install ".[{extra}]" in qkv\'s folder'
