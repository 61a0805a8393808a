"""What the modules are given: inputs, masks and caches checked and laid out, and PyTorch's keywords.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length, ``s`` memory length.

:class:`qkv.MultiHeadAttention` and the transformer layers (``qkv.blocks``) take inputs of
their projections' size and dtype, one layer's cache of the kind of the call (a
cross-attention cache filled once from the memory), and qkv's keywords: each check here
names the argument and the fix, where PyTorch's own error ("mat1 and mat2 must have the same
dtype", "unexpected keyword argument") names neither. ``*_TORCH_NAMES`` map
``nn.MultiheadAttention``'s and ``nn.Transformer*``'s keywords to qkv's, ``KERAS_NAMES`` Keras'
attention layers' (read by ``qkv.functional.foreign_keywords``). ``(length, b, dim)`` inputs (``batch_first=False``) and
:class:`qkv.Attention`'s seq2seq masks are laid out here too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._args import meta_fix
from .cache import LatentCache

#: ``nn.MultiheadAttention.forward``'s keywords, and what :class:`MultiHeadAttention` takes instead.
TORCH_NAMES = {name: ("nn.MultiheadAttention", hint) for name, hint in {
    "attn_mask": "mask= (bool, True = may attend: ~attn_mask; a float attn_mask is qkv.attention's bias=)",
    "key_padding_mask": "mask=~key_padding_mask[:, None, None, :] (qkv: True = may attend; PyTorch's key padding "
                        "mask: True = ignore)",
    "need_weights": "return_weights= (per-head weights (b, h, i, j); weights.mean(1) is PyTorch's average)",
    "average_attn_weights": "nothing: the weights are per head (b, h, i, j); weights.mean(1) averages them",
    "is_causal": "causal= (aligned bottom-right; for PyTorch's top-left with i != j, mask=~attn_mask)",
}.items()}


#: Keras 3's attention layers' call keywords, and what qkv's modules take instead (``qkv.interop_keras`` lists
#: the differences; its masks are True = attend, as qkv's).
KERAS_NAMES = {name: ("a Keras attention layer", hint) for name, hint in {
    "attention_mask": "mask= (True = may attend, as Keras': attention_mask[:, None] for a (B, T, S) mask)",
    "use_causal_mask": "causal= (aligned bottom-right; Keras' is top-left: when T != S pass "
                       "mask=torch.ones(T, S, dtype=torch.bool).tril())",
    "return_attention_scores": "return_weights=",
    "query_mask": "mask= (a query mask (B, T): mask=query_mask[:, None, :, None], & any other mask)",
    "value_mask": "mask= (a value mask (B, S): mask=value_mask[:, None, None, :])",
    "key_mask": "mask= (a key mask (B, S): mask=key_mask[:, None, None, :])",
    "training": "module.train() or module.eval() (dropout follows the module's mode)",
}.items()}

#: Every foreign keyword qkv's modules (:class:`qkv.MultiHeadAttention`, :class:`qkv.Attention`) answer with their own name.
MODULE_NAMES = {**KERAS_NAMES, **TORCH_NAMES}

#: PyTorch's key padding masks are True = ignore; qkv's masks are True = may attend.
_PADDING = "(qkv: True = may attend; PyTorch's key padding mask: True = ignore)"

#: ``nn.TransformerEncoderLayer.forward``'s keywords, and what :class:`TransformerEncoderLayer` takes instead.
ENCODER_TORCH_NAMES = {name: ("nn.TransformerEncoderLayer", hint) for name, hint in {
    "src_mask": "mask=~src_mask (bool, True = may attend; for a causal src_mask such as "
                "nn.Transformer.generate_square_subsequent_mask, causal=True)",
    "src_key_padding_mask": f"mask=~src_key_padding_mask[:, None, None, :] {_PADDING}",
    "is_causal": "causal=",
}.items()}

#: ``nn.TransformerDecoderLayer.forward``'s keywords (``memory_mask`` is a keyword of both: True = may
#: attend here), and what :class:`TransformerDecoderLayer` takes instead.
DECODER_TORCH_NAMES = {name: ("nn.TransformerDecoderLayer", hint) for name, hint in {
    "tgt_mask": "mask=~tgt_mask (bool, True = may attend); the self-attention is causal=True by default, so "
                "nn.Transformer.generate_square_subsequent_mask is not needed",
    "tgt_key_padding_mask": f"mask=~tgt_key_padding_mask[:, None, None, :] {_PADDING}",
    "memory_key_padding_mask": f"memory_mask=~memory_key_padding_mask[:, None, None, :] {_PADDING}",
    "tgt_is_causal": "causal= (True by default)",
    "memory_is_causal": "memory_mask= (bool, True = may attend; e.g. qkv.masks.causal())",
}.items()}


def stack_names(names: dict, origin: str) -> dict:
    """A layer's keyword table with the stack's module as their origin."""
    return {name: (origin, hint) for name, (_, hint) in names.items()}


def check_input(name: str, x: Tensor, projection: nn.Module, first: bool = True) -> None:
    """Checks an input of ``projection`` (an ``nn.Linear``): a tensor ``(b, length, in_features)`` of its dtype
    (``(length, b, in_features)`` where not ``first``, a ``batch_first=False`` module's)."""
    size = projection.in_features
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor {_layout(size, first)[0]}, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != size:
        order = " (qkv's order is (query, key, value); Keras' is (query, value, key))" if name != "query" else ""
        raise ValueError(f"{name}: expected shape {' '.join(_layout(size, first))}, got {tuple(x.shape)}{order}")
    input_dtype(name, x, getattr(projection, "weight", None))


def check_unbatched(name: str, x: Tensor, projection: nn.Module, first: bool = True) -> None:
    """Checks an unbatched input ``(length, in_features)`` of ``projection``, its messages naming the shape the caller
    gave (the module runs it as a batch of one, whose shape the caller never made)."""
    input_dtype(name, x, getattr(projection, "weight", None))  # first: token ids (b, length) are 2-d too
    if x.shape[-1] != projection.in_features:
        size = projection.in_features
        raise ValueError(f"{name}: expected shape {' '.join(_layout(size, first))}, or (length, {size}) unbatched, "
                         f"got {tuple(x.shape)}")  # fmt: skip


def name_device(names: tuple[str, ...], inputs: tuple[Tensor, ...], projections: tuple[nn.Module, ...]) -> None:
    """After a projection of ``inputs`` failed: ``ValueError`` naming the input on another device than its projection's
    weight and the fix (:func:`input_device`); else nothing, and the caller re-raises PyTorch's error.

    Read after the fact, never checked before a projection runs: a weight may be somewhere else
    until then (accelerate's offloading keeps it on meta and loads it in a hook; ``device_map``
    moves the input to the weight's device), and a call that works must keep working.
    """
    for name, x, projection in zip(names, inputs, projections):
        input_device(name, x, getattr(projection, "weight", None))


def _layout(size: int, first: bool) -> tuple[str, str]:
    """An input's shape and its layout's name, for messages (made only when one is raised: a step checks its inputs)."""
    return (f"(b, length, {size})", "(batch first)") if first else (f"(length, b, {size})", "(batch_first=False)")


def checked_inputs(query: Tensor, key: Tensor, value: Tensor, projections: tuple, first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A multi-head module's ``query``, ``key``, ``value`` checked against their projections ``(W^Q, W^K, W^V)`` in the
    caller's layout (``first``: batch first, else ``(length, b, dim)``), then as ``(b, length, dim)`` views."""
    wq, wk, wv = projections
    check_input("query", query, wq, first)
    if key is not query or wk.in_features != wq.in_features:  # else one input, checked once
        check_input("key", key, wk, first)
    if value is not key or wv.in_features != wk.in_features:
        check_input("value", value, wv, first)
    b = 0 if first else 1  # (the memory of another batch: key's, whatever value is, as Attention says)
    if key.shape[b] != query.shape[b]:
        raise ValueError(f"key: expected batch {query.shape[b]} like query, got {key.shape[b]} (key {tuple(key.shape)})")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"value: expected batch and length matching key ({'b, j' if first else 'j, b'} = "
                         f"{tuple(key.shape[:2])}), got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")  # fmt: skip
    return (query, key, value) if first else batch_first(query, key, value)


def split_heads(mha: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A multi-head module's projections ``(b, i, h·d)``, ``(b, j, g·d)``, ``(b, j, g·e)`` as its heads ``(b, h, i, d)``,
    ``(b, g, j, d)``, ``(b, g, j, e)``.

    "b i (h d) -> b h i d" by view + transpose: the same views as ``einops.rearrange`` without
    its per-call pattern handling, a measurable share of a one-token step (``Tensor.unflatten``,
    a Python wrapper, cost 1-2 µs more a call).
    """
    (b, i, _), (_, j, _) = q.shape, k.shape
    return (q.view(b, i, mha.heads, mha.dim_head).transpose(1, 2),
            k.view(b, j, mha.kv_heads, mha.dim_head).transpose(1, 2),
            v.view(b, j, mha.kv_heads, mha.dim_value_head).transpose(1, 2))  # fmt: skip


def input_dtype(name: str, x: Tensor, weight: Tensor | None) -> None:
    """``TypeError`` for an input that a product with ``weight`` would refuse, naming the input and the fix.

    PyTorch's own message, "mat1 and mat2 must have the same dtype", names neither the
    argument nor which side to convert. Under ``torch.autocast`` mixed floating types are
    fine (autocast casts both sides of each product), and so is a weight that is not a float
    (a quantised layer handles its own types).
    """
    if weight is None or x.dtype == weight.dtype:  # the common case: one comparison
        return
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype} (token ids go through an embedding first)")
    if not weight.dtype.is_floating_point or autocast_on(x.device.type):
        return
    raise TypeError(
        f"{name}: dtype {x.dtype} differs from the module's parameters ({weight.dtype}); call .to({x.dtype}) "
        f"on the module or .to({weight.dtype}) on the input"
    )


def input_device(name: str, x: Tensor, weight: Tensor | None) -> None:
    """``ValueError`` for an input on another device than the module's parameters, naming the input and the fix
    (PyTorch's own message comes from deep inside the first product and names neither)."""
    if not isinstance(weight, Tensor) or x.device == weight.device:
        return
    if weight.device.type == "meta":
        raise ValueError(f"{name}: on {x.device}, the module's parameters on meta (shapes without values); "
                         f"{meta_fix(x.device, 'module')}, or give a meta input")
    raise ValueError(f"{name}: on {x.device}, the module's parameters on {weight.device}; call "
                     f".to('{x.device}') on the module or .to('{weight.device}') on the input")  # fmt: skip


def autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (False for a device type it does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know ("meta")
        return False


def check_layer_cache(cache: object, cross: bool) -> None:
    """A cache ``MultiHeadAttention`` can use: one layer's, of its kind (self- or cross-attention)."""
    if isinstance(cache, LatentCache):
        # it passes the duck test below, then failed inside with "c_kv: expected (b, 1, n, ·)"
        raise TypeError("cache: a LatentCache holds the latent of qkv.MultiHeadLatentAttention (c_KV and its rotary "
                        "key), not keys and values; MultiHeadAttention takes a qkv.KVCache or StreamingCache")  # fmt: skip
    if not (hasattr(cache, "update") or hasattr(cache, "attend")):
        hint = "; a DecoderCache holds one per layer: pass its " + ("cross[layer]" if cross else "self_attn[layer]")
        raise TypeError(f"cache: expected one layer's cache (qkv.KVCache or StreamingCache), got {type(cache).__name__}"
                        + (hint if hasattr(cache, "self_attn") else ""))  # fmt: skip
    if hasattr(cache, "attend"):  # a paged serving step: its own checks
        return
    held = getattr(cache, "from_memory", False)
    if cross and getattr(cache, "positions_in_cache", False):
        raise TypeError(f"cache: a {type(cache).__name__} evicts keys as tokens stream in; a cross-attention cache "
                        "holds the whole memory: pass a qkv.KVCache")  # fmt: skip
    if cross and not held and cache.length:
        n = cache.length
        raise ValueError(f"cache: holds {n} self-attention position{'s' * (n != 1)}; a cross-attention call (key is not "
                         "query) needs its own KVCache, filled from the memory on its first call (a DecoderCache's "
                         "cross[layer])")  # fmt: skip
    if not cross and held:
        raise ValueError(f"cache: holds the keys and values of a cross-attention memory ({cache.length} positions); "
                         "self-attention needs a KVCache of its own (a DecoderCache's self_attn[layer])")  # fmt: skip


def memory_held(cache, key: Tensor) -> bool:
    """True when a cross-attention ``cache`` holds the memory's K/V already; ``key`` must be that memory's shape."""
    if not getattr(cache, "from_memory", False):
        return False
    b = cache.keys.shape[0]
    if key.shape[0] != b or key.shape[1] != cache.length:
        raise ValueError(
            f"key: the cache holds the K/V of a memory of batch {b} and length {cache.length}, got key "
            f"{tuple(key.shape)}; the memory is read on the first call only: reset() the cache for a new memory"
        )
    return True


def seq2seq_mask(name: str, x: object, b: int, i: int, j: int) -> object:
    """A seq2seq call's tensor ``mask`` / ``bias`` for its ``(b, 1, i, j)`` weights (lazy objects unchanged).

    ``(b, i, j)`` gains the head dim; ``(b, j)`` (a padding mask, True = a real key) becomes
    ``(b, 1, 1, j)``; ``(i, j)`` and ``(1, j)`` broadcast as they are. With ``b = i`` a 2-d
    mask reads both ways, and guessing would mask the wrong axis without a sign, so it is refused.
    """
    if not isinstance(x, Tensor):
        return x
    if x.dim() == 3:
        return x.unsqueeze(1)
    if x.dim() != 2 or x.shape[0] == 1 or x.shape[0] != b:
        return x  # (j,), (1, j), (i, j) with i != b, or a shape qkv.attention names
    if b == i:
        raise ValueError(
            f"{name}: shape {tuple(x.shape)} reads as a padding mask (b, j) and as a per-query mask (i, j) when "
            f"b = i = {b}; pass {name}[:, None, :] (b, 1, j) or {name}[None] (1, i, j)"
        )
    return x[:, None, None, :]


def squeeze_dims(x: Tensor, dims: list[int]) -> Tensor:
    for dim in dims:
        x = x.squeeze(dim)
    return x


def batch_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(length, b, dim)`` inputs as ``(b, length, dim)`` views, keeping which of them are the same tensor."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if isinstance(x, Tensor) and x.dim() != 3:
            raise ValueError(f"{name}: expected shape (length, b, dim) (batch_first=False), got {tuple(x.shape)}")
    flip = lambda x: x.transpose(0, 1) if isinstance(x, Tensor) else x  # noqa: E731 (others: check_input's TypeError)
    q = flip(query)
    k = q if key is query else flip(key)
    v = k if value is key else flip(value)
    return q, k, v


def memory_positions(q: Tensor, cache) -> tuple[Tensor, Tensor]:
    """Where a cross-attention call's queries ``q (b, h, i, d)`` stand against a memory whose keys ``cache`` holds
    (rotated when it was filled; none given now): the last ``i`` of its positions, as the call without a cache has
    them, and no key positions."""
    j = cache.length
    return torch.arange(j - q.shape[-2], j, device=q.device), torch.arange(0, device=q.device)
