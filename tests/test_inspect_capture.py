"""Tests of ``qkv.inspect.capture``: tokens as shown, and the weights kept from one run.

The weights from qkv inside the model are checked against transformers' own ``"eager"``
attention; the chosen heads and rows against slices of all weights; and a long text
against the memory it may use: no tensor as large as one layer's ``(h, i, j)`` weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dispatch_ops import Largest  # noqa: E402
from inspect_models import minilm_folder, needs_minilm, tiny_llama  # noqa: E402

from qkv.inspect.capture import _label, run, tokenize  # noqa: E402
from qkv.inspect.model import InspectError, load, resolve  # noqa: E402
from qkv.inspect.selection import Selection, choose  # noqa: E402

pytestmark = needs_minilm
SENTENCE = "The cat sat on the mat because it was tired."


@pytest.fixture(scope="module")
def minilm():
    return load(resolve(None))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load(resolve(tiny_llama(tmp_path_factory.mktemp("tiny-llama"))))


def _eager(folder, ids: tuple[int, ...]) -> np.ndarray:
    """All weights ``(l, h, i, j)`` from transformers' own eager attention."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.cat(out.attentions).numpy()


def test_labels_make_whitespace_visible():
    assert _label(" cat") == "cat"
    assert _label("\n") == "\u21b5" and _label("\t") == "\u21e5"
    assert _label(" ") == "\u2423" and _label("") == "\u2205"
    assert _label("##ing") == "##ing"


def test_tokenize_minilm(minilm):
    text = tokenize(minilm, "Tokenizers split words.")
    assert text.labels == ("[CLS]", "token", "##izer", "##s", "split", "words", ".", "[SEP]")
    assert text.special == (0, 7)
    assert text.ids[0] == minilm.tokenizer.cls_token_id


def test_tokenize_refuses_empty_and_too_long_texts(minilm):
    with pytest.raises(InspectError, match="^TEXT: expected some text, got an empty string$"):
        tokenize(minilm, " \n ")
    with pytest.raises(InspectError, match=r"^TEXT: 602 tokens, but all-MiniLM-L6-v2 takes at most 512 \(its max_position_embeddings\)$"):
        tokenize(minilm, "word " * 600)


def _all(loaded, text):
    return choose(layers=loaded.layers, heads=loaded.heads, tokens=len(text.ids))


def test_minilm_weights_equal_eager(minilm):
    text = tokenize(minilm, SENTENCE)
    capture = run(minilm, text, _all(minilm, text))
    expected = _eager(minilm_folder(), text.ids)
    assert capture.weights.shape == expected.shape == (6, 12, 13, 13)
    np.testing.assert_allclose(capture.weights, expected, rtol=0, atol=1e-5)


def test_chosen_heads_and_rows_are_slices_of_all_weights(minilm):
    text = tokenize(minilm, SENTENCE)
    everything = run(minilm, text, _all(minilm, text)).weights
    chosen = Selection(heads=(2, 7, 11), rows=(0, 4, 12), total_heads=12, total_rows=13, automatic=False)
    some = run(minilm, text, chosen).weights
    assert some.shape == (6, 3, 3, 13)
    np.testing.assert_allclose(some, everything[:, [2, 7, 11]][:, :, [0, 4, 12]], rtol=0, atol=1e-5)


def test_decoder_weights_are_causal_and_equal_eager(llama, tmp_path):
    assert llama.causal and (llama.heads, llama.kv_heads) == (6, 2)
    text = tokenize(llama, SENTENCE)
    capture = run(llama, text, _all(llama, text))
    assert np.triu(capture.weights, k=1).max() == 0.0  # no token sees a later one
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)
    folder = llama.model.config._name_or_path
    np.testing.assert_allclose(capture.weights, _eager(folder, text.ids), rtol=0, atol=1e-5)


def test_long_text_never_builds_a_layer_of_weights(llama):
    # 2000 tokens, 6 heads: one layer's weights would be 6 x 2000 x 2000 float32 = 92 MiB.
    text = tokenize(llama, " ".join(f"w{k % 50}" for k in range(1000)))
    tokens = len(text.ids)
    selection = choose(layers=llama.layers, heads=llama.heads, tokens=tokens)
    assert selection.automatic and len(selection.rows) < tokens
    with Largest(new_only=True) as largest:
        capture = run(llama, text, selection)
    layer_of_weights = llama.heads * tokens * tokens * 4
    assert largest.nbytes < layer_of_weights / 16, (largest.nbytes, layer_of_weights)
    assert capture.weights.shape == (2, 6, len(selection.rows), tokens)
    assert capture.weights.size * 4 == 2 * llama.heads * len(selection.rows) * tokens * 4
    # The rows kept are the right ones: the same rows of transformers' eager weights.
    expected = _eager(llama.model.config._name_or_path, text.ids)[:, :, list(selection.rows)]
    np.testing.assert_allclose(capture.weights, expected, rtol=0, atol=1e-5)
