"""TransformerLens' names of attention's activations: ``"pattern"``, ``("pattern", 3)``, ``"pattern3"`` → ``blocks.3.attn.hook_pattern``.

Its ``utils.get_act_name`` and ``ActivationCache.__getitem__``, for the points of an
attention layer (the only ones qkv hooks or records): a full name stays as it is; a
shorthand ``"{name}{layer}{type}"`` (``"v0"``, ``"k6a"``) or a key ``(name, layer)`` /
``(name, layer, type)`` becomes ``blocks.{layer}.attn.hook_{name}``, with its aliases
(``attn`` → ``pattern``, ``attn_logits`` → ``attn_scores``, ``query``/``key``/``value`` →
``q``/``k``/``v``) and a negative layer counted from the last attention layer. A layer type
other than attention's (``"mlp"``, ``"ln1"``) names no point of qkv's.
"""

from __future__ import annotations

import re
from typing import Sequence

#: TransformerLens' aliases of attention's activation names.
ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "query": "q", "key": "k", "value": "v"}
#: Layer types that mean attention (TransformerLens' ``a``, ``attention``).
ATTENTION = (None, "", "a", "attn", "attention")


def entry_name(key: object, layers: Sequence[int]) -> str:
    """The full name ``key`` stands for; ``layers`` the model's attention layers, ascending (for negative layers)."""
    if isinstance(key, str):
        if "." in key or key.startswith("hook_"):
            return key
        found = re.match(r"([a-z]+)(\d+)([a-z]?.*)", key)  # TransformerLens' shorthand: name, layer, type
        if found is None:
            raise KeyError(f"{key!r}: expected a hook name, a shorthand such as 'pattern3', or (name, layer)")
        key = (found.group(1), int(found.group(2)), found.group(3))
    if not isinstance(key, tuple) or not 2 <= len(key) <= 3 or not isinstance(key[0], str):
        raise KeyError(f"{key!r}: expected a hook name or (name, layer[, layer type]), e.g. ('pattern', 3)")
    name, layer, kind = key[0], key[1], key[2] if len(key) == 3 else None
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise KeyError(f"{key!r}: the layer is an int, got {type(layer).__name__}")
    if kind not in ATTENTION:
        raise KeyError(f"{key!r}: layer type {kind!r} is not attention's; qkv hooks and records attention's points only")
    if layer < 0 and layers:
        if layer < -len(layers):
            raise KeyError(f"{key!r}: the model has {len(layers)} attention layers")
        layer = layers[layer]
    return f"blocks.{layer}.attn.hook_{ALIASES.get(name, name)}"
