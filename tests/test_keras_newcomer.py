"""A Keras 3 user's first conversions with ``qkv.interop_keras`` (``from_keras``), torch backend.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``d``
per-head query/key size; b=2, h=3, i=5, j=7, d=4, model size 12.

Each test pins a rough edge met by moving small Keras models to qkv with only README's "From
Keras" and the docstrings to hand: an error that names the fix, a difference written down.
The oracle is the Keras layer itself, called beside its copy in float32.
"""

from __future__ import annotations


import pytest
import torch

import qkv

from keras_backend import KERAS_MASK_WARNING, keras

pytestmark = KERAS_MASK_WARNING


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_keras_class_instead_of_a_layer_says_to_make_one():
    # forgetting the parentheses gave "expected a Keras attention layer (...), got type"
    with pytest.raises(TypeError, match=r"got the class keras\.layers\.MultiHeadAttention.*built instance"):
        qkv.MultiHeadAttention.from_keras(keras.layers.MultiHeadAttention)


def test_a_keras_model_says_to_convert_its_attention_layers():
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(20, 12)(tokens)
    model = keras.Model(tokens, keras.layers.MultiHeadAttention(3, 4, name="self_attn")(x, x))
    # it said "got Functional", which names neither the layer inside nor how to reach it
    with pytest.raises(TypeError, match=r"a Keras model.*model\.get_layer\('self_attn'\)"):
        qkv.MultiHeadAttention.from_keras(model)


def test_keras_masking_in_self_attention_is_a_query_and_a_value_mask():
    """Embedding(mask_zero=True) before a self-attention masks the queries too (README, "From Keras")."""
    tokens = keras.Input((6,), dtype="int32")
    embed = keras.layers.Embedding(20, 12, mask_zero=True)
    layer = keras.layers.MultiHeadAttention(3, 4)
    x = embed(tokens)
    y, _ = layer(x, x, use_causal_mask=True, return_attention_scores=True)  # the explicit path
    ids = torch.tensor([[3, 4, 5, 6, 0, 0], [1, 2, 3, 4, 5, 6]])
    theirs = keras.Model(tokens, y)(ids)
    ours, keep = qkv.MultiHeadAttention.from_keras(layer), ids != 0
    e = embed(ids).detach()
    both = keep[:, None, None, :] & keep[:, None, :, None]
    torch.testing.assert_close(ours(e, mask=both, causal=True), theirs, rtol=0, atol=1e-5)
    # the value mask alone lets the padded queries attend: their rows differ
    alone = ours(e, mask=keep[:, None, None, :], causal=True)
    assert not torch.allclose(alone[0, 4:], theirs[0, 4:], atol=1e-3)
    torch.testing.assert_close(alone[:, :4], theirs[:, :4], rtol=0, atol=1e-5)


def test_attention_weights_in_training_are_before_dropout_in_qkv_dropped_in_keras():
    q, v = randn(2, 5, 12), randn(2, 7, 12, seed=2)
    layer = keras.layers.Attention(dropout=0.5)
    layer([q, v])
    _, theirs = layer([q, v], return_attention_scores=True, training=True)
    _, ours = qkv.Attention.from_keras(layer).train()(q, v, return_weights=True)
    torch.testing.assert_close(ours.sum(-1), torch.ones(2, 5))  # before dropout, as the docstring says
    assert not torch.allclose(theirs.sum(-1), torch.ones(2, 5))
    import qkv.interop_keras as interop

    assert "qkv's ``Attention`` returns them before dropout" in " ".join(interop.__doc__.split())


def test_readme_says_keras_masking_in_self_attention_masks_the_queries_too():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### From Keras", 1)[1].split("\n### ", 1)[0]
    assert "before a self-attention masks the queries too" in section
