"""Running a model on a text and keeping the attention weights ``qkv inspect`` shows.

Shape legend: ``l`` layers, ``h`` chosen heads, ``i`` chosen query rows, ``j`` keys (all
tokens of the text).

The text is one sequence without padding, so no attention mask is passed: an encoder sees
every token, a decoder is causal by its own layers' flag. The weights come back through
``transformers``' ``output_attentions``, one ``(1, h, i, j)`` tensor per layer. The selection is a keyword
argument of the forward call, ``weights_for={"heads": [...], "rows": [...]}``: transformers
passes such arguments down to every layer's attention function, and qkv's (the model is
loaded with ``attn_implementation="qkv"``) builds only those weights, so a long text never
holds the weights of rows and heads not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .model import InspectError, Loaded
from .selection import Selection

__all__ = ["Capture", "Text", "run", "tokenize"]


@dataclass(frozen=True)
class Text:
    """A text as the model's tokenizer splits it."""

    ids: tuple[int, ...]  # token ids, j of them
    labels: tuple[str, ...]  # each token as shown on the page (whitespace made visible)
    special: tuple[int, ...]  # positions of the tokenizer's special tokens ([CLS], [SEP], BOS, ...)


@dataclass(frozen=True)
class Capture:
    """The weights kept from one run: ``weights (l, h, i, j)`` for ``selection``'s heads and rows."""

    text: Text
    selection: Selection
    weights: np.ndarray  # float32 (l, h, i, j), rows sum to 1 over j


def _label(piece: str) -> str:
    """A token as text a reader can see: newlines and tabs as symbols, a blank as ␣."""
    shown = piece.replace("\n", "\u21b5").replace("\t", "\u21e5").replace("\r", "")
    shown = shown.strip(" ")
    if shown:
        return shown
    return "\u2423" if piece else "\u2205"  # a space token, or one that decodes to nothing


def tokenize(loaded: Loaded, text: str) -> Text:
    """Split ``text`` into the model's tokens (with the special tokens it adds)."""
    if not text.strip():
        raise InspectError("TEXT: expected some text, got an empty string")
    tokenizer = loaded.tokenizer
    ids = [int(x) for x in tokenizer(text)["input_ids"]]
    if not ids:
        raise InspectError(f"TEXT: the tokenizer of {loaded.name} made no tokens of {text!r}")
    if loaded.max_tokens is not None and len(ids) > loaded.max_tokens:
        raise InspectError(
            f"TEXT: {len(ids)} tokens, but {loaded.name} takes at most {loaded.max_tokens} "
            "(its max_position_embeddings)"
        )
    special_ids = set(tokenizer.all_special_ids)
    labels = tuple(_label(tokenizer.decode([token])) for token in ids)
    special = tuple(position for position, token in enumerate(ids) if token in special_ids)
    return Text(ids=tuple(ids), labels=labels, special=special)


def run(loaded: Loaded, text: Text, selection: Selection) -> Capture:
    """Run the model on ``text`` and return the selected weights of every layer."""
    # transformers hands keyword arguments of the forward call down to every layer's attention
    # function (as it does position_ids).
    selected = {} if selection.weights_for() is None else {"weights_for": selection.weights_for()}
    input_ids = torch.tensor([text.ids], dtype=torch.long)
    embeddings = loaded.model.get_input_embeddings()
    vocabulary = getattr(embeddings, "num_embeddings", None)
    if vocabulary is not None and text.ids and max(text.ids) >= vocabulary:
        raise InspectError(
            f"--model: the tokenizer gives token id {max(text.ids)} but the model's vocabulary has {vocabulary} "
            "entries: the folder's tokenizer does not belong to its model"
        )
    with torch.inference_mode():
        outputs = loaded.model(input_ids=input_ids, output_attentions=True, **selected)
    layers = outputs.attentions
    expected = (1, len(selection.heads), len(selection.rows), len(text.ids))
    if layers is None or len(layers) != loaded.layers or any(w is None for w in layers):
        raise RuntimeError(
            f"the model returned no attention weights for some of its {loaded.layers} layers: "
            "is its attention implementation qkv's?"
        )
    weights = np.empty((loaded.layers, *expected[1:]), dtype=np.float32)
    for index, layer in enumerate(layers):
        if tuple(layer.shape) != expected:
            raise RuntimeError(f"layer {index}: expected weights of shape {expected}, got {tuple(layer.shape)}")
        weights[index] = layer[0].float().numpy()
    return Capture(text=text, selection=selection, weights=weights)
