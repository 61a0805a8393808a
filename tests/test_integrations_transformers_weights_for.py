"""Tests of ``qkv.integrations.transformers_weights_for``: only the chosen heads and rows of the weights.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key length,
``d`` query/key size, ``e`` value size.

Oracles: all weights from transformers' ``eager`` attention (sliced to the chosen heads and
rows), and the same model loaded with ``"qkv"`` for the outputs. Models: the packaged MiniLM
on a right-padded batch, a tiny random Llama (GQA, causal) on a left-padded one, and the
attention function alone on odd sizes. Memory: a long text never makes a layer's weights.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dispatch_ops import Largest  # noqa: E402
from inspect_models import minilm_folder, needs_minilm, tiny_llama  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

from qkv.integrations import transformers as integration  # noqa: E402
from qkv.integrations.transformers_weights_for import NAME, attention_forward, register  # noqa: E402

register()
SENTENCES = ["The cat sat on the mat because it was tired.", "Attention is all you need."]
CHOSEN = {"heads": [4, 1], "rows": [0, 3, 6]}  # unsorted on purpose: the order is kept


class _Layer(torch.nn.Module):
    """What an attention function reads from a layer."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal
        self.config = type("Config", (), {"output_attentions": False})()


def _odd(b=2, h=6, g=3, i=7, j=7, d=11, e=13):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, h, i, d, generator=gen), torch.randn(b, g, j, d, generator=gen),
            torch.randn(b, g, j, e, generator=gen))  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
def test_the_function_selects_from_the_same_attention(causal):
    q, k, v = _odd()
    layer = _Layer(causal)
    out_all, weights_all = integration.attention_forward(layer, q, k, v, None, scaling=0.3, output_attentions=True)
    out, weights = attention_forward(layer, q, k, v, None, scaling=0.3, output_attentions=True, weights_for=CHOSEN)
    # The output is qkv's without weights (its fast path), equal to the one with all weights
    # (materialised) up to rounding.
    torch.testing.assert_close(out, integration.attention_forward(layer, q, k, v, None, scaling=0.3)[0], rtol=0, atol=0)
    torch.testing.assert_close(out, out_all, rtol=0, atol=1e-6)
    assert weights.shape == (2, 2, 3, 7)
    expected = weights_all[:, CHOSEN["heads"]][:, :, CHOSEN["rows"]]
    torch.testing.assert_close(weights, expected, rtol=0, atol=2e-6)


def test_without_output_attentions_or_weights_for_it_is_qkvs_function():
    q, k, v = _odd()
    layer = _Layer(True)
    out, weights = attention_forward(layer, q, k, v, None, weights_for=CHOSEN)
    assert weights is None
    torch.testing.assert_close(out, integration.attention_forward(layer, q, k, v, None)[0], rtol=0, atol=0)
    out, weights = attention_forward(layer, q, k, v, None, output_attentions=True)
    assert weights.shape == (2, 6, 7, 7)


def test_bad_selections_and_keywords_are_named():
    q, k, v = _odd()
    with pytest.raises(ValueError, match=r"weights_for: 'rows' expected indices in \[0, 7\), got \[9\]"):
        attention_forward(_Layer(False), q, k, v, None, output_attentions=True, weights_for={"rows": [9]})
    with pytest.raises(TypeError, match=r"cannot honour the keyword argument\(s\) \['cu_seq_lens_q'\]"):
        attention_forward(_Layer(False), q, k, v, None, output_attentions=True, weights_for=CHOSEN,
                          cu_seq_lens_q=torch.tensor([0, 7]))  # fmt: skip


def _pair(folder, implementation: str):
    return AutoModel.from_pretrained(folder, attn_implementation=implementation).eval()


def _compare(folder, batch):
    eager, selecting, plain = (_pair(folder, name) for name in ("eager", NAME, integration.NAME))
    with torch.inference_mode():
        all_weights = eager(**batch, output_attentions=True).attentions
        chosen = selecting(**batch, output_attentions=True, weights_for=CHOSEN)
        reference = plain(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(chosen.last_hidden_state[real], reference.last_hidden_state[real], rtol=0, atol=0)
    for layer, (mine, theirs) in enumerate(zip(chosen.attentions, all_weights)):
        expected = theirs[:, CHOSEN["heads"]][:, :, CHOSEN["rows"]]
        keep = real[:, CHOSEN["rows"]]  # rows of padding tokens are not compared
        torch.testing.assert_close(mine.transpose(1, 2)[keep], expected.transpose(1, 2)[keep], rtol=0, atol=1e-5,
                                   msg=f"layer {layer}")  # fmt: skip


@needs_minilm
def test_minilm_right_padded_batch():
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    _compare(minilm_folder(), tokenizer(SENTENCES, padding=True, return_tensors="pt"))


@needs_minilm
def test_tiny_llama_left_padded_batch(tmp_path):
    folder = tiny_llama(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt", return_token_type_ids=False)  # a BERT tokenizer
    _compare(folder, batch)


@needs_minilm
def test_a_long_text_never_makes_a_layer_of_weights(tmp_path):
    model = _pair(tiny_llama(tmp_path), NAME)
    i = 1536
    ids = torch.randint(1000, 2000, (1, i), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), Largest(new_only=True) as largest:
        out = model(input_ids=ids, output_attentions=True, weights_for={"rows": [0, 700, i - 1]})
    layer_of_weights = 6 * i * i * 4  # h x i x j float32: 54 MiB
    assert largest.nbytes < layer_of_weights / 16, (largest.nbytes, layer_of_weights)
    assert [tuple(w.shape) for w in out.attentions] == [(1, 6, 3, i)] * 2
