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
