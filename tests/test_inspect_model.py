"""Tests of ``qkv.inspect.model``: where ``--model`` points, and loading with qkv as the attention."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from inspect_models import needs_minilm, needs_smollm2, smollm2_folder  # noqa: E402

from qkv.inspect.model import DEFAULT_MODEL, InspectError, load, resolve  # noqa: E402
from qkv.integrations.transformers import NAME  # noqa: E402


@needs_minilm
def test_default_is_the_packaged_minilm():
    where = resolve(None)
    assert where.name == DEFAULT_MODEL and where.gguf_file is None
    assert (where.folder / "config.json").is_file() and (where.folder / "model.safetensors").is_file()


@needs_smollm2
def test_gguf_file_and_its_folder_resolve_alike():
    folder = smollm2_folder()
    by_folder = resolve(folder)
    by_file = resolve(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert by_folder == by_file
    assert by_file.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and by_file.name == "SmolLM2-135M-Instruct.Q4_1"


def test_folder_with_config(tmp_path):
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    where = resolve(tmp_path / "my-model")
    assert (where.folder, where.gguf_file, where.name) == (tmp_path / "my-model", None, "my-model")


@pytest.mark.parametrize(
    "files, target, message",
    [
        ((), "missing", "--model: {path} does not exist"),
        (("weights.bin",), "weights.bin", "--model: expected a model folder or a .gguf file, got the file weights.bin"),
        (("a.gguf", "b.gguf"), ".", r"--model: {path} holds 2 .gguf files, name one of \['a.gguf', 'b.gguf'\]"),
        (("notes.txt",), ".", "--model: expected a folder with config.json or a .gguf file, got {path}"),
    ],
)
def test_bad_model_paths(tmp_path, files, target, message):
    for name in files:
        (tmp_path / name).write_bytes(b"")
    path = tmp_path / target if target != "." else tmp_path
    with pytest.raises(InspectError, match="^" + message.format(path=path) + "$"):
        resolve(path)


def test_a_folder_transformers_cannot_read_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(InspectError, match=r"^--model: could not load [^\n]+: [^\n]+$"):
        load(resolve(tmp_path))


@needs_minilm
def test_minilm_loads_with_qkv_attention():
    loaded = load(resolve(None))
    assert loaded.model.config._attn_implementation == NAME == "qkv"
    assert not loaded.model.training
    assert (loaded.layers, loaded.heads, loaded.kv_heads, loaded.causal, loaded.max_tokens) == (6, 12, 12, False, 512)
    assert type(loaded.model).__name__ == "BertModel"  # the base model: no head to run


@needs_minilm
def test_an_encoder_decoder_and_a_tokenizer_of_another_vocabulary_are_one_line_errors(tmp_path):
    import torch
    from inspect_models import minilm_folder
    from transformers import AutoTokenizer, BartConfig, BartModel, LlamaConfig, LlamaModel

    from qkv.inspect.capture import run, tokenize
    from qkv.inspect.selection import Selection

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    BartModel(BartConfig(vocab_size=tokenizer.vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                         max_position_embeddings=32)).save_pretrained(tmp_path / "bart")  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "bart")
    with pytest.raises(InspectError, match=r"^--model: bart is an encoder-decoder \(BartModel\); qkv inspect draws"):
        load(resolve(tmp_path / "bart"))
    LlamaModel(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "small")  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "small")
    loaded = load(resolve(tmp_path / "small"))
    text = tokenize(loaded, "The cat sat.")
    with pytest.raises(InspectError, match=r"^--model: the tokenizer gives token id \d+ but the model's vocabulary has "
                                           r"100 entries: the folder's tokenizer does not belong to its model$"):  # fmt: skip
        run(loaded, text, Selection(heads=(0, 1), rows=(0,), total_heads=2, total_rows=len(text.ids), automatic=False))
