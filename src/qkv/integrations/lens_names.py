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

from ..edits.hook_points import POINTS as CALL_POINTS

#: TransformerLens' aliases of attention's activation names.
ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "query": "q", "key": "k", "value": "v"}
#: Layer types that mean attention (TransformerLens' ``a``, ``attention``).
ATTENTION = (None, "", "a", "attn", "attention")
#: The attention points qkv hooks or records: one call's, the rotated q and k of a model that rotates them, and
#: ``result`` (``qkv.record``'s per-head output).
POINTS = (*CALL_POINTS, "rot_q", "rot_k", "result")


def layer_of(index: int, layers: Sequence[int]) -> int:
    """A layer index as qkv reads it: itself, or a negative one counted from the last of the attention ``layers``
    (ascending); one out of their range stays as it is, for the caller to refuse."""
    return layers[index] if -len(layers) <= index < 0 else index


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens' ``utils.get_act_name`` for attention's points: ``get_act_name("pattern", 3)`` is
    ``"blocks.3.attn.hook_pattern"`` (``"pattern3"``, ``"k6a"`` and full names too), for ``fwd_hooks`` names."""
    if layer is None and layer_type is None:
        return entry_name(name, ())
    return entry_name((name, layer) if layer_type is None else (name, layer, layer_type), ())


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
        layer = layer_of(layer, layers)
        if layer < 0:
            raise KeyError(f"{key!r}: the model has {len(layers)} attention layers")
    name = ALIASES.get(name, name)
    if name not in POINTS:
        raise KeyError(f"{key!r}: {name!r} is not an attention point; qkv hooks and records {', '.join(POINTS)} (the "
                       "residual stream and MLPs are reached by torch's register_forward_hook on the model's modules)")
    return f"blocks.{layer}.attn.hook_{name}"
